from pathlib import Path

import pytest

from prunewatch.probes import (
    CALIBRATION_PATH,
    DEFAULT_PROBES_PATH,
    EVALUATION_PATH,
    ProbeFileError,
    load_calibration_set,
    load_probes,
)

VALID = """
probes:
  - id: legal-a
    domain: legal
    version: 1
    max_tokens: 16
    system: You are a lawyer.
    prompt: Who pays?
  - id: tech-a
    domain: tech
    version: 2
    max_tokens: 8
    prompt: What is a route?
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "probes.yaml"
    path.write_text(text)
    return path


def test_canonical_probes_cover_three_domains_with_unique_ids():
    probe_set = load_probes(DEFAULT_PROBES_PATH)
    assert probe_set.domains == ["finance", "legal", "tech"]
    ids = [p.id for p in probe_set.probes]
    assert len(ids) == len(set(ids)) >= 6
    assert all(len(p.content_hash) == 16 for p in probe_set.probes)


def test_valid_file_loads_in_order_with_versions(tmp_path):
    probe_set = load_probes(write(tmp_path, "role: calibration\n" + VALID))
    assert [p.id for p in probe_set.probes] == ["legal-a", "tech-a"]
    assert [p.version for p in probe_set.probes] == [1, 2]
    assert probe_set.probes[1].system == ""
    assert probe_set.calibration_texts() == {"legal": ["You are a lawyer.\n\nWho pays?"], "tech": ["What is a route?"]}


def test_content_hash_and_digest_change_with_the_prompt(tmp_path):
    before = load_probes(write(tmp_path, VALID))
    after = load_probes(write(tmp_path, VALID.replace("Who pays?", "Who pays the costs?")))
    assert before.probes[0].content_hash != after.probes[0].content_hash
    assert before.probes[1].content_hash == after.probes[1].content_hash
    assert before.digest != after.digest


@pytest.mark.parametrize(
    "mutation, message",
    [
        (lambda t: t.replace("    max_tokens: 16\n", ""), "probe legal-a: max_tokens: Field required"),
        (lambda t: t.replace("version: 2", "version: 0"), "probe tech-a: version: Input should be greater than or equal to 1"),
        (lambda t: t.replace("id: tech-a", "id: legal-a"), "probe id 'legal-a' appears twice"),
        (lambda t: t.replace("domain: tech", "domain: Tech Stuff"), "probe tech-a: domain: String should match pattern"),
        (lambda t: t + "    colour: red\n", "probe tech-a: colour: Extra inputs are not permitted"),
        (lambda t: "probes: []\n", "the probes list is empty"),
        (lambda t: "just: [a, b\n", "cannot read probes file"),
    ],
)
def test_invalid_files_name_the_problem(tmp_path, mutation, message):
    with pytest.raises(ProbeFileError) as info:
        load_probes(write(tmp_path, mutation(VALID)))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ProbeFileError, match="probes file not found"):
        load_probes(tmp_path / "nope.yaml")


def test_filter_by_domain_and_unknown_domain(tmp_path):
    probe_set = load_probes(write(tmp_path, VALID))
    assert [p.id for p in probe_set.filter(["tech"]).probes] == ["tech-a"]
    with pytest.raises(ProbeFileError, match=r"unknown domain\(s\) \['medical'\]"):
        probe_set.filter(["medical"])


def test_a_file_without_a_role_is_an_evaluation_set_and_is_never_calibrated_on(tmp_path):
    probe_set = load_probes(write(tmp_path, VALID))
    assert probe_set.role == "evaluation"
    with pytest.raises(ProbeFileError, match="is an evaluation set: engines are calibrated on a calibration set"):
        probe_set.calibration_texts()
    with pytest.raises(ProbeFileError, match="has role evaluation, not calibration"):
        load_calibration_set(write(tmp_path, VALID))
    with pytest.raises(ProbeFileError, match="role must be one of calibration, evaluation, got 'training'"):
        load_probes(write(tmp_path, "role: training\n" + VALID))
    with pytest.raises(ProbeFileError, match=r"unknown top-level key\(s\) \['rolle'\]"):
        load_probes(write(tmp_path, "rolle: calibration\n" + VALID))


def test_a_check_belongs_to_the_content_hash_and_a_probe_without_one_keeps_its_hash(tmp_path):
    plain = load_probes(write(tmp_path, VALID)).probes[1]
    checked = load_probes(write(tmp_path, VALID + "    check: {contains: [route]}\n")).probes[1]
    other = load_probes(write(tmp_path, VALID + "    check: {contains: [gateway]}\n")).probes[1]
    assert plain.check is None and checked.check is not None
    assert len({plain.content_hash, checked.content_hash, other.content_hash}) == 3
    before = __import__("hashlib").sha256(__import__("json").dumps(  # how probes were hashed before checks existed
        {"system": "", "prompt": "What is a route?", "max_tokens": 8}, sort_keys=True).encode()).hexdigest()[:16]
    assert plain.content_hash == before


@pytest.mark.parametrize("check, message", [
    ("{contains: [a], regex: b}", "exactly one of contains, any_of, regex, number, python"),
    ("{}", "exactly one of"),
    ("{regex: '('}", "not a valid regular expression"),
    ("{contains: [a], tolerance: 0.1}", "tolerance applies to a number check only"),
    ("{python: {function: '1f', asserts: ['x']}}", "String should match pattern"),
    ("{python: {function: f, asserts: []}}", "List should have at least 1 item"),
])
def test_invalid_checks_name_the_problem(tmp_path, check, message):
    with pytest.raises(ProbeFileError, match="probe tech-a: check"):
        load_probes(write(tmp_path, VALID + f"    check: {check}\n"))
    with pytest.raises(ProbeFileError, match=__import__("re").escape(message)):
        load_probes(write(tmp_path, VALID + f"    check: {check}\n"))


def test_shipped_sets_have_their_roles_and_the_canonical_probes_are_evaluation_probes():
    calibration, evaluation, canonical = (load_probes(CALIBRATION_PATH), load_probes(EVALUATION_PATH),
                                          load_probes(DEFAULT_PROBES_PATH))
    assert (calibration.role, evaluation.role, canonical.role) == ("calibration", "evaluation", "evaluation")
    assert len(evaluation.probes) >= 60 and len(evaluation.domains) >= 9
    assert {"chat", "code", "arithmetic", "factual", "translation", "summarisation", "legal", "tech",
            "finance"} <= set(evaluation.domains) == set(calibration.domains)
    assert sum(p.check is not None for p in evaluation.probes) >= 30
    assert all(p.check is not None and p.check.kind == "python" for p in evaluation.by_domain()["code"])
    by_id = {p.id: p for p in evaluation.probes}
    assert all(by_id[p.id].content_hash == p.content_hash for p in canonical.probes)  # verbatim copies
    assert canonical.domains == ["finance", "legal", "tech"]
