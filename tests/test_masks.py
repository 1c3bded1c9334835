"""Masks against exact numpy references (True = attend)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jattn import masks


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (4, 4), (3, 7), (7, 3), (6, None)])
@pytest.mark.parametrize("offset", [0, 1, 3, -2])
def test_causal_mask_is_tril(q_len, kv_len, offset):
    kv = q_len if kv_len is None else kv_len
    expected = np.tril(np.ones((q_len, kv), dtype=bool), k=offset)
    got = masks.causal_mask(q_len, kv_len, offset=offset)
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_causal_mask_bottom_right_matches_decoding_alignment():
    # The last q_len of kv_len positions: query i is absolute position kv_len - q_len + i.
    q_len, kv_len = 3, 8
    got = np.asarray(masks.causal_mask(q_len, kv_len, offset=kv_len - q_len))
    full = np.tril(np.ones((kv_len, kv_len), dtype=bool))
    np.testing.assert_array_equal(got, full[-q_len:])


def test_causal_mask_traced_offset_under_jit():
    f = jax.jit(lambda off: masks.causal_mask(4, 6, offset=off))
    for off in (0, 2):
        np.testing.assert_array_equal(np.asarray(f(off)), np.tril(np.ones((4, 6), bool), k=off))


def test_causal_mask_equals_flax():
    got = masks.causal_mask(5)
    ref = nn.make_causal_mask(jnp.ones((1, 5)))[0, 0].astype(bool)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def _np_window(q_len, kv_len, left, right, offset=0):
    out = np.zeros((q_len, kv_len), dtype=bool)
    for i in range(q_len):
        for j in range(kv_len):
            p = i + offset
            out[i, j] = (j >= p - left) and (right is None or j <= p + right)
    return out


@pytest.mark.parametrize(
    "q_len,kv_len,left,right,offset",
    [(6, 6, 2, 0, 0), (6, 6, 1, 1, 0), (4, 9, 3, None, 5), (5, 5, 0, 0, 0), (3, 8, 2, 1, 2)],
)
def test_sliding_window_mask(q_len, kv_len, left, right, offset):
    got = masks.sliding_window_mask(q_len, kv_len, local_window_size=(left, right), offset=offset)
    np.testing.assert_array_equal(np.asarray(got), _np_window(q_len, kv_len, left, right, offset))


@given(
    q_len=st.integers(1, 9),
    kv_len=st.integers(1, 9),
    left=st.integers(0, 9),
    right=st.one_of(st.none(), st.integers(0, 9)),
    offset=st.integers(-3, 6),
)
def test_sliding_window_property(q_len, kv_len, left, right, offset):
    got = masks.sliding_window_mask(q_len, kv_len, local_window_size=(left, right), offset=offset)
    np.testing.assert_array_equal(np.asarray(got), _np_window(q_len, kv_len, left, right, offset))
    if right == 0:
        # A causal window is a subset of the causal mask with the same offset.
        causal = np.asarray(masks.causal_mask(q_len, kv_len, offset=offset))
        assert not np.any(np.asarray(got) & ~causal)


def test_lengths_to_valid():
    lengths = np.array([[0, 3], [5, 1]])
    got = np.asarray(masks.lengths_to_valid(lengths, 5))
    assert got.shape == (2, 2, 5)
    for idx in np.ndindex(lengths.shape):
        np.testing.assert_array_equal(got[idx], [t < lengths[idx] for t in range(5)])


def test_padding_mask_matches_flax_make_attention_mask():
    q_valid = np.array([[True, True, False], [True, False, False]])
    k_valid = np.array([[True, True, True, False], [True, True, False, False]])
    got = masks.padding_mask(q_valid, k_valid)
    ref = nn.make_attention_mask(q_valid, k_valid, dtype=jnp.bool_)
    assert got.shape == (2, 1, 3, 4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_padding_mask_one_side():
    k_valid = np.array([[True, False, True]])
    got = masks.padding_mask(key_valid=k_valid)
    assert got.shape == (1, 1, 1, 3)
    np.testing.assert_array_equal(np.asarray(got)[0, 0, 0], k_valid[0])
    q_only = masks.padding_mask(query_valid=k_valid)
    assert q_only.shape == (1, 1, 3, 1)
    assert masks.padding_mask() is None


def test_padding_mask_from_lengths_equals_valid_form():
    got = masks.padding_mask_from_lengths([2, 3], [1, 4], q_len=3, kv_len=4)
    q_valid = np.arange(3)[None] < np.array([2, 3])[:, None]
    k_valid = np.arange(4)[None] < np.array([1, 4])[:, None]
    np.testing.assert_array_equal(
        np.asarray(got), q_valid[:, None, :, None] & k_valid[:, None, None]
    )
    with pytest.raises(ValueError, match="q_len is required"):
        masks.padding_mask_from_lengths([2], None)
    with pytest.raises(ValueError, match="kv_len is required"):
        masks.padding_mask_from_lengths(None, [2])


def test_segment_mask_matches_flax_and_loops():
    seg = np.array([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 3, 3]])
    got = np.asarray(masks.segment_mask(seg))
    ref = nn.make_attention_mask(seg, seg, pairwise_fn=jnp.equal, dtype=jnp.bool_)
    np.testing.assert_array_equal(got, np.asarray(ref))
    for b in range(2):
        for i in range(6):
            for j in range(6):
                assert got[b, 0, i, j] == (seg[b, i] == seg[b, j])


def test_segment_mask_cross():
    q = np.array([[0, 1]])
    k = np.array([[0, 0, 1]])
    np.testing.assert_array_equal(
        np.asarray(masks.segment_mask(q, k))[0, 0], [[True, True, False], [False, False, True]]
    )


def test_combine_masks_broadcasts_and_skips_none():
    causal = masks.causal_mask(4)  # [4, 4]
    pad = masks.padding_mask(key_valid=np.array([[True, True, True, False], [True] * 4]))
    got = masks.combine_masks(None, causal, None, pad)
    expected = np.logical_and(np.tril(np.ones((4, 4), bool)), np.asarray(pad))
    assert got.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert masks.combine_masks(None, None) is None
    assert masks.combine_masks() is None


def test_combine_masks_reads_masks_as_dot_product_attention_does():
    """Float 0/1 masks (flax's) are accepted as by the attention entry; other values are not."""
    causal = np.tril(np.ones((3, 3), bool))
    got = masks.combine_masks(causal.astype(np.float32), np.array([1, 1, 0], np.int32))
    np.testing.assert_array_equal(got, causal & np.array([True, True, False]))
    with pytest.raises(ValueError, match="additive mask"):
        masks.combine_masks(np.where(causal, 0.0, -np.inf))
    with pytest.raises(ValueError, match="book's causal buffer"):
        masks.combine_masks(np.triu(np.ones((4, 4), np.float32), 1))


def test_combine_masks_errors():
    with pytest.raises(TypeError, match="must be boolean"):
        masks.combine_masks(np.ones((2, 2), np.complex64))
    with pytest.raises(ValueError, match="do not broadcast"):
        masks.combine_masks(np.ones((2, 3), bool), np.ones((4, 3), bool))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_mask_to_bias(dtype):
    m = masks.causal_mask(3)
    bias = masks.mask_to_bias(m, dtype)
    assert bias.dtype == dtype
    b = np.asarray(bias.astype(jnp.float32))
    assert np.all(b[np.tril(np.ones((3, 3), bool))] == 0)
    upper = b[~np.tril(np.ones((3, 3), bool))]
    assert np.all(np.isfinite(upper)) and np.all(upper < -1e4)
    # softmax of (logits + bias) hides what the mask hides
    w = jax.nn.softmax(jnp.zeros((3, 3), jnp.float32) + bias.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(w)[0], [1, 0, 0])


def test_mask_to_bias_rejects_non_bool():
    with pytest.raises(TypeError, match="boolean"):
        masks.mask_to_bias(np.ones((2, 2)))


@pytest.mark.parametrize(
    "call,err,match",
    [
        (lambda: masks.causal_mask(0), ValueError, "q_len must be >= 1"),
        (lambda: masks.causal_mask(-3), ValueError, "q_len must be >= 1"),
        (lambda: masks.causal_mask(3, 0), ValueError, "kv_len must be >= 1"),
        (lambda: masks.causal_mask(2.5), TypeError, "q_len must be a Python int"),
        (
            lambda: masks.sliding_window_mask(4, local_window_size=(-1, 0)),
            ValueError,
            r"local_window_size\[0\] \(left\)",
        ),
        (
            lambda: masks.sliding_window_mask(4, local_window_size=(1, -2)),
            ValueError,
            r"local_window_size\[1\] \(right\)",
        ),
        (lambda: masks.lengths_to_valid(np.array([1.5]), 3), TypeError, "integers"),
        (
            lambda: masks.padding_mask(np.array([[1, 0]])),
            TypeError,
            "query_valid must be a boolean",
        ),
        (lambda: masks.segment_mask(np.array([[0.5]])), TypeError, "query_segment_ids must hold"),
        (
            lambda: masks.segment_mask(np.zeros((2, 3), int), np.zeros((3, 3), int)),
            ValueError,
            "share batch dims",
        ),
    ],
)
def test_mask_errors(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_traced_size_is_a_clear_error():
    with pytest.raises(TypeError, match="static size"):
        jax.jit(lambda n: masks.causal_mask(n))(3)
