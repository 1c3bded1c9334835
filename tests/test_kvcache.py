"""jattn.kvcache: appends at per-row ends, the decoding mask, capacity behaviour, one trace.

References are independent of the cache: ``jax.nn.dot_product_attention`` on each row's
real tokens, and numpy for the buffers and the mask.
"""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jattn import kvcache as kv
from jattn.kernels import cpu as cpu_kernels
from tests.reference import np_attention

B, CAP, H, K, D = 3, 12, 4, 2, 5

# Most tests run the step jitted: one compilation instead of dozens of eager op dispatches.
jit_step = jax.jit(
    kv.update_and_attend, static_argnames=("local_window_size", "is_causal", "return_weights")
)


def qkv(rng, length, batch=(B,), heads=H, kv_heads=K, dim=D):
    """Random query [*batch, length, heads, dim] and key/value [*batch, length, kv_heads, dim]."""

    def draw(h):
        return jnp.asarray(rng.normal(size=(*batch, length, h, dim)), jnp.float32)

    return draw(heads), draw(kv_heads), draw(kv_heads)


def full_causal(q, k, v, window=None):
    """Reference: jax.nn's attention of one row's whole sequence, causal (and windowed)."""
    local = None if window is None else (window, 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local)


def rows_at(x, positions):
    """[B, L, ...] -> [B, 1, ...]: row b's entry at positions[b]."""
    return x[np.arange(x.shape[0]), np.asarray(positions)][:, None]


def decode_in_chunks(q, k, v, prompt_lengths, steps, *, capacity=CAP, window=None):
    """Ragged prefill (right-padded to the longest prompt), then ``steps`` one-token steps.

    Returns the per-row outputs of the real tokens, in order, and the final cache.
    """
    lengths = np.asarray(prompt_lengths)
    t = int(lengths.max())
    cache = kv.init_cache(q.shape[0], capacity, k.shape[-2], k.shape[-1])
    out, cache = kv.update_and_attend(
        cache, q[:, :t], k[:, :t], v[:, :t], num_new=jnp.asarray(lengths), local_window_size=window
    )
    per_row = [[out[b, : lengths[b]]] for b in range(q.shape[0])]
    for i in range(steps):
        pos = lengths + i
        o, cache = jit_step(
            cache, rows_at(q, pos), rows_at(k, pos), rows_at(v, pos), local_window_size=window
        )
        for b in range(q.shape[0]):
            per_row[b].append(o[b])
    return [np.concatenate(r) for r in per_row], cache


# ----------------------------------------------------------------------------------------
# init and append
# ----------------------------------------------------------------------------------------


def test_init_cache_shapes_and_dtypes():
    cache = kv.init_cache((2, 3), 7, 2, 4, v_head_dim=6, dtype=jnp.bfloat16)
    assert cache.keys.shape == (2, 3, 7, 2, 4) and cache.keys.dtype == jnp.bfloat16
    assert cache.values.shape == (2, 3, 7, 2, 6)
    assert cache.lengths.shape == (2, 3) and cache.lengths.dtype == jnp.int32
    assert not cache.keys.any() and not cache.lengths.any()
    assert kv.capacity(cache) == 7
    assert kv.init_cache((), 5, 1, 3).keys.shape == (5, 1, 3)
    # a pytree: jit and tree_map see three leaves
    assert len(jax.tree.leaves(cache)) == 3


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"capacity": 0}, ValueError, "capacity must be >= 1"),
        ({"capacity": 4.0}, TypeError, "capacity must be a Python int"),
        ({"dtype": jnp.int32}, TypeError, "floating dtype"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads"),
    ],
)
def test_init_cache_rejects_bad_arguments(kwargs, exc, match):
    args = {"batch_shape": 2, "capacity": 4, "num_kv_heads": 1, "head_dim": 2} | kwargs
    with pytest.raises(exc, match=match):
        kv.init_cache(**args)


def test_append_writes_real_tokens_at_each_rows_end(rng):
    _, k, v = qkv(rng, 4)
    cache = kv.init_cache(B, CAP, K, D)
    cache = kv.append(cache, k[:, :2], v[:, :2], num_new=jnp.array([2, 1, 0]))
    cache = kv.append(cache, k[:, 2:], v[:, 2:], num_new=jnp.array([1, 2, 2]))
    # numpy reference: row b holds its real tokens back to back, zeros elsewhere.
    expected = np.zeros((B, CAP, K, D), np.float32)
    k = np.asarray(k)
    expected[0, :3] = k[0, [0, 1, 2]]
    expected[1, :3] = k[1, [0, 2, 3]]
    expected[2, :2] = k[2, [2, 3]]
    np.testing.assert_array_equal(cache.keys, expected)
    np.testing.assert_array_equal(cache.lengths, [3, 3, 2])
    assert cache.values.shape == cache.keys.shape


def test_append_casts_to_the_cache_dtype(rng):
    _, k, v = qkv(rng, 2)
    cache = kv.append(kv.init_cache(B, CAP, K, D, dtype=jnp.bfloat16), k, v)
    assert cache.keys.dtype == jnp.bfloat16
    np.testing.assert_array_equal(cache.keys[:, :2], k.astype(jnp.bfloat16))


@pytest.mark.parametrize(
    ("key_shape", "num_new", "match"),
    [
        ((B, 2, K, D + 1), None, "must have shape"),
        ((B + 1, 2, K, D), None, "must have shape"),
        ((B, 2, K, D), jnp.array([3, 0, 0]), r"num_new must be in \[0, 2\]"),
        ((B, 2, K, D), jnp.array([1, 1]), "num_new must have the batch shape"),
        ((B, 2, K, D), jnp.array([1.0, 1.0, 1.0]), "num_new must hold integers"),
    ],
)
def test_append_rejects_bad_chunks(key_shape, num_new, match):
    cache = kv.init_cache(B, CAP, K, D)
    x = jnp.zeros(key_shape)
    with pytest.raises((ValueError, TypeError), match=match):
        kv.append(cache, x, x, num_new=num_new)


def test_functions_reject_something_else_than_a_cache():
    with pytest.raises(TypeError, match=r"must be a jattn\.kvcache\.KVCache"):
        kv.append((jnp.zeros((1, 2, 1, 1)),) * 3, jnp.zeros((1, 1, 1, 1)), jnp.zeros((1, 1, 1, 1)))


# ----------------------------------------------------------------------------------------
# Decoding equals the full causal forward pass
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 2])
def test_ragged_prefill_then_steps_equals_full_causal_attention(rng, window):
    prompt_lengths, steps = [3, 5, 1], 4
    q, k, v = qkv(rng, 9)
    got, cache = decode_in_chunks(q, k, v, prompt_lengths, steps, window=window)
    # causal: row b's first n + steps outputs depend on its first n + steps tokens only
    ref = full_causal(q, k, v, window)
    for b, n in enumerate(prompt_lengths):
        np.testing.assert_allclose(got[b], ref[b, : n + steps], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache.lengths, np.add(prompt_lengths, steps))


@settings(max_examples=10)
@given(splits=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_any_chunking_equals_full_causal_attention(splits):
    """Chunks of any sizes (a prompt in pieces, steps of several tokens) agree with one pass."""
    rng = np.random.default_rng(len(splits))
    total = sum(splits)
    q, k, v = qkv(rng, total, batch=(2,), heads=3, kv_heads=1)  # multi-query attention
    cache = kv.init_cache(2, CAP, 1, D)
    outs, start = [], 0
    for n in splits:
        o, cache = jit_step(
            cache, q[:, start : start + n], k[:, start : start + n], v[:, start : start + n]
        )
        outs.append(o)
        start += n
    np.testing.assert_allclose(
        jnp.concatenate(outs, axis=1), full_causal(q, k, v), atol=1e-5, rtol=1e-5
    )


def test_padding_queries_give_zeros(rng):
    q, k, v = qkv(rng, 4)
    out, _ = kv.update_and_attend(
        kv.init_cache(B, CAP, K, D), q, k, v, num_new=jnp.array([4, 2, 0])
    )
    np.testing.assert_array_equal(out[1, 2:], 0.0)
    np.testing.assert_array_equal(out[2], 0.0)
    assert np.all(np.abs(np.asarray(out[0])).sum(axis=(-1, -2)) > 0)


def test_no_batch_dims_and_two_batch_dims(rng):
    q, k, v = qkv(rng, 5, batch=(2, 3))
    ref = full_causal(*(x.reshape(6, *x.shape[2:]) for x in (q, k, v))).reshape(q.shape)
    cache = kv.init_cache((2, 3), 8, K, D)
    a, cache = jit_step(cache, q[..., :3, :, :], k[..., :3, :, :], v[..., :3, :, :])
    b, cache = jit_step(cache, q[..., 3:, :, :], k[..., 3:, :, :], v[..., 3:, :, :])
    np.testing.assert_allclose(jnp.concatenate([a, b], axis=-3), ref, atol=1e-5, rtol=1e-5)
    q1, k1, v1 = q[0, 0], k[0, 0], v[0, 0]  # [T, H, D]: no batch axis at all
    c = kv.init_cache((), 8, K, D)
    o1, c = jit_step(c, q1[:2], k1[:2], v1[:2])
    o2, c = jit_step(c, q1[2:], k1[2:], v1[2:])
    np.testing.assert_allclose(jnp.concatenate([o1, o2]), ref[0, 0], atol=1e-5, rtol=1e-5)


def test_extra_mask_is_anded_in(rng):
    q, k, v = qkv(rng, 4)
    # hide cache position 0 from every query
    extra = jnp.arange(CAP) != 0
    out, _ = kv.update_and_attend(kv.init_cache(B, CAP, K, D), q, k, v, mask=extra)
    hide_first = (jnp.arange(4) != 0)[None, None, None, :] & jnp.tril(jnp.ones((1, 1, 4, 4), bool))
    ref = jax.nn.dot_product_attention(q[:, 1:], k, v, mask=hide_first[..., 1:, :])
    np.testing.assert_allclose(out[:, 1:], ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[:, 0], 0.0)  # query 0 sees only key 0: hidden


def test_decode_mask_equals_numpy():
    starts, lengths, num_new = np.array([0, 3, 6]), np.array([2, 5, 8]), np.array([2, 2, 2])
    q_len, kv_len, window = 3, 8, 1
    got = kv.decode_mask(
        starts, lengths, q_len, kv_len, num_new=num_new, local_window_size=(window, None)
    )
    assert got.shape == (3, 1, q_len, kv_len)
    ref = np.zeros((3, q_len, kv_len), bool)
    for b in range(3):
        for t in range(q_len):
            p = starts[b] + t
            for j in range(kv_len):
                ref[b, t, j] = (
                    j < lengths[b] and t < num_new[b] and p < kv_len and p - window <= j <= p
                )
    np.testing.assert_array_equal(got[:, 0], ref)


def test_attend_rejects_its_own_mask_arguments(rng):
    q, k, v = qkv(rng, 2)
    cache = kv.init_cache(B, CAP, K, D)
    with pytest.raises(TypeError, match="builds the decoding mask itself"):
        kv.update_and_attend(cache, q, k, v, key_value_seq_lengths=cache.lengths)
    with pytest.raises(ValueError, match="query must have shape"):
        kv.attend(cache, q[0], starts=cache.lengths)


def test_attention_keywords_pass_through(rng):
    q, k, v = qkv(rng, 3)
    cache = kv.init_cache(B, CAP, K, D)
    (out, weights), _ = kv.update_and_attend(cache, q, k, v, return_weights=True, scale=0.5)
    assert weights.shape == (B, H, 3, CAP)
    np.testing.assert_array_equal(weights[..., 3:], 0.0)  # unfilled positions get no weight
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# Capacity
# ----------------------------------------------------------------------------------------


def test_overflow_raises_in_eager_mode(rng):
    q, k, v = qkv(rng, 5)
    cache = kv.init_cache(B, 6, K, D)
    _, cache = kv.update_and_attend(cache, q[:, :4], k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match=r"KV cache overflow.*capacity is 6"):
        kv.update_and_attend(cache, q[:, :3], k[:, :3], v[:, :3])
    # a chunk whose *padding* would not fit is fine: padding is never written
    _, full = kv.update_and_attend(
        cache, q[:, :3], k[:, :3], v[:, :3], num_new=jnp.array([2, 0, 1])
    )
    np.testing.assert_array_equal(full.lengths, [6, 4, 5])


def test_overflow_under_jit_drops_writes_and_hides_those_queries(rng):
    q, k, v = qkv(rng, 7)
    cache = kv.init_cache(B, 6, K, D)
    _, cache = kv.update_and_attend(cache, q[:, :4], k[:, :4], v[:, :4])
    before = cache.keys
    assert not bool(jnp.all(kv.fits(cache, 3)))
    out, after = jax.jit(kv.update_and_attend)(cache, q[:, 4:], k[:, 4:], v[:, 4:])
    # the two tokens that fit are written and correct; the third is dropped, not clamped
    np.testing.assert_array_equal(after.lengths, [6, 6, 6])
    np.testing.assert_array_equal(after.keys[:, :4], before[:, :4])
    np.testing.assert_array_equal(after.keys[:, 4:6], k[:, 4:6])
    np.testing.assert_allclose(out[:, :2], full_causal(q, k, v)[:, 4:6], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[:, 2], 0.0)


def test_fits_per_row():
    cache = kv.init_cache(2, 4, 1, 1)._replace(lengths=jnp.array([1, 3], jnp.int32))
    np.testing.assert_array_equal(kv.fits(cache, 1), [True, True])
    np.testing.assert_array_equal(kv.fits(cache, jnp.array([3, 2])), [True, False])


# ----------------------------------------------------------------------------------------
# Fixed shapes: the jitted step traces once
# ----------------------------------------------------------------------------------------


def test_jitted_decode_step_traces_once(rng):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(cache, q, k, v):
        return kv.update_and_attend(cache, q, k, v)

    q, k, v = qkv(rng, 6)
    cache = kv.init_cache(B, CAP, K, D)
    for i in range(6):  # lengths change every call; shapes do not
        _, cache = step(cache, q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
    np.testing.assert_array_equal(cache.lengths, [6, 6, 6])


def test_scan_carries_the_cache(rng):
    q, k, v = qkv(rng, 5)

    def body(cache, qkv_t):
        out, cache = kv.update_and_attend(cache, *(x[:, None] for x in qkv_t))
        return cache, out[:, 0]

    # [T, B, ...] so scan walks the time axis
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    cache, outs = jax.lax.scan(body, kv.init_cache(B, CAP, K, D), xs)
    np.testing.assert_array_equal(cache.lengths, [5, 5, 5])
    np.testing.assert_allclose(jnp.swapaxes(outs, 0, 1), full_causal(q, k, v), atol=1e-5, rtol=1e-5)


def test_long_ragged_prefill_equals_full_causal_attention(rng):
    """A prompt long enough for dot_product_attention's automatic blockwise path on CPU."""
    q, k, v = qkv(rng, 140, batch=(2,), heads=2, kv_heads=1, dim=8)
    cache = kv.init_cache(2, 160, 1, 8)
    out, cache = jit_step(cache, q, k, v, num_new=jnp.array([140, 130]))
    ref = full_causal(q, k, v)
    np.testing.assert_allclose(out[0], ref[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out[1, :130], ref[1, :130], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[1, 130:], 0.0)
    np.testing.assert_array_equal(cache.lengths, [140, 130])


# ----------------------------------------------------------------------------------------
# Rolling caches: the last `capacity` tokens, sliding-window attention
# ----------------------------------------------------------------------------------------


def windowed(q, k, v, left):
    """Reference: jax.nn's causal attention with keys p - left ... p visible."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(left, 0))


def test_rolling_cache_is_its_own_type_and_writes_modulo_capacity(rng):
    cache = kv.init_cache(2, 4, 1, 2, rolling=True)
    assert isinstance(cache, kv.RollingKVCache) and kv.capacity(cache) == 4
    assert len(jax.tree.leaves(cache)) == 3
    _, k, v = qkv(rng, 7, batch=(2,), kv_heads=1, dim=2)
    # row 0: 7 tokens (positions 0-6), row 1: 2 tokens, then 3 more for both
    cache = kv.append(cache, k, v, num_new=jnp.array([7, 2]))
    cache = kv.append(cache, k[:, :3], v[:, :3])
    np.testing.assert_array_equal(cache.lengths, [10, 5])
    # numpy: position p of a row's sequence lives in slot p % 4 (the latest one wins)
    for b, seq in enumerate(
        (np.concatenate([k[0], k[0, :3]]), np.concatenate([k[1, :2], k[1, :3]]))
    ):
        expected = np.zeros((4, 1, 2), np.float32)
        for p, key in enumerate(seq):
            expected[p % 4] = key
        np.testing.assert_array_equal(cache.keys[b], expected)
    np.testing.assert_array_equal(kv.fits(cache, jnp.array([100, 100])), [True, True])


@pytest.mark.parametrize("chunks", [[1] * 9, [7, 1, 1, 1, 1], [3, 2, 4], [11]])
def test_rolling_cache_equals_full_windowed_attention_over_long_sequences(chunks, rng):
    # capacity 4, sequences of 3 * capacity and more: every slot is overwritten twice
    lengths = np.array([sum(chunks) + 3 * 4, sum(chunks) + 3 * 4 - 2, 3 * 4])
    total = int(lengths.max())
    q, k, v = qkv(rng, total)
    ref = windowed(q, k, v, 4)
    cache = kv.init_cache(B, 4, K, D, rolling=True)
    outs = [[] for _ in range(B)]
    sizes = chunks + [1] * (total - sum(chunks))
    start = 0
    for n in sizes:
        num_new = np.clip(lengths - start, 0, n)  # ragged: rows run out at their own lengths
        sl = slice(start, start + n)
        o, cache = jit_step(cache, q[:, sl], k[:, sl], v[:, sl], num_new=jnp.asarray(num_new))
        for b in range(B):
            outs[b].append(o[b, : num_new[b]])
        np.testing.assert_array_equal(o[np.arange(n)[None, :] >= num_new[:, None]], 0.0)
        start += n
    for b in range(B):
        got = np.concatenate(outs[b])
        np.testing.assert_allclose(got, ref[b, : lengths[b]], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache.lengths, lengths)


def test_rolling_cache_with_a_smaller_window_and_two_batch_dims(rng):
    q, k, v = qkv(rng, 13, batch=(2, 2))
    ref = windowed(*(x.reshape(4, *x.shape[2:]) for x in (q, k, v)), 3).reshape(q.shape)
    cache = kv.init_cache((2, 2), 5, K, D, rolling=True)
    outs = []
    for sl in (slice(0, 6), *(slice(t, t + 1) for t in range(6, 13))):
        o, cache = jit_step(cache, q[..., sl, :, :], k[..., sl, :, :], v[..., sl, :, :],
                            local_window_size=(3, 0))  # fmt: skip
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=-3), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"left side \(6\) exceeds the rolling cache's capacity"):
        kv.update_and_attend(cache, q[..., :1, :, :], k[..., :1, :, :], v[..., :1, :, :],
                             local_window_size=6)  # fmt: skip


def test_rolling_mask_equals_numpy():
    starts, num_new, cap, t = np.array([0, 3, 9]), np.array([2, 2, 1]), 4, 2
    got = np.asarray(kv.rolling_mask(jnp.asarray(starts), t, cap, num_new=jnp.asarray(num_new)))
    assert got.shape == (3, 1, t, cap + t)
    for b, s in enumerate(starts):
        # slot j holds the latest p < s with p % cap == j; then the chunk at s, s + 1
        slots = [max((p for p in range(s) if p % cap == j), default=-1) for j in range(cap)]
        key_pos = slots + [s + i for i in range(t)]
        key_real = [p >= 0 for p in slots] + [i < num_new[b] for i in range(t)]
        for i in range(t):
            qp = s + i
            want = [
                bool(real and i < num_new[b] and 0 <= qp - p <= cap)
                for p, real in zip(key_pos, key_real, strict=True)
            ]
            np.testing.assert_array_equal(got[b, 0, i], want)


def test_rolling_decode_step_traces_once_and_scans(rng):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(cache, q, k, v):
        return kv.update_and_attend(cache, q, k, v)

    q, k, v = qkv(rng, 20)
    cache = kv.init_cache(B, 3, K, D, rolling=True)
    outs = []
    for i in range(20):  # far past the capacity: lengths grow, shapes do not
        o, cache = step(cache, q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
        outs.append(o)
    np.testing.assert_array_equal(cache.lengths, [20, 20, 20])
    np.testing.assert_allclose(jnp.concatenate(outs, 1), windowed(q, k, v, 3), atol=1e-5, rtol=1e-5)


def test_rolling_cache_refuses_attend_after_append(rng):
    q, k, v = qkv(rng, 2)
    cache = kv.append(kv.init_cache(B, 4, K, D, rolling=True), k, v)
    with pytest.raises(TypeError, match="Use update_and_attend"):
        kv.attend(cache, q, starts=jnp.zeros(B, jnp.int32))
    with pytest.raises(TypeError, match="rolling must be a Python bool"):
        kv.init_cache(B, 4, K, D, rolling=1)


# ----------------------------------------------------------------------------------------
# The fused CPU kernel: a plain call reads the cache in place up to each row's length
# ----------------------------------------------------------------------------------------

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available() or jax.default_backend() != "cpu",
    reason="the fused CPU kernel is not built",
)

jit_attend = jax.jit(kv.update_and_attend, static_argnames=("is_causal", "implementation"))


def filled(rng, batch, capacity, starts, chunk, heads=(4, 2), dims=(16, 16)):
    """A cache holding ``starts`` random tokens per row (``[*batch]``) and a chunk."""
    (h, kh), (d, dv) = heads, dims
    cache = kv.init_cache(batch, capacity, kh, d, v_head_dim=dv)
    longest = max(int(np.max(starts)), 1)

    def draw(t, n, dim):
        return jnp.asarray(rng.normal(size=(*batch, t, n, dim)), jnp.float32)

    starts = jnp.asarray(starts, jnp.int32).reshape(batch)
    cache = kv.append(cache, draw(longest, kh, d), draw(longest, kh, dv), num_new=starts)
    return cache, (draw(chunk, h, d), draw(chunk, kh, d), draw(chunk, kh, dv))


def np_decode_reference(after, q, starts, num_new, causal):
    """float64: each row's real queries (stored ones: ``starts + t < capacity``) over the
    keys written after the chunk (causal per row); the rest zeros."""
    cap, t = after.keys.shape[-3], q.shape[-3]
    starts, num_new, lengths = (np.asarray(x)[..., None, None, None]
                                for x in (starts, num_new, after.lengths))  # fmt: skip
    pos = starts + np.arange(t)[:, None]  # [*batch, 1, T, 1]
    j = np.arange(cap)
    mask = (np.arange(t)[:, None] < np.minimum(num_new, cap - starts)) & (j < lengths)
    if causal:
        mask = mask & (j <= pos)
    return np_attention(q, after.keys, after.values, mask=mask)


FUSED_CASES = [  # (batch, capacity, chunk, causal, heads, dims, starts, num_new)
    ((4,), 130, 1, True, (4, 2), (16, 16), [0, 37, 5, 130], [1, 1, 0, 1]),  # decode; a full row
    ((2, 3), 40, 5, True, (4, 4), (8, 8), [[0, 9, 33], [37, 1, 20]], [[5, 3, 0], [5, 5, 2]]),
    ((3,), 24, 4, False, (6, 2), (12, 7), [9, 0, 20], [2, 4, 4]),  # not causal, dv != d
    ((2,), 1300, 1, True, (8, 4), (32, 32), [1250, 600], [1, 1]),  # rows over key splits
    ((2,), 96, 64, True, (2, 1), (16, 16), [0, 30], [64, 50]),  # a prefill chunk
]


@needs_kernel
@pytest.mark.parametrize("case", FUSED_CASES, ids=str)
def test_fused_kernel_equals_numpy_and_the_dense_path(case):
    """Ragged rows, padding queries, a row of length 0, overflow under jit (a chunk past
    the capacity: those queries attend nothing), GQA, several batch dims."""
    batch, cap, chunk, causal, heads, dims, starts, num_new = case
    rng = np.random.default_rng(cap + chunk)
    cache, (q, k, v) = filled(rng, batch, cap, starts, chunk, heads, dims)
    assert kv.fused(cache, q, {}) and kv.fused(cache)
    n = jnp.asarray(num_new, jnp.int32)
    out, after = jit_attend(cache, q, k, v, num_new=n, is_causal=causal)
    dense, _ = jit_attend(cache, q, k, v, num_new=n, is_causal=causal, implementation="xla")
    want = np_decode_reference(after, q, starts, num_new, causal)
    assert out.dtype == dense.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out, dense, rtol=2e-5, atol=2e-5)
    # attend() after append() takes the same route
    again = jax.jit(kv.attend, static_argnames="is_causal")(
        after, q, starts=cache.lengths, num_new=n, is_causal=causal
    )
    np.testing.assert_array_equal(again, out)


@needs_kernel
def test_a_plain_step_runs_the_kernel_and_any_other_keyword_the_dense_path():
    rng = np.random.default_rng(1)
    cache, (q, k, v) = filled(rng, (2,), 32, [5, 9], 1)

    def hlo(**kw):
        f = jax.jit(lambda c, *x: kv.update_and_attend(c, *x, **kw)[0])
        return f.trace(cache, q, k, v).lower().as_text()

    assert "jattn_cpu_paged_attention" in hlo()
    assert "jattn_cpu_paged_attention" in hlo(scale=0.3, dtype=jnp.float32, deterministic=True)
    others = [
        dict(implementation="xla"), dict(mask=jnp.ones((2, 4, 1, 32), bool)),
        dict(local_window_size=(4, 0)), dict(sinks=jnp.zeros(4)),
        dict(score_mod=lambda s, b, h, qi, ki: s), dict(precision="highest"),
        dict(dropout_rate=0.5, dropout_rng=jax.random.key(0)),
    ]  # fmt: skip
    for kw in others:
        assert "jattn_cpu_paged_attention" not in hlo(**kw), kw
        assert not kv.fused(cache, q, kw), kw
    assert not kv.fused(cache, jnp.zeros((2, 257, 4, 16)), {})  # a chunk past 256 queries
    assert not kv.fused(kv.init_cache(2, 8, 2, 16, rolling=True))
    assert not kv.fused(cache, q.astype(jnp.float16), {"dtype": jnp.int32})


@needs_kernel
def test_fused_kernel_in_half_precision_gives_the_dense_paths_dtype():
    rng = np.random.default_rng(2)
    cache, chunk = filled(rng, (2,), 64, [30, 3], 1)
    cache = cache._replace(keys=cache.keys.astype(jnp.bfloat16),
                           values=cache.values.astype(jnp.bfloat16))  # fmt: skip
    q, k, v = (x.astype(jnp.bfloat16) for x in chunk)
    assert kv.fused(cache, q, {})
    out, _ = jit_attend(cache, q, k, v)
    dense, _ = jit_attend(cache, q, k, v, implementation="xla")
    assert out.dtype == dense.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(np.float32), dense.astype(np.float32), atol=2e-2)


@needs_kernel
def test_fused_kernel_gradient_equals_the_dense_paths():
    """Through the chunk and the cache's buffers; a padding query's gradient is zero."""
    rng = np.random.default_rng(3)
    cache, chunk = filled(rng, (3,), 20, [7, 0, 12], 3)
    n = jnp.asarray([3, 2, 0])
    weights = jnp.asarray(rng.normal(size=(3, 3, 4, 16)), jnp.float32)

    def loss(chunk, keys, values, **kw):
        c = cache._replace(keys=keys, values=values)
        out, _ = kv.update_and_attend(c, *chunk, num_new=n, **kw)
        return jnp.sum(out * weights)

    args = (chunk, cache.keys, cache.values)
    fused = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    dense = jax.jit(jax.grad(lambda *a: loss(*a, implementation="xla"), argnums=(0, 1, 2)))(*args)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(dense), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(fused[0][0][1, 2:], 0.0)  # row 1's padding query
    np.testing.assert_array_equal(fused[0][0][2], 0.0)  # row 2: no real query


@needs_kernel
def test_fused_kernel_inside_shard_map():
    """The kernel's output varies over the manual mesh axes its operands vary over, as the
    XLA formulation's does (``platform_dependent`` needs both branches' types equal)."""
    mesh = jax.make_mesh((1,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(4)
    cache, (q, k, v) = filled(rng, (2,), 32, [5, 9], 1)
    spec = kv.KVCache(jax.P("b"), jax.P("b"), jax.P("b"))

    def step(cache, q, k, v):
        return kv.update_and_attend(cache, q, k, v)

    sharded = jax.shard_map(step, mesh=mesh, in_specs=(spec, *[jax.P("b")] * 3),
                            out_specs=(jax.P("b"), spec))  # fmt: skip
    out, _ = jax.jit(sharded)(cache, q, k, v)
    want, _ = jit_attend(cache, q, k, v, implementation="xla")
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
