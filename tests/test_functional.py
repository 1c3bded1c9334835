"""The functional core against jax.nn, flax and a float64 numpy reference."""

import math
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from reference import np_attention

import jattn

RTOL = ATOL = 2e-5


def _qkv(shape_q, shape_kv, seed=0, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, shape_q, dtype)
    k = jax.random.normal(k2, shape_kv, dtype)
    v = jax.random.normal(k3, shape_kv, dtype)
    return q, k, v


def _grads(fn, q, k, v):
    # A fixed random cotangent: a plain sum would hide errors that cancel across heads/rows.
    out = jax.eval_shape(fn, q, k, v)
    ct = jax.random.normal(jax.random.key(42), out.shape, out.dtype)
    # jit the whole gradient: one compilation instead of one per primitive.
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), argnums=(0, 1, 2)))(q, k, v)


def _assert_same_with_grads(fn_a, fn_b, q, k, v, tol=ATOL):
    np.testing.assert_allclose(jax.jit(fn_a)(q, k, v), jax.jit(fn_b)(q, k, v), rtol=tol, atol=tol)
    for ga, gb in zip(_grads(fn_a, q, k, v), _grads(fn_b, q, k, v), strict=False):
        np.testing.assert_allclose(ga, gb, rtol=10 * tol, atol=10 * tol)


# ---------------------------------------------------------------------------------------
# Agreement with jax.nn.dot_product_attention (outputs and gradients)
# ---------------------------------------------------------------------------------------

CASES = {
    "plain": dict(q=(2, 5, 4, 8), kv=(2, 5, 4, 8), kw={}),
    "causal": dict(q=(2, 6, 4, 8), kv=(2, 6, 4, 8), kw=dict(is_causal=True)),
    "cross_longer_kv": dict(q=(2, 3, 2, 8), kv=(2, 7, 2, 8), kw=dict(is_causal=True)),
    "gqa": dict(q=(2, 6, 8, 4), kv=(2, 6, 2, 4), kw=dict(is_causal=True)),
    "mqa": dict(q=(1, 5, 4, 4), kv=(1, 5, 1, 4), kw={}),
    "scale": dict(q=(2, 4, 2, 8), kv=(2, 4, 2, 8), kw=dict(scale=0.3, is_causal=True)),
    "kv_lengths": dict(
        q=(3, 5, 2, 4), kv=(3, 6, 2, 4), kw=dict(key_value_seq_lengths=np.array([6, 2, 4]))
    ),
    "q_and_kv_lengths": dict(
        q=(3, 5, 2, 4),
        kv=(3, 5, 2, 4),
        kw=dict(query_seq_lengths=np.array([5, 3, 1]), key_value_seq_lengths=np.array([5, 3, 2])),
    ),
    "window": dict(q=(1, 8, 2, 4), kv=(1, 8, 2, 4), kw=dict(local_window_size=(2, 1))),
    "causal_window": dict(
        q=(1, 8, 2, 4), kv=(1, 8, 2, 4), kw=dict(local_window_size=(3, 0), is_causal=True)
    ),
}


@pytest.mark.top_left  # some cases have fewer queries than keys, as jax.nn's top-left
@pytest.mark.parametrize("name", list(CASES))
def test_matches_jax_nn(name):
    case = CASES[name]
    q, k, v = _qkv(case["q"], case["kv"])
    kw = case["kw"]

    def ours(q, k, v):
        return jattn.dot_product_attention(q, k, v, **kw)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, **kw)

    _assert_same_with_grads(ours, theirs, q, k, v)


def test_matches_jax_nn_with_mask_and_bias():
    q, k, v = _qkv((2, 5, 3, 4), (2, 5, 3, 4))
    rng = np.random.default_rng(1)
    mask = rng.random((2, 1, 5, 5)) > 0.4
    mask[..., 0] = True  # no fully masked rows: jax.nn averages those instead of zeroing
    bias = rng.normal(size=(1, 3, 5, 5)).astype(np.float32)

    def ours(q, k, v):
        return jattn.dot_product_attention(q, k, v, bias=bias, mask=mask)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask)

    _assert_same_with_grads(ours, theirs, q, k, v)


def test_extra_batch_dims_equal_flattened_batch():
    q, k, v = _qkv((2, 3, 5, 2, 4), (2, 3, 5, 2, 4))
    got = jattn.dot_product_attention(q, k, v, is_causal=True)
    flat = jax.nn.dot_product_attention(
        q.reshape(6, 5, 2, 4), k.reshape(6, 5, 2, 4), v.reshape(6, 5, 2, 4), is_causal=True
    )
    np.testing.assert_allclose(got.reshape(6, 5, 2, 4), flat, rtol=RTOL, atol=ATOL)


def test_no_batch_dims():
    q, k, v = _qkv((5, 2, 4), (5, 2, 4))
    got = jattn.dot_product_attention(q, k, v, is_causal=True)
    ref = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------
# Agreement with flax
# ---------------------------------------------------------------------------------------


def test_matches_flax_dot_product_attention_and_grads():
    q, k, v = _qkv((2, 3, 6, 2, 8), (2, 3, 6, 2, 8))
    mask = nn.make_causal_mask(jnp.ones((2, 3, 6)))  # float 0/1 mask, as flax builds it

    def ours(q, k, v):
        return jattn.dot_product_attention(q, k, v, mask=mask)

    def theirs(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=mask)

    _assert_same_with_grads(ours, theirs, q, k, v)


def test_flax_linen_mhdpa_accepts_jattn_as_attention_fn():
    x = jax.random.normal(jax.random.key(3), (2, 7, 16))
    mask = nn.make_causal_mask(jnp.ones((2, 7)))
    kwargs = dict(num_heads=4, qkv_features=16, dropout_rate=0.1)
    ref_mod = nn.MultiHeadDotProductAttention(**kwargs)
    our_mod = nn.MultiHeadDotProductAttention(**kwargs, attention_fn=jattn.dot_product_attention)
    params = ref_mod.init(jax.random.key(0), x, mask=mask, deterministic=True)
    np.testing.assert_allclose(
        our_mod.apply(params, x, mask=mask, deterministic=True),
        ref_mod.apply(params, x, mask=mask, deterministic=True),
        rtol=RTOL,
        atol=ATOL,
    )
    # sow_weights: the intermediates equal flax's own.
    sow = dict(mask=mask, deterministic=True, sow_weights=True, mutable=["intermediates"])
    _, ours = our_mod.apply(params, x, **sow)
    _, theirs = ref_mod.apply(params, x, **sow)
    a = jax.tree.leaves(ours["intermediates"])[0]
    b = jax.tree.leaves(theirs["intermediates"])[0]
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    # Dropout in training runs through jattn with flax's key plumbing.
    out = our_mod.apply(
        params, x, mask=mask, deterministic=False, rngs={"dropout": jax.random.key(1)}
    )
    assert out.shape == x.shape and bool(jnp.all(jnp.isfinite(out)))


def test_flax_nnx_multihead_accepts_jattn_as_attention_fn():
    x = jax.random.normal(jax.random.key(3), (2, 7, 16))
    ref_mod = nnx.MultiHeadAttention(
        num_heads=4, in_features=16, decode=False, rngs=nnx.Rngs(0), deterministic=True
    )
    our_mod = nnx.MultiHeadAttention(
        num_heads=4,
        in_features=16,
        decode=False,
        rngs=nnx.Rngs(0),
        deterministic=True,
        attention_fn=jattn.dot_product_attention,
    )
    mask = nnx.make_causal_mask(jnp.ones((2, 7)))
    np.testing.assert_allclose(our_mod(x, mask=mask), ref_mod(x, mask=mask), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------
# Independent float64 reference, including fully masked rows (property-based)
# ---------------------------------------------------------------------------------------


@pytest.mark.top_left
@given(
    batch=st.lists(st.integers(1, 2), min_size=0, max_size=2),
    t=st.integers(1, 6),
    s=st.integers(1, 6),
    kv_heads=st.integers(1, 2),
    groups=st.integers(1, 2),
    d=st.sampled_from([1, 3, 4]),
    causal=st.booleans(),
    mask_density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_reference(batch, t, s, kv_heads, groups, d, causal, mask_density, seed):
    h = kv_heads * groups
    q, k, v = _qkv((*batch, t, h, d), (*batch, s, kv_heads, d), seed=seed)
    rng = np.random.default_rng(seed)
    mask = rng.random((*batch, h, t, s)) < mask_density  # may contain fully masked rows
    attend = jax.jit(jattn.dot_product_attention, static_argnames=("is_causal", "return_weights"))
    got, w = attend(q, k, v, mask=mask, is_causal=causal, return_weights=True)
    full = mask & np.tril(np.ones((t, s), bool)) if causal else mask
    ref, ref_w = np_attention(q, k, v, mask=full, return_weights=True)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)


def test_rows_sum_to_one_and_future_is_zero():
    q, k, _v = _qkv((2, 6, 3, 4), (2, 6, 3, 4))
    w = jattn.dot_product_attention_weights(q, k, is_causal=True)
    assert w.shape == (2, 3, 6, 6)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    upper = ~np.tril(np.ones((6, 6), bool))
    assert np.all(np.asarray(w)[..., upper] == 0.0)


def test_weights_function_equals_returned_weights():
    q, k, v = _qkv((2, 5, 2, 4), (2, 5, 2, 4))
    _, w = jattn.dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    np.testing.assert_allclose(w, jattn.dot_product_attention_weights(q, k, is_causal=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_fully_masked_rows_give_zeros_and_finite_grads(dtype):
    q, k, v = _qkv((2, 4, 2, 8), (2, 4, 2, 8), dtype=dtype)
    mask = np.ones((2, 2, 4, 4), bool)
    mask[0, :, 1, :] = False  # query 1 of example 0 sees nothing
    mask[1, 1, :, :] = False  # head 1 of example 1 sees nothing at all

    def f(q, k, v):
        return jattn.dot_product_attention(q, k, v, mask=mask)

    out, w = jattn.dot_product_attention(q, k, v, mask=mask, return_weights=True)
    assert out.dtype == dtype and w.dtype == dtype
    assert np.all(np.asarray(out[0, 1], np.float32) == 0.0)
    assert np.all(np.asarray(out[1, :, 1], np.float32) == 0.0)
    assert np.all(np.asarray(w[0, :, 1], np.float32) == 0.0)
    assert np.all(np.asarray(w[1, 1], np.float32) == 0.0)
    # the other rows still sum to one
    np.testing.assert_allclose(np.asarray(w[0, :, 0], np.float32).sum(-1), 1.0, rtol=1e-2)
    grads = _grads(f, q, k, v)
    for g in grads:
        assert g.dtype == dtype
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    # a fully masked query row receives no gradient at all
    assert np.all(np.asarray(grads[0][0, 1], np.float32) == 0.0)


def test_large_logits_stay_finite():
    q, k, v = _qkv((1, 4, 1, 4), (1, 4, 1, 4))
    out = jattn.dot_product_attention(q * 1e4, k * 1e4, v, is_causal=True)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_close_to_float32(dtype):
    q, k, v = _qkv((2, 6, 2, 8), (2, 6, 2, 8))
    lo = jattn.dot_product_attention(
        q.astype(dtype), k.astype(dtype), v.astype(dtype), is_causal=True
    )
    assert lo.dtype == dtype
    ref = jattn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(lo, np.float32), ref, atol=5e-2, rtol=5e-2)


def test_dtype_argument_sets_computation_and_output_dtype():
    q, k, v = _qkv((1, 3, 1, 4), (1, 3, 1, 4))
    out = jattn.dot_product_attention(q, k, v, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------
# The chapter's numbers
# ---------------------------------------------------------------------------------------

BOOK_CONTEXT = np.array(  # the book's printed `all_context_vecs`
    [
        [0.4421, 0.5931, 0.5790],
        [0.4419, 0.6515, 0.5683],
        [0.4431, 0.6496, 0.5671],
        [0.4304, 0.6298, 0.5510],
        [0.4671, 0.5910, 0.5266],
        [0.4177, 0.6503, 0.5645],
    ]
)


def test_simplified_self_attention_journey(book_inputs):
    loop = jattn.simplified_self_attention_loop(book_inputs)
    mat, w = jattn.simplified_self_attention(book_inputs, return_weights=True)
    np.testing.assert_allclose(loop[1], [0.4419, 0.6515, 0.5683], atol=1e-4)
    np.testing.assert_allclose(mat, BOOK_CONTEXT, atol=1e-4)
    np.testing.assert_allclose(loop, mat, rtol=1e-6, atol=1e-6)
    # the book's attention weights for "journey"
    np.testing.assert_allclose(w[1], [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581], atol=1e-4)
    # against numpy, from scratch
    x = book_inputs.astype(np.float64)
    s = x @ x.T
    ref = np.exp(s) / np.exp(s).sum(-1, keepdims=True) @ x
    np.testing.assert_allclose(mat, ref, rtol=1e-5)


def test_simplified_self_attention_batched(book_inputs):
    batch = np.stack([book_inputs, book_inputs[::-1]])
    got = jattn.simplified_self_attention(batch)
    np.testing.assert_allclose(got[0], jattn.simplified_self_attention(book_inputs), rtol=1e-6)
    np.testing.assert_allclose(
        got[1], jattn.simplified_self_attention_loop(book_inputs[::-1]), rtol=1e-5
    )


def test_simplified_forms_reject_bad_input():
    with pytest.raises(ValueError, match="rank >= 2"):
        jattn.simplified_self_attention(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="one sequence"):
        jattn.simplified_self_attention_loop(np.ones((2, 3, 3), np.float32))
    with pytest.raises(TypeError, match="floating dtype"):
        jattn.simplified_self_attention(np.ones((3, 3), np.int32))


# ---------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------


def _drop(q, k, v, rng, rate=0.5, **kw):
    return jattn.dot_product_attention_weights(
        q, k, is_causal=True, dropout_rate=rate, dropout_rng=rng, **kw
    )


@pytest.fixture
def small_qk():
    q, k, _ = _qkv((2, 8, 3, 4), (2, 8, 3, 4))
    return q, k


def test_dropout_same_key_same_output_other_key_differs(small_qk):
    q, k = small_qk
    a = _drop(q, k, None, jax.random.key(1))
    b = _drop(q, k, None, jax.random.key(1))
    c = _drop(q, k, None, jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_dropout_deterministic_ignores_key(small_qk):
    q, k = small_qk
    base = jattn.dot_product_attention_weights(q, k, is_causal=True)
    for rng in (None, jax.random.key(5)):
        got = jattn.dot_product_attention_weights(
            q, k, is_causal=True, dropout_rate=0.5, dropout_rng=rng, deterministic=True
        )
        np.testing.assert_array_equal(got, base)


def test_dropout_rate_zero_is_identity(small_qk):
    q, k = small_qk
    base = jattn.dot_product_attention_weights(q, k, is_causal=True)
    np.testing.assert_array_equal(_drop(q, k, None, None, rate=0.0), base)


def test_dropout_keeps_and_scales_like_the_chapter(small_qk):
    q, k = small_qk
    rate = 0.5
    base = np.asarray(jattn.dot_product_attention_weights(q, k, is_causal=True))
    dropped = np.asarray(_drop(q, k, None, jax.random.key(7), rate=rate))
    kept = dropped != 0
    # each surviving weight is scaled by exactly 1/(1 - rate) (the chapter's factor 2)
    np.testing.assert_allclose(dropped[kept], base[kept] / (1 - rate), rtol=1e-6)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_keep_rate_within_4_sigma(rate):
    x = jnp.ones((200, 300))
    y = np.asarray(jattn.dropout(x, rate, rng=jax.random.key(3)))
    n = y.size
    kept = np.count_nonzero(y)
    p = 1 - rate
    assert abs(kept - n * p) <= 4 * math.sqrt(n * p * (1 - p))
    np.testing.assert_allclose(y[y != 0], 1 / p, rtol=1e-6)


def test_dropout_preserves_expectation(small_qk):
    q, k = small_qk
    _, _, v = _qkv((2, 8, 3, 4), (2, 8, 3, 4))
    keys = jax.random.split(jax.random.key(0), 4000)
    outs = jax.vmap(
        lambda r: jattn.dot_product_attention(
            q, k, v, is_causal=True, dropout_rate=0.3, dropout_rng=r
        )
    )(keys)
    ref = jattn.dot_product_attention(q, k, v, is_causal=True)
    std_err = np.asarray(outs).std(0) / math.sqrt(len(keys))
    err = np.abs(np.asarray(outs).mean(0) - np.asarray(ref))
    assert np.all(err <= 5 * std_err + 1e-6)


@pytest.mark.parametrize(
    "mode,shared_axes",
    [(True, (0, 1)), ("batch", (0,)), ("heads", (1,)), (False, ())],
)
def test_broadcast_dropout_modes(small_qk, mode, shared_axes):
    q, k = small_qk
    w = np.asarray(_drop(q, k, None, jax.random.key(9), broadcast_dropout=mode))
    lower = np.tril(np.ones((8, 8), bool))
    zero = (w == 0) & lower  # dropped positions (upper triangle is zero anyway)
    for axis in (0, 1):
        first = np.take(zero, 0, axis=axis)
        same = all(
            np.array_equal(first, np.take(zero, i, axis=axis)) for i in range(1, zero.shape[axis])
        )
        assert same == (axis in shared_axes), (mode, axis)


def test_dropout_without_key_is_a_clear_error(small_qk):
    q, k = small_qk
    with pytest.raises(ValueError, match=r"dropout_rng=jax.random.key"):
        _drop(q, k, None, None, rate=0.1)
    with pytest.raises(ValueError, match=r"rng=jax.random.key"):
        jattn.dropout(jnp.ones(3), 0.5)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_dropout_rate_out_of_range(small_qk, rate):
    q, k = small_qk
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        _drop(q, k, None, jax.random.key(0), rate=rate)
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\)"):
        jattn.dropout(jnp.ones(3), rate, rng=jax.random.key(0))


def test_dropout_broadcast_dims_and_deterministic():
    x = jnp.ones((4, 6))
    y = np.asarray(jattn.dropout(x, 0.5, rng=jax.random.key(0), broadcast_dims=(0,)))
    assert all(np.array_equal(y[0], y[i]) for i in range(4))
    np.testing.assert_array_equal(jattn.dropout(x, 0.5, deterministic=True), x)
    with pytest.raises(ValueError, match="broadcast_dropout"):
        jattn.dot_product_attention_weights(
            x[None, :, None, :],
            x[None, :, None, :],
            dropout_rate=0.1,
            dropout_rng=jax.random.key(0),
            broadcast_dropout="rows",
        )


# ---------------------------------------------------------------------------------------
# Transformations
# ---------------------------------------------------------------------------------------


def test_jit_equals_eager_and_traces_once():
    q, k, v = _qkv((2, 6, 2, 4), (2, 6, 2, 4))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, k, v, rng):
        return jattn.dot_product_attention(
            q, k, v, is_causal=True, dropout_rate=0.2, dropout_rng=rng
        )

    eager = jattn.dot_product_attention(
        q, k, v, is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(0)
    )
    np.testing.assert_allclose(f(q, k, v, jax.random.key(0)), eager, rtol=1e-6, atol=1e-6)
    for seed in range(1, 4):  # new keys and values, same shapes: no retrace
        f(q + seed, k, v, jax.random.key(seed))
    chex.clear_trace_counter()


def test_vmap_equals_batched_call():
    q, k, v = _qkv((3, 5, 2, 4), (3, 5, 2, 4))
    batched = jattn.dot_product_attention(q, k, v, is_causal=True)
    mapped = jax.vmap(lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    np.testing.assert_allclose(mapped, batched, rtol=1e-6, atol=1e-6)


def test_grad_matches_finite_differences_float64():
    with jax.enable_x64(True):
        q, k, v = _qkv((1, 4, 2, 3), (1, 4, 2, 3), dtype=jnp.float64)
        jax.test_util.check_grads(
            jax.jit(lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True)),
            (q, k, v),
            order=2,
            modes=["rev"],
            atol=1e-5,
            rtol=1e-5,
        )


def test_causal_by_gradient():
    # d out[i] / d x[j] is exactly zero for j > i and nonzero for j <= i.
    x = jax.random.normal(jax.random.key(0), (7, 4))

    def f(x):
        qkv = x[:, None, :]  # [T, 1 head, D]
        return jattn.dot_product_attention(qkv, qkv, qkv, is_causal=True)[:, 0, :]

    dep = jattn.causality.dependence_matrix(f, x)
    lower = np.tril(np.ones((7, 7), bool))
    assert np.all(dep[~lower] == 0.0)
    assert np.all(dep[lower] > 0.0)


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------

GOOD = (2, 4, 2, 8)


@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,kw,err,match",
    [
        ((4, 8), (4, 8), (4, 8), {}, ValueError, r"rank >= 3"),
        ((2, 4, 2, 8), (4, 2, 8), (4, 2, 8), {}, ValueError, "same rank"),
        ((2, 4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8), {}, ValueError, "share batch dims"),
        ((2, 4, 2, 8), (2, 4, 2, 6), (2, 4, 2, 6), {}, ValueError, "same head_dim"),
        ((2, 4, 2, 8), (2, 5, 2, 8), (2, 4, 2, 8), {}, ValueError, "same length"),
        (
            (2, 4, 3, 8),
            (2, 4, 2, 8),
            (2, 4, 2, 8),
            {},
            ValueError,
            "multiple of the number of key/value heads",
        ),
        (GOOD, GOOD, GOOD, dict(mask=np.ones((3, 4, 4), bool)), ValueError, "mask of shape"),
        (
            GOOD,
            GOOD,
            GOOD,
            dict(bias=np.ones((2, 2, 4, 5), np.float32)),
            ValueError,
            "bias of shape",
        ),
        (GOOD, GOOD, GOOD, dict(bias=np.ones((4, 4), np.int32)), TypeError, "bias must be a float"),
        (
            GOOD,
            GOOD,
            GOOD,
            dict(mask=np.ones((4, 4), np.complex64)),
            TypeError,
            "mask must be boolean",
        ),
        (GOOD, GOOD, GOOD, dict(dtype=jnp.int32), TypeError, "dtype must be a floating"),
        (
            GOOD,
            GOOD,
            GOOD,
            dict(key_value_seq_lengths=np.array([1, 2, 3])),
            ValueError,
            "key_value_seq_lengths must have the batch shape",
        ),
        (GOOD, GOOD, GOOD, dict(local_window_size="wide"), TypeError, "local_window_size"),
        (GOOD, GOOD, GOOD, dict(dropout_rate="high"), TypeError, "dropout_rate must be a float"),
    ],
)
def test_bad_input_errors(q_shape, k_shape, v_shape, kw, err, match):
    q, k, v = (jnp.ones(s, jnp.float32) for s in (q_shape, k_shape, v_shape))
    with pytest.raises(err, match=match):
        jattn.dot_product_attention(q, k, v, **kw)


def test_integer_inputs_are_a_type_error():
    x = jnp.ones(GOOD, jnp.int32)
    with pytest.raises(TypeError, match="query must have a floating dtype"):
        jattn.dot_product_attention(x, x.astype(jnp.float32), x.astype(jnp.float32))
    with pytest.raises(TypeError, match="value must have a floating dtype"):
        jattn.dot_product_attention(x.astype(jnp.float32), x.astype(jnp.float32), x)


def test_none_input_is_a_type_error():
    x = jnp.ones(GOOD)
    with pytest.raises(TypeError, match="key is required"):
        jattn.dot_product_attention(x, None, x)


# ---------------------------------------------------------------------------------------
# PyTorch scaled_dot_product_attention semantics (optional: torch is not a dependency)
# ---------------------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.top_left
def test_matches_torch_sdpa_including_fully_masked_rows():
    torch = pytest.importorskip("torch")
    q, k, v = _qkv((2, 3, 5, 4), (2, 3, 7, 4))  # torch layout [B, H, T, D] ...
    rng = np.random.default_rng(0)
    mask = rng.random((2, 3, 5, 7)) > 0.5
    mask[0, 1, 2] = False  # a fully masked row
    to_t = lambda a: torch.from_numpy(np.asarray(a).copy())  # noqa: E731
    for causal in (False, True):
        ref = torch.nn.functional.scaled_dot_product_attention(
            to_t(q), to_t(k), to_t(v), attn_mask=None if causal else to_t(mask), is_causal=causal
        ).numpy()
        # ... and jattn's layout [B, T, H, D]
        t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
        got = jattn.dot_product_attention(
            t(q), t(k), t(v), mask=None if causal else mask, is_causal=causal
        )
        np.testing.assert_allclose(np.asarray(t(got)), ref, rtol=1e-5, atol=1e-5)
        if not causal:  # torch zeroes the fully masked row, and so does jattn
            assert np.all(ref[0, 1, 2] == 0.0) and np.all(np.asarray(got)[0, 2, 1] == 0.0)


@pytest.mark.parametrize("implementation", [None, "dense", "blockwise", "cpu_fused"])
def test_a_window_wider_than_any_distance_is_no_window(implementation):
    """Windows past int32 (sys.maxsize, 2**31) once overflowed positions: an error on the
    XLA paths, wrong numbers on the fused kernel."""
    if implementation == "cpu_fused" and not jattn.kernels.adapter("cpu_fused").available("cpu"):
        pytest.skip("the fused CPU kernel is not built")
    q, k, v = _qkv((1, 130, 2, 8), (1, 130, 2, 8))
    want = jattn.dot_product_attention(q, k, v, implementation="dense")
    for window in ((sys.maxsize, sys.maxsize), (2**31, 2**31), (0, sys.maxsize)):
        out = jattn.dot_product_attention(
            q, k, v, local_window_size=window, implementation=implementation
        )
        ref = want
        if window[0] == 0:  # each query sees itself and what follows
            ref = jattn.dot_product_attention(
                q, k, v, mask=jnp.triu(jnp.ones((130, 130), bool)), implementation="dense"
            )
        np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)


def test_segment_ids_past_int32_are_refused_not_wrapped():
    with jax.enable_x64(True):
        q = jnp.ones((1, 4, 1, 2))
        ids = jnp.asarray([[7, 7, 7 + 2**32, 7 + 2**32]], jnp.int64)
        with pytest.raises(ValueError, match="must fit in it"):
            jattn.dot_product_attention(q, q, q, query_segment_ids=ids, key_value_segment_ids=ids)
