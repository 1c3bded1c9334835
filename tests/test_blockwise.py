"""The blockwise (FlashAttention-style) path against the dense path, numpy and itself.

Outputs must agree with the dense float32 path within 1e-5 and gradients within 1e-4,
across every mask option, GQA, batch dims, cross-attention and lengths that are not a
multiple of the tile size; dropout must drop exactly the dense path's weights.
"""

import math
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import np_attention

import jattn
from jattn import _prng, blockwise
from jattn._call import Operands, Settings
from jattn.blockwise._schedule import causal_fast

OUT_TOL = 1e-5
GRAD_TOL = 1e-4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _qkv(batch, q_len, kv_len, heads, kv_heads, dim, v_dim=None, seed=0, dtype=jnp.float32):
    # numpy draws: no compilation per shape
    rng = np.random.default_rng(seed)
    shapes = (
        (*batch, q_len, heads, dim),
        (*batch, kv_len, kv_heads, dim),
        (*batch, kv_len, kv_heads, v_dim or dim),
    )
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in shapes)


def _out_and_grads(fns, q, k, v):
    """``(fn(q, k, v), grads)`` of each of ``fns`` for one fixed random cotangent, in one jit."""
    out_shape = jax.eval_shape(fns[0], q, k, v)
    ct = jax.random.normal(jax.random.key(42), out_shape.shape, jnp.float32)

    def run(q, k, v):
        results = []
        for fn in fns:
            out, vjp = jax.vjp(fn, q, k, v)
            results.append((out, vjp(ct.astype(out.dtype))))
        return results

    return jax.jit(run)(q, k, v)


def _path(impl, **kw):
    return lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=impl, **kw)


def _assert_paths_agree(q, k, v, out_tol=OUT_TOL, grad_tol=GRAD_TOL, **kw):
    (out_b, grads_b), (out_d, grads_d) = _out_and_grads(
        [_path("blockwise", **kw), _path("dense", **kw)], q, k, v
    )
    np.testing.assert_allclose(out_b, out_d, rtol=out_tol, atol=out_tol)
    for name, gb, gd in zip("qkv", grads_b, grads_d, strict=True):
        np.testing.assert_allclose(gb, gd, rtol=grad_tol, atol=grad_tol, err_msg=f"d{name}")
    return out_b, grads_b


# Lengths are odd and not multiples of the tile (64 for sequences <= 512, else 128).
CASES = {
    "causal_gqa": dict(shape=((2,), 130, 130, 6, 2, 8), kw=dict(is_causal=True)),
    "mqa_two_batch_dims_no_mask": dict(shape=((2, 3), 70, 70, 4, 1, 8), kw={}),
    "no_batch_dims": dict(shape=((), 90, 90, 2, 2, 8), kw=dict(is_causal=True)),
    "cross_kv_lengths": dict(
        shape=((3,), 37, 150, 2, 2, 8), kw=dict(key_value_seq_lengths=np.array([150, 61, 1]))
    ),
    "causal_cross_q_longer": dict(shape=((2,), 150, 90, 2, 1, 8), kw=dict(is_causal=True)),
    "causal_cross_kv_longer_scale_v_dim": dict(
        shape=((2,), 70, 200, 2, 2, 8, 12), kw=dict(is_causal=True, scale=0.3)
    ),
    "window_left_right": dict(shape=((2,), 200, 200, 2, 2, 8), kw=dict(local_window_size=(30, 5))),
    "window_causal": dict(
        shape=((1,), 180, 180, 2, 2, 8), kw=dict(is_causal=True, local_window_size=(40, 40))
    ),
    "window_unbounded_right": dict(
        shape=((1,), 150, 150, 2, 2, 8), kw=dict(local_window_size=(10, None))
    ),
    "one_query_decode": dict(
        shape=((2,), 1, 150, 2, 2, 8), kw=dict(mask=jattn.causal_mask(1, 150, offset=149))
    ),
}


@pytest.mark.top_left  # the cross-length causal cases
@pytest.mark.parametrize("name", sorted(CASES))
def test_blockwise_equals_dense_outputs_and_grads(name):
    case = CASES[name]
    q, k, v = _qkv(*case["shape"])
    _assert_paths_agree(q, k, v, **case["kw"])


def test_blockwise_equals_float64_numpy_reference():
    q, k, v = _qkv((2,), 130, 130, 4, 2, 8)
    lengths = np.array([130, 50])
    mask = (
        np.tril(np.ones((130, 130), bool))[None, None]
        & (np.arange(130) < lengths[:, None])[:, None, None, :]
    )
    got = jattn.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lengths, implementation="blockwise"
    )
    np.testing.assert_allclose(got, np_attention(q, k, v, mask=mask), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Segment ids and arbitrary masks
# ---------------------------------------------------------------------------------------


def test_segment_ids_equal_a_segment_mask_and_numpy():
    q, k, v = _qkv((2,), 150, 150, 2, 2, 8)
    rng = np.random.default_rng(0)
    ids = np.sort(rng.integers(0, 5, size=(2, 150)), axis=1)  # packed sequences
    out_b, _ = _assert_paths_agree(q, k, v, is_causal=True, query_segment_ids=ids)
    mask = (ids[:, :, None] == ids[:, None, :])[:, None] & np.tril(np.ones((150, 150), bool))
    np.testing.assert_allclose(out_b, np_attention(q, k, v, mask=mask), rtol=1e-5, atol=1e-5)
    dense_by_mask = jattn.dot_product_attention(
        q, k, v, is_causal=True, mask=jattn.segment_mask(ids), implementation="dense"
    )
    np.testing.assert_allclose(out_b, dense_by_mask, rtol=OUT_TOL, atol=OUT_TOL)


def test_unsorted_and_cross_segment_ids():
    q, k, v = _qkv((2,), 100, 130, 2, 2, 8)
    rng = np.random.default_rng(1)
    q_ids = rng.integers(0, 3, size=(2, 100))  # not sorted: tiles are skipped one by one
    kv_ids = rng.integers(0, 3, size=(2, 130))
    kv_ids[1] = 7  # no key shares a query's segment: fully masked rows
    out, _ = _assert_paths_agree(q, k, v, query_segment_ids=q_ids, key_value_segment_ids=kv_ids)
    assert np.all(np.asarray(out[1]) == 0)


@pytest.mark.top_left  # 140 queries, 150 keys
@pytest.mark.parametrize("mask_shape", ["full", "broadcast_batch_heads", "key_padding"])
def test_boolean_mask_arrays(mask_shape):
    q, k, v = _qkv((2,), 140, 150, 4, 2, 8)
    rng = np.random.default_rng(2)
    if mask_shape == "full":
        mask = rng.random((2, 4, 140, 150)) < 0.4
        mask[:, :, :, 64:128] = False  # whole tiles masked: skipped
        mask[0, 1, 5] = False  # a fully masked row
    elif mask_shape == "broadcast_batch_heads":
        mask = rng.random((1, 1, 140, 150)) < 0.3
    else:
        mask = (np.arange(150) < np.array([150, 33])[:, None])[:, None, None, :]
    out, _ = _assert_paths_agree(q, k, v, mask=mask, is_causal=mask_shape != "full")
    if mask_shape == "full":
        assert np.all(np.asarray(out[0, 5, 1]) == 0)


# ---------------------------------------------------------------------------------------
# Fully masked rows, dtypes
# ---------------------------------------------------------------------------------------


def test_fully_masked_rows_are_zero_with_zero_grads():
    q, k, v = _qkv((3,), 130, 130, 2, 2, 8)
    kw = dict(
        key_value_seq_lengths=np.array([0, 130, 7]), query_seq_lengths=np.array([130, 60, 130])
    )
    out, (dq, dk, dv) = _assert_paths_agree(q, k, v, is_causal=True, **kw)
    out, dq = np.asarray(out), np.asarray(dq)
    assert np.all(out[0] == 0) and np.all(dq[0] == 0)  # no key at all
    assert np.all(out[1, 60:] == 0) and np.all(dq[1, 60:] == 0)  # padding queries
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs(dtype):
    q, k, v = _qkv((2,), 150, 150, 4, 2, 16, dtype=dtype)
    kw = dict(is_causal=True, key_value_seq_lengths=np.array([150, 0]))
    (out_b, grads_b), (out_low, grads_low) = _out_and_grads(
        [_path("blockwise", **kw), _path("dense", **kw)], q, k, v
    )
    assert out_b.dtype == dtype and all(g.dtype == dtype for g in grads_b)
    assert np.all(np.asarray(out_b[1], np.float32) == 0)
    # Against the float32 dense path on the same (rounded) inputs: the error is the
    # input dtype's rounding, as for the dense path in that dtype.
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    [(out_ref, grads_ref)] = _out_and_grads([_path("dense", **kw)], *f32)
    eps = float(jnp.finfo(dtype).eps)
    err_b = np.abs(np.asarray(out_b, np.float32) - out_ref).max()
    err_d = np.abs(np.asarray(out_low, np.float32) - out_ref).max()
    assert err_b <= max(2 * err_d, 4 * eps), (err_b, err_d)
    for gb, gl, gr in zip(grads_b, grads_low, grads_ref, strict=True):
        scale = float(np.abs(gr).max())
        err_b = np.abs(np.asarray(gb, np.float32) - gr).max()
        err_d = np.abs(np.asarray(gl, np.float32) - gr).max()
        assert err_b <= max(2 * err_d, 8 * eps * scale), (err_b, err_d)


# ---------------------------------------------------------------------------------------
# Dropout: the dense path's mask, tile by tile
# ---------------------------------------------------------------------------------------


def _dropped_weights_via_blockwise(
    q, k, rng, rate, block, is_causal=False, dropout_shared=(False, False)
):
    """The dropped weights, read off a blockwise call whose values are one-hot keys."""
    *batch, kv_len, kv_heads, _ = k.shape
    # [batch..., S, K, S]: value row s is the unit vector e_s, so out[..., t, h, s] = w[h, t, s]
    eye = jnp.broadcast_to(jnp.eye(kv_len)[:, None, :], (*batch, kv_len, kv_heads, kv_len))
    settings = Settings(is_causal=is_causal, dropout_shared=dropout_shared)
    ops = Operands(scale=1 / math.sqrt(q.shape[-1]), dropout_rate=rate, dropout_rng=rng)
    out, _ = blockwise.attention(q, k, eye, ops, settings, block_q=block, block_k=block)
    return jnp.moveaxis(out, -2, -3)  # [batch..., H, T, S]


@pytest.mark.parametrize("broadcast", [False, True, "batch", "heads"])
def test_dropout_mask_equals_dense_for_every_block_size(broadcast):
    q, k, _ = _qkv((2,), 45, 45, 4, 2, 8)
    rng, rate = jax.random.key(5), 0.3
    dense = jattn.dot_product_attention_weights(
        q, k, is_causal=True, dropout_rate=rate, dropout_rng=rng, broadcast_dropout=broadcast
    )
    shared = jattn._checks.broadcast_dropout(broadcast)
    # Block-size independence once; the other modes check their row numbering.
    for block in (16, 48) if broadcast is False else (16,):
        got = _dropped_weights_via_blockwise(
            q, k, rng, rate, block, is_causal=True, dropout_shared=shared
        )
        np.testing.assert_array_equal(np.asarray(got) == 0, np.asarray(dense) == 0)
        np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-6)


def test_dropout_deterministic_per_key_and_statistically_sound():
    q, k, v = _qkv((4,), 200, 200, 4, 4, 8)
    rate = 0.1

    @jax.jit
    def drop(rng):
        return jattn.dot_product_attention(
            q, k, v, is_causal=True, dropout_rate=rate, dropout_rng=rng, implementation="blockwise"
        )

    a, b, c = drop(jax.random.key(1)), drop(jax.random.key(1)), drop(jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    # Keep rate within 4 sigma over every visible weight, and no correlation between
    # horizontally or vertically adjacent decisions (pairs kept together ~ p^2).
    w = np.asarray(
        _dropped_weights_via_blockwise(q, k, jax.random.key(3), rate, 64, is_causal=True)
    )
    visible = np.broadcast_to(np.tril(np.ones((200, 200), bool)), w.shape)
    kept = (w != 0) & visible
    p, n = 1 - rate, visible.sum()
    assert abs(kept.sum() - n * p) <= 4 * math.sqrt(n * p * (1 - p))
    for a_, b_, both in (
        (kept[..., :, :-1], kept[..., :, 1:], visible[..., :, 1:]),
        (kept[..., :-1, :], kept[..., 1:, :], visible[..., :-1, :]),
    ):
        pairs = both.sum()
        together = (a_ & b_ & both).sum()
        assert abs(together - pairs * p * p) <= 4 * math.sqrt(pairs * p * p * (1 - p * p))


def test_dropout_grads_equal_dense_and_traced_rate_works():
    q, k, v = _qkv((2,), 100, 100, 2, 2, 8)
    rng = jax.random.key(7)
    static, _ = _assert_paths_agree(q, k, v, is_causal=True, dropout_rate=0.2, dropout_rng=rng)

    @jax.jit
    def with_traced_rate(rate):
        return jattn.dot_product_attention(
            q, k, v, is_causal=True, dropout_rate=rate, dropout_rng=rng, implementation="blockwise"
        )

    np.testing.assert_allclose(with_traced_rate(0.2), static, rtol=1e-6, atol=1e-6)


def test_prng_keys_are_independent_and_block_addressable():
    words_a = _prng.key_words(jax.random.key(0))
    words_b = _prng.key_words(jax.random.key(1))
    rows = jnp.arange(300, dtype=jnp.uint32)[:, None]
    cols = jnp.arange(400, dtype=jnp.uint32)[None, :]
    thr = _prng.keep_threshold(0.5)
    a = np.asarray(_prng.keep_from_counters(_prng.row_keys(words_a, rows), thr, cols))
    b = np.asarray(_prng.keep_from_counters(_prng.row_keys(words_b, rows), thr, cols))
    n = a.size
    # Two keys agree on about half the decisions (independent fair coins).
    assert abs((a == b).sum() - n / 2) <= 4 * math.sqrt(n / 4)
    # A block computed alone equals the same block of the whole mask.
    part = _prng.keep_from_counters(_prng.row_keys(words_a, rows[100:164]), thr, cols[:, 200:232])
    np.testing.assert_array_equal(part, a[100:164, 200:232])
    full = _prng.keep_mask(jax.random.key(0), 0.5, (3, 100, 400))
    np.testing.assert_array_equal(np.asarray(full).reshape(300, 400), a)


# ---------------------------------------------------------------------------------------
# Transformations and memory
# ---------------------------------------------------------------------------------------


def test_jit_traces_once_and_vmap_equals_batched_call():
    q, k, v = _qkv((3,), 130, 130, 2, 2, 8)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, k, v, rng):
        return jattn.dot_product_attention(
            q, k, v, is_causal=True, dropout_rate=0.1, dropout_rng=rng, implementation="blockwise"
        )

    for seed in range(3):  # new values and keys, same shapes: no retrace
        f(q + seed, k, v, jax.random.key(seed))
    chex.clear_trace_counter()

    def g(q, k, v):
        return jattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise")

    np.testing.assert_allclose(jax.vmap(g)(q, k, v), g(q, k, v), rtol=1e-6, atol=1e-6)


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_forward_backward_memory_grows_linearly():
    def fwd_bwd(impl):
        def loss(q, k, v):
            return jattn.dot_product_attention(q, k, v, is_causal=True, implementation=impl).sum()

        return jax.grad(loss, argnums=(0, 1, 2))

    def shape(t):
        return jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)  # compiled, never run

    small, big = (_temp_bytes(fwd_bwd("blockwise"), *[shape(t)] * 3) for t in (1024, 2048))
    dense = _temp_bytes(fwd_bwd("dense"), *[shape(2048)] * 3)
    assert big <= 0.15 * dense, (big, dense)
    assert big / small <= 2.5, (small, big)


# ---------------------------------------------------------------------------------------
# The implementation argument and its automatic rule
# ---------------------------------------------------------------------------------------


def _is_blockwise(t, s=None, **kw):
    q, k, v = _qkv((1,), t, s or t, 2, 2, 8)
    # The host's route alone (a traced call also carries the other platforms' deferred
    # branches, each a custom VJP of its own).
    with jattn.kernels.lowering_platforms():
        jaxpr = jax.make_jaxpr(lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw))
        return "custom_vjp_call" in str(jaxpr(q, k, v))


def test_automatic_rule():
    assert _is_blockwise(256, is_causal=True)
    assert _is_blockwise(256, 512)
    # short: the fused CPU kernel (from 128 keys, where it was built), else dense
    fused = jattn.kernels.adapter("cpu_fused").available("cpu")
    assert _is_blockwise(128, is_causal=True) is fused
    assert not _is_blockwise(64, is_causal=True)
    assert _is_blockwise(1, 4096) is fused  # one query (decoding): the CPU kernel, or dense
    assert not _is_blockwise(256, return_weights=True)  # needs the weights
    assert _is_blockwise(256, bias=jnp.zeros((256, 256)))  # sliced per tile (issue 13)
    assert _is_blockwise(64, implementation="blockwise")
    assert not _is_blockwise(256, implementation="dense")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(implementation="flash"), "implementation must be None"),
        (dict(implementation="blockwise", return_weights=True), "full \\[q_len, kv_len\\]"),
        (dict(key_value_segment_ids=np.zeros((1, 8), int)), "needs query_segment_ids"),
        (dict(query_segment_ids=np.zeros((1, 7), int)), "query_segment_ids must have shape"),
        (dict(query_segment_ids=np.zeros((1, 8))), "must hold integers"),
    ],
)
def test_bad_arguments_are_clear_errors(kw, match):
    q, k, v = _qkv((1,), 8, 8, 2, 2, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        jattn.dot_product_attention(q, k, v, **kw)


def test_segment_ids_need_kv_ids_for_cross_attention():
    q, k, v = _qkv((1,), 8, 9, 2, 2, 4)
    with pytest.raises(ValueError, match="key_value_segment_ids is required"):
        jattn.dot_product_attention(q, k, v, query_segment_ids=np.zeros((1, 8), int))


# ---------------------------------------------------------------------------------------
# The benchmark script runs (no timing is asserted)
# ---------------------------------------------------------------------------------------


def test_benchmark_quick_mode_writes_a_table(tmp_path):
    out = tmp_path / "results.md"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "bench_attention.py"),
        "--quick",
        "--lengths",
        "64",
        "--skip-module",
        "--skip-dropout",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=600)
    text = out.read_text()
    assert "| T |" in text and "jattn blockwise ms" in text
    # the CPU, the sgemm rate of the same rounds, and the report as this CPU kind's block
    assert "sgemm GFLOP/s" in text and "blockwise / sgemm" in text
    assert "## Goals (issue 25)" in text  # one row per row of its table, even when --quick
    assert text.startswith("<!-- cpu: ") and "<!-- end cpu: " in text
    assert list(tmp_path.glob("results-*.png"))


@pytest.mark.parametrize("kind", ["avx512", "other"])
@pytest.mark.parametrize("dropout", [False, True])
def test_causal_fast_path_equals_dense_under_each_tile_rule(kind, dropout, monkeypatch):
    """Plain causal self-attention takes the causal fast path (diagonal sub-tiles) under
    both CPU rules; outputs, log-sum-exp and gradients (through both) equal the dense path,
    and dropout drops the dense path's weights."""
    monkeypatch.setenv("JATTN_CPU_KIND", kind)
    q, k, v = _qkv((1,), 1000, 1000, 4, 2, 8)
    cfg = blockwise.make_config(
        q_len=1000, kv_len=1000, num_heads=4, kv_heads=2, batch_size=1, scale=1.0, is_causal=True
    )
    assert causal_fast(cfg, blockwise.Aux(), cfg.block_q, cfg.block_k)
    back = cfg.backward_tiles()
    assert causal_fast(back, blockwise.Aux(), back.block_k, back.block_q)
    kw = dict(is_causal=True, return_residual=True)
    if dropout:
        kw.update(dropout_rate=0.25, dropout_rng=jax.random.key(3))

    def loss(impl):
        def fn(q, k, v):
            out, lse = jattn.dot_product_attention(q, k, v, implementation=impl, **kw)
            return jnp.sum(out * jnp.cos(out)) + 0.1 * jnp.sum(jnp.sin(lse)), (out, lse)

        return jax.jit(jax.grad(fn, argnums=(0, 1, 2), has_aux=True))

    grads_b, (out_b, lse_b) = loss("blockwise")(q, k, v)
    grads_d, (out_d, lse_d) = loss("dense")(q, k, v)
    np.testing.assert_allclose(out_b, out_d, rtol=OUT_TOL, atol=OUT_TOL)
    np.testing.assert_allclose(lse_b, lse_d, rtol=OUT_TOL, atol=OUT_TOL)
    for name, gb, gd in zip("qkv", grads_b, grads_d, strict=True):
        np.testing.assert_allclose(gb, gd, rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=f"d{name}")


@pytest.mark.parametrize("kind", ["avx512", "other"])
@pytest.mark.parametrize("length", [1, 7, 100, 300, 512, 513, 600, 1000, 1030, 2048, 5000])
def test_tile_rule_tiles_divide_and_pad_little(kind, length, monkeypatch):
    monkeypatch.setenv("JATTN_CPU_KIND", kind)
    assert blockwise.cpu_kind() == kind
    tiles = blockwise.default_tiles(length, length)
    for padded, fwd, bwd in (
        (tiles.padded_q, tiles.fwd_q, tiles.bwd_q),
        (tiles.padded_kv, tiles.fwd_k, tiles.bwd_k),
    ):
        assert padded >= length and padded % fwd == 0 and padded % bwd == 0
        assert max(fwd, bwd) <= -(-length // 8) * 8  # a short sequence is one tile
        # Large tiles never pad more than 1/8 of the work (128-token tiles may, as before).
        assert padded - length <= max(length // 8, 127)
    if kind == "other":  # the AVX2 rule of benchmarks/results.md, unchanged
        expected = min(64 if length <= 512 else 128, -(-length // 8) * 8)
        assert tiles.fwd_q == tiles.bwd_q == tiles.fwd_k == tiles.bwd_k == expected


@pytest.mark.parametrize(
    ("vendor", "family", "flags", "rule"),
    [
        ("AuthenticAMD", 25, {"avx2", "avx512f"}, "avx512"),  # Zen 4 (the AVX-512 sweep)
        ("AuthenticAMD", 25, {"avx2"}, "avx512"),  # Zen 3: measured to want large tiles
        ("GenuineIntel", 6, {"avx2", "avx512f"}, "avx512"),  # any AVX-512 CPU
        ("GenuineIntel", 6, {"avx2"}, "other"),  # unmeasured AVX2: the rule measured there
        ("AuthenticAMD", 23, {"avx2"}, "other"),  # Zen 2: not measured
        ("", None, frozenset(), "other"),  # no /proc/cpuinfo (macOS, Windows)
    ],
)
def test_tile_rule_follows_the_measured_cpu_families(vendor, family, flags, rule):
    """The large-tile rule keys on what was measured (AVX-512, or a measured CPU family),
    not on the AVX-512 flag alone (../shared/measurements/avx2-zen3-tiles.md)."""
    assert blockwise._config.tile_rule(vendor, family, frozenset(flags)) == rule


def test_cpu_kind_reads_this_machine_unless_forced(monkeypatch):
    monkeypatch.delenv("JATTN_CPU_KIND", raising=False)
    detected = blockwise.cpu_kind()
    assert detected in ("avx512", "other")
    monkeypatch.setenv("JATTN_CPU_KIND", "other" if detected == "avx512" else "avx512")
    assert blockwise.cpu_kind() != detected
