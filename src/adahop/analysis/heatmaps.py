"""Outlier heatmaps: |tensor| max-pooled to a viewable size, drawn per layer and as an overview."""

from __future__ import annotations

from pathlib import Path

import torch

from ..atomic import save_figure
from ..policy.strategies import ROLES
from .outliers import LayerReport

ROLE_NAMES = {"x": "X (activations)", "w": "W (weights)", "g": "dY (output grads)"}

PATTERN_CODES = {"none": 0, "row": 1, "col": 2}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_layer(report: LayerReport, path: Path) -> None:
    """Three log-scaled |value| panels (X, W, dY) with their pattern and scores."""
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    roles = list(report.tensors)
    fig, axes = plt.subplots(1, len(roles), figsize=(4.6 * len(roles), 4.2), squeeze=False)
    for ax, role in zip(axes[0], roles):
        t = report.tensors[role]
        img = t.heatmap.clamp_min(t.heatmap.max().item() * 1e-4 + 1e-30).numpy()
        im = ax.imshow(img, aspect="auto", interpolation="nearest", cmap="magma", norm=LogNorm())
        ax.set_title(
            f"{ROLE_NAMES[role]} {list(t.shape)}\npattern={t.pattern}  row={t.row_score:.1f}  col={t.col_score:.1f}",
            fontsize=9,
        )
        ax.set_xlabel("column (max-pooled)")
        ax.set_ylabel("row (max-pooled)")
        fig.colorbar(im, ax=ax, fraction=0.046)
    title = report.name
    if report.strategies:
        title += "   " + "  ".join(f"{g}: {s}" for g, s in report.strategies.items())
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def plot_overview(reports: list[LayerReport], path: Path) -> None:
    """Layers x (X, W, dY): colour = pattern, text = the deciding score."""
    from matplotlib.colors import ListedColormap

    plt = _pyplot()
    grid = torch.full((len(reports), len(ROLES)), float("nan"))
    fig, ax = plt.subplots(figsize=(5.5, 0.28 * len(reports) + 1.6))
    for i, rep in enumerate(reports):
        for j, role in enumerate(ROLES):
            t = rep.tensors.get(role)
            if t is None:
                continue
            grid[i, j] = PATTERN_CODES[t.pattern]
            ax.text(j, i, f"{max(t.row_score, t.col_score):.1f}", ha="center", va="center", fontsize=7)
    cmap = ListedColormap(["#dddddd", "#e4572e", "#4c8fd6"])
    ax.imshow(grid.numpy(), aspect="auto", cmap=cmap, vmin=0, vmax=2)
    ax.set_xticks(range(len(ROLES)), ["X", "W", "dY"])
    ax.set_yticks(range(len(reports)), [r.name for r in reports], fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in cmap.colors]
    ax.legend(
        handles,
        ["none", "row", "col"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02 - 1.2 / len(reports)),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    ax.set_title("outlier pattern per layer (number: max(row, col) score)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
