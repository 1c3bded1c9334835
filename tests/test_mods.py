"""Score and mask modifiers, sinks and block masks (jattn.mods, jattn.block_mask).

References: the float64 numpy attention of tests/reference.py with numpy versions of each
modifier written here from their definitions (ALiBi paper, T5's bucketing, Gemma's
soft-capping, gpt-oss's sinks), hand-computed values, finite differences
(``jax.test_util.check_grads`` in float64) and identities that route the same function
through other code (a sink as an extra key with a bias; a mask_mod as a mask array).
PyTorch's flex_attention and autograd are in tests/test_mods_torch.py.
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
from jax.test_util import check_grads
from reference import np_flex_attention, np_t5_bucket

import jattn
from jattn import mods
from jattn.blockwise import _closure

dpa = jattn.dot_product_attention


def normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, dtype)


# ----------------------------------------------------------------------------------------
# numpy versions of the modifiers, from their definitions
# ----------------------------------------------------------------------------------------


NP_SCORES = {
    "softcap": lambda p: lambda s, b, h, qi, ki: p["cap"] * np.tanh(s / p["cap"]),
    "alibi": lambda p: lambda s, b, h, qi, ki: s + p["slopes"][h] * (ki - qi),
    "alibi_sym": lambda p: lambda s, b, h, qi, ki: s - p["slopes"][h] * np.abs(ki - qi),
    "relative": lambda p: (
        lambda s, b, h, qi, ki: (
            s
            + p["table"][
                np.vectorize(lambda r: np_t5_bucket(r, p["table"].shape[0], True, 16))(ki - qi), h
            ]
        )
    ),
    "alibi+softcap": lambda p: (
        lambda s, b, h, qi, ki: p["cap"] * np.tanh((s + p["slopes"][h] * (ki - qi)) / p["cap"])
    ),
}
JAX_SCORES = {
    "softcap": lambda p: mods.softcap(p["cap"]),
    "alibi": lambda p: mods.alibi(p["slopes"]),
    "alibi_sym": lambda p: mods.alibi(p["slopes"], symmetric=True),
    "relative": lambda p: mods.relative_bias(p["table"], max_distance=16),
    "alibi+softcap": lambda p: mods.compose(mods.alibi(p["slopes"]), mods.softcap(p["cap"])),
}


def np_mask(name, p, n, t, s):
    """bool [N|1, 1, T, S] for the mask named ``name``."""
    qi, ki = np.arange(t)[:, None], np.arange(s)[None, :]
    if name == "causal":
        return (qi >= ki)[None, None]
    if name == "window":
        return ((ki >= qi - 2) & (ki <= qi + 1))[None, None]
    if name == "prefix":
        return ((ki <= qi) | (ki < p["prefix"][:, None, None]))[:, None]
    q_ids, k_ids = p["q_ids"], p["kv_ids"]
    doc = (q_ids[:, :, None] == k_ids[:, None, :])[:, None]
    if name == "document":
        return doc
    if name == "causal&document":
        return doc & (qi >= ki)[None, None]
    if name == "prefix|window":
        return np_mask("prefix", p, n, t, s) | np_mask("window", p, n, t, s)
    raise AssertionError(name)


def jax_mask(name, p, batch):
    ids = {k: jnp.asarray(p[k]).reshape(*batch, -1) for k in ("q_ids", "kv_ids")}
    return {
        "causal": lambda: mods.causal(),
        "window": lambda: mods.sliding_window(2, 1),
        "prefix": lambda: mods.prefix_lm(jnp.asarray(p["prefix"]).reshape(batch)),
        "document": lambda: mods.document(ids["q_ids"], ids["kv_ids"]),
        "causal&document": lambda: mods.causal() & mods.document(ids["q_ids"], ids["kv_ids"]),
        "prefix|window": lambda: mods.or_masks(
            mods.prefix_lm(jnp.asarray(p["prefix"]).reshape(batch)), mods.sliding_window(2, 1)
        ),
    }[name]()


def draw_params(rng, n, h, t, s):
    return {
        "cap": float(rng.uniform(0.3, 3.0)),
        "slopes": rng.uniform(0.05, 1.0, h).astype(np.float32),
        "table": rng.normal(size=(8, h)).astype(np.float32),
        "prefix": rng.integers(0, t + 1, n),
        "q_ids": np.sort(rng.integers(0, 3, (n, t)), axis=1),
        "kv_ids": np.sort(rng.integers(0, 3, (n, s)), axis=1),
        "sinks": rng.normal(size=h).astype(np.float32),
    }


# ----------------------------------------------------------------------------------------
# Against the float64 numpy reference
# ----------------------------------------------------------------------------------------

SCORE_NAMES = [None, *NP_SCORES]
MASK_NAMES = [None, "causal", "window", "prefix", "document", "causal&document", "prefix|window"]


@given(
    batch=st.sampled_from([(), (1,), (2,), (2, 1)]),
    t=st.integers(1, 9),
    s=st.integers(1, 9),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]),
    d=st.sampled_from([1, 4, 8]),
    score=st.sampled_from(SCORE_NAMES),
    mask=st.sampled_from(MASK_NAMES),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_numpy_reference(batch, t, s, kv_heads, groups, d, score, mask, with_sinks, seed):
    rng = np.random.default_rng(seed)
    n, h = math.prod(batch), kv_heads * groups
    q = rng.normal(size=(n, t, h, d)).astype(np.float32)
    k = rng.normal(size=(n, s, kv_heads, d)).astype(np.float32)
    v = rng.normal(size=(n, s, kv_heads, 3)).astype(np.float32)
    p = draw_params(rng, n, h, t, s)
    sinks = p["sinks"] if with_sinks else None
    want_out, want_w, want_lse = np_flex_attention(
        q,
        k,
        v,
        score=None if score is None else NP_SCORES[score](p),
        mask=None if mask is None else np_mask(mask, p, n, t, s),
        sinks=sinks,
    )
    call = jax.jit(  # one program per example instead of its operations one by one
        functools.partial(
            dpa,
            score_mod=None if score is None else JAX_SCORES[score](p),
            mask_mod=None if mask is None else jax_mask(mask, p, batch),
            sinks=sinks,
            return_weights=True,
            return_residual=True,
        )
    )
    out, w, lse = call(
        q.reshape(*batch, t, h, d),
        k.reshape(*batch, s, kv_heads, d),
        v.reshape(*batch, s, kv_heads, 3),
    )
    np.testing.assert_allclose(out.reshape(want_out.shape), want_out, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(w.reshape(want_w.shape), want_w, atol=2e-6)
    # lse: [batch..., T, H]; rows with no key: the sink, or large_negative without sinks
    lse = np.swapaxes(np.asarray(lse).reshape(n, t, h), 1, 2)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], atol=2e-5, rtol=1e-5)
    assert np.all(lse[~seen] == jattn.large_negative(jnp.float32))


def test_float64_in_float64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        q, k, v = (rng.normal(size=(2, 5, 2, 4)) for _ in range(3))
        p = draw_params(rng, 2, 2, 5, 5)
        want, _, _ = np_flex_attention(
            q, k, v, score=NP_SCORES["alibi+softcap"](p), mask=np_mask("causal", p, 2, 5, 5),
            sinks=p["sinks"],
        )  # fmt: skip
        slopes = jnp.asarray(p["slopes"], jnp.float64)
        out = dpa(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
            score_mod=mods.compose(mods.alibi(slopes), mods.softcap(p["cap"])),
            mask_mod=mods.causal(), sinks=jnp.asarray(p["sinks"], jnp.float64),
        )  # fmt: skip
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, want, atol=1e-12)


# ----------------------------------------------------------------------------------------
# The indices the modifiers see
# ----------------------------------------------------------------------------------------


def test_indices_have_the_documented_shapes_and_dtype():
    seen = {}

    def spy(score, b, h, q_idx, kv_idx):
        seen.update(score=score, b=b, h=h, q=q_idx, k=kv_idx)
        return score

    q = normal(0, (2, 3, 5, 4, 8))  # batch (2, 3), T=5, H=4
    k = normal(1, (2, 3, 7, 2, 8))  # S=7, 2 kv heads
    dpa(q, k, k, score_mod=spy)
    assert seen["score"].shape == (6, 4, 5, 7) and seen["score"].dtype == jnp.float32
    for name, shape in (
        ("b", (6, 1, 1, 1)),
        ("h", (1, 4, 1, 1)),
        ("q", (1, 1, 5, 1)),
        ("k", (1, 1, 1, 7)),
    ):
        assert seen[name].shape == shape and seen[name].dtype == jnp.int32, name
    np.testing.assert_array_equal(np.asarray(seen["b"]).ravel(), np.arange(6))
    np.testing.assert_array_equal(np.asarray(seen["h"]).ravel(), np.arange(4))
    np.testing.assert_array_equal(np.asarray(seen["k"]).ravel(), np.arange(7))


def test_b_is_the_row_major_flattened_batch_index_and_h_the_query_head():
    # Only flattened row 4 = (1, 1) of batch (2, 3) and query head 3 (kv head 1) see keys.
    q = normal(0, (2, 3, 4, 4, 8))
    k = normal(1, (2, 3, 4, 2, 8))
    out = dpa(q, k, k, mask_mod=lambda b, h, qi, ki: (b == 4) & (h == 3))
    nonzero = np.abs(np.asarray(out)).sum(axis=(2, 4)) > 0  # [2, 3, H]
    expected = np.zeros((2, 3, 4), bool)
    expected[1, 1, 3] = True
    np.testing.assert_array_equal(nonzero, expected)


def test_positions_are_absolute_and_top_left_aligned():
    q, k = normal(0, (1, 3, 2, 4)), normal(1, (1, 6, 2, 4))
    out = dpa(q, k, k, mask_mod=mods.causal())
    with pytest.warns(jattn.CausalAlignmentWarning):  # top-left with fewer queries: said
        top_left = dpa(q, k, k, is_causal=True)
    np.testing.assert_array_equal(out, top_left)


# ----------------------------------------------------------------------------------------
# Order of operations, sinks as an extra key, weights
# ----------------------------------------------------------------------------------------


def test_score_mod_runs_before_the_bias_so_a_bias_mask_stays_a_mask():
    q, k = normal(0, (2, 6, 2, 4)), normal(1, (2, 6, 2, 4))
    causal = jattn.causal_mask(6)
    cap = mods.softcap(1.0)
    with_bias = dpa(q, k, k, bias=jattn.mask_to_bias(causal), score_mod=cap)
    with_mask = dpa(q, k, k, mask=causal, score_mod=cap)
    np.testing.assert_allclose(with_bias, with_mask, atol=1e-6)


def test_a_sink_is_an_extra_key_with_zero_value_and_the_sink_as_its_logit():
    q, k, v = normal(0, (2, 5, 4, 8)), normal(1, (2, 5, 2, 8)), normal(2, (2, 5, 2, 8))
    sinks = normal(3, (4,))
    out, lse = dpa(q, k, v, sinks=sinks, is_causal=True, return_residual=True)
    # The same function without sinks: one more key (k = 0, so q·k = 0) whose bias is the
    # sink and whose value is 0; causal keeps it visible to every query (mask column 0).
    k1 = jnp.concatenate([jnp.zeros((2, 1, 2, 8)), k], axis=1)
    v1 = jnp.concatenate([jnp.zeros((2, 1, 2, 8)), v], axis=1)
    bias = jnp.zeros((4, 5, 6)).at[:, :, 0].set(sinks[:, None])
    mask = jnp.concatenate([jnp.ones((5, 1), bool), jattn.causal_mask(5)], axis=1)
    out1, lse1 = dpa(q, k1, v1, bias=bias, mask=mask, return_residual=True)
    np.testing.assert_allclose(out, out1, atol=1e-6)
    np.testing.assert_allclose(lse, lse1, atol=1e-6)


def test_weights_with_sinks_sum_to_one_minus_the_sink_probability():
    q, k = normal(0, (1, 4, 2, 8)), normal(1, (1, 4, 2, 8))
    sinks = jnp.array([0.5, -1.0])
    w = jattn.dot_product_attention_weights(q, k, sinks=sinks)
    _, w2, lse = dpa(q, k, k, sinks=sinks, return_weights=True, return_residual=True)
    np.testing.assert_array_equal(w, w2)
    p_sink = np.exp(np.asarray(sinks)[None, :, None] - np.swapaxes(np.asarray(lse), -1, -2))
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0 - p_sink, atol=1e-6)
    assert np.all(np.asarray(w).sum(-1) < 1.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_fully_masked_rows_with_sinks_give_zeros_the_sink_as_lse_and_finite_gradients(dtype):
    q, k, v = (normal(i, (2, 4, 2, 8), dtype) for i in range(3))
    sinks = jnp.array([0.3, -2.0])
    # Query 0 of batch row 0 sees nothing; the others see something.
    mask_mod = lambda b, h, qi, ki: (b > 0) | (qi > 0)  # noqa: E731

    def loss(q, k, v, sinks):
        out, lse = dpa(q, k, v, mask_mod=mask_mod, sinks=sinks, return_residual=True)
        return jnp.sum(out.astype(jnp.float32) ** 2), (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, sinks
    )
    assert out.dtype == dtype
    np.testing.assert_array_equal(out[0, 0], 0)
    # the lse comes back in the input dtype (as jax.nn's residual): the sinks rounded to it
    np.testing.assert_allclose(lse[0, 0], sinks.astype(dtype).astype(lse.dtype), rtol=1e-6)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    np.testing.assert_array_equal(grads[0][0, 0], 0)  # the empty row's queries


def test_a_very_negative_sink_changes_nothing():
    q, k, v = (normal(i, (2, 5, 2, 4)) for i in range(3))
    with_sink = dpa(q, k, v, is_causal=True, sinks=jnp.full((2,), -1e30))
    np.testing.assert_allclose(with_sink, dpa(q, k, v, is_causal=True), atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_user_modifiers_on_the_blockwise_path_with_x64_on(dtype):
    """With jax_enable_x64 the blockwise loop counters are int64; a modifier comparing or
    subtracting its indices still gets int32 ones (it used to fail inside lax)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        q, k, v = (rng.normal(size=(1, 300, 2, 8)) for _ in range(3))
        table = jnp.arange(300, dtype=jnp.int32)

        def mask_mod(b, h, q_idx, kv_idx):
            return table[kv_idx] <= q_idx

        def score_mod(s, b, h, q_idx, kv_idx):
            return s - (q_idx - kv_idx).astype(s.dtype) * 0.01

        want, _, _ = np_flex_attention(
            q, k, v, score=lambda s, b, h, qi, ki: s - (qi - ki) * 0.01,
            mask=np.tri(300, dtype=bool),
        )  # fmt: skip
        out = dpa(
            *(jnp.asarray(x, dtype) for x in (q, k, v)), mask_mod=mask_mod,
            score_mod=score_mod, implementation="blockwise",
        )  # fmt: skip
        assert out.dtype == dtype
        np.testing.assert_allclose(out, want, atol=1e-12 if dtype == jnp.float64 else 2e-5)


# ----------------------------------------------------------------------------------------
# Gradients (finite differences, float64) and transformations
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["alibi", "relative", "sinks"])
def test_gradients_to_closed_over_arrays_match_finite_differences(which):
    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        q, k, v = (jnp.asarray(rng.normal(size=(2, 5, 2, 4))) for _ in range(3))
        param = {
            "alibi": jnp.asarray(rng.uniform(0.1, 1.0, 2)),
            "relative": jnp.asarray(rng.normal(size=(8, 2))),
            "sinks": jnp.asarray(rng.normal(size=2)),
        }[which]

        def f(q, k, v, param):
            kwargs = {
                "alibi": lambda: {"score_mod": mods.alibi(param)},
                "relative": lambda: {"score_mod": mods.relative_bias(param, max_distance=16)},
                "sinks": lambda: {"sinks": param, "score_mod": mods.softcap(2.0)},
            }[which]()
            return dpa(q, k, v, mask_mod=mods.causal(), **kwargs)

        check_grads(f, (q, k, v, param), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_a_ready_made_mod_is_a_pytree_whose_gradient_is_its_arrays_gradient():
    q, k = normal(0, (1, 4, 2, 4)), normal(1, (1, 4, 2, 4))
    slopes = jnp.array([0.5, 0.25])

    def loss_of_mod(mod):
        return dpa(q, k, k, score_mod=mod).sum()

    g_mod = jax.grad(loss_of_mod)(mods.alibi(slopes))
    g_slopes = jax.grad(lambda s: loss_of_mod(mods.alibi(s)))(slopes)
    assert isinstance(g_mod, mods.Alibi)
    np.testing.assert_allclose(g_mod.slopes, g_slopes, rtol=1e-6)
    assert np.any(np.asarray(g_slopes) != 0)


def test_jit_equals_eager_and_traces_once_for_new_arrays():
    q = normal(0, (2, 6, 2, 4))
    ids = jnp.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, score_mod, mask_mod, sinks):
        return dpa(q, q, q, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)

    for scale in (1.0, 2.0):
        score_mod = mods.alibi(jnp.array([0.5, 0.25]) * scale)
        mask_mod = mods.causal() & mods.document(ids * int(scale))
        sinks = jnp.array([0.1, 0.2]) * scale
        eager = dpa(q, q, q, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)
        np.testing.assert_allclose(f(q, score_mod, mask_mod, sinks), eager, atol=1e-6)


def test_vmap_equals_the_batched_call():
    q = normal(0, (3, 6, 2, 4))
    ids = jnp.array([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1], [0, 1, 2, 3, 4, 5]])
    prefix = jnp.array([2, 0, 5])

    def one(q, ids, prefix):
        mask = mods.document(ids) & mods.prefix_lm(prefix)
        return dpa(q, q, q, mask_mod=mask, score_mod=mods.softcap(1.5))

    mapped = jax.vmap(one)(q, ids, prefix)
    batched = dpa(
        q, q, q, mask_mod=mods.document(ids) & mods.prefix_lm(prefix), score_mod=mods.softcap(1.5)
    )
    np.testing.assert_allclose(mapped, batched, atol=1e-6)


def test_grad_under_jit_of_a_closure_over_traced_arrays():
    q = normal(0, (2, 6, 2, 4))
    table = normal(1, (8, 2))
    ids = jnp.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])

    def loss(q, table, ids):
        score_mod = lambda s, b, h, qi, ki: s + table[jnp.clip(ki - qi, -3, 4) + 3, h]  # noqa: E731
        mask_mod = lambda b, h, qi, ki: ids[b, qi] == ids[b, ki]  # noqa: E731
        return dpa(q, q, q, score_mod=score_mod, mask_mod=mask_mod).sum()

    eager = jax.grad(loss, argnums=(0, 1))(q, table, ids)
    for g, want in zip(jax.jit(jax.grad(loss, argnums=(0, 1)))(q, table, ids), eager, strict=True):
        np.testing.assert_allclose(g, want, atol=1e-5)
    assert np.any(np.asarray(eager[1]) != 0)


# ----------------------------------------------------------------------------------------
# Ready-made modifiers: exact values
# ----------------------------------------------------------------------------------------


def test_alibi_slopes_follow_the_paper():
    np.testing.assert_allclose(mods.alibi_slopes(8), [2.0**-i for i in range(1, 9)])
    np.testing.assert_allclose(mods.alibi_slopes(4), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...)
    want = [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    np.testing.assert_allclose(mods.alibi_slopes(12), want, rtol=1e-6)
    np.testing.assert_allclose(mods.alibi_slopes(1), [2.0**-8])


def test_t5_buckets_by_hand_and_against_the_formula():
    # 32 buckets, bidirectional, max_distance 128: 16 per direction, 8 exact.
    hand = {0: 0, -1: 1, -7: 7, -8: 8, -20: 10, -200: 15, 1: 17, 7: 23, 20: 26, 200: 31}
    rel = jnp.array(list(hand))
    got = mods.relative_position_bucket(rel, num_buckets=32, bidirectional=True, max_distance=128)
    np.testing.assert_array_equal(got, list(hand.values()))
    for num_buckets, bidirectional, max_distance in (
        (32, True, 128),
        (32, False, 128),
        (8, True, 16),
        (10, False, 40),
    ):
        r = np.arange(-300, 301)
        want = [np_t5_bucket(x, num_buckets, bidirectional, max_distance) for x in r]
        got = mods.relative_position_bucket(
            r, num_buckets=num_buckets, bidirectional=bidirectional, max_distance=max_distance
        )
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("mod", "want"),
    [
        (mods.causal(), lambda q, k: k <= q),
        (mods.sliding_window(2), lambda q, k: (k <= q) & (k >= q - 2)),
        (mods.sliding_window(1, 2), lambda q, k: (k >= q - 1) & (k <= q + 2)),
        (mods.sliding_window(1, None), lambda q, k: k >= q - 1),
        (mods.prefix_lm(3), lambda q, k: (k <= q) | (k < 3)),
        (
            mods.document(jnp.array([0, 0, 1, 1, 1, 2])),
            lambda q, k: np.array([0, 0, 1, 1, 1, 2])[q] == np.array([0, 0, 1, 1, 1, 2])[k],
        ),
        (mods.causal() | mods.sliding_window(0, 1), lambda q, k: k <= q + 1),
    ],
    ids=["causal", "window", "window_lr", "window_open", "prefix", "document", "or"],
)
def test_mask_mods_equal_their_definition(mod, want):
    q, k = np.arange(6)[:, None], np.arange(6)[None, :]
    got = mods.evaluate_mask_mod(mod, (1, 1, 6, 6))
    np.testing.assert_array_equal(np.broadcast_to(got, (1, 1, 6, 6))[0, 0], want(q, k))


def test_ready_made_masks_equal_jattns_mask_options():
    q = normal(0, (2, 8, 2, 4))
    ids = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
    pairs = [
        ({"mask_mod": mods.causal()}, {"is_causal": True}),
        ({"mask_mod": mods.sliding_window(3, 1)}, {"local_window_size": (3, 1)}),
        ({"mask_mod": mods.document(ids)}, {"query_segment_ids": ids}),
    ]
    for mod_kwargs, option_kwargs in pairs:
        np.testing.assert_array_equal(dpa(q, q, q, **mod_kwargs), dpa(q, q, q, **option_kwargs))


# ----------------------------------------------------------------------------------------
# Block masks
# ----------------------------------------------------------------------------------------


def np_states(mask: np.ndarray, bq: int, bk: int) -> np.ndarray:
    """Per-tile 0 (none visible) / 1 (some) / 2 (all) of ``mask [..., T, S]``, by loops."""
    *lead, t, s = mask.shape
    out = np.zeros((*lead, -(-t // bq), -(-s // bk)), np.int8)
    for i in range(out.shape[-2]):
        for j in range(out.shape[-1]):
            tile = mask[..., i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            out[..., i, j] = np.where(tile.all((-2, -1)), 2, np.where(tile.any((-2, -1)), 1, 0))
    return out


@given(
    n=st.integers(1, 3),
    h=st.integers(1, 3),
    t=st.integers(1, 40),
    s=st.integers(1, 40),
    bq=st.sampled_from([1, 3, 8, 16]),
    bk=st.sampled_from([1, 5, 8, 16]),
    density=st.sampled_from([0.0, 0.05, 0.5, 0.95, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_block_mask_states_are_exact(n, h, t, s, bq, bk, density, seed):
    rng = np.random.default_rng(seed)
    # Tiles drawn empty / full / random, so every state occurs, then noise inside.
    tile_kind = rng.integers(0, 3, (n, h, -(-t // bq), -(-s // bk)))
    kinds = np.repeat(np.repeat(tile_kind, bq, axis=2), bk, axis=3)[:, :, :t, :s]
    table = np.where(
        kinds == 0, False, np.where(kinds == 1, True, rng.random((n, h, t, s)) < density)
    )
    table_j = jnp.asarray(table)
    bm = jattn.block_mask(
        lambda b, hh, qi, ki: table_j[b, hh, qi, ki],
        q_len=t, kv_len=s, batch_shape=n, num_heads=h, block_q=bq, block_k=bk,
    )  # fmt: skip
    assert (bm.block_q, bm.block_k) == (min(bq, -(-t // 8) * 8), min(bk, -(-s // 8) * 8))
    want = np_states(table, bm.block_q, bm.block_k)
    np.testing.assert_array_equal(np.broadcast_to(bm.state, want.shape), want)
    needed, full = bm.tile_flags()
    np.testing.assert_array_equal(needed, (want > 0).any(axis=(0, 1)))
    np.testing.assert_array_equal(full, (want == 2).all(axis=(0, 1)))


@pytest.mark.parametrize(
    ("mod", "dense"),
    [
        (mods.causal(), lambda q, k: k <= q),
        (mods.sliding_window(20, 3), lambda q, k: (k >= q - 20) & (k <= q + 3)),
        (mods.prefix_lm(37), lambda q, k: (k <= q) | (k < 37)),
    ],
    ids=["causal", "window", "prefix"],
)
def test_block_mask_of_ready_made_masks_against_numpy(mod, dense):
    bm = jattn.block_mask(mod, q_len=100, kv_len=90, block_q=16, block_k=32)
    assert bm.state.shape == (1, 1, 7, 3)
    want = np_states(dense(np.arange(100)[:, None], np.arange(90)[None, :]), 16, 32)
    np.testing.assert_array_equal(bm.state[0, 0], want)


def test_block_mask_keeps_only_the_axes_the_mask_varies_over():
    ids = jnp.array([[0] * 10 + [1] * 6, [0] * 16])
    doc = jattn.block_mask(
        mods.document(ids), q_len=16, batch_shape=(2,), num_heads=4, block_q=8, block_k=8
    )
    assert doc.state.shape == (2, 1, 2, 2)
    np.testing.assert_array_equal(doc.state[0, 0], [[2, 1], [1, 1]])
    np.testing.assert_array_equal(doc.state[1, 0], [[2, 2], [2, 2]])
    heads = jattn.block_mask(
        lambda b, h, q, k: k <= q + h, q_len=16, num_heads=3, block_q=8, block_k=8
    )
    assert heads.state.shape == (1, 3, 2, 2)
    causal = jattn.block_mask(mods.causal(), q_len=16, batch_shape=(2, 3), num_heads=4)
    assert causal.state.shape == (1, 1, 1, 1) and causal.block_q == 16


def test_block_mask_under_jit_with_traced_segment_ids():
    ids = jnp.array([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4])

    @jax.jit
    def states(ids):
        return jattn.block_mask(
            mods.causal() & mods.document(ids), q_len=16, batch_shape=2, block_q=4, block_k=4
        ).state

    eager = jattn.block_mask(
        mods.causal() & mods.document(ids), q_len=16, batch_shape=2, block_q=4, block_k=4
    ).state
    np.testing.assert_array_equal(states(ids), eager)
    dense = (np.asarray(ids)[:, :, None] == np.asarray(ids)[:, None, :]) & np.tri(16, dtype=bool)
    np.testing.assert_array_equal(eager[:, 0], np_states(dense, 4, 4))


def test_block_mask_call_equals_mask_mod_call_and_passes_through_jit():
    q = normal(0, (2, 16, 2, 4))
    ids = jnp.array([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4])
    mask_mod = mods.causal() & mods.document(ids)
    bm = jattn.block_mask(mask_mod, q_len=16, batch_shape=2, block_q=4, block_k=4)
    want = dpa(q, q, q, mask_mod=mask_mod, score_mod=mods.softcap(2.0))
    np.testing.assert_array_equal(dpa(q, q, q, block_mask=bm, score_mod=mods.softcap(2.0)), want)
    np.testing.assert_array_equal(
        dpa(q, q, q, mask_mod=mask_mod, block_mask=bm), dpa(q, q, q, mask_mod=mask_mod)
    )

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, bm):
        return dpa(q, q, q, block_mask=bm)

    np.testing.assert_allclose(f(q, bm), dpa(q, q, q, mask_mod=mask_mod), atol=1e-6)
    other = jattn.block_mask(
        mods.causal() & mods.document(ids[::-1]), q_len=16, batch_shape=2, block_q=4, block_k=4
    )
    np.testing.assert_allclose(f(q, other), dpa(q, q, q, mask_mod=other.mask_mod), atol=1e-6)
    leaves = jax.tree.leaves(bm)
    assert any(x.dtype == jnp.int8 for x in leaves) and any(x.dtype == jnp.int32 for x in leaves)


def test_block_mask_state_matches_its_density():
    bm = jattn.block_mask(mods.causal(), q_len=64, block_q=16, block_k=16)
    assert float(bm.density()) == pytest.approx(10 / 16)
    assert "BlockMask(state (1, 1, 4, 4)" in repr(bm)


# ----------------------------------------------------------------------------------------
# Routing, kernels' view, hoisting for the blockwise custom VJP
# ----------------------------------------------------------------------------------------


def test_native_softcap_recognises_only_a_bare_softcap():
    assert mods.native_softcap(mods.softcap(30.0)) == 30.0
    assert mods.native_softcap(None) is None
    assert mods.native_softcap(mods.compose(mods.softcap(30.0))) is None
    assert mods.native_softcap(lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0)) is None


def test_hoist_exposes_every_closed_over_array():
    slopes = jnp.array([0.5, 0.25])
    ids = jnp.array([2, 1, 0])
    fn = lambda s, h, pos: s + slopes[h] * ids[pos]  # noqa: E731
    example = (jnp.ones((2, 3)), jnp.array([[0], [1]]), jnp.array([[0, 1, 2]]))
    converted, consts = _closure.hoist(fn, *example)
    assert {c.shape for c in consts} == {(2,), (3,)}
    np.testing.assert_array_equal(converted(*example, *consts), fn(*example))
    moved = [c * 2 if c.dtype == jnp.float32 else c for c in consts]
    np.testing.assert_array_equal(
        converted(*example, *moved), example[0] + 2 * slopes[example[1]] * ids[example[2]]
    )


def test_hoisted_constants_get_gradients_through_a_custom_vjp_under_grad_of_jit():
    # What the blockwise path's custom VJP will do with a score_mod: carry the hoisted
    # constants as operands and differentiate the converted function in the backward pass.
    import functools

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def apply(fn, x, consts):
        return fn(x, *consts).sum()

    def fwd(fn, x, consts):
        return apply(fn, x, consts), (x, consts)

    def bwd(fn, res, g):
        x, consts = res
        _, vjp = jax.vjp(lambda x_, c_: fn(x_, *c_), x, consts)
        return vjp(jnp.broadcast_to(g, x.shape))

    apply.defvjp(fwd, bwd)

    def f(x, slopes, ids):
        mod = lambda s: s * slopes[ids] + jnp.sin(s)  # noqa: E731
        converted, consts = _closure.hoist(mod, x)
        return apply(converted, x, consts)

    def direct(x, slopes, ids):
        return (x * slopes[ids] + jnp.sin(x)).sum()

    x, slopes, ids = jnp.linspace(0, 1, 3), jnp.array([1.0, 2.0, 3.0]), jnp.array([2, 0, 1])
    want = jax.grad(direct, (0, 1))(x, slopes, ids)
    for transform in (
        jax.grad,
        lambda g, a: jax.jit(jax.grad(g, a)),
        lambda g, a: jax.grad(jax.jit(g), a),
    ):
        got = transform(f, (0, 1))(x, slopes, ids)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
