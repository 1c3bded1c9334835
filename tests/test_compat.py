"""Drop-in compatibility with jax.nn and flax, as their own tests and users write calls.

Each test uses jattn the way code written for ``jax.nn.dot_product_attention`` or for
flax's ``dot_product_attention`` / attention modules uses it, and compares with the
library it replaces. The whole suite runs with ``jax_numpy_rank_promotion='raise'``
(tests/conftest.py), as jax's own test harness does.
"""

import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

import jattn
from jattn import masks


def _qkv(seed=0, shape=(2, 8, 4, 16), kv_heads=None, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    kv_shape = shape if kv_heads is None else (*shape[:-2], kv_heads, shape[-1])
    return (
        jax.random.normal(keys[0], shape, dtype),
        jax.random.normal(keys[1], kv_shape, dtype),
        jax.random.normal(keys[2], kv_shape, dtype),
    )


# ----------------------------------------------------------------------------------------
# jax.nn's vocabulary: implementation names and return_residual
# ----------------------------------------------------------------------------------------


def test_rank_promotion_raise_with_lengths_as_jax_nn():
    # The call that used to fail under 'raise' (the suite runs under it).
    assert jax.config.jax_numpy_rank_promotion == "raise"
    q, k, v = _qkv()
    lengths = jnp.array([8, 5], jnp.int32)
    kw = dict(is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    ref = jax.nn.dot_product_attention(q, k, v, **kw)
    got = jattn.dot_product_attention(q, k, v, **kw)
    # jax.nn averages over the hidden keys where jattn gives zeros: compare real queries.
    np.testing.assert_allclose(got[1, :5], ref[1, :5], atol=1e-6)
    np.testing.assert_allclose(got[0], ref[0], atol=1e-6)
    mask = masks.padding_mask_from_lengths(lengths, lengths, q_len=8, kv_len=8)
    assert mask.shape == (2, 1, 8, 8)


def test_xla_is_the_dense_path():
    q, k, v = _qkv()
    dense = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="dense")
    xla = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_array_equal(xla, dense)


def test_cudnn_without_a_gpu_is_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: the cuDNN route is tested in tests/test_kernels.py")
    q, k, v = _qkv(dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"implementation='cudnn' cannot be used here: .*GPU"):
        jattn.dot_product_attention(q, k, v, implementation="cudnn")


@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_return_residual_equals_jax_nn(implementation, kv_heads):
    q, k, v = _qkv(kv_heads=kv_heads)
    out, lse = jattn.dot_product_attention(
        q, k, v, is_causal=True, return_residual=True, implementation=implementation
    )
    ref_out, ref_lse = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    assert lse.shape == ref_lse.shape == q.shape[:-1]  # [batch..., T, H]
    assert lse.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)


def test_residual_of_rows_that_attend_nothing_and_its_gradient_agree_across_paths():
    q, k, v = _qkv(shape=(2, 300, 2, 8))
    lengths = jnp.array([300, 0], jnp.int32)  # row 1 sees no key at all

    def f(implementation):
        def loss(q, k, v):
            out, lse = jattn.dot_product_attention(
                q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                return_residual=True, implementation=implementation,
            )  # fmt: skip
            real = jnp.where(lengths[:, None, None] > 0, lse, 0.0)
            return jnp.sum(out) + jnp.sum(jnp.sin(real)), (out, lse)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, (_, lse_d)), grads_d = f("dense")
    (_, (out_b, lse_b)), grads_b = f("blockwise")
    np.testing.assert_array_equal(lse_d[1], jattn.large_negative(jnp.float32))
    np.testing.assert_array_equal(lse_b[1], jattn.large_negative(jnp.float32))
    np.testing.assert_allclose(lse_b[0], lse_d[0], atol=2e-5)
    np.testing.assert_array_equal(out_b[1], 0.0)
    for gb, gd in zip(grads_b, grads_d, strict=True):  # the lse is differentiable on both
        np.testing.assert_allclose(gb, gd, atol=5e-5)
        assert np.all(np.isfinite(np.asarray(gb)))


# ----------------------------------------------------------------------------------------
# flax: force_fp32_for_softmax, the einsum hooks, promote_dtype
# ----------------------------------------------------------------------------------------


def _mhdpa_pair(**kwargs):
    common = dict(num_heads=2, qkv_features=8, **kwargs)
    return (
        nn.MultiHeadDotProductAttention(**common),
        nn.MultiHeadDotProductAttention(**common, attention_fn=jattn.dot_product_attention),
    )


@pytest.mark.parametrize("force", [True, False])
def test_force_fp32_for_softmax_sows_weights_as_flax(force):
    x = jax.random.normal(jax.random.key(1), (2, 5, 8), jnp.bfloat16)
    ref_mod, our_mod = _mhdpa_pair(dtype=jnp.bfloat16, force_fp32_for_softmax=force)
    variables = ref_mod.init(jax.random.key(0), x)
    apply = dict(mutable=["intermediates"], sow_weights=True)
    ref_y, ref_state = ref_mod.apply(variables, x, **apply)
    our_y, our_state = our_mod.apply(variables, x, **apply)
    ref_w = ref_state["intermediates"]["attention_weights"][0]
    our_w = our_state["intermediates"]["attention_weights"][0]
    assert our_w.dtype == ref_w.dtype == (jnp.float32 if force else jnp.bfloat16)
    np.testing.assert_allclose(
        np.asarray(our_w, np.float32), np.asarray(ref_w, np.float32), atol=1e-2
    )
    np.testing.assert_allclose(
        np.asarray(our_y, np.float32), np.asarray(ref_y, np.float32), atol=5e-2
    )
    q, k, _ = _qkv(dtype=jnp.bfloat16)
    w = jattn.dot_product_attention_weights(q, k, force_fp32_for_softmax=force)
    assert w.dtype == (jnp.float32 if force else jnp.bfloat16)


class _CountingEinsum:
    """A flax einsum hook (as AQT's quantized einsums are passed): records its calls."""

    calls: typing.ClassVar[list] = []

    def __call__(self, subscripts, a, b):
        _CountingEinsum.calls.append(subscripts)
        return jnp.einsum(subscripts, a, b)


def test_flax_einsum_hooks_are_honoured():
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    hooks = dict(
        qk_attn_weights_einsum_cls=_CountingEinsum, attn_weights_value_einsum_cls=_CountingEinsum
    )
    ref_mod, our_mod = _mhdpa_pair(**hooks)
    variables = ref_mod.init(jax.random.key(0), x)
    ref = ref_mod.apply(variables, x)
    _CountingEinsum.calls.clear()
    got = our_mod.apply(variables, x)
    assert _CountingEinsum.calls == ["...qhd,...khd->...hqk", "...hqk,...khd->...qhd"]
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_einsum_dot_general_is_used_and_changes_the_result():
    q, k, v = _qkv()
    seen = []

    def doubling_dot_general(*args, **kwargs):
        seen.append(True)
        return 2.0 * jax.lax.dot_general(*args, **kwargs)

    got = jattn.dot_product_attention(q, k, v, einsum_dot_general=doubling_dot_general)
    # logits doubled (as a scale of 2 * 1/sqrt(d)), then the value product doubled
    ref = 2.0 * jattn.dot_product_attention(q, k, v, scale=2.0 / np.sqrt(q.shape[-1]))
    assert len(seen) == 2
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_einsum_hooks_gqa_repeats_kv_heads():
    q, k, v = _qkv(kv_heads=2)
    got = jattn.dot_product_attention(
        q, k, v, is_causal=True,
        qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum,
    )  # fmt: skip
    ref = jattn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,excerpt",
    [
        (dict(qk_attn_weights_einsum=jnp.einsum), "must be given together"),
        (
            dict(qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum,
                 precision=jax.lax.Precision.HIGHEST),
            "mutually exclusive",
        ),
        (dict(einsum_dot_general="dot"), "einsum_dot_general must be a function"),
    ],
)  # fmt: skip
def test_einsum_hook_misuse_is_a_clear_error(kwargs, excerpt):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match=excerpt):
        jattn.dot_product_attention(q, k, v, **kwargs)


def test_einsum_hooks_never_reach_the_blockwise_path():
    q, k, v = _qkv(shape=(1, 300, 2, 8))
    with pytest.raises(ValueError, match="implementation='blockwise' cannot be used here: flax"):
        jattn.dot_product_attention(
            q, k, v, implementation="blockwise", einsum_dot_general=jax.lax.dot_general
        )
    # automatic: dense, so the hook runs
    seen = []

    def dot_general(*a, **kw):
        seen.append(True)
        return jax.lax.dot_general(*a, **kw)

    jattn.dot_product_attention(q, k, v, einsum_dot_general=dot_general)
    assert seen


def test_promote_dtype_as_flax_nnx():
    q, k, v = _qkv()
    got = jattn.dot_product_attention(
        q, k, v, dtype=jnp.bfloat16, promote_dtype=nnx_dtypes.promote_dtype
    )
    ref = nnx.dot_product_attention(q, k, v, dtype=jnp.bfloat16)
    assert got.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=3e-2)
    calls = []

    def promote(args, dtype=None):
        calls.append(dtype)
        return tuple(jnp.asarray(a, jnp.float32) for a in args)

    jattn.dot_product_attention(q, k, v, promote_dtype=promote)
    assert calls == [None]
    with pytest.raises(TypeError, match="promote_dtype must be a function"):
        jattn.dot_product_attention(q, k, v, promote_dtype="float32")


def test_nnx_multihead_attention_with_jattn_under_its_own_settings():
    # flax NNX's MultiHeadAttention passes dtype, precision, is_causal, module=: all honoured.
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    common = dict(num_heads=2, in_features=8, qkv_features=8, decode=False)
    ref = nnx.MultiHeadAttention(**common, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(
        **common, attention_fn=jattn.dot_product_attention, rngs=nnx.Rngs(0)
    )
    mask = nnx.make_causal_mask(jnp.ones((2, 6)))
    np.testing.assert_allclose(ours(x, mask=mask), ref(x, mask=mask), atol=1e-5)
