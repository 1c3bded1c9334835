"""The demo's two pictures: loss curves against the entropy floor, and attention heatmaps.

Drawn with :mod:`jattn.viz` (Agg canvas, no pyplot state), so they work headless.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from jattn import viz

__all__ = ["SMOOTHING_WINDOW", "plot_attention", "plot_losses", "trailing_geometric_mean"]

_COLORS = {"causal": "tab:blue", "leaky": "tab:red"}


SMOOTHING_WINDOW = 20
"""Steps in the trailing geometric mean that smooths the per-step training losses of ``loss.png``."""


def trailing_geometric_mean(values, window: int = SMOOTHING_WINDOW) -> np.ndarray:
    """Entry ``i``: geometric mean of ``values[max(0, i - window + 1) : i + 1]`` (> 0).

    The mean of the logarithms, as the log-scale plot shows them: one spike moves it
    far less than it moves the arithmetic mean. Windows are shorter at the start.
    """
    logs = np.log(np.asarray(values, dtype=np.float64))
    sums = np.concatenate([[0.0], np.cumsum(logs)])
    ends = np.arange(1, len(logs) + 1)
    starts = np.maximum(ends - window, 0)
    return np.exp((sums[ends] - sums[starts]) / (ends - starts))


def plot_losses(
    records: Sequence[Mapping],
    floor: float | None,
    path,
    *,
    title: str = "",
    window: int = SMOOTHING_WINDOW,
) -> Path:
    """Training and held-out loss of every run against the entropy floor (log scale).

    Each run's per-step training loss is drawn faint, and solid its trailing geometric
    mean over ``window`` steps (:func:`trailing_geometric_mean`; the legend says so);
    held-out losses are dots.

    Args:
      records: ``metrics.jsonl`` entries: ``{'run', 'step', 'loss', ...}`` per training
        step and ``{'run', 'step', 'eval_loss'}`` per evaluation.
      floor: the task's entropy floor in nats per token, or None (not drawn).
      path: where to write the PNG.
      title: figure title.
      window: steps in the trailing geometric mean of the smoothed training curves.

    Returns:
      The path written.
    """
    fig, ax = viz.new_figure(size=(10.0, 4.6))
    runs = list(dict.fromkeys(r["run"] for r in records))
    for i, run in enumerate(runs):
        color = _COLORS.get(run, f"C{i + 2}")
        train = [(r["step"], r["loss"]) for r in records if r["run"] == run and "loss" in r]
        evals = [
            (r["step"], r["eval_loss"]) for r in records if r["run"] == run and "eval_loss" in r
        ]
        if train:
            steps, loss = (np.asarray(v, dtype=np.float64) for v in zip(*train, strict=True))
            ax.plot(steps, loss, color=color, alpha=0.2, linewidth=0.8,
                    label=f"{run}: train, each step (dropout on)")  # fmt: skip
            ax.plot(steps, trailing_geometric_mean(loss, window), color=color,
                    label=f"{run}: train, smoothed: geometric mean of the last {window} steps")  # fmt: skip
        if evals:
            steps, loss = zip(*evals, strict=True)
            ax.plot(steps, loss, "o", color=color, markersize=3.5,
                    label=f"{run}: held-out (dropout off)")  # fmt: skip
    if floor is not None:
        ax.axhline(floor, color="black", linestyle="--", label=f"entropy floor {floor:.3f} nats")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats per token)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves
    return viz.save_figure(fig, path)


def plot_attention(
    weights: Mapping[str, Sequence[np.ndarray]],
    labels: Sequence[str],
    path,
    *,
    causal_runs: Sequence[str] = ("causal",),
    title: str = "Attention weights on one held-out window",
) -> Path:
    """Attention weights of one held-out window: a row of heads per (run, layer).

    Every panel shares one colour scale, ``[0, 1]``, drawn as one labelled colour bar.

    Args:
      weights: ``{run: [layer weights [num_heads, T, T], ...]}``.
      labels: the ``T`` input tokens, as text.
      path: where to write the PNG.
      causal_runs: runs whose upper triangle is the causal mask: drawn blank, so the
        masked positions are visible at a glance (their weights are exactly zero).
      title: the figure's title (a line saying how to read the panels is added).

    Returns:
      The path written.
    """
    panels = [
        (run, layer, w) for run, per_layer in weights.items() for layer, w in enumerate(per_layer)
    ]
    num_heads = max(w.shape[0] for _, _, w in panels)
    fig, axes = viz.new_figure(ncols=num_heads, nrows=len(panels), size=(3.4, 3.4))
    axes = np.asarray(axes, dtype=object).reshape(len(panels), num_heads)
    for row, (run, layer, w_HxTxT) in enumerate(panels):
        for head in range(num_heads):
            ax = axes[row, head]
            values = np.array(w_HxTxT[head], dtype=np.float64)
            if run in causal_runs:
                # NaN is drawn blank: the positions the causal mask hides.
                values[np.triu(np.ones(values.shape, dtype=bool), k=1)] = np.nan
            viz.attention_heatmap(
                values,
                list(labels),
                ax=ax,
                title=f"{run} · layer {layer} · head {head}",
                annotate=False,
                vmax=1.0,
                colorbar=False,  # one shared bar below: every panel has the scale [0, 1]
            )
            ax.tick_params(labelsize=5)
            ax.xaxis.label.set_size(7)
            ax.yaxis.label.set_size(7)
            ax.title.set_size(8)
            # Every panel shows the same tokens: label the outer ones only (readable, and
            # laying out thousands of tick labels would take seconds).
            if head > 0:
                ax.tick_params(labelleft=False)
                ax.set_ylabel("")
            if row < len(panels) - 1:
                ax.tick_params(labelbottom=False)
                ax.set_xlabel("")
    bar = fig.colorbar(axes[0, 0].images[-1], ax=axes.ravel().tolist(), shrink=0.6, aspect=40)
    bar.set_label("attention weight (each query row sums to 1)", size=9)
    masked = " and ".join(r for r in weights if r in causal_runs)
    how = "rows: queries, columns: keys" + (
        f"; blank in the {masked} panels: hidden by the causal mask" if masked else ""
    )
    fig.suptitle(f"{title}\n{how}", size=11)
    return viz.save_figure(fig, path)
