"""The "reasoning path heatmap": calibrated block influence, layers x domains, as a PNG for people."""

from __future__ import annotations

from pathlib import Path

from engine.calibration import Calibration


def write_heatmap(calibration: Calibration, path: Path) -> Path:
    """Render influence (1 - cos(in, out), measured on the dense model) per layer and domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted(calibration.domains)
    matrix = [[calibration.domains[d].influence[i] for d in domains] for i in range(calibration.num_layers)]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(domains), 1.2 + 0.38 * calibration.num_layers))
    image = ax.imshow(matrix, aspect="auto", cmap="viridis", origin="upper")
    ax.set_xticks(range(len(domains)), domains)
    ax.set_yticks(range(calibration.num_layers), [f"layer {i}" for i in range(calibration.num_layers)])
    peak = max(max(row) for row in matrix) or 1.0
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=7,
                    color="white" if value < 0.6 * peak else "black")
    ax.set_title(f"Block influence, {calibration.model_name}\n(1 − cos(in, out), measured, dense model)", fontsize=9)
    fig.colorbar(image, ax=ax, label="influence")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
