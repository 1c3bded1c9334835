"""jattn.viz: what the heatmaps and line plots draw, their errors, and lazy matplotlib."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import BOOK_TOKENS

from jattn import viz

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _weights(n=6, seed=0):
    """A causal, row-normalised [n, n] weight matrix (numpy reference, not jattn)."""
    w = np.tril(np.random.default_rng(seed).random((n, n)) + 0.1)
    return w / w.sum(axis=-1, keepdims=True)


def test_import_jattn_does_not_import_matplotlib():
    code = "import sys, jattn, jattn.viz; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_new_figure_grid_and_agg_canvas():
    fig, ax = viz.new_figure()
    assert not isinstance(ax, list)
    fig, axes = viz.new_figure(ncols=3, nrows=2)
    assert len(axes) == 6
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"
    with pytest.raises(ValueError, match="ncols must be an int >= 1"):
        viz.new_figure(ncols=0)


def test_attention_heatmap_draws_the_weights_with_token_labels():
    w = _weights()
    ax = viz.attention_heatmap(w, BOOK_TOKENS, title="weights")
    np.testing.assert_allclose(ax.images[0].get_array(), w)
    assert [t.get_text() for t in ax.get_xticklabels()] == BOOK_TOKENS
    assert [t.get_text() for t in ax.get_yticklabels()] == BOOK_TOKENS
    assert ax.get_title() == "weights"
    texts = [t.get_text() for t in ax.texts]
    assert texts == [format(v, ".2f") for v in w.ravel()]


def test_attention_heatmap_rectangular_with_column_tokens():
    w = np.full((2, 3), 1 / 3)
    ax = viz.attention_heatmap(w, ["a", "b"], col_tokens=["x", "y", "z"], annotate=False)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["x", "y", "z"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    assert len(ax.texts) == 0


def test_attention_heatmap_errors():
    with pytest.raises(ValueError, match=r"weights must be a 2-d \[q_len, kv_len\] array"):
        viz.attention_heatmap(np.ones((1, 6, 6)))
    with pytest.raises(ValueError, match="has 5 labels but the matrix has 6 positions"):
        viz.attention_heatmap(_weights(), BOOK_TOKENS[:5])


def test_mask_heatmap():
    mask = np.tril(np.ones((4, 4), bool))
    ax = viz.mask_heatmap(mask, list("abcd"))
    np.testing.assert_array_equal(ax.images[0].get_array(), mask.astype(float))
    assert [t.get_text() for t in ax.texts] == ["1" if m else "0" for m in mask.ravel()]
    with pytest.raises(TypeError, match="mask must be boolean"):
        viz.mask_heatmap(mask.astype(np.float32))


def test_dropout_heatmap_crosses_out_exactly_the_dropped_weights():
    w = _weights()
    keep = np.random.default_rng(1).random(w.shape) > 0.5
    dropped = np.where(keep, w * 2, 0.0)
    ax = viz.dropout_heatmap(w, dropped, BOOK_TOKENS)
    zeroed = (w != 0) & (dropped == 0)
    (marks,) = ax.lines
    rows, cols = np.nonzero(zeroed)
    np.testing.assert_array_equal(marks.get_xdata(), cols)
    np.testing.assert_array_equal(marks.get_ydata(), rows)
    assert len(ax.texts) == w.size - zeroed.sum()  # every other cell shows its value
    with pytest.raises(ValueError, match="must have the same shape"):
        viz.dropout_heatmap(w, dropped[:3])


def test_line_plot():
    x = np.array([1, 2, 4])
    ax = viz.line_plot(
        x, {"a": [1, 2, 3], "b": [3, 2, 1]}, logx=True, logy=True, styles={"b": "k--"}
    )
    assert [line.get_label() for line in ax.lines] == ["a", "b"]
    np.testing.assert_array_equal(ax.lines[1].get_ydata(), [3, 2, 1])
    assert ax.lines[1].get_linestyle() == "--"
    assert ax.get_xscale() == ax.get_yscale() == "log"
    with pytest.raises(ValueError, match="series 'a' has shape"):
        viz.line_plot(x, {"a": [1, 2]})
    with pytest.raises(ValueError, match="x must be 1-d"):
        viz.line_plot(np.ones((2, 2)), {})


def test_save_figure_writes_a_png_and_makes_folders(tmp_path):
    fig, ax = viz.new_figure()
    viz.attention_heatmap(_weights(3), ax=ax)
    path = viz.save_figure(fig, tmp_path / "a" / "b" / "w.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_bar_plot():
    ax = viz.bar_plot({"loop": 2.0, "vmap": 1.0}, ylabel="ms")
    assert [p.get_height() for p in ax.patches] == [2.0, 1.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["loop", "vmap"]
    assert [t.get_text() for t in ax.texts] == ["2", "1"]
    with pytest.raises(ValueError, match="values must be finite numbers"):
        viz.bar_plot({"a": float("nan")})
