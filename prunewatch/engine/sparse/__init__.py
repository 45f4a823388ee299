"""Activation sparsity: calibrated input thresholds on the decoder's linear layers, computed by a
compiled kernel that never reads the weight rows of zeroed inputs, and counted from what ran."""

from prunewatch.engine.sparse.calibration import SparsityCalibration, calibrate_sparsity, calibrate_sparsity_on_texts
from prunewatch.engine.sparse.install import SparsityInstallation, install_sparsity
from prunewatch.engine.sparse.kernel import (
    KernelOutput,
    SparseKernelUnavailableError,
    sparse_linear,
)
from prunewatch.engine.sparse.module import SparseLinear, SparsityOptions
from prunewatch.engine.sparse.output_head import ShortlistHead, install_shortlist_head
from prunewatch.engine.sparse.targets import DEFAULT_PROJECTIONS, find_sparse_targets, layer_key
from prunewatch.engine.sparse.thresholds import LayerThresholds

__all__ = [
    "DEFAULT_PROJECTIONS",
    "KernelOutput",
    "LayerThresholds",
    "SparseKernelUnavailableError",
    "ShortlistHead",
    "SparseLinear",
    "SparsityCalibration",
    "SparsityInstallation",
    "SparsityOptions",
    "calibrate_sparsity",
    "calibrate_sparsity_on_texts",
    "find_sparse_targets",
    "install_shortlist_head",
    "install_sparsity",
    "layer_key",
    "sparse_linear",
]
