"""No silent wrong answers for the book's readers (issue 23, items 1-4, 8 and 10).

The mistakes a reader of the book makes first: the book's ``triu`` mask buffer (True =
*hide*), PyTorch's additive masks, the ``[batch, heads, T, head_dim]`` layout, a decoding
loop with ``is_causal=True``, the book's class names. Each gets an error or a warning that
names the fix, and the legitimate masks next to them pass unchanged.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference import np_attention

import jattn
from jattn import kvcache, mods
from jattn import linen as jl
from jattn import nnx as jn

B, T, H, D = 2, 6, 4, 8
BOOK_BUFFER = np.triu(np.ones((T, T), np.float32), k=1)  # the book's registered buffer


def _qkv(q_len=T, kv_len=T, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = ((B, q_len, H, D), (B, kv_len, H, D), (B, kv_len, H, D))
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True)]


# ----------------------------------------------------------------------------------------
# Item 1: masks are read one way everywhere
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("buffer", [BOOK_BUFFER, BOOK_BUFFER.astype(bool)], ids=["float", "bool"])
def test_the_books_buffer_is_refused(buffer):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"book's causal buffer.*is_causal=True.*~buffer"):
        jattn.dot_product_attention(q, k, v, mask=buffer)
    with pytest.raises(ValueError, match="book's causal buffer"):
        jattn.dot_product_attention(q, k, v, mask=jnp.broadcast_to(buffer, (B, H, T, T)))
    with pytest.raises(ValueError, match="book's causal buffer"):
        jattn.combine_masks(buffer, np.ones((B, 1, 1, T), bool))


@pytest.mark.parametrize(
    "mask",
    [
        np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf),  # torch SDPA's additive mask
        np.where(np.tril(np.ones((T, T), bool)), 0.0, -1e9),
        np.full((T, T), 0.5),
    ],
    ids=["-inf", "-1e9", "0.5"],
)
def test_additive_float_masks_are_refused(mask):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"additive mask.*m == 0.*bias=m"):
        jattn.dot_product_attention(q, k, v, mask=mask)
    with pytest.raises(ValueError, match="additive mask"):
        jattn.combine_masks(mask)


def test_the_buffer_is_refused_by_the_modules_and_the_kv_cache():
    x = jax.random.normal(jax.random.key(1), (B, T, 8))
    linen = jl.MultiHeadAttention(8, T, 0.0, 2)
    params = linen.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="book's causal buffer"):
        linen.apply(params, x, mask=BOOK_BUFFER)
    module = jn.MultiHeadAttention(8, 8, T, 0.0, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="book's causal buffer"):
        module(x, mask=BOOK_BUFFER.astype(bool))
    q, k, v = _qkv()
    cache = kvcache.init_cache(B, T, H, D)
    with pytest.raises(ValueError, match="book's causal buffer"):
        kvcache.update_and_attend(cache, q, k, v, mask=BOOK_BUFFER)
    with pytest.raises(ValueError, match="additive mask"):
        kvcache.update_and_attend(cache, q, k, v, mask=np.where(BOOK_BUFFER == 1, -np.inf, 0.0))


def test_legitimate_masks_still_pass():
    """flax's float 0/1 masks, all-False masks, a strictly-upper mask of another shape,
    one-token masks and anti-causal masks that include the diagonal are never refused."""
    q, k, v = _qkv()
    causal = np.tril(np.ones((T, T), bool))
    np.testing.assert_array_equal(
        jattn.dot_product_attention(q, k, v, mask=causal.astype(np.float32)),
        jattn.dot_product_attention(q, k, v, mask=causal),
    )
    np.testing.assert_array_equal(jattn.dot_product_attention(q, k, v, mask=np.zeros((T, T))), 0)
    anti = ~np.tril(np.ones((T, T), bool), k=-1)  # j >= i: sees itself and later keys
    expected = np_attention(*map(np.asarray, (q, k, v)), mask=anti)
    got = jattn.dot_product_attention(q, k, v, mask=anti)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    q1, k5, v5 = _qkv(1, 5)
    jattn.dot_product_attention(q1, k5, v5, mask=np.array([[False, True, True, True, True]]))
    jattn.dot_product_attention(q1, q1, q1, mask=np.zeros((1, 1), bool))
    q3, k3, v3 = _qkv(3, 3)  # below 4 tokens the pattern is left alone (random masks hit it)
    jattn.dot_product_attention(q3, k3, v3, mask=np.triu(np.ones((3, 3), bool), k=1))


def test_traced_masks_are_taken_as_given():
    """Under jit a mask argument is a tracer: its values cannot be read, so it is used as
    given (documented), as the dense reference with the same boolean mask."""
    q, k, v = _qkv()
    got = jax.jit(lambda m: jattn.dot_product_attention(q, k, v, mask=m))(BOOK_BUFFER != 0)
    expected = np_attention(*map(np.asarray, (q, k, v)), mask=BOOK_BUFFER != 0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Item 2: the book's [batch, heads, T, head_dim] layout
# ----------------------------------------------------------------------------------------


def test_the_books_layout_is_named_when_the_mask_shows_it():
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in _qkv())  # [batch, heads, T, head_dim]
    with pytest.raises(ValueError, match=r"\[batch, heads, T, head_dim\].*swapaxes\(x, -3, -2\)"):
        jattn.dot_product_attention(q, k, v, mask=np.tril(np.ones((T, T), bool)))


def test_swapped_module_inputs_are_named():
    module = jn.MultiHeadAttention(8, 8, 10, 0.0, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\[batch\.\.\., d_in, T\].*swapaxes\(x, -1, -2\)"):
        module(jnp.ones((2, 8, 5)))
    linen = jl.MultiHeadAttention(8, 10, 0.0, 2)
    params = linen.init(jax.random.key(0), jnp.ones((2, 5, 8)))
    with pytest.raises(ValueError, match=r"initialized for d_in = 8.*\[batch\.\.\., d_in, T\]"):
        linen.apply(params, jnp.ones((2, 8, 5)))


# ----------------------------------------------------------------------------------------
# Item 3: is_causal with fewer queries than keys
# ----------------------------------------------------------------------------------------


def test_top_left_causal_decoding_warns_and_names_the_fix():
    q, k, v = _qkv()
    assert issubclass(jattn.CausalAlignmentWarning, UserWarning)
    with pytest.warns(jattn.CausalAlignmentWarning, match=r"offset=kv_len - q_len"):
        jattn.dot_product_attention(q[:, -1:], k, v, is_causal=True)
    with pytest.warns(jattn.CausalAlignmentWarning):
        jattn.dot_product_attention_weights(q[:, -2:], k, is_causal=True)


def test_the_named_alternative_is_bottom_right_and_silent():
    q, k, v = _qkv()
    full = jattn.dot_product_attention(q, k, v, is_causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jattn.CausalAlignmentWarning)
        last = jattn.dot_product_attention(
            q[:, -1:], k, v, mask=jattn.causal_mask(1, T, offset=T - 1)
        )
        jattn.dot_product_attention(q, k, v, is_causal=True)  # q_len == kv_len
        jattn.dot_product_attention(q[:, :2], k, v, mask=jattn.causal_mask(2, T))
    np.testing.assert_allclose(last, full[:, -1:], rtol=1e-5, atol=1e-6)


def test_decoding_through_the_library_does_not_warn():
    x = jax.random.normal(jax.random.key(1), (B, T, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jattn.CausalAlignmentWarning)
        module = jn.MultiHeadAttention(8, 8, T, 0.0, 2, rngs=nnx.Rngs(0))
        module.init_cache((B, T, 8))
        module(x[:, :3], decode=True)
        module(x[:, 3:4], decode=True)
        q, k, v = _qkv()
        kvcache.update_and_attend(kvcache.init_cache(B, T, H, D), q[:, :1], k[:, :1], v[:, :1])


# ----------------------------------------------------------------------------------------
# Item 4 and 8: the book's names; one name per idea; NNX's dropout-stream message
# ----------------------------------------------------------------------------------------


def test_the_books_class_names_work():
    assert jl.SelfAttention_v1 is jl.SelfAttentionV1
    assert jl.SelfAttention_v2 is jl.SelfAttentionV2
    assert jn.SelfAttention_v1 is jn.SelfAttentionV1
    assert jn.SelfAttention_v2 is jn.SelfAttentionV2
    assert {"SelfAttention_v1", "SelfAttention_v2"} <= set(jl.__all__) & set(jn.__all__)
    x = jnp.asarray(jattn.book.INPUTS)
    module = jn.SelfAttention_v2(3, 2, rngs=nnx.Rngs(0))
    assert module(x).shape == (6, 2)


def test_old_aliases_are_gone():
    with pytest.raises(TypeError, match="causal"):
        jn.CausalAttention(3, 2, 6, 0.0, causal=True, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="causal"):
        jl.CausalAttention(2, 6, 0.0, causal=True)
    with pytest.raises(TypeError, match="window_left"):
        jattn.sliding_window_mask(4, window_left=2)
    with pytest.raises(TypeError, match="window"):
        kvcache.decode_mask(np.zeros(1, int), np.ones(1, int), 1, 4, window=2)


def test_nnx_rngs_without_a_dropout_stream_is_named():
    module = jn.MultiHeadAttention(8, 8, 4, 0.1, 2, rngs=nnx.Rngs(params=0))
    module.train()
    with pytest.raises(
        ValueError, match=r"`dropout` or `default` stream: nnx.Rngs\(params=0\) has neither"
    ):
        module(jnp.ones((1, 4, 8)))


# ----------------------------------------------------------------------------------------
# Item 10: drop-in details
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
def test_residual_in_the_input_dtype_as_jax_nn(dtype, implementation):
    q, k, v = _qkv(dtype=dtype)
    _, lse = jattn.dot_product_attention(
        q, k, v, is_causal=True, return_residual=True, implementation=implementation
    )
    _, expected = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    assert lse.dtype == expected.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(lse, np.float32), np.asarray(expected, np.float32), rtol=1e-2, atol=1e-2
    )


def test_a_low_precision_cotangent_for_the_residual_is_accepted():
    """jax's own testDotProductAttentionResidual: a bfloat16 cotangent for the lse (a guard:
    the residual is now bfloat16, so the cotangent matches it)."""
    q, k, v = _qkv(dtype=jnp.bfloat16)
    out, vjp = jax.vjp(lambda q: jattn.dot_product_attention(q, k, v, return_residual=True), q)
    (grad,) = vjp((jnp.ones_like(out[0]), jnp.ones_like(out[1])))
    assert grad.dtype == jnp.bfloat16 and bool(jnp.isfinite(grad.astype(jnp.float32)).all())


def test_fully_masked_rows_keep_a_finite_float16_residual():
    q, k, v = _qkv(dtype=jnp.float16)
    _, lse = jattn.dot_product_attention(q, k, v, mask=np.zeros((T, T)), return_residual=True)
    assert lse.dtype == jnp.float16 and bool(jnp.isfinite(lse).all())


def test_non_token_arrays_are_not_called_tokens():
    with pytest.raises(TypeError, match="alibi slopes must have a floating dtype") as info:
        mods.alibi(jnp.array([1, 2]))
    assert "Token" not in str(info.value)
