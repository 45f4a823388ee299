from pathlib import Path

import pytest

from prunewatch.probes import DEFAULT_PROBES_PATH, ProbeFileError, load_probes

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
    probe_set = load_probes(write(tmp_path, VALID))
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
