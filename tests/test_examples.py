"""Runs every example at its smallest size and asserts the claim it makes.

Each example's ``main(argv)`` returns the numbers it printed; the tests check those
numbers against the claim (and, where cheap, against an independent numpy reference),
and that the PNG was written.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _cli import help_entries
from conftest import BOOK_INPUTS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = ROOT / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(name: str):
    """Imports ``examples/<name>.py`` (the scripts import their sibling ``_common``)."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))
    return importlib.import_module(name)


def run(name: str, tmp_path, *flags: str):
    """Runs the example's ``main`` with ``flags`` and ``--out tmp_path``; checks its PNG."""
    result = load(name).main([*flags, "--out", str(tmp_path)])
    png = tmp_path / f"{name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC, f"{name} did not write {png.name}"
    return result


def _np_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


ALL = sorted(p.stem for p in EXAMPLES_DIR.glob("[0-9][0-9]_*.py"))


def test_every_example_is_listed():
    assert len(ALL) == 8, f"expected eight examples in examples/, found {ALL}"


@pytest.mark.parametrize("name", ALL)
def test_help_shows_every_default_and_how_to_regenerate_the_picture(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load(name).main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    entries = help_entries(text)
    assert "--out" in entries and "--seed" in entries
    defaults = vars(load(name).build_parser().parse_args([]))
    for flag, entry in entries.items():
        if flag == "--help":
            continue
        # The default shown is the one the example really uses.
        default = defaults[flag.lstrip("-").replace("-", "_")]
        assert f"(default: {default})" in entry, entry
    assert "(default: runs/examples)" in entries["--out"]
    # The docstring says how the committed picture is regenerated.
    assert f"python examples/{name}.py --out docs/examples" in " ".join(text.split())


def test_default_output_folder_is_runs_examples_not_docs(tmp_path, monkeypatch):
    """Without --out an example writes under ./runs/examples and leaves docs/examples alone."""
    committed = ROOT / "docs" / "examples" / "04_causality_seen.png"
    before = committed.stat().st_mtime_ns, committed.read_bytes()
    monkeypatch.chdir(tmp_path)
    load("04_causality_seen").main([])
    png = tmp_path / "runs" / "examples" / "04_causality_seen.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert (committed.stat().st_mtime_ns, committed.read_bytes()) == before
    default = load("04_causality_seen")._common.DEFAULT_OUT
    assert not default.is_absolute() and default.parts[0] == "runs"


# --- 1. Two ways to mask -------------------------------------------------------------------


def test_01_two_ways_to_mask_agree(tmp_path):
    r = run("01_two_ways_to_mask", tmp_path, "--seeds", "16")
    assert r.max_diff_book <= 1e-6
    assert r.max_diff_jattn_book <= 1e-6
    assert r.max_diff_seeds <= 1e-6
    # Independent reference: the book's first way, in float64 numpy.
    x = BOOK_INPUTS.astype(np.float64)
    queries, keys = x @ r.w_query, x @ r.w_key
    weights = _np_softmax(queries @ keys.T / np.sqrt(keys.shape[-1])) * np.tril(np.ones((6, 6)))
    expected = weights / weights.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(r.renormalised, expected, atol=1e-6)
    np.testing.assert_allclose(r.neg_inf, expected, atol=1e-6)
    assert np.all(r.neg_inf[np.triu_indices(6, k=1)] == 0.0)


# --- 2. Why scale by sqrt(d_k) ---------------------------------------------------------------


def test_02_unscaled_saturates_scaled_does_not(tmp_path):
    r = run("02_why_scale", tmp_path, "--max-log2-dk", "8", "--seeds", "8", "--tokens", "16")
    ent_u, ent_s = r.entropy["unscaled"], r.entropy["scaled"]
    grad_u, grad_s = r.grad_norm["unscaled"], r.grad_norm["scaled"]
    assert list(r.d_k) == [2, 4, 8, 16, 32, 64, 128, 256]
    # Unscaled: entropy falls at every doubling of d_k and ends far below a uniform row;
    # the median logit gradient ends orders of magnitude below its start.
    assert np.all(np.diff(ent_u) < 0), ent_u
    assert ent_u[-1] < 0.15 * r.max_entropy, ent_u
    assert grad_u[-1] < 0.05 * grad_u.max(), grad_u
    # Scaled: both stay flat (within 15%) whatever d_k.
    assert ent_s.min() > 0.85 * ent_s.max() and ent_s.min() > 0.75 * r.max_entropy, ent_s
    assert grad_s.min() > 0.85 * grad_s.max(), grad_s


def test_02_gradient_wrt_bias_is_the_softmax_gradient():
    """The example's gradient equals the analytic softmax backward pass (numpy)."""
    mod = load("02_why_scale")
    key, t, d_k, max_dk, v_dim = jax.random.key(3), 5, 4, 8, 3
    stats = jax.jit(mod.row_stats, static_argnames=("num_tokens", "max_dk", "v_dim"))
    entropy, grad_norm = stats(key, d_k, 0.5, num_tokens=t, max_dk=max_dk, v_dim=v_dim)
    # Redraw the same q, k, v, probe as row_stats does.
    k_q, k_k, k_v, k_g = jax.random.split(key, 4)
    q = np.asarray(jax.random.normal(k_q, (t, 1, max_dk)))[:, 0, :d_k]
    k = np.asarray(jax.random.normal(k_k, (t, 1, max_dk)))[:, 0, :d_k]
    v = np.asarray(jax.random.normal(k_v, (t, 1, v_dim)))[:, 0]
    g = np.asarray(jax.random.normal(k_g, (t, 1, v_dim)))[:, 0]
    p = _np_softmax(0.5 * q @ k.T)  # [T, T]
    u = g @ v.T  # d loss / d weights, [T, T]
    grad = p * (u - np.sum(p * u, axis=-1, keepdims=True))  # softmax backward
    np.testing.assert_allclose(grad_norm, np.linalg.norm(grad, axis=-1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(entropy, -np.sum(p * np.log(p), axis=-1), rtol=1e-4)


# --- 3. Stacking heads is vmap ---------------------------------------------------------------


def test_03_loop_vmap_and_split_heads_agree(tmp_path):
    flags = ("--batch", "2", "--tokens", "8", "--d-in", "4", "--heads", "2", "--head-dim", "4")
    r = run("03_heads_are_vmap", tmp_path, *flags, "--repeats", "1")
    assert r.max_diff_book <= 1e-6
    assert r.max_diff_random <= 1e-5
    # The book's two causal heads: rows sum to 1, nothing above the diagonal.
    assert r.book_weights.shape == (2, 6, 6)
    np.testing.assert_allclose(r.book_weights.sum(-1), 1.0, rtol=1e-6)
    assert np.all(r.book_weights[:, np.triu(np.ones((6, 6), bool), k=1)] == 0)
    assert set(r.seconds) == {"loop", "vmap", "split"}
    assert all(np.isfinite(s) and s > 0 for s in r.seconds.values())


def test_03_stack_heads():
    mod = load("03_heads_are_vmap")
    params = {f"heads_{i}": {"W_query": {"kernel": np.full((3, 2), i)}} for i in range(4)}
    stacked = mod.stack_heads(params, 4)
    assert stacked["W_query"]["kernel"].shape == (4, 3, 2)
    np.testing.assert_array_equal(stacked["W_query"]["kernel"][:, 0, 0], [0, 1, 2, 3])


# --- 4. Causality, seen ----------------------------------------------------------------------


def test_04_causal_jacobian_is_lower_triangular_leaky_is_full(tmp_path):
    r = run("04_causality_seen", tmp_path)
    assert r.causal_future_max == 0.0  # exactly: no path from a later token
    assert r.zeros_above_diagonal == r.entries_above_diagonal == 15
    assert r.causal_past_min > 0  # every earlier token (and itself) is seen
    assert r.leaky_future_min > 0  # without the mask every output sees the future
    # The last token sees everything either way: the same mask row, the same Jacobian row.
    np.testing.assert_allclose(r.causal[-1], r.leaky[-1], rtol=1e-6)
    assert not np.allclose(r.causal[0], r.leaky[0])


# --- 5. Dropout in expectation ---------------------------------------------------------------


def test_05_dropout_is_unbiased(tmp_path):
    rate = 0.5
    r = run("05_dropout_expectation", tmp_path, "--max-log2-keys", "8", "--repeats", "16")
    assert -0.65 < r.slope < -0.35, f"log-log slope {r.slope}, expected about -0.5"
    assert r.rms_error[-1] < 0.15 * r.rms_error[0]
    assert abs(r.zero_fraction - rate) < 4 * r.zero_fraction_sigma
    # Each weight's mean over 4096 keys is within ~6 standard errors (w <= 1, std <= 1/sqrt(N)).
    assert r.weights_mean_error < 6 / np.sqrt(16 * 2**8)
    assert r.same_key_same_mask and r.other_key_other_mask
    # The shown mask: survivors are scaled by 1 / (1 - rate), the rest are exactly zero.
    kept = r.dropped != 0
    np.testing.assert_allclose(r.dropped[kept], r.weights[kept] / (1 - rate), rtol=1e-6)
    assert np.all(r.dropped[np.triu_indices(6, k=1)] == 0)


# --- 6. Compile once -------------------------------------------------------------------------


def test_06_buckets_trace_once_per_bucket(tmp_path):
    r = run("06_compile_once", tmp_path, "--requests", "6", "--max-len", "20")
    assert r.traces_raw[-1] == r.distinct_lengths
    assert r.traces_bucketed[-1] == r.distinct_buckets < r.distinct_lengths
    assert r.max_abs_diff <= 1e-5
    assert r.padded_rows_zero


def test_06_bucket_length():
    mod = load("06_compile_once")
    assert [mod.bucket_length(n) for n in (1, 8, 9, 16, 17, 64, 65)] == [8, 8, 16, 16, 32, 64, 128]


def test_06_padded_attention_matches_numpy_and_traces_once():
    mod = load("06_compile_once")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4, 4)).astype(np.float32)
    counter = [0]
    attend = mod.make_attention(w, counter)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    q, k, v = (x @ w_i for w_i in w)
    scores = np.where(np.tril(np.ones((5, 5), bool)), q @ k.T / 2.0, -np.inf)
    expected = _np_softmax(scores) @ v
    for n_pad in (8, 8):  # the second call with the same shape must not retrace
        padded = np.zeros((n_pad, 4), np.float32)
        padded[:5] = x
        out = np.asarray(attend(padded, np.int32(5)))
        np.testing.assert_allclose(out[:5], expected, rtol=1e-5, atol=1e-5)
        assert np.all(out[5:] == 0)
    assert counter[0] == 1


# --- 7. The book's models ----------------------------------------------------------------

SMALL_07 = ("--layers", "1", "--emb-dim", "32", "--context", "32", "--vocab", "64",
            "--prompt-len", "4", "--new-tokens", "6", "--repeats", "1")  # fmt: skip


def test_07_book_models_agree_with_the_books_pytorch_models(tmp_path):
    mod = load("07_book_models")
    rows = run("07_book_models", tmp_path, *SMALL_07)
    assert [r.arch for r in rows] == ["gpt2", "llama3", "qwen3"]
    assert all(r.jattn_tok_s > 0 for r in rows)
    if not mod.book_available():
        assert all(r.max_logit_diff is None and r.book_tok_s is None for r in rows)
        return
    for r in rows:
        assert r.weights.startswith("book") and r.max_logit_diff <= 1e-4, r
        assert r.same_tokens is True and r.book_tok_s > 0, r


def test_07_runs_without_torch(tmp_path, monkeypatch, capsys):
    mod = load("07_book_models")
    monkeypatch.setattr(mod, "book_available", lambda: False)
    rows = run("07_book_models", tmp_path, *SMALL_07, "--models", "qwen3")
    assert "not installed: jattn's own initialization" in capsys.readouterr().out
    (row,) = rows
    assert row.weights == "jattn init" and row.book_tok_s is None and row.jattn_tok_s > 0


def test_07_small_configs_parse():
    mod = load("07_book_models")
    from jattn import models

    for arch, cfg in mod.configs(2, 64, 128, 512).items():
        parsed = models.config_from_book(arch, cfg)
        assert parsed.n_layers == 2 and parsed.emb_dim == 64


# --- 8. Packed training ------------------------------------------------------------------


def test_08_packed_training_follows_the_padded_run_on_fewer_slots(tmp_path):
    r = run("08_packed_training", tmp_path, "--steps", "4", "--docs", "8", "--emb-dim", "16")
    # The same documents per step give the same loss and gradients: the curves coincide.
    assert r.max_loss_diff <= 1e-4, r.max_loss_diff
    assert r.loss_packed[-1] < r.loss_packed[0]  # Adam on the counting task learns
    assert r.slots_packed < r.slots_padded
    assert r.real_tokens <= r.slots_packed


def test_08_padded_rows_hold_one_document_each():
    mod = load("08_packed_training")
    docs = mod.make_documents(np.random.default_rng(0), 5, 6, 10)
    assert all(3 <= len(d) <= 6 and np.all(np.diff(d) % 10 == 1) for d in docs)
    rows = mod.pad_rows(docs, 6)
    assert rows.tokens.shape == (5, 6)
    np.testing.assert_array_equal(rows.segment_ids.max(axis=1), 1)
    for got, doc in zip(mod.jattn.unpack(rows), docs, strict=True):
        np.testing.assert_array_equal(got, doc)
