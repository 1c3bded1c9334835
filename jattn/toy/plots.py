"""The demo's two pictures: loss curves against the entropy floor, and attention heatmaps.

Drawn with :mod:`jattn.viz` (Agg canvas, no pyplot state), so they work headless.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from jattn import viz

__all__ = ["plot_attention", "plot_losses"]

_COLORS = {"causal": "tab:blue", "leaky": "tab:red"}


def _ema(values: np.ndarray, decay: float = 0.9) -> np.ndarray:
    """Exponential moving average with bias correction (smooths the per-step losses)."""
    out = np.empty_like(values)
    acc = 0.0
    for i, v in enumerate(values):
        acc = decay * acc + (1 - decay) * v
        out[i] = acc / (1 - decay ** (i + 1))
    return out


def plot_losses(records: Sequence[Mapping], floor: float | None, path, *, title: str = "") -> Path:
    """Training and held-out loss of every run against the entropy floor (log scale).

    Args:
      records: ``metrics.jsonl`` entries: ``{'run', 'step', 'loss', ...}`` per training
        step and ``{'run', 'step', 'eval_loss'}`` per evaluation.
      floor: the task's entropy floor in nats per token, or None (not drawn).
      path: where to write the PNG.
      title: figure title.

    Returns:
      The path written.
    """
    fig, ax = viz.new_figure(size=(7.5, 4.6))
    runs = list(dict.fromkeys(r["run"] for r in records))
    for i, run in enumerate(runs):
        color = _COLORS.get(run, f"C{i + 2}")
        train = [(r["step"], r["loss"]) for r in records if r["run"] == run and "loss" in r]
        evals = [
            (r["step"], r["eval_loss"]) for r in records if r["run"] == run and "eval_loss" in r
        ]
        if train:
            steps, loss = (np.asarray(v, dtype=np.float64) for v in zip(*train, strict=True))
            ax.plot(steps, loss, color=color, alpha=0.2, linewidth=0.8)
            ax.plot(steps, _ema(loss), color=color, label=f"{run}: train (dropout on)")
        if evals:
            steps, loss = zip(*evals, strict=True)
            ax.plot(steps, loss, "o", color=color, markersize=3.5, label=f"{run}: held-out")
    if floor is not None:
        ax.axhline(floor, color="black", linestyle="--", label=f"entropy floor {floor:.3f} nats")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats per token)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return viz.save_figure(fig, path)


def plot_attention(
    weights: Mapping[str, Sequence[np.ndarray]],
    labels: Sequence[str],
    path,
    *,
    causal_runs: Sequence[str] = ("causal",),
) -> Path:
    """Attention weights of one held-out window: a row of heads per (run, layer).

    Args:
      weights: ``{run: [layer weights [num_heads, T, T], ...]}``.
      labels: the ``T`` input tokens, as text.
      path: where to write the PNG.
      causal_runs: runs whose upper triangle is the causal mask: drawn blank, so the
        masked positions are visible at a glance (their weights are exactly zero).

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
                colorbar=head == num_heads - 1,
            )
            ax.tick_params(labelsize=5)
            ax.xaxis.label.set_size(7)
            ax.yaxis.label.set_size(7)
            ax.title.set_size(8)
    return viz.save_figure(fig, path)
