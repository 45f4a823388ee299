"""The Triton sparse kernel: equal to a float64 dense matmul of the masked input for one row and for
batches (every row with its own mask, the union of channels read), never reading the weight rows of
inactive channels, reporting the same work as the CPU kernel, and lowering to GPU code.

Without a GPU the kernel runs under Triton's interpreter on CPU tensors; with one, on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is decorated, so before it is imported

triton = pytest.importorskip("triton")

from prunewatch.engine.sparse import kernel as kernels  # noqa: E402  (TRITON_INTERPRET must be set first)
from prunewatch.engine.sparse import triton_kernel  # noqa: E402
from prunewatch.engine.sparse.kernel import SparseKernelUnavailableError  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # about 1 ulp of the output


def _case(rows: int, n_in: int, n_out: int, dtype: torch.dtype, seed: int, bias: bool = True):
    """Inputs, a weight (out, in) and a WINA-like scale, rounded to `dtype` (scale stays float32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    weight = (torch.randn(n_out, n_in, generator=g) / n_in ** 0.5).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype) if bias else None
    scale = torch.rand(n_in, generator=g) + 0.5
    return x, weight, b, scale


def _row_mask(x: torch.Tensor, scale: torch.Tensor, threshold: float) -> torch.Tensor:
    """(rows, in): which entries pass, scored in float32 as both kernels score them."""
    return x.float().abs() * scale > threshold


def _shared_mask(x: torch.Tensor, scale: torch.Tensor, keep: int) -> torch.Tensor:
    """(rows, in): the `keep` channels of largest summed score (float64), the lower index first on a tie."""
    summed = (x.double().abs() * scale.double()).sum(dim=0)
    top = torch.sort(summed, descending=True, stable=True).indices[:keep]
    mask = torch.zeros(x.shape[1], dtype=torch.bool)
    mask[top] = True
    return mask.expand_as(x)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias, mask: torch.Tensor) -> torch.Tensor:
    """float64 dense matmul of the masked input: what the kernel must equal, up to output rounding."""
    y = (x.double() * mask) @ weight.double().t()
    return y + bias.double() if bias is not None else y


def _poisoned(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """W^T with NaN in the rows of channels no row keeps: reading any of them would make NaN outputs."""
    weight_t = weight.t().contiguous()
    weight_t[~mask.any(dim=0)] = float("nan")
    return weight_t


def _run(x, weight_t, bias, scale, threshold, keep=-1, split_k=None):
    on = [t.to(DEVICE) if t is not None else None for t in (x, weight_t, bias, scale)]
    output, active, kept = triton_kernel.sparse_linear(*on, threshold, keep, 0, split_k=split_k)
    return output.cpu(), active, kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy", ["row", "shared"])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_equals_the_float64_reference_and_never_reads_inactive_rows(rows, policy, dtype):
    n_in, n_out = 300, 130  # not multiples of any block size: every tile has a tail
    x, weight, bias, scale = _case(rows, n_in, n_out, dtype, seed=rows * 10 + len(policy))
    if policy == "row":
        threshold, keep = float((x.float().abs() * scale).flatten().quantile(0.6 if rows == 1 else 0.9)), -1
        mask = _row_mask(x, scale, threshold)
    else:
        threshold, keep = 0.0, 120
        mask = _shared_mask(x, scale, keep)
    union = mask.any(dim=0)
    assert int((~union).sum()) > n_in // 5  # enough poisoned rows that a stray read would show
    if rows > 1 and policy == "row":  # rows differ, so a kernel using one row's mask would be wrong
        assert not torch.equal(mask[0], mask[1]) and int(union.sum()) > int(mask[0].sum())
    output, active, kept = _run(x, _poisoned(weight, mask), bias, scale, threshold, keep)
    assert output.dtype == dtype and output.shape == (rows, n_out)
    assert torch.isfinite(output).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(output.double(), _reference(x, weight, bias, mask), rtol=tol, atol=tol)
    assert active == int(union.sum())
    assert kept == int((mask & (x != 0)).sum()) if policy == "shared" else kept == int(mask.sum())


@pytest.mark.parametrize("split_k", [1, 3, 7])
def test_partial_sums_over_splits_of_the_active_list_add_up_to_one_pass(split_k):
    x, weight, bias, scale = _case(4, 513, 70, torch.float32, seed=11)
    threshold = float((x.abs() * scale).flatten().quantile(0.8))
    mask = _row_mask(x, scale, threshold)
    output, active, _ = _run(x, _poisoned(weight, mask), bias, scale, threshold, split_k=split_k)
    torch.testing.assert_close(output.double(), _reference(x, weight, bias, mask), rtol=1e-5, atol=1e-5)
    assert active == int(mask.any(dim=0).sum())


def test_rows_beyond_one_tile_share_the_union_of_all_rows():
    x, weight, _, _ = _case(20, 96, 40, torch.float32, seed=12)
    scale = torch.ones(96)  # magnitude score, as TEAL
    threshold = float(x.abs().flatten().quantile(0.95))
    mask = _row_mask(x, scale, threshold)
    output, active, kept = _run(x, _poisoned(weight, mask), None, scale, threshold)
    torch.testing.assert_close(output.double(), _reference(x, weight, None, mask), rtol=1e-5, atol=1e-5)
    assert (active, kept) == (int(mask.any(dim=0).sum()), int(mask.sum()))


@pytest.mark.parametrize("keep", [0, 64])
def test_no_channel_or_every_channel_kept(keep):
    x, weight, bias, scale = _case(3, 64, 33, torch.float32, seed=13)
    weight_t = torch.full((64, 33), float("nan")) if keep == 0 else weight.t().contiguous()
    output, active, kept = _run(x, weight_t, bias, scale, 0.0, keep=keep)
    expected = bias.expand(3, 33).double() if keep == 0 else _reference(x, weight, bias, torch.ones_like(x, dtype=bool))
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5)
    assert (active, kept) == (keep, 3 * keep)


def test_a_threshold_above_every_score_returns_the_bias_and_reads_nothing():
    x, _, bias, scale = _case(2, 64, 32, torch.float32, seed=14)
    output, active, kept = _run(x, torch.full((64, 32), float("nan")), bias, scale, threshold=1e9)
    assert (active, kept) == (0, 0)
    torch.testing.assert_close(output, bias.expand(2, 32))


@pytest.mark.parametrize("policy", ["row", "shared"])
def test_same_results_and_counts_as_the_cpu_kernel(policy):
    x, weight, bias, scale = _case(4, 257, 90, torch.float32, seed=15)
    x[:, :9] = 0.0  # zero entries: the shared policy counts only non-zero kept entries
    threshold = float((x.abs() * scale).flatten().quantile(0.7))
    keep = 100 if policy == "shared" else -1
    try:
        cpu = kernels.build().sparse_linear(x, weight.t().contiguous(), bias, scale, threshold, keep, 1)
    except SparseKernelUnavailableError as exc:
        pytest.skip(f"no CPU kernel to compare with: {exc}")
    output, active, kept = _run(x, weight.t().contiguous(), bias, scale, threshold, keep)
    torch.testing.assert_close(output, cpu[0], rtol=1e-5, atol=1e-5)
    assert (active, kept) == (cpu[1], cpu[2])


def test_bad_shapes_raise_the_cpu_kernels_errors():
    x, weight, _, _ = _case(1, 16, 8, torch.float32, seed=16)
    with pytest.raises(RuntimeError, match="input channels"):
        triton_kernel.sparse_linear(x, torch.zeros(17, 8), None, torch.ones(16), 0.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        triton_kernel.sparse_linear(x, weight.t(), None, torch.ones(16), 0.0)
    with pytest.raises(RuntimeError, match="float32 vector"):
        triton_kernel.sparse_linear(x, weight.t().contiguous(), None, torch.ones(16, dtype=torch.float64), 0.0)
    with pytest.raises(RuntimeError, match="one device"):
        triton_kernel.sparse_linear(x, weight.t().contiguous(), None, torch.ones(16, device="meta"), 0.0)


def test_cuda_tensors_dispatch_to_triton_and_other_devices_are_refused():
    assert kernels.device_kernel("cuda") is triton_kernel.sparse_linear
    with pytest.raises(SparseKernelUnavailableError, match="CUDA \\(Triton\\) and the CPU only"):
        kernels.device_kernel("meta")


def test_cuda_without_triton_is_an_actionable_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "prunewatch.engine.sparse.triton_kernel")  # so the kernel module is imported afresh
    with pytest.raises(SparseKernelUnavailableError, match=r"needs triton.*pip install 'triton>=3.2'"):
        kernels.device_kernel(torch.device("cuda"))


_LOWER = """
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prunewatch.engine.sparse import triton_kernel as k

found = {}
for rows, weight_type in ((1, "bf16"), (8, "bf16"), (8, "fp32")):
    block_m, block_n, block_k = k._SINGLE_ROW if rows == 1 else k._MULTI_ROW
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": 4, "USE_DOT": rows > 1,
                 "PRECISION": k._dot_precision({"bf16": torch.bfloat16, "fp32": torch.float32}[weight_type])}
    signature = {"x_ptr": "*fp32", "idx_ptr": "*i32", "n_ptr": "*i32", "w_ptr": "*" + weight_type,
                 "part_ptr": "*fp32", "rows": "i32", "n_in": "i32", "n_out": "i32",
                 **{name: "constexpr" for name in constants}}
    try:
        compiled = triton.compile(ASTSource(fn=k._sparse_gemm_kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32))
    except (ImportError, FileNotFoundError) as exc:
        print(json.dumps({"skip": str(exc)}))
        sys.exit(0)
    found[f"{rows}-{weight_type}"] = {"cubin": len(compiled.asm["cubin"]), "mma": "mma" in compiled.asm["ptx"]}
print(json.dumps(found))
"""


def test_lowers_to_gpu_code_for_hopper(tmp_path):
    """The interpreter cannot prove the kernel compiles (dynamic loop bound, dot shapes): lower it to
    a cubin for sm_90 with Triton's own compiler, which needs no GPU. In a child process, since
    triton's own library functions are interpreted once TRITON_INTERPRET was set at import."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cached one
    done = subprocess.run([sys.executable, "-c", _LOWER], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in found:
        pytest.skip(f"cannot lower for sm_90 here: {found['skip']}")
    assert set(found) == {"1-bf16", "8-bf16", "8-fp32"} and all(v["cubin"] > 0 for v in found.values())
    assert found["8-bf16"]["mma"]  # tensor cores for the batch tile


@pytest.mark.parametrize("policy", ["row", "shared"])
def test_the_engine_on_the_triton_kernel_equals_the_masked_dense_model(policy, monkeypatch):
    """Calibration, installation and SparseLinear with the Triton kernel (on CUDA; without a GPU, the
    interpreter on CPU tensors stands in): a batch of 3 rows per decode step, WINA scores."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing, instrument
    from prunewatch.engine.sparse import calibrate_sparsity, install, install_sparsity, module
    from prunewatch.engine.sparse.targets import find_sparse_targets, score_scale

    if DEVICE == "cpu":  # CPU tensors would go to the compiled kernel
        for owner in (module, install):
            monkeypatch.setattr(owner, "device_kernel", lambda device: triton_kernel.sparse_linear)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(DEVICE)
    instrumented = instrument(model)
    g = torch.Generator().manual_seed(1)
    calibration = calibrate_sparsity(instrumented, [torch.randint(0, 128, (1, 32), generator=g)],
                                     model_fingerprint="t", corpus_digest="d", score="wina")
    ids = torch.randint(0, 128, (3, 4), generator=g).to(DEVICE)  # (B, T)

    def decode(plan: ExecutionPlan) -> tuple[torch.Tensor, ExecutionLedger]:
        ledger, cache, logits = ExecutionLedger(), DynamicCache(config=config), []
        with torch.no_grad(), executing(plan, ledger):
            for t in range(ids.shape[1]):
                positions = torch.full((ids.shape[0], 1), t, device=DEVICE)
                logits.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True,
                                    position_ids=positions).logits)
        return torch.cat(logits, dim=1), ledger

    installation = install_sparsity(instrumented, calibration)
    try:
        assert {m.scale.device.type for m in installation.layers.values()} == {torch.device(DEVICE).type}
        sparse, ledger = decode(ExecutionPlan(activation_sparsity=0.5, sparsity_policy=policy))
    finally:
        installation.uninstall()
    handles = []
    for key, (_, linear) in find_sparse_targets(instrumented).items():
        threshold, scale = calibration.threshold(key, 0.5), score_scale(linear, "wina").to(DEVICE)

        def masked(m, args, t=threshold, s=scale):
            score = args[0].abs() * s  # (B, 1, in)
            if policy == "row":
                return (args[0] * (score > t),)
            top = torch.sort(score.reshape(-1, score.shape[-1]).sum(0), descending=True, stable=True).indices
            mask = torch.zeros(score.shape[-1], dtype=torch.bool, device=score.device)
            mask[top[:max(1, round(0.5 * score.shape[-1]))]] = True  # SparseLinear's keep at target 0.5
            return (args[0] * mask,)

        handles.append(linear.register_forward_pre_hook(masked))
    try:
        expected, _ = decode(ExecutionPlan())
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(sparse, expected, rtol=1e-4, atol=1e-4)
    assert 0.3 < ledger.input_sparsity < 0.7
