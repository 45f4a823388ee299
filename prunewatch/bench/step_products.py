"""The weight products of one decode step, replayed alone: how much of a step is reading weights.

Why: the bound 1 / (1 - s f) holds when a decode step's time is its bytes. A step also runs norms,
rotary embeddings, attention, cache updates and, eagerly, Python around every operator, or, compiled,
the guard checks and the graph's wrapper; none of that shrinks when rows are skipped. Replaying only the
products of a real step (the same modules, on the inputs they received in it, in the same order, under
the same plan) times the part pruning can shorten; the rest of a step is its measured time minus that.
The products' own speedup against the dense step's products then says how close the kernels come to
their bound, apart from what the rest of the step costs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from prunewatch.engine.sparse.targets import LinearWrapper, is_conv1d


@dataclass(frozen=True)
class StepProducts:
    """The product calls of one decode step (one token row each), in the order the step made them."""

    calls: list[tuple[nn.Module, torch.Tensor]]
    outputs: list[torch.Tensor]  # what each call returned in the step, to check a replay against
    # Per call, the projection it computes: the module's attribute name in its parent ("q_proj", "down_proj",
    # "lm_head"), the same for a wrapper and the linear it replaced, so two models' steps line up by projection.
    projections: list[str] = field(default_factory=list)


def product_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost modules that compute a weight product: the engine's wrappers (which read their own
    weights), and every linear or GPT-2 Conv1D layer not inside one."""
    found: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (LinearWrapper, nn.Linear)) or is_conv1d(child):
                found.append(child)
            else:
                walk(child)

    walk(model)
    return found


def capture_step(model: nn.Module, decode: Callable[[], object]) -> StepProducts:
    """Run `decode` (a greedy decode of a few tokens) with every product module hooked, and keep the calls
    of its last step: the last call of each module that ran on one token row. Raises ValueError when
    those are not one call per module (the replay would not be one step)."""
    calls: list[tuple[nn.Module, torch.Tensor]] = []
    outputs: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        x = args[0]
        if x.numel() == x.shape[-1]:  # one token row: a decode step (or a prefill's last-position head)
            calls.append((module, x.detach().clone()))
            outputs.append(output.detach().clone())

    modules = product_modules(model)
    names = {id(module): name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        decode()
    finally:
        for handle in handles:
            handle.remove()
    per_step = len({id(module) for module, _ in calls})
    last = calls[-per_step:] if per_step else []
    if not last or len({id(module) for module, _ in last}) != per_step:
        raise ValueError(f"{len(calls)} single-row product calls of {per_step} modules: the last step is not one "
                         "call per module")
    return StepProducts(calls=last, outputs=outputs[-per_step:],
                        projections=[names.get(id(module), type(module).__name__) for module, _ in last])


def capture_checked(model: nn.Module, decode: Callable[[], object],
                    context: Callable[[], contextlib.AbstractContextManager], label: str) -> StepProducts:
    """capture_step, then one replay under `context` that must reproduce every output the step computed, so what
    is timed later is the step's work. Raises RuntimeError naming `label` and the module that did not."""
    products = capture_step(model, decode)
    for (module, _), step_output, replayed in zip(products.calls, products.outputs, replay(products, context)):
        if not torch.allclose(replayed, step_output, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"{label}: replaying {type(module).__name__} did not reproduce the step's output")
    return products


def replay(products: StepProducts, context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
           ) -> list[torch.Tensor]:
    """Run the captured calls once, in order, under `context` (the engine's execution of the step's plan)."""
    with torch.no_grad(), context():
        return [module(x) for module, x in products.calls]


def time_replay(products: StepProducts, context: Callable[[], contextlib.AbstractContextManager], reps: int,
                synchronize: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of each of `reps` replays of one captured step under `context` (prunewatch.bench.speed replays each run's
    products right after the run, so they meet the load that run met)."""
    times: list[float] = []
    for _ in range(reps):
        with _timed(times, synchronize):
            replay(products, context)
    return times


def time_replay_by_projection(products: StepProducts, context: Callable[[], contextlib.AbstractContextManager],
                              reps: int, synchronize: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds of each of `reps` replays of one captured step under `context`, per projection (the calls of
    every layer to its q_proj, ..., summed): which products shorten when rows are skipped and which do not. Each
    call is timed alone, so a projection's time includes its call's fixed cost (the wrapper's Python, the kernel's
    dispatch and parallel region), which is what small layers spend most of theirs on."""
    times: dict[str, list[float]] = {name: [0.0] * reps for name in products.projections}
    with torch.no_grad(), context():
        for rep in range(reps):
            for (module, x), name in zip(products.calls, products.projections, strict=True):
                synchronize()
                started = time.perf_counter()
                module(x)
                synchronize()
                times[name][rep] += time.perf_counter() - started
    return times


@contextlib.contextmanager
def _timed(into: list[float], synchronize: Callable[[], None]) -> Iterator[None]:
    synchronize()
    started = time.perf_counter()
    yield
    synchronize()
    into.append(time.perf_counter() - started)


def median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3
