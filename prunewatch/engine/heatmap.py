"""The "reasoning path heatmap": calibrated block influence (layers x domains) and, where measured,
head influence (layers x heads, per domain), as a PNG for people."""

from __future__ import annotations

from pathlib import Path

from prunewatch.engine.calibration import Calibration


def _annotated(ax, matrix: list[list[float]], fmt: str = "{:.3f}"):
    image = ax.imshow(matrix, aspect="auto", cmap="viridis", origin="upper")
    peak = max(max(row) for row in matrix) or 1.0
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            ax.text(j, i, fmt.format(value), ha="center", va="center", fontsize=6,
                    color="white" if value < 0.6 * peak else "black")
    return image


def write_heatmap(calibration: Calibration, path: Path) -> Path:
    """Render block influence (1 - cos(in, out)) per layer and domain, then each domain's head
    influence (a head's write into the residual stream / the stream's norm), all measured dense."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted(calibration.domains)
    layers = calibration.num_layers
    with_heads = [d for d in domains if calibration.domains[d].head_influence]
    heads = len(calibration.domains[with_heads[0]].head_influence[0]) if with_heads else 0
    widths = [1.6 + 1.3 * len(domains)] + [1.0 + 0.55 * heads] * len(with_heads)
    fig, axes = plt.subplots(1, len(widths), figsize=(sum(widths), 1.4 + 0.38 * layers),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    blocks_ax = axes[0][0]
    matrix = [[calibration.domains[d].influence[i] for d in domains] for i in range(layers)]
    image = _annotated(blocks_ax, matrix)
    blocks_ax.set_xticks(range(len(domains)), domains)
    blocks_ax.set_yticks(range(layers), [f"layer {i}" for i in range(layers)])
    blocks_ax.set_title(f"Block influence, {calibration.model_name}\n(1 − cos(in, out), measured, dense model)",
                        fontsize=9)
    fig.colorbar(image, ax=blocks_ax, label="block influence")
    for ax, domain in zip(axes[0][1:], with_heads):
        image = _annotated(ax, calibration.domains[domain].head_influence, "{:.2f}")
        ax.set_xticks(range(heads), [f"h{h}" for h in range(heads)])
        ax.set_yticks(range(layers), [str(i) for i in range(layers)])
        ax.set_title(f"Head influence, {domain}\n(‖write‖ / ‖residual‖)", fontsize=9)
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
