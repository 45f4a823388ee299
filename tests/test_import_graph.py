"""The house's shape: parts import only parts below them, and no modules import each other in a cycle.

Imports inside functions count too: a cycle or an upward arrow hidden behind a function-level import
still ties two parts into one. The graph is read from the source (ast), so the check costs no imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "prunewatch"
LAYERS = {
    # the foundations: they import nothing of ours
    "engine": 0, "probes": 0, "services": 0,
    # the contracts every part shares: result, metric families, PromQL, store
    "records": 1,
    # the parts that run engines: the scheduled prober and the HTTP API
    "collector": 2, "server": 2,
    # readers of records, and the benchmarks
    "alerts": 3, "dashboards": 3, "roi": 3, "bench": 3,
    # the one command-line layer: prunewatch.cli, prunewatch.commands, prunewatch.stack, ...
    "cli": 4,
}
"""Part -> level. A part may import its own level (no cycles) and any level below it, never above.
A part is a subpackage of `prunewatch`; the modules of `prunewatch` outside them form the command line."""
PARTS = tuple(LAYERS)
ISOLATED = {"engine", "probes", "services"}
"""Parts that import no other part of ours."""
WITHOUT_ENGINE = ("alerts", "dashboards", "roi")
"""Parts that read records only: nothing they import, directly or through other modules, is the engine."""


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the parts (Alembic revision scripts left out)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts and "versions" in path.parts:
            continue
        name = ".".join(("prunewatch",) + path.relative_to(PACKAGE).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (a package counts as its __init__)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (resolve(alias.name) for alias in node.names)))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    target = full if full in modules else resolve(node.module)
                    if target:
                        deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_detector_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles_between_project_modules():
    modules = project_modules()
    assert {"prunewatch.engine.pruning_engine", "prunewatch.records.store.migrate", "prunewatch.roi.report"} <= set(modules)
    assert cycles(import_graph(modules)) == []


def part_of(module: str) -> str:
    """`prunewatch.engine.x` -> `engine`; a module of the command line (`prunewatch.cli`, ...) -> `cli`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS and parts[1] != "cli" else "cli"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import of a module of a higher part, or of any other part by an isolated one."""
    found = []
    for module, deps in graph.items():
        mine = part_of(module)
        for dep in deps:
            theirs = part_of(dep)
            if theirs == mine:
                continue
            if LAYERS[theirs] > LAYERS[mine] or mine in ISOLATED:
                found.append(f"{module} -> {dep}")
    return sorted(found)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_layer_check_finds_an_upward_arrow_and_an_isolated_part_reaching_out():
    graph = {"prunewatch.engine.a": {"prunewatch.records.b"},
             "prunewatch.collector.c": {"prunewatch.d", "prunewatch.engine.a"}, "prunewatch.records.b": set(),
             "prunewatch.d": {"prunewatch.collector.c"}}
    assert upward_imports(graph) == ["prunewatch.collector.c -> prunewatch.d", "prunewatch.engine.a -> prunewatch.records.b"]


def test_every_part_imports_only_parts_below_it():
    modules = project_modules()
    assert {part_of(name) for name in modules} == set(LAYERS), "a new top-level part needs a level in LAYERS"
    assert upward_imports(import_graph(modules)) == []


def test_readers_of_records_never_reach_the_engine():
    graph = import_graph(project_modules())
    for module in (name for name in graph if part_of(name) in WITHOUT_ENGINE):
        engine = sorted(dep for dep in reachable(graph, module) if part_of(dep) == "engine")
        assert not engine, f"{module} reaches the engine through {engine}"


def test_the_bundled_probe_model_has_one_name():
    from prunewatch.engine.model_store import PROBE_MODEL_DIR
    from prunewatch.records.models import BUNDLED_PROBE_MODEL

    assert PROBE_MODEL_DIR.name == BUNDLED_PROBE_MODEL and (PROBE_MODEL_DIR / "config.json").is_file()


def test_parts_of_one_level_do_not_import_each_other_both_ways():
    graph = import_graph(project_modules())
    parts: dict[str, set[str]] = {part: set() for part in LAYERS}
    for module, deps in graph.items():
        parts[part_of(module)].update(part_of(dep) for dep in deps if part_of(dep) != part_of(module))
    assert cycles(parts) == []


def test_the_readers_of_records_do_not_import_each_other():
    """The ROI app and the dashboards each read records; what they share (the placeholder prices, PromQL, metric
    names) lives in records, so neither depends on the other. The dashboards draw the alert rules' thresholds,
    so they read the rule set (prunewatch.alerts) and nothing else of another reader."""
    graph = import_graph(project_modules())
    readers, allowed = ("alerts", "dashboards", "roi"), {("dashboards", "alerts")}
    crossing = sorted(f"{module} -> {dep}" for module, deps in graph.items() for dep in deps
                      if part_of(module) in readers and part_of(dep) in readers and part_of(dep) != part_of(module)
                      and (part_of(module), part_of(dep)) not in allowed)
    assert crossing == []
