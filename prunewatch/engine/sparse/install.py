"""Install SparseLinear on every target linear of an instrumented model, and take it off again.

Installing changes nothing by itself: each wrapped layer still runs dense until an execution plan
asks for activation sparsity (ExecutionPlan.activation_sparsity or layer_sparsity > 0), so one
loaded model serves dense and sparse requests side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.execution import InstrumentedModel
from prunewatch.engine.sparse.calibration import SparsityCalibration
from prunewatch.engine.sparse.kernel import SparseKernelUnavailableError, device_kernel
from prunewatch.engine.sparse.module import SparseLinear, SparsityOptions
from prunewatch.engine.sparse.targets import find_sparse_targets, score_scale


@dataclass
class SparsityInstallation:
    """The wrapped layers of one model; `uninstall()` puts the original layers back."""

    instrumented: InstrumentedModel
    layers: dict[str, SparseLinear]  # layer_key -> wrapper
    calibration: SparsityCalibration
    options: SparsityOptions

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights activation sparsity can skip (one read per token step)."""
        return sum(m.weight_t.numel() * m.weight_t.element_size() for m in self.layers.values())

    def uninstall(self) -> None:
        for layer in self.layers.values():
            _replace(self.instrumented, layer.layer, layer, layer.restore())
        self.layers = {}


def _replace(instrumented: InstrumentedModel, layer: int, old: nn.Module, new: nn.Module) -> None:
    """Put `new` where `old` sits inside the block, at whatever depth other wrappers left it."""
    block = instrumented.blocks[layer].block
    for parent in block.modules():
        for child, module in parent.named_children():
            if module is old:
                setattr(parent, child, new)
                return
    raise LookupError(f"{type(old).__name__} is not inside block {layer}")


def install_sparsity(
    instrumented: InstrumentedModel,
    calibration: SparsityCalibration,
    options: SparsityOptions | None = None,
    model_fingerprint: str | None = None,
) -> SparsityInstallation:
    """Wrap every target linear with calibrated thresholds; typed errors, never a silent dense run.

    Raises SparseKernelUnavailableError when the model's device has no kernel (CPU: it cannot be
    compiled here; CUDA: no triton; any other device), CalibrationMismatchError when the calibration
    is for another model or lacks a layer, InvalidRequestError when sparsity is already installed.
    """
    options = options or SparsityOptions()
    device = next(instrumented.model.parameters()).device
    if device.type not in ("cpu", "cuda"):
        raise SparseKernelUnavailableError(
            f"activation sparsity has kernels for CUDA (Triton) and the CPU only; the model is on {device.type}")
    device_kernel(device)  # fail here, at install time, rather than on the first sparse request
    if model_fingerprint is not None:
        calibration.check_model(model_fingerprint)
    if any(isinstance(m, SparseLinear) for m in instrumented.model.modules()):
        raise InvalidRequestError("activation sparsity is already installed on this model; uninstall it first")
    targets = find_sparse_targets(instrumented, options.projections)
    curves = {key: calibration.layer(key) for key in targets}  # every layer checked before any is wrapped
    layers: dict[str, SparseLinear] = {}
    for key, (layer, linear) in targets.items():
        name = key.split(":", 1)[1]
        wrapper = SparseLinear(linear, layer, name, curves[key], score_scale(linear, calibration.score), options,
                               sparsity=calibration.layer_sparsity(key))
        _replace(instrumented, layer, linear, wrapper)
        layers[key] = wrapper
    return SparsityInstallation(instrumented=instrumented, layers=layers, calibration=calibration, options=options)
