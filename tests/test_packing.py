"""jattn.pack / unpack / positions_from_segment_ids and jattn.varlen_attention.

References: hand-written layouts for packing; for varlen attention, each sequence run
alone through the float64 numpy reference (tests/reference.py) with its own causal mask.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import np_attention

import jattn

SEQS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]


def test_pack_first_fit_layout_by_hand():
    p = jattn.pack(SEQS, 6, pad_id=99)
    np.testing.assert_array_equal(p.tokens, [[1, 2, 3, 9, 10, 11], [4, 5, 6, 7, 8, 99]])
    np.testing.assert_array_equal(p.segment_ids, [[1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(p.positions, [[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 0]])
    np.testing.assert_array_equal(p.rows, [0, 1, 0, 0])
    np.testing.assert_array_equal(p.starts, [0, 0, 3, 4])
    np.testing.assert_array_equal(p.lengths, [3, 5, 1, 2])
    assert all(a.dtype == np.int32 for a in p)


def test_unpack_round_trips_tokens_and_per_token_values():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, n) for n in rng.integers(1, 9, 20)]
    p = jattn.pack(seqs, 8, num_rows=20)
    assert p.tokens.shape == (20, 8)
    for got, want in zip(jattn.unpack(p), seqs, strict=True):
        np.testing.assert_array_equal(got, want)
    # Anything computed per token (here a one-hot "logit") comes back per sequence.
    values = jnp.asarray(np.eye(50, dtype=np.float32)[p.tokens])  # [rows, 8, 50]
    for got, want in zip(jattn.unpack(p, values), seqs, strict=True):
        np.testing.assert_array_equal(np.argmax(got, -1), want)


def test_positions_from_segment_ids_restart_per_document():
    p = jattn.pack(SEQS, 6)
    pos = np.asarray(jattn.positions_from_segment_ids(p.segment_ids))
    real = p.segment_ids > 0
    np.testing.assert_array_equal(pos[real], p.positions[real])
    np.testing.assert_array_equal(
        jattn.positions_from_segment_ids([[7, 7, 3, 3, 3, 7]]), [[0, 1, 0, 1, 2, 0]]
    )


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: jattn.pack([[1, 2, 3]], 2), ValueError, "more than row_length=2"),
        (lambda: jattn.pack([], 4), ValueError, "sequences is empty"),
        (lambda: jattn.pack([[1.5, 2.0]], 4), ValueError, r"sequences\[0\] must be"),
        (lambda: jattn.pack(np.zeros((2, 3), int), 4), TypeError, "list of 1-D"),
        (lambda: jattn.pack(SEQS, 6, num_rows=1), ValueError, "need 2 rows"),
        (lambda: jattn.pack(SEQS, 0), ValueError, "row_length must be"),
        (lambda: jattn.unpack(jattn.pack(SEQS, 6), np.zeros((3, 6))), ValueError, "num_rows"),
        (lambda: jattn.pack(SEQS, 6, pad_id=None), ValueError, "pad_id must be an int"),
        (lambda: jattn.pack(SEQS, 6, pad_id=0.5), ValueError, "pad_id must be an int"),
        (lambda: jattn.pack(SEQS, 6, pad_id=2**40), ValueError, "pad_id must be an int"),
        # ids past int32 would wrap around into other (valid-looking) ids
        (lambda: jattn.pack([np.array([2**32 + 7])], 4), ValueError, "must fit in it"),
        (lambda: jattn.pack([np.array([2**31], np.uint32)], 4), ValueError, "must fit in it"),
        (lambda: jattn.positions_from_segment_ids(None), TypeError, "segment_ids is required"),
    ],
)
def test_bad_packing_input_is_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------------------
# varlen_attention
# ----------------------------------------------------------------------------------------


def _qkv(total_q, total_k, h=4, kh=2, d=8, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (total_q, h, d)),
        jax.random.normal(kk, (total_k, kh, d)),
        jax.random.normal(kv, (total_k, kh, d)),
    )


def _per_sequence(q, k, v, cu_q, cu_k, causal):
    """Each sequence alone through the float64 reference (bottom-right causal)."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[-1]))
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        nq, nk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if nq == 0:
            continue
        mask = np.tril(np.ones((nq, nk), bool), k=nk - nq) if causal else None
        out[qs] = np_attention(q[qs], k[ks], v[ks], mask=mask)
    return out


@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_self_attention_equals_each_sequence_alone(implementation, causal):
    cu = np.array([0, 5, 6, 19, 27])
    q, k, v = _qkv(27, 27)
    out = jattn.varlen_attention(
        q, k, v, cu_seqlens_q=cu, is_causal=causal, implementation=implementation
    )
    np.testing.assert_allclose(out, _per_sequence(q, k, v, cu, cu, causal), atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_cross_lengths_align_bottom_right(causal):
    cu_q, cu_k = np.array([0, 2, 5, 5, 9]), np.array([0, 6, 9, 12, 16])
    q, k, v = _qkv(9, 16)
    out = jattn.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, is_causal=causal)
    np.testing.assert_allclose(out, _per_sequence(q, k, v, cu_q, cu_k, causal), atol=1e-5)


def test_varlen_padding_tail_is_zero_with_finite_gradients_and_jit_compiles_once():
    q, k, v = _qkv(16, 16)
    traces = []

    @jax.jit
    def loss(q, k, v, cu):
        traces.append(1)
        return jnp.sum(jattn.varlen_attention(q, k, v, cu_seqlens_q=cu, is_causal=True) ** 2)

    for cu in (np.array([0, 4, 11]), np.array([0, 9, 10])):  # 5 and 6 padding tokens
        out = jattn.varlen_attention(q, k, v, cu_seqlens_q=cu, is_causal=True)
        np.testing.assert_allclose(
            out[: cu[-1]], _per_sequence(q, k, v, cu, cu, True)[: cu[-1]], atol=1e-5
        )
        assert np.all(np.asarray(out[cu[-1] :]) == 0)
        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, jnp.asarray(cu))
        assert all(np.all(np.isfinite(g)) for g in grads)
        assert np.all(np.asarray(grads[0][cu[-1] :]) == 0)
    assert len(traces) == 1


def test_varlen_gradients_equal_the_per_sequence_gradients():
    cu = np.array([0, 3, 10])
    q, k, v = _qkv(10, 10, h=2, kh=2, d=4)

    def packed(q, k, v):
        return jnp.sum(jnp.sin(jattn.varlen_attention(q, k, v, cu_seqlens_q=cu, is_causal=True)))

    def alone(q, k, v):
        total = 0.0
        for b in range(2):
            s = slice(cu[b], cu[b + 1])
            out = jattn.dot_product_attention(q[s], k[s], v[s], is_causal=True)
            total = total + jnp.sum(jnp.sin(out))
        return total

    grads = [jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v) for f in (packed, alone)]
    for g, ref in zip(*grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(cu_seqlens_q=[1, 4]), ValueError, "must start at 0"),
        (dict(cu_seqlens_q=[0, 5, 3]), ValueError, "never decrease"),
        (dict(cu_seqlens_q=[0, 9]), ValueError, r"at most at the token count \(8\)"),
        (dict(cu_seqlens_q=[8]), ValueError, "at least two"),
        (dict(cu_seqlens_q=[0.0, 8.0]), TypeError, "cu_seqlens_q"),
        (dict(cu_seqlens_q=[0, 8], cu_seqlens_k=[0, 4, 8]), ValueError, "same number"),
        (
            dict(cu_seqlens_q=[0, 8], cu_seqlens_k=[0, 6], local_window_size=2),
            ValueError,
            "self-attention",
        ),
        (dict(cu_seqlens_q=None), TypeError, "cu_seqlens_q is required"),
        (
            dict(
                cu_seqlens_q=[0, 8], cu_seqlens_k=[0, 6], is_causal=True, implementation="cpu_fused"
            ),
            ValueError,
            "implementation='cpu_fused' cannot run causal attention with cu_seqlens_k",
        ),
    ],
)
def test_bad_varlen_input_is_a_clear_error(kwargs, error, match):
    q, k, v = _qkv(8, 8)
    with pytest.raises(error, match=match):
        jattn.varlen_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize(
    "bad", [[1, 4, 11], [0, 11, 4], [0, 4, 17]], ids=["start", "decreasing", "past_end"]
)
def test_traced_cu_seqlens_that_are_wrong_give_nan_output_and_gradients(bad, which):
    """Under jit the values cannot be read at the entry: the program checks them, and wrong
    ones make the output and every gradient NaN (never plausible numbers), where an eager
    call raises. Right ones give the bits of a call whose values were read at the entry,
    and the program keeps jit's fast dispatch (no effects in it)."""
    good = np.array([0, 6, 16])
    q, k, v = _qkv(16, 16, h=2, kh=2, d=4)

    def f(q, k, v, cu):
        pair = (
            dict(cu_seqlens_q=cu, cu_seqlens_k=good)
            if which == "q"
            else dict(cu_seqlens_q=good, cu_seqlens_k=cu)
        )
        return jattn.varlen_attention(q, k, v, is_causal=True, **pair)

    loss = jax.jit(lambda q, k, v, cu: jnp.sum(jnp.sin(f(q, k, v, cu))))
    out, grads = jax.jit(f)(q, k, v, np.array(bad)), jax.grad(loss, (0, 1, 2))(q, k, v, bad)
    assert np.isnan(out).all() and all(np.isnan(g).all() for g in grads)
    with pytest.raises(ValueError, match=f"cu_seqlens_{which} must start at 0"):
        f(q, k, v, np.array(bad))  # eager: the entry reads the values

    constant = jax.jit(lambda q, k, v: f(q, k, v, good))  # read at the entry, not traced
    np.testing.assert_array_equal(jax.jit(f)(q, k, v, good), constant(q, k, v))
    grads = jax.grad(loss, (0, 1, 2))(q, k, v, good)
    want = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(constant(q, k, v))), (0, 1, 2))(q, k, v)
    for g, ref in zip(grads, want, strict=True):
        np.testing.assert_array_equal(g, ref)
    assert not jax.make_jaxpr(f)(q, k, v, good).effects


def test_vmapped_cu_seqlens_poison_only_the_wrong_rows():
    q, k, v = _qkv(12, 12, h=2, kh=2, d=4)
    cus = np.array([[0, 5, 12], [0, 7, 5], [0, 3, 9]])  # the middle one decreases
    out = jax.vmap(lambda cu: jattn.varlen_attention(q, k, v, cu_seqlens_q=cu))(cus)
    assert np.isnan(out[1]).all()
    for i in (0, 2):
        want = jattn.varlen_attention(q, k, v, cu_seqlens_q=cus[i])
        np.testing.assert_allclose(out[i], want, atol=1e-6)


def test_unpack_takes_nested_lists():
    packed = jattn.pack(SEQS, 6)
    values = np.arange(2 * 6).reshape(2, 6)
    got = jattn.unpack(packed, values.tolist())
    for a, b in zip(got, jattn.unpack(packed, values), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("same", ["object", "values"])
def test_cu_seqlens_k_equal_to_cu_seqlens_q_is_self_attention(same):
    """FlashAttention's habit, cu_seqlens_q passed for the keys too: self-attention, so a
    window works and every implementation with segment ids serves it."""
    cu = np.array([0, 5, 6, 19, 27])
    cu_k = cu if same == "object" else cu.tolist()
    q, k, v = _qkv(27, 27)
    want = jattn.varlen_attention(q, k, v, cu_seqlens_q=cu, is_causal=True, local_window_size=3)
    got = jattn.varlen_attention(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, is_causal=True, local_window_size=3
    )
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, _per_sequence_windowed(q, k, v, cu, 3), atol=1e-5)


def _per_sequence_windowed(q, k, v, cu, left):
    out = np.zeros((q.shape[0], q.shape[1], v.shape[-1]))
    for b in range(len(cu) - 1):
        s, n = slice(cu[b], cu[b + 1]), cu[b + 1] - cu[b]
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        out[s] = np_attention(q[s], k[s], v[s], mask=(j <= i) & (j >= i - left))
    return out


def test_varlen_cross_causal_in_float64_on_the_blockwise_path():
    """Bottom-right causal cross attention runs a mask function; with jax_enable_x64 its
    tile indices used to be int64 against int32 and fail inside lax."""
    with jax.enable_x64(True):
        cu_q, cu_k = np.array([0, 100, 300]), np.array([0, 130, 320])
        q, k, v = (x.astype(jnp.float64) for x in _qkv(300, 320))
        out = jattn.varlen_attention(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, is_causal=True,
            implementation="blockwise",
        )  # fmt: skip
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, _per_sequence(q, k, v, cu_q, cu_k, True), atol=1e-12)


def test_varlen_needs_flat_inputs():
    q, k, v = _qkv(8, 8)
    with pytest.raises(ValueError, match=r"query must be \[total_tokens"):
        jattn.varlen_attention(q[None], k[None], v[None], cu_seqlens_q=[0, 8])
    with pytest.raises(ValueError, match="pass cu_seqlens_k"):
        jattn.varlen_attention(q, k[:4], v[:4], cu_seqlens_q=[0, 8])
