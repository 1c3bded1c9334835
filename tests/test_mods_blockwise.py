"""Score/mask modifiers, block masks, sinks and bias on the blockwise path.

The blockwise path must compute what the dense path computes (outputs within 1e-5,
log-sum-exp and gradients within 1e-4 in float32, gradients of the arrays a modifier
closes over, of sinks and of a bias included), and both must equal the float64 numpy
reference (tests/reference.py ``np_flex_attention``) with numpy modifiers written from
their definitions. Tile skipping is checked on the schedule itself
(:func:`jattn.blockwise.tile_flags`), never by time.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import np_flex_attention, np_t5_bucket

import jattn
from jattn import blockwise, mods
from jattn._call import Operands, Settings

dpa = jattn.dot_product_attention
B, T, H, K, D = 2, 150, 4, 2, 8  # lengths not a multiple of any tile; GQA (2 groups)
OUT_TOL, GRAD_TOL = 1e-5, 1e-4


def qkv(seed=0, batch=B, t=T, s=T, heads=H, kv_heads=K):
    r = np.random.default_rng(seed)
    return (
        jnp.asarray(r.normal(size=(batch, t, heads, D)), jnp.float32),
        jnp.asarray(r.normal(size=(batch, s, kv_heads, D)), jnp.float32),
        jnp.asarray(r.normal(size=(batch, s, kv_heads, D)), jnp.float32),
    )


R = np.random.default_rng(11)
SLOPES = R.uniform(0.05, 0.5, H).astype(np.float32)
TABLE = R.normal(size=(16, H)).astype(np.float32)
SINKS = R.normal(size=H).astype(np.float32)
IDS = np.stack([np.arange(T) // 40, np.arange(T) // 70]).astype(np.int32)  # [B, T]
PREFIX = np.array([30, 100], np.int32)


def np_relative(s, b, h, qi, ki):
    bucket = np.vectorize(lambda r: np_t5_bucket(r, TABLE.shape[0]))(ki - qi)
    return s + TABLE[bucket, h]


def np_table_bias(s, b, h, qi, ki):
    return s + TABLE[np.clip(ki - qi, -7, 8) + 7, h]


# name -> (jax score_mod of the parameter, numpy score_mod, the parameter or None)
SCORES = {
    "softcap": (lambda p: mods.softcap(0.8), lambda s, *i: 0.8 * np.tanh(s / 0.8), None),
    "alibi": (
        lambda p: mods.alibi(p),
        lambda s, b, h, qi, ki: s + SLOPES[h] * (ki - qi),
        SLOPES,
    ),
    "alibi_symmetric": (
        lambda p: mods.alibi(p, symmetric=True),
        lambda s, b, h, qi, ki: s - SLOPES[h] * np.abs(ki - qi),
        SLOPES,
    ),
    "relative_bias": (lambda p: mods.relative_bias(p, max_distance=32), np_relative, TABLE),
    "alibi+softcap": (
        lambda p: mods.compose(mods.alibi(p), mods.softcap(1.5)),
        lambda s, b, h, qi, ki: 1.5 * np.tanh((s + SLOPES[h] * (ki - qi)) / 1.5),
        SLOPES,
    ),
    "closure over a table": (
        lambda p: lambda s, b, h, qi, ki: s + p[jnp.clip(ki - qi, -7, 8) + 7, h],
        np_table_bias,
        TABLE,
    ),
}


def _assert_paths_agree(fn, args, grad_argnums, out_tol=OUT_TOL, grad_tol=GRAD_TOL):
    """``fn(impl, *args) -> out`` on both paths: outputs and gradients of a fixed random
    projection of the outputs w.r.t. ``args[i]`` for ``i`` in ``grad_argnums``."""

    def loss(impl):
        def f(*a):
            out = fn(impl, *a)
            outs = out if isinstance(out, tuple) else (out,)
            return sum(jnp.sum(jnp.sin(x * (1.0 + 0.1 * n))) for n, x in enumerate(outs))

        return f

    results = {}
    for impl in ("blockwise", "dense"):  # jitted: one program each instead of eager ops
        out = jax.jit(functools.partial(fn, impl))(*args)
        grads = jax.jit(jax.grad(loss(impl), argnums=grad_argnums))(*args)
        results[impl] = (out, grads)
    (ob, gb), (od, gd) = results["blockwise"], results["dense"]
    for xb, xd in zip(*(o if isinstance(o, tuple) else (o,) for o in (ob, od)), strict=True):
        np.testing.assert_allclose(xb, xd, atol=out_tol, rtol=out_tol)
    for n, (xb, xd) in enumerate(zip(gb, gd, strict=True)):
        np.testing.assert_allclose(xb, xd, atol=grad_tol, rtol=grad_tol, err_msg=f"grad {n}")
    return ob


@pytest.mark.parametrize("name", list(SCORES))
def test_score_mods_equal_dense_and_numpy_with_gradients_of_their_arrays(name):
    make, np_score, param = SCORES[name]
    q, k, v = qkv(1)
    p = jnp.asarray(param) if param is not None else jnp.zeros(())

    def fn(impl, q, k, v, p):
        return dpa(q, k, v, is_causal=True, score_mod=make(p), implementation=impl)

    out = _assert_paths_agree(fn, (q, k, v, p), (0, 1, 2, 3))
    mask = np.tril(np.ones((T, T), bool))[None, None]
    want, _, _ = np_flex_attention(q, k, v, score=np_score, mask=mask)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)


def np_masks():
    qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
    causal = (qi >= ki)[None, None]
    window = ((ki >= qi - 20) & (ki <= qi + 5))[None, None]
    doc = (IDS[:, :, None] == IDS[:, None, :])[:, None]
    prefix = ((ki <= qi)[None] | (ki[None] < PREFIX[:, None, None]))[:, None]
    return {
        "causal": (mods.causal(), causal),
        "sliding_window": (mods.sliding_window(20, 5), window),
        "prefix_lm": (mods.prefix_lm(jnp.asarray(PREFIX)), prefix),
        "document": (mods.document(jnp.asarray(IDS)), doc),
        "causal&document": (mods.causal() & mods.document(jnp.asarray(IDS)), causal & doc),
        "prefix|window": (
            mods.or_masks(mods.prefix_lm(jnp.asarray(PREFIX)), mods.sliding_window(20, 5)),
            prefix | window,
        ),
        "lambda (checkerboard of 3)": (
            lambda b, h, qi, ki: ((qi // 3 + ki // 3 + h) % 2 == 0) | (qi == ki),
            np.broadcast_to(
                ((qi // 3 + ki // 3 + np.arange(H)[:, None, None]) % 2 == 0) | (qi == ki),
                (1, H, T, T),
            ),
        ),
    }


@pytest.mark.parametrize("via", ["mask_mod", "block_mask"])
@pytest.mark.parametrize("name", list(np_masks()))
def test_mask_mods_and_block_masks_equal_dense_and_numpy(name, via):
    mask_mod, np_mask = np_masks()[name]
    q, k, v = qkv(2)
    kwargs = {"mask_mod": mask_mod}
    if via == "block_mask":
        kwargs = {
            "block_mask": jattn.block_mask(
                mask_mod, q_len=T, batch_shape=B, num_heads=H, block_q=32, block_k=32
            )
        }

    def fn(impl, q, k, v):
        return dpa(q, k, v, implementation=impl, return_residual=True, **kwargs)

    out, lse = _assert_paths_agree(fn, (q, k, v), (0, 1, 2))
    want, _, want_lse = np_flex_attention(q, k, v, mask=np_mask)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.swapaxes(lse, 1, 2), want_lse, atol=2e-5, rtol=1e-5)


def test_sinks_lse_and_fully_masked_rows_equal_dense_and_numpy():
    q, k, v = qkv(3)
    lengths = jnp.array([T, 0])  # row 1 sees no key at all: it attends only its sinks
    mask_mod = mods.document(jnp.asarray(IDS))

    def fn(impl, q, k, v, sinks):
        return dpa(
            q, k, v, is_causal=True, mask_mod=mask_mod, sinks=sinks,
            key_value_seq_lengths=lengths, return_residual=True, implementation=impl,
        )  # fmt: skip

    out, lse = _assert_paths_agree(fn, (q, k, v, jnp.asarray(SINKS)), (0, 1, 2, 3))
    qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (qi >= ki)[None, None] & (IDS[:, :, None] == IDS[:, None, :])[:, None]
    visible = visible & (ki[None] < np.asarray(lengths)[:, None, None])[:, None]
    want, _, want_lse = np_flex_attention(q, k, v, mask=visible, sinks=SINKS)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.swapaxes(lse, 1, 2), want_lse, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[1], 0.0)  # the sink takes all the mass, no value
    np.testing.assert_allclose(lse[1], np.broadcast_to(SINKS, (T, H)), rtol=1e-6)
    grads = jax.jit(jax.grad(lambda q: jnp.sum(fn("blockwise", q, k, v, jnp.asarray(SINKS))[0])))(q)
    np.testing.assert_array_equal(grads[1], 0.0)


@pytest.mark.parametrize(
    "shape", [(T, T), (H, 1, T), (B, 1, T, T), (B, H, T, T), (1, 1, 1, T), (B, H, T, 1)]
)
def test_bias_of_any_broadcast_shape_with_its_gradient(shape):
    q, k, v = qkv(4)
    bias = jnp.asarray(np.random.default_rng(5).normal(size=shape), jnp.float32)

    def fn(impl, q, k, v, bias, slopes):
        return dpa(q, k, v, bias, is_causal=True, score_mod=mods.alibi(slopes), implementation=impl)

    out = _assert_paths_agree(fn, (q, k, v, bias, jnp.asarray(SLOPES)), (0, 1, 2, 3, 4))
    mask = np.tril(np.ones((T, T), bool))[None, None]
    # the order of the dense path and FlexAttention: score_mod on the scaled logits, then bias
    full_bias = np.broadcast_to(np.asarray(bias).reshape((1,) * (4 - len(shape)) + shape),
                                (B, H, T, T))  # fmt: skip
    want, _, _ = np_flex_attention(
        q, k, v, mask=mask,
        score=lambda s, b, h, qi, ki: s + SLOPES[h] * (ki - qi) + full_bias[b, h, qi, ki],
    )  # fmt: skip
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)


def test_ragged_lengths_mqa_and_every_option_together():
    q, k, v = qkv(6, kv_heads=1, s=170)
    q_lengths, kv_lengths = jnp.array([150, 77]), jnp.array([101, 170])
    kv_ids = jnp.asarray(np.stack([np.arange(170) // 40, np.arange(170) // 70]), jnp.int32)
    bias = jnp.asarray(np.random.default_rng(7).normal(size=(1, H, 1, 170)), jnp.float32)

    def fn(impl, q, k, v, slopes, sinks, bias):
        return dpa(
            q, k, v, bias,
            score_mod=mods.compose(mods.alibi(slopes), mods.softcap(2.0)),
            mask_mod=mods.document(jnp.asarray(IDS), kv_ids), sinks=sinks,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            local_window_size=(60, 10), return_residual=True, implementation=impl,
        )  # fmt: skip

    args = (q, k, v, jnp.asarray(SLOPES), jnp.asarray(SINKS), bias)
    out, _ = _assert_paths_agree(fn, args, (0, 1, 2, 3, 4, 5))
    np.testing.assert_array_equal(out[1, 77:], 0.0)  # padding queries


def test_dropout_with_modifiers_drops_the_dense_paths_weights():
    q, k, v = qkv(8)
    key = jax.random.key(3)

    def fn(impl, q, k, v, slopes, sinks):
        return dpa(
            q, k, v, score_mod=mods.alibi(slopes), mask_mod=mods.causal() & mods.document(
                jnp.asarray(IDS)), sinks=sinks, dropout_rate=0.3, dropout_rng=key,
            implementation=impl,
        )  # fmt: skip

    _assert_paths_agree(fn, (q, k, v, jnp.asarray(SLOPES), jnp.asarray(SINKS)), (0, 1, 2, 3, 4))


def test_jit_traces_once_for_new_modifier_arrays_and_vmap_equals_the_batched_call():
    q, k, v = qkv(9)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, score_mod, mask_mod, sinks):
        return dpa(
            q, k, v, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
            implementation="blockwise",
        )  # fmt: skip

    for seed in (0, 1):
        r = np.random.default_rng(seed)
        slopes = jnp.asarray(r.uniform(0.1, 0.5, H), jnp.float32)
        ids = jnp.asarray(np.sort(r.integers(0, 4, (B, T)), axis=1), jnp.int32)
        args = (mods.alibi(slopes), mods.causal() & mods.document(ids), jnp.asarray(SINKS))
        want = dpa(q, k, v, score_mod=args[0], mask_mod=args[1], sinks=args[2],
                   implementation="dense")  # fmt: skip
        np.testing.assert_allclose(f(q, *args), want, atol=OUT_TOL)

    def one(q, k, v):  # per example: b == 0 inside, which ALiBi and sinks ignore
        return dpa(q, k, v, is_causal=True, score_mod=mods.alibi(jnp.asarray(SLOPES)),
                   sinks=jnp.asarray(SINKS), implementation="blockwise")  # fmt: skip

    batched = jax.vmap(one)(q[:, None], k[:, None], v[:, None])[:, 0]
    np.testing.assert_allclose(batched, one(q, k, v), atol=OUT_TOL)


# ----------------------------------------------------------------------------------------
# The schedule: skipped tiles, unmasked tiles, the causal fast path
# ----------------------------------------------------------------------------------------


def flags(t, block=64, batch=1, **settings_and_ops):
    q = jax.ShapeDtypeStruct((batch, t, H, D), jnp.float32)
    ops = Operands(scale=1.0, block_mask=settings_and_ops.pop("block_mask", None))
    settings = Settings(**settings_and_ops)
    q = jnp.zeros(q.shape, q.dtype)
    return blockwise.tile_flags(q, q, q, ops, settings, block_q=block, block_k=block)


def test_a_causal_mask_mod_runs_the_schedule_and_fast_path_of_is_causal():
    plain = flags(1024, is_causal=True)
    for mask_mod in (mods.causal(), mods.causal() & mods.causal()):
        got = flags(1024, mask_mod=mask_mod)
        np.testing.assert_array_equal(got[0], plain[0])
        np.testing.assert_array_equal(got[1], plain[1])
        assert got[2] == plain[2]


def test_documents_skip_the_tiles_between_documents_and_leave_full_tiles_unmasked():
    t, block = 1024, 64
    ids = jnp.repeat(jnp.arange(4), t // 4)[None]  # 4 documents of 256 tokens
    needed, full, fast = flags(t, block, mask_mod=mods.causal() & mods.document(ids))
    assert not fast
    i, j = np.arange(t // block)[:, None], np.arange(t // block)[None, :]
    same_doc = (i * block) // 256 == (j * block) // 256
    np.testing.assert_array_equal(needed, same_doc & (j <= i))  # exactly the visible tiles
    np.testing.assert_array_equal(full, same_doc & (j < i))  # off-diagonal: no mask at all
    causal_needed = flags(t, block, is_causal=True)[0]
    assert (needed.sum(), causal_needed.sum()) == (4 * 10, 16 * 17 // 2)  # 40 tiles of 136
    # a block mask gives the same schedule, coarsened from its own (smaller) tiles
    bm = jattn.block_mask(mods.causal() & mods.document(ids), q_len=t, block_q=32, block_k=32)
    got = flags(t, block, block_mask=bm)
    np.testing.assert_array_equal(got[0], needed)
    np.testing.assert_array_equal(got[1], full)


def test_a_block_mask_whose_tiles_do_not_divide_the_paths_is_rebuilt():
    q, k, v = qkv(10)
    mask_mod = mods.causal() & mods.document(jnp.asarray(IDS))
    bm = jattn.block_mask(mask_mod, q_len=T, batch_shape=B, block_q=24, block_k=40)
    got = dpa(q, k, v, block_mask=bm, implementation="blockwise")
    np.testing.assert_allclose(got, dpa(q, k, v, mask_mod=mask_mod, implementation="dense"),
                               atol=OUT_TOL)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [
        {"score_mod": mods.softcap(2.0)},
        {"mask_mod": mods.causal()},
        {"sinks": jnp.zeros(2)},
        {"block_mask": jattn.block_mask(mods.causal(), q_len=256)},
        {"bias": jnp.zeros((256, 256))},
    ],
    ids=["score_mod", "mask_mod", "sinks", "block_mask", "bias"],
)
def test_the_automatic_rule_runs_long_modified_calls_blockwise(kwargs):
    q = qkv(0, batch=1, t=256, s=256, heads=2, kv_heads=2)[0]
    auto = dpa(q, q, q, **kwargs)  # blockwise, or the fused CPU kernel where it takes them
    np.testing.assert_allclose(auto, dpa(q, q, q, implementation="blockwise", **kwargs), atol=1e-5)
    np.testing.assert_allclose(auto, dpa(q, q, q, implementation="dense", **kwargs), atol=1e-5)


# ----------------------------------------------------------------------------------------
# Property test: small tiles (8 x 8), random shapes and modifiers, against numpy
# ----------------------------------------------------------------------------------------


@given(
    batch=st.sampled_from([(), (2,), (2, 1)]),
    t=st.integers(1, 30),
    s=st.integers(1, 30),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]),
    score=st.sampled_from([None, "softcap", "alibi", "alibi+softcap"]),
    mask=st.sampled_from([None, "causal", "window", "document", "causal&document"]),
    with_sinks=st.booleans(),
    bias=st.sampled_from([None, "per key", "full"]),
    seed=st.integers(0, 2**16),
)
def test_small_tiles_match_numpy(batch, t, s, kv_heads, groups, score, mask, with_sinks, bias,
                                 seed):  # fmt: skip
    r = np.random.default_rng(seed)
    n, h = math.prod(batch), kv_heads * groups
    q = r.normal(size=(*batch, t, h, D)).astype(np.float32)
    k = r.normal(size=(*batch, s, kv_heads, D)).astype(np.float32)
    v = r.normal(size=(*batch, s, kv_heads, D)).astype(np.float32)
    slopes = r.uniform(0.05, 0.5, h).astype(np.float32)
    sinks = r.normal(size=h).astype(np.float32) if with_sinks else None
    q_ids = np.sort(r.integers(0, 3, (n, t)), axis=1).astype(np.int32)
    kv_ids = np.sort(r.integers(0, 3, (n, s)), axis=1).astype(np.int32)
    bias_arr = {
        None: None,
        "per key": r.normal(size=(h, 1, s)).astype(np.float32),
        "full": r.normal(size=(*batch, h, t, s)).astype(np.float32),
    }[bias]
    jax_score = {
        None: None,
        "softcap": mods.softcap(1.0),
        "alibi": mods.alibi(jnp.asarray(slopes)),
        "alibi+softcap": mods.compose(mods.alibi(jnp.asarray(slopes)), mods.softcap(1.0)),
    }[score]
    doc = mods.document(
        jnp.asarray(q_ids).reshape(*batch, t), jnp.asarray(kv_ids).reshape(*batch, s)
    )
    jax_mask = {
        None: None, "causal": mods.causal(), "window": mods.sliding_window(3, 2),
        "document": doc, "causal&document": mods.causal() & doc,
    }[mask]  # fmt: skip
    out, lse = jax.jit(  # one program per example instead of its operations one by one
        lambda q, k, v: blockwise.attention(
            q, k, v,
            Operands(scale=1.0 / math.sqrt(D),
                     bias=None if bias_arr is None else jnp.asarray(bias_arr),
                     sinks=None if sinks is None else jnp.asarray(sinks)),
            Settings(score_mod=jax_score, mask_mod=jax_mask, return_residual=True),
            block_q=8, block_k=8,
        )
    )(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))  # fmt: skip

    full_bias = 0.0
    if bias_arr is not None:
        lead = (1,) * (len(batch) + 3 - bias_arr.ndim)
        full_bias = np.broadcast_to(bias_arr.reshape(lead + bias_arr.shape), (*batch, h, t, s))
        full_bias = full_bias.reshape(n, h, t, s)

    def np_score(x, b, hh, qi, ki):
        if score in ("alibi", "alibi+softcap"):
            x = x + slopes[hh] * (ki - qi)
        if score in ("softcap", "alibi+softcap"):
            x = np.tanh(x)
        return x + full_bias

    qi, ki = np.arange(t)[:, None], np.arange(s)[None, :]
    np_doc = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    np_mask = {
        None: None, "causal": (qi >= ki)[None, None],
        "window": ((ki >= qi - 3) & (ki <= qi + 2))[None, None],
        "document": np_doc, "causal&document": (qi >= ki)[None, None] & np_doc,
    }[mask]  # fmt: skip
    want, _, want_lse = np_flex_attention(
        q.reshape(n, t, h, D), k.reshape(n, s, kv_heads, D), v.reshape(n, s, kv_heads, D),
        score=np_score, mask=np_mask, sinks=sinks,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(out).reshape(want.shape), want, atol=2e-5, rtol=1e-5)
    lse = np.swapaxes(np.asarray(lse).reshape(n, t, h), 1, 2)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], atol=2e-5, rtol=1e-5)
    assert np.all(lse[~seen] == jattn.large_negative(jnp.float32))
