"""The kernel's builds for the other instruction sets this host runs: the same bits as this host's build where they
sum in the same order. `make test-isa` runs this module (PRUNEWATCH_TEST_ISAS=1); `make test` skips it, as each
build takes about a minute here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.kernel_outputs import make_inputs, outputs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.environ.get("PRUNEWATCH_TEST_ISAS") != "1",
                                reason="builds the kernel for two more instruction sets: run `make test-isa`")
# Operators whose every output is one chain of fused multiply-adds (or integer sums, or a copy) in an order the
# vector width does not change; the sparse product and the attention sum across vector lanes.
SAME_ORDER = ("fp32_dense", "int8_dense", "int4_dense", "threshold_mask")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("isa") / "inputs.pt"
    make_inputs(path)
    return path


@pytest.fixture(scope="module")
def native(inputs: Path) -> dict[str, torch.Tensor]:
    return outputs(torch.load(inputs))


def build_outputs(capability: str, inputs: Path) -> dict[str, torch.Tensor]:
    """The operators' outputs from the build for `capability`, in a process of its own."""
    out = inputs.with_name(f"{capability}.pt")
    subprocess.run([sys.executable, "-m", "tests.engine.kernel_outputs", str(inputs), str(out)], cwd=ROOT,
                   env={**os.environ, "ATEN_CPU_CAPABILITY": capability}, check=True, timeout=900)
    return torch.load(out)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="compares AVX2 with AVX-512")
def test_the_avx2_build_gives_every_bit_of_the_avx512_build(inputs: Path, native: dict[str, torch.Tensor]) -> None:
    avx2 = build_outputs("avx2", inputs)
    assert avx2.keys() == native.keys()
    differ = [name for name in native if not torch.equal(native[name], avx2[name])]
    assert not differ, differ


def test_the_plain_build_gives_the_vector_builds_bits_where_it_sums_in_their_order(
        inputs: Path, native: dict[str, torch.Tensor]) -> None:
    plain = build_outputs("default", inputs)
    assert plain.keys() == native.keys()
    for name, expected in native.items():
        if name.split()[0] in SAME_ORDER:
            assert torch.equal(plain[name], expected), name
        else:
            torch.testing.assert_close(plain[name], expected, rtol=0, atol=1e-5, msg=name)
