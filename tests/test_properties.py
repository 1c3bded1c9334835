"""Property-based tests: random shapes, masks, dtypes and options against a float64 numpy reference.

Hypothesis draws the sizes and options; the values come from a numpy generator seeded by
hypothesis, so every example is reproducible from its printed seed. The reference is
tests/reference.py's ``np_attention`` with a mask built here from first principles (index
comparisons), not from jattn.masks. The ``ci`` profile (tests/conftest.py) runs 25
derandomized examples per test; ``HYPOTHESIS_PROFILE=dev`` runs 200 random ones.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import np_attention

import jattn
from jattn import convert
from jattn import linen as jl
from jattn import nnx as jn

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Absolute tolerance per unit of max|v|: float32 rounding; the low-precision paths round
# the weights to the input dtype before the weighted sum (8 and 11 significant bits).
TOL = {"float32": 2e-5, "bfloat16": 2.5e-2, "float16": 4e-3}
# The tests that compile gradients or whole modules per example run 2/5 as many.
FEWER = settings(max_examples=max(1, settings().max_examples * 2 // 5))


@dataclasses.dataclass
class AttentionCase:
    batch: tuple[int, ...]
    q_len: int
    kv_len: int
    kv_heads: int
    groups: int
    head_dim: int
    v_dim: int
    dtype: str
    is_causal: bool
    window: tuple[int, int] | None
    mask_kind: str | None  # None, "qk" [T, S], "batch" [batch..., 1, T, S], "full"
    hide_rows: bool  # make some query rows see nothing
    q_lengths: bool
    kv_lengths: bool
    segments: bool
    scale: float | None
    logit_size: float  # inputs multiplied by this: 30 gives logits in the hundreds
    seed: int

    @property
    def heads(self) -> int:
        return self.kv_heads * self.groups


@st.composite
def attention_cases(draw, dtypes=tuple(DTYPES)) -> AttentionCase:
    return AttentionCase(
        batch=tuple(draw(st.lists(st.integers(1, 2), max_size=2))),
        q_len=draw(st.integers(1, 9)),
        kv_len=draw(st.integers(1, 9)),
        kv_heads=draw(st.integers(1, 2)),
        groups=draw(st.integers(1, 2)),
        head_dim=draw(st.integers(1, 8)),
        v_dim=draw(st.integers(1, 5)),
        dtype=draw(st.sampled_from(dtypes)),
        is_causal=draw(st.booleans()),
        window=draw(st.none() | st.tuples(st.integers(0, 4), st.integers(0, 4))),
        mask_kind=draw(st.sampled_from([None, "qk", "batch", "full"])),
        hide_rows=draw(st.booleans()),
        q_lengths=draw(st.booleans()),
        kv_lengths=draw(st.booleans()),
        segments=draw(st.booleans()),
        scale=draw(st.none() | st.floats(0.05, 2.0)),
        logit_size=draw(st.sampled_from([1.0, 1.0, 30.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _inputs(case: AttentionCase):
    """q, k, v rounded to the case's dtype, and every mask option, as numpy arrays."""
    rng = np.random.default_rng(case.seed)
    b, t, s, h = case.batch, case.q_len, case.kv_len, case.heads
    dtype = DTYPES[case.dtype]
    q = rng.normal(size=(*b, t, h, case.head_dim)) * case.logit_size
    k = rng.normal(size=(*b, s, case.kv_heads, case.head_dim))
    v = rng.normal(size=(*b, s, case.kv_heads, case.v_dim))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    opts = {}
    mask_shape = {"qk": (t, s), "batch": (*b, 1, t, s), "full": (*b, h, t, s)}.get(case.mask_kind)
    if mask_shape is not None:
        mask = rng.random(mask_shape) < 0.8
        if case.hide_rows:
            mask[..., rng.integers(t), :] = False
        opts["mask"] = mask
    if case.q_lengths:
        opts["query_seq_lengths"] = rng.integers(0, t + 1, size=b)
    if case.kv_lengths:
        opts["key_value_seq_lengths"] = rng.integers(0 if case.hide_rows else 1, s + 1, size=b)
    if case.segments:
        opts["query_segment_ids"] = np.sort(rng.integers(0, 3, size=(*b, t)), axis=-1)
        opts["key_value_segment_ids"] = np.sort(rng.integers(0, 3, size=(*b, s)), axis=-1)
    if case.window is not None:
        opts["local_window_size"] = case.window
    if case.scale is not None:
        opts["scale"] = case.scale
    return q, k, v, opts


def _reference_mask(case: AttentionCase, opts) -> np.ndarray:
    """The combined mask ``[batch..., H, T, S]`` from index comparisons alone."""
    b, t, s = case.batch, case.q_len, case.kv_len
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    mask = np.ones((*b, case.heads, t, s), bool)
    if case.is_causal:
        mask &= j <= i
    if case.window is not None:
        left, right = case.window
        mask &= (j >= i - left) & (j <= i + right)
    if "mask" in opts:
        mask &= opts["mask"]
    if "query_seq_lengths" in opts:
        lengths = np.asarray(opts["query_seq_lengths"])[..., None, None, None]
        mask &= i < lengths
    if "key_value_seq_lengths" in opts:
        lengths = np.asarray(opts["key_value_seq_lengths"])[..., None, None, None]
        mask &= j < lengths
    if "query_segment_ids" in opts:
        qs = opts["query_segment_ids"][..., None, :, None]
        ks = opts["key_value_segment_ids"][..., None, None, :]
        mask &= qs == ks
    return mask


@pytest.mark.top_left  # drawn shapes have fewer queries at times
@given(attention_cases())
def test_dense_and_blockwise_match_the_float64_reference(case):
    q, k, v, opts = _inputs(case)
    arrays = {
        name: opts.pop(name) for name in list(opts) if name not in ("scale", "local_window_size")
    }

    @jax.jit  # one compilation per example (eager mode compiles every op separately)
    def both(q, k, v, arrays):
        return [
            jattn.dot_product_attention(
                q, k, v, is_causal=case.is_causal, implementation=impl, **opts, **arrays
            )
            for impl in ("dense", "blockwise")
        ]

    mask = _reference_mask(case, opts | arrays)
    ref = np_attention(q, k, v, mask=mask, scale=opts.get("scale"))
    atol = TOL[case.dtype] * np.abs(np.asarray(v, np.float64)).max()
    hidden = ~mask.any(-1)  # [batch..., H, T]: queries that see no key
    for out in both(q, k, v, arrays):
        assert out.dtype == DTYPES[case.dtype]
        assert out.shape == (*case.batch, case.q_len, case.heads, case.v_dim)
        out = np.asarray(out, np.float64)
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out, ref, atol=atol, rtol=0)
        # A query that sees no key gives exact zeros, in every dtype.
        assert np.all(np.moveaxis(out, -2, -3)[hidden] == 0.0)


@FEWER
@pytest.mark.top_left  # drawn shapes have fewer queries at times
@given(attention_cases(dtypes=("float32",)), st.sampled_from([False, True, "batch", "heads"]))
def test_dense_and_blockwise_agree_with_dropout_and_in_gradients(case, broadcast_dropout):
    """The two implementations drop the same weights and have the same gradients."""
    q, k, v, opts = _inputs(case)
    opts |= dict(
        dropout_rate=0.3,
        dropout_rng=jax.random.key(case.seed),
        broadcast_dropout=broadcast_dropout,
        is_causal=case.is_causal,
    )
    cotangent = jnp.asarray(
        np.random.default_rng(case.seed + 1).normal(
            size=(*case.batch, case.q_len, case.heads, case.v_dim)
        ),
        jnp.float32,
    )

    @jax.jit
    def both(q, k, v):
        def f(q, k, v, implementation):
            out = jattn.dot_product_attention(q, k, v, implementation=implementation, **opts)
            return jnp.sum(out * cotangent), out

        grad = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
        return [grad(q, k, v, impl) for impl in ("dense", "blockwise")]

    ((_, dense), dense_grads), ((_, block), block_grads) = both(q, k, v)
    scale = 1.0 + float(np.abs(np.asarray(v)).max())
    np.testing.assert_allclose(block, dense, atol=2e-5 * scale, rtol=0)
    for g_block, g_dense in zip(block_grads, dense_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(g_block)))
        g_scale = 1.0 + float(np.abs(np.asarray(g_dense)).max())
        np.testing.assert_allclose(g_block, g_dense, atol=5e-5 * g_scale, rtol=0)


# ----------------------------------------------------------------------------------------
# Modules: the book's MultiHeadAttention in Linen and NNX against numpy
# ----------------------------------------------------------------------------------------


@st.composite
def module_cases(draw):
    heads = draw(st.integers(1, 3))
    return dict(
        batch=tuple(draw(st.lists(st.integers(1, 2), max_size=2))),
        tokens=draw(st.integers(1, 6)),
        extra_context=draw(st.integers(0, 2)),
        d_in=draw(st.integers(1, 5)),
        heads=heads,
        kv_heads=draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0])),
        head_dim=draw(st.integers(1, 3)),
        qkv_bias=draw(st.booleans()),
        causal=draw(st.booleans()),
        padding=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _np_mha(params, x, *, heads, kv_heads, causal, key_valid):
    """The book's MultiHeadAttention forward pass in float64 numpy, from Linen params."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)

    def dense(name, x):
        y = x @ p[name]["kernel"]
        return y + p[name]["bias"] if "bias" in p[name] else y

    x = np.asarray(x, np.float64)
    t = x.shape[-2]
    q, k, v = (dense(n, x) for n in ("W_query", "W_key", "W_value"))
    split = lambda a, n: a.reshape(*a.shape[:-1], n, a.shape[-1] // n)  # noqa: E731
    mask = np.ones((t, t), bool)
    if causal:
        mask = np.tril(mask)
    if key_valid is not None:
        mask = mask & key_valid[..., None, None, :]
    ctx = np_attention(split(q, heads), split(k, kv_heads), split(v, kv_heads), mask=mask)
    return dense("out_proj", ctx.reshape(*ctx.shape[:-2], -1))


@FEWER
@given(module_cases())
def test_linen_and_nnx_multihead_attention_match_numpy(case):
    rng = np.random.default_rng(case["seed"])
    b, t = case["batch"], case["tokens"]
    d_out = case["heads"] * case["head_dim"]
    x = jnp.asarray(rng.normal(size=(*b, t, case["d_in"])), jnp.float32)
    key_valid = None
    mask = None
    if case["padding"]:
        key_valid = rng.random((*b, t)) < 0.7
        key_valid[..., 0] = True  # every query keeps its first key
        mask = jattn.padding_mask(key_valid=jnp.asarray(key_valid))
    sizes = (d_out, t + case["extra_context"], 0.0, case["heads"], case["qkv_bias"])
    options = dict(num_kv_heads=case["kv_heads"], is_causal=case["causal"])
    linen = jl.MultiHeadAttention(*sizes, **options)
    variables = jax.jit(linen.init)(jax.random.key(case["seed"]), x)
    ref = _np_mha(
        variables["params"],
        x,
        heads=case["heads"],
        kv_heads=case["kv_heads"],
        causal=case["causal"],
        key_valid=key_valid,
    )
    got_linen = jax.jit(linen.apply)(variables, x, mask)
    # An abstract NNX module (no initializer runs): linen_to_nnx fills in the Linen weights.
    nnx_module = nnx.eval_shape(
        lambda: jn.MultiHeadAttention(case["d_in"], *sizes, **options, rngs=nnx.Rngs(1))
    )
    got_nnx = nnx.jit(lambda m, x, mask: m(x, mask))(
        convert.linen_to_nnx(variables, nnx_module), x, mask
    )
    for got in (got_linen, got_nnx):
        assert got.shape == (*b, t, d_out)
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=2e-5, rtol=2e-5)


@FEWER
@given(st.integers(1, 8), st.data())
def test_chunked_decoding_equals_the_full_forward_pass(total, data):
    """Any split of a sequence into prompt and chunks gives the full pass's outputs."""
    cuts = sorted(data.draw(st.sets(st.integers(1, total - 1))) if total > 1 else set())
    bounds = [0, *cuts, total]
    seed = data.draw(st.integers(0, 2**31 - 1))
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(2, total, 6)), jnp.float32)
    # One module shape for every example, so compilations (per chunk length) are shared.
    module = jn.MultiHeadAttention(6, 8, 8, 0.0, 4, num_kv_heads=2, rngs=nnx.Rngs(seed))
    call = nnx.jit(lambda m, x: m(x, decode=True))
    full = nnx.jit(lambda m, x: m(x))(module, x)
    module.init_cache((2, 8, 6))  # room for 8 tokens; `total` of them are used
    chunks = [call(module, x[:, a:z]) for a, z in itertools.pairwise(bounds)]
    np.testing.assert_allclose(jnp.concatenate(chunks, axis=1), full, atol=2e-6, rtol=2e-6)
