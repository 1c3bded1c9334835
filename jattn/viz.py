"""Plotting helpers for attention: weight heatmaps with token labels, masks, dropout masks.

matplotlib is imported inside the functions, never at module import, so ``import jattn``
(and ``import jattn.viz``) works without it. Figures are plain ``matplotlib.figure.Figure``
objects rendered with the Agg canvas: nothing here touches pyplot's global state or the
interactive backend, so the helpers are safe in scripts, tests and notebooks alike.

Typical use::

    from jattn import viz

    fig, (ax0, ax1) = viz.new_figure(ncols=2)
    viz.attention_heatmap(weights, tokens, ax=ax0, title="weights")
    viz.mask_heatmap(jattn.causal_mask(6), tokens, ax=ax1, title="causal mask")
    viz.save_figure(fig, "out/weights.png")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "attention_heatmap",
    "bar_plot",
    "dropout_heatmap",
    "line_plot",
    "mask_heatmap",
    "new_figure",
    "save_figure",
]


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # pragma: no cover - exercised only without the extra installed
        raise ImportError(
            "jattn.viz needs matplotlib; install it with `pip install 'jattn[plot]'` "
            "(or `pip install matplotlib`)."
        ) from None


def new_figure(ncols: int = 1, nrows: int = 1, *, size: tuple[float, float] = (4.2, 3.8)):
    """A figure with a grid of axes, rendered by the Agg canvas (no pyplot, no GUI).

    Args:
      ncols: number of panel columns (>= 1).
      nrows: number of panel rows (>= 1).
      size: (width, height) of one panel in inches.

    Returns:
      ``(fig, axes)``: ``axes`` is a single Axes for a 1 x 1 grid, otherwise a flat list.
    """
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    for name, n in (("ncols", ncols), ("nrows", nrows)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}.")
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    return fig, axes[0] if len(axes) == 1 else axes


def save_figure(fig, path, *, dpi: int = 110) -> Path:
    """Saves ``fig`` as ``path`` (parent folders created) and returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def _axes(ax):
    if ax is None:
        _, ax = new_figure()
    return ax


def _as_matrix(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 2:
        raise ValueError(
            f"{name} must be a 2-d [q_len, kv_len] array, got shape {arr.shape}. Select one "
            f"example and head first, e.g. {name}[0, 0]."
        )
    return arr


def _labels(tokens, n: int, name: str) -> list[str] | None:
    if tokens is None:
        return None
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"{name} has {len(tokens)} labels but the matrix has {n} positions.")
    return tokens


def _label_axes(ax, shape, row_tokens, col_tokens, xlabel, ylabel, title):
    rows = _labels(row_tokens, shape[0], "row_tokens")
    cols = _labels(col_tokens, shape[1], "tokens" if col_tokens is row_tokens else "col_tokens")
    ax.set_xticks(range(shape[1]), cols if cols is not None else range(shape[1]))
    ax.set_yticks(range(shape[0]), rows if rows is not None else range(shape[0]))
    if cols is not None:
        ax.tick_params(axis="x", labelrotation=45)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)


def _annotate(ax, values: np.ndarray, fmt: str, skip: np.ndarray | None = None) -> None:
    """Writes each value in its cell, in a colour readable on the colormap there."""
    lo, hi = ax.images[-1].get_clim()
    threshold = lo + 0.6 * (hi - lo)  # viridis: dark below, light above
    for (i, j), v in np.ndenumerate(values):
        if skip is not None and skip[i, j]:
            continue
        ax.text(
            j,
            i,
            format(v, fmt),
            ha="center",
            va="center",
            fontsize=7,
            color="black" if v > threshold else "white",
        )


def attention_heatmap(
    weights,
    tokens: Sequence[str] | None = None,
    *,
    col_tokens: Sequence[str] | None = None,
    ax=None,
    title: str | None = None,
    annotate: bool = True,
    fmt: str = ".2f",
    vmin: float | None = 0.0,
    vmax: float | None = None,
    cmap: str = "viridis",
    xlabel: str = "key",
    ylabel: str = "query",
    colorbar: bool = True,
):
    """Draws a ``[q_len, kv_len]`` weight matrix as a heatmap, rows = queries.

    Args:
      weights: 2-d array-like ``[q_len, kv_len]`` (one example, one head).
      tokens: labels of the query rows, and of the key columns unless ``col_tokens`` is given.
      col_tokens: labels of the key columns when they differ from the rows.
      ax: a matplotlib Axes to draw on; a new figure is made when None.
      title: panel title.
      annotate: write each value in its cell (for small matrices).
      fmt: format spec of the annotations.
      vmin: colour-scale minimum (0 by default: weights are probabilities).
      vmax: colour-scale maximum; the data maximum when None.
      cmap: matplotlib colormap name.
      xlabel: x-axis label.
      ylabel: y-axis label.
      colorbar: add a colour bar beside the panel.

    Returns:
      The Axes drawn on.
    """
    values = _as_matrix(weights, "weights").astype(np.float64)
    ax = _axes(ax)
    image = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    cols = tokens if col_tokens is None else col_tokens
    _label_axes(ax, values.shape, tokens, cols, xlabel, ylabel, title)
    if annotate:
        _annotate(ax, values, fmt)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, shrink=0.8)
    return ax


def mask_heatmap(
    mask,
    tokens: Sequence[str] | None = None,
    *,
    col_tokens: Sequence[str] | None = None,
    ax=None,
    title: str | None = None,
    xlabel: str = "key",
    ylabel: str = "query",
):
    """Draws a boolean ``[q_len, kv_len]`` mask: dark = attend (True), light = hidden (False).

    Args:
      mask: 2-d boolean array-like (True = attend, as everywhere in jattn).
      tokens: labels of the rows (and columns unless ``col_tokens`` is given).
      col_tokens: labels of the columns when they differ from the rows.
      ax: Axes to draw on, or None for a new figure.
      title: panel title.
      xlabel: x-axis label.
      ylabel: y-axis label.

    Returns:
      The Axes drawn on.
    """
    values = _as_matrix(mask, "mask")
    if values.dtype != np.bool_:
        raise TypeError(
            f"mask must be boolean (True = attend), got dtype {values.dtype}. Build it with "
            "jattn.masks or convert with `mask.astype(bool)`."
        )
    ax = _axes(ax)
    ax.imshow(values.astype(np.float64), cmap="Greys", vmin=-0.25, vmax=1.25)
    cols = tokens if col_tokens is None else col_tokens
    _label_axes(ax, values.shape, tokens, cols, xlabel, ylabel, title)
    for (i, j), v in np.ndenumerate(values):
        ax.text(
            j,
            i,
            "1" if v else "0",
            ha="center",
            va="center",
            fontsize=7,
            color="white" if v else "black",
        )
    return ax


def dropout_heatmap(
    weights,
    dropped,
    tokens: Sequence[str] | None = None,
    *,
    ax=None,
    title: str | None = None,
    fmt: str = ".2f",
):
    """Draws attention weights after dropout, crossing out the weights dropout zeroed.

    A cell is marked dropped where the weight was nonzero before dropout and is exactly
    zero after it; surviving weights show their rescaled value ``w / (1 - rate)``.

    Args:
      weights: 2-d ``[q_len, kv_len]`` weights before dropout.
      dropped: the same weights after dropout (same shape).
      tokens: row/column labels.
      ax: Axes to draw on, or None for a new figure.
      title: panel title.
      fmt: format spec of the annotations.

    Returns:
      The Axes drawn on.
    """
    before = _as_matrix(weights, "weights").astype(np.float64)
    after = _as_matrix(dropped, "dropped").astype(np.float64)
    if before.shape != after.shape:
        raise ValueError(
            f"weights and dropped must have the same shape, got {before.shape} and {after.shape}."
        )
    ax = attention_heatmap(after, tokens, ax=ax, title=title, annotate=False, fmt=fmt)
    zeroed = (before != 0) & (after == 0)
    _annotate(ax, after, fmt, skip=zeroed)
    rows, cols = np.nonzero(zeroed)
    ax.plot(cols, rows, "x", color="red", markersize=10, markeredgewidth=2, linestyle="none")
    return ax


def line_plot(
    x,
    series: Mapping[str, Any],
    *,
    ax=None,
    title: str | None = None,
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    logy: bool = False,
    styles: Mapping[str, str] | None = None,
):
    """Plots several named curves over one x axis, with a legend.

    Args:
      x: 1-d x values.
      series: ``{label: y}`` with each ``y`` 1-d of the same length as ``x``.
      ax: Axes to draw on, or None for a new figure.
      title: panel title.
      xlabel: x-axis label.
      ylabel: y-axis label.
      logx: logarithmic x axis.
      logy: logarithmic y axis.
      styles: optional ``{label: matplotlib format string}``, e.g. ``{"reference": "k--"}``.

    Returns:
      The Axes drawn on.
    """
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"x must be 1-d, got shape {x.shape}.")
    ax = _axes(ax)
    styles = dict(styles or {})
    for label, y in series.items():
        y = np.asarray(y)
        if y.shape != x.shape:
            raise ValueError(f"series {label!r} has shape {y.shape}, but x has shape {x.shape}.")
        ax.plot(x, y, styles.get(label, "o-"), label=label)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def bar_plot(
    values: Mapping[str, float],
    *,
    ax=None,
    title: str | None = None,
    ylabel: str = "",
    fmt: str = ".3g",
):
    """One labelled bar per entry of ``{label: value}``, each annotated with its value.

    Args:
      values: ``{label: value}``, drawn left to right in order.
      ax: Axes to draw on, or None for a new figure.
      title: panel title.
      ylabel: y-axis label.
      fmt: format spec of the value written above each bar.

    Returns:
      The Axes drawn on.
    """
    labels = [str(k) for k in values]
    heights = np.asarray([float(v) for v in values.values()])
    if heights.ndim != 1 or not np.all(np.isfinite(heights)):
        raise ValueError(f"values must be finite numbers, got {dict(values)!r}.")
    ax = _axes(ax)
    bars = ax.bar(labels, heights, color=[f"C{i}" for i in range(len(labels))])
    ax.bar_label(bars, labels=[format(h, fmt) for h in heights], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)
    if title:
        ax.set_title(title)
    return ax
