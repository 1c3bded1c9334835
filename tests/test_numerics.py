"""Numerics at the edges: large logits, float16/bfloat16, 64-bit mode, NaN checking, gradients.

Where the mathematics is finite, no output and no gradient may be NaN or Inf: fully masked
rows (zeros by convention), one-hot softmaxes from huge logits, partially ``-inf`` biases,
dropout, padding in a KV cache. ``jax.debug_nans`` makes JAX raise on the first NaN any
operation produces, hidden branches of a ``where`` included, so those tests also prove
that no NaN is made and then masked away.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads
from reference import np_attention

import jattn
from jattn import kvcache
from jattn import linen as jl
from jattn import nnx as jn
from jattn.toy import CopyTask, TinyGPT, TinyGPTConfig, TrainConfig, init_state, make_train_step

IMPLEMENTATIONS = ["dense", "blockwise"]
LOW = [jnp.bfloat16, jnp.float16]


def _normal(shape, dtype=jnp.float32, seed=0, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


def _qkv(batch=(2,), t=6, s=6, heads=2, kv_heads=2, d=4, dtype=jnp.float32, scale=1.0):
    return (
        _normal((*batch, t, heads, d), dtype, 0, scale),
        _normal((*batch, s, kv_heads, d), dtype, 1, scale),
        _normal((*batch, s, kv_heads, d), dtype, 2),
    )


def _all_finite(tree) -> bool:
    return all(np.isfinite(np.asarray(x, np.float64)).all() for x in jax.tree.leaves(tree))


def _loss_and_grads(fn, *args):
    """``sum(fn(*args) ** 2)`` and its gradients, in float32."""
    loss = lambda *a: jnp.sum(jnp.square(fn(*a).astype(jnp.float32)))  # noqa: E731
    return jax.value_and_grad(loss, argnums=tuple(range(len(args))))(*args)


# A mask with a fully masked query row (example 0) and a fully masked head (example 1).
MASK = np.ones((2, 2, 6, 6), bool)
MASK[0, :, 1] = False
MASK[1, 1] = False


# ----------------------------------------------------------------------------------------
# Large logits and low precision
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, *LOW])
def test_large_logits_are_finite_and_match_the_reference(implementation, dtype):
    # |q . k| reaches ~1e5: past float16's largest value (65504), so the logits must not
    # be formed in the input dtype; the softmax is then all but one-hot.
    q, k, v = _qkv(dtype=dtype, scale=100.0)
    fn = lambda q, k, v: jattn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, mask=MASK, implementation=implementation
    )
    out = fn(q, k, v)
    assert out.dtype == dtype and _all_finite(out)
    ref = np_attention(q, k, v, mask=MASK & np.tril(np.ones((6, 6), bool)))
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=tol * 5, rtol=0)
    loss, grads = _loss_and_grads(fn, q, k, v)
    assert _all_finite((loss, grads))


@pytest.mark.parametrize("is_causal", [False, True])
def test_float16_query_times_a_large_scale_stays_finite_on_blockwise(is_causal):
    """float16 q of 300s with scale=300: q * scale (9e4) is past float16's 65504, but the
    float32 logits are not. The blockwise path folds the scale into q, and must keep that
    product in float32 (issue 23, item 11): its answer is finite and the dense path's."""
    q = jnp.full((1, 40, 2, 8), 300.0, jnp.float16)
    _, k, v = _qkv((1,), 40, 40, 2, 2, 8, jnp.float16)
    kw = dict(scale=300.0, is_causal=is_causal)
    blockwise = jattn.dot_product_attention(q, k, v, implementation="blockwise", **kw)
    dense = jattn.dot_product_attention(q, k, v, implementation="dense", **kw)
    assert blockwise.dtype == jnp.float16
    assert np.isfinite(np.asarray(blockwise, np.float32)).all()
    np.testing.assert_allclose(
        np.asarray(blockwise, np.float32), np.asarray(dense, np.float32), rtol=1e-2, atol=1e-2
    )
    mask = np.tril(np.ones((40, 40), bool)) if is_causal else None
    ref = np_attention(q, k, v, scale=300.0, mask=mask)
    np.testing.assert_allclose(np.asarray(blockwise, np.float32), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_matches_float32_on_the_same_inputs(implementation, dtype):
    q, k, v = _qkv(dtype=dtype)
    kwargs = dict(is_causal=True, key_value_seq_lengths=jnp.array([6, 3]))
    lo = jattn.dot_product_attention(q, k, v, implementation=implementation, **kwargs)
    hi = jattn.dot_product_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), implementation=implementation, **kwargs
    )
    assert lo.dtype == dtype
    np.testing.assert_allclose(np.asarray(lo, np.float32), hi, atol=3e-2, rtol=0)
    fn = lambda q, k, v: jattn.dot_product_attention(  # noqa: E731
        q, k, v, implementation=implementation, mask=MASK, **kwargs
    )
    _, grads = _loss_and_grads(fn, q, k, v)
    assert all(g.dtype == dtype for g in grads) and _all_finite(grads)


def test_partially_minus_inf_bias_gives_finite_outputs_and_gradients():
    # An additive mask written with -inf (as users port it from PyTorch): the rows that
    # keep a key are finite, and so are the gradients through the hidden entries.
    q, k, v = _qkv()
    bias = jnp.where(jnp.tril(jnp.ones((6, 6), bool)), 0.0, -jnp.inf)
    fn = lambda q, k, v: jattn.dot_product_attention(q, k, v, bias=bias)  # noqa: E731
    np.testing.assert_allclose(
        fn(q, k, v), jattn.dot_product_attention(q, k, v, is_causal=True), atol=1e-6
    )
    with jax.debug_nans(True):
        loss, grads = _loss_and_grads(fn, q, k, v)
    assert _all_finite((loss, grads))


def _finfo_min_case(t=40):
    """An HF-style additive mask: ``finfo(float32).min`` on the future keys of a causal
    call, and on every key of two padding query rows. Those rows' visible logits all lie
    below ``jattn.large_negative``: ``(q, k, v, bias [1, 1, t, t], visibility [t, t])``."""
    q, k, v = _qkv(batch=(1,), t=t, s=t)
    visible = np.tril(np.ones((t, t), bool))
    bias = np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32)
    bias[[3, t - 2]] = np.finfo(np.float32).min  # padding queries: every key biased
    return q, k, v, bias[None, None], visible


PATHS = ["dense", "blockwise", "cpu_fused", "pallas"]


def _on(implementation, monkeypatch):
    """Skips the fused CPU kernel where it is not built; runs the Pallas kernel in
    interpret mode off its hardware."""
    from jattn import kernels
    from jattn.kernels.cpu import _library

    if implementation == "cpu_fused" and _library.library() is None:
        pytest.skip(f"fused CPU kernel {_library.status()}")
    monkeypatch.setenv(kernels.INTERPRET_ENV, "1")


@pytest.mark.parametrize("hidden", ["finfo.min", "-inf"])
@pytest.mark.parametrize("implementation", PATHS)
def test_rows_below_large_negative_weigh_their_visible_keys_on_every_path(
    implementation, hidden, monkeypatch
):
    # The softmax over the visible keys alone is the answer (the float64 reference's: the
    # padding rows average their own and earlier keys). A finite stand-in for hidden keys
    # gave the hidden ones, future keys included, all the weight on the dense path
    # (`future_leak` 0.14), and zeros on the blockwise path and the Pallas kernel. An
    # additive -inf counts as finfo.min: the same answer, where dense averaged the hidden
    # keys and the others gave zeros.
    _on(implementation, monkeypatch)
    q, k, v, bias, visible = _finfo_min_case()
    given = bias if hidden == "finfo.min" else np.where(bias == bias.min(), -np.inf, bias)
    fn = lambda q, k, v: jattn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, bias=given, implementation=implementation
    )
    ref = np_attention(q, k, v, mask=visible, bias=bias.astype(np.float64))
    np.testing.assert_allclose(np.asarray(fn(q, k, v), np.float64), ref, atol=2e-6, rtol=0)
    _, grads = _loss_and_grads(fn, q, k, v)
    assert _all_finite(grads)
    # (the tiled paths' gradients of those rows are not exact: docs/guides/conventions.md)


def test_rows_below_large_negative_have_exact_dense_gradients():
    # dL/dv = P^T dL/dout with the reference's weights (the padding rows' included).
    q, k, v, bias, visible = _finfo_min_case()
    fn = lambda v: jattn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, bias=bias, implementation="dense"
    )
    d_out = _normal(q.shape, seed=5)
    d_v = jax.grad(lambda v: jnp.sum(fn(v) * d_out))(v)
    _, weights = np_attention(
        q, k, v, mask=visible, bias=bias.astype(np.float64), return_weights=True
    )
    expected = np.einsum("nhts,nthd->nshd", weights, np.asarray(d_out, np.float64))
    np.testing.assert_allclose(np.asarray(d_v, np.float64), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["dense", "blockwise", "pallas"])
def test_a_score_mod_hiding_a_whole_row_gives_it_zeros(implementation, monkeypatch):
    # FlexAttention's way of hiding keys: -inf scores. A row hidden throughout attends
    # nothing (zeros, finite gradients); the other rows are the causal reference's.
    _on(implementation, monkeypatch)
    q, k, v = _qkv(batch=(1,), t=40, s=40)
    hide = lambda s, b, h, qi, ki: jnp.where(qi == 3, -jnp.inf, s)  # noqa: E731
    fn = lambda q, k, v: jattn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, score_mod=hide, implementation=implementation
    )
    visible = np.tril(np.ones((40, 40), bool))
    visible[3] = False
    ref = np_attention(q, k, v, mask=visible)
    np.testing.assert_allclose(np.asarray(fn(q, k, v), np.float64), ref, atol=2e-6, rtol=0)
    with jax.debug_nans(True):
        _, grads = _loss_and_grads(fn, q, k, v)
    assert _all_finite(grads)


@pytest.mark.parametrize("dtype", LOW)
def test_modules_in_low_precision_match_float32_and_have_finite_gradients(dtype):
    x = _normal((2, 5, 6), dtype)
    hi = jl.MultiHeadAttention(8, 5, 0.1, 2, num_kv_heads=1)
    lo = hi.clone(dtype=dtype, param_dtype=dtype)
    evaluate = jax.jit(
        lambda module, v, x: module.apply(v, x, deterministic=True), static_argnums=0
    )
    variables = jax.jit(lambda k, x: hi.init(k, x, deterministic=True))(
        jax.random.key(0), x.astype(jnp.float32)
    )
    low_vars = jax.tree.map(lambda p: p.astype(dtype), variables)
    got = evaluate(lo, low_vars, x)
    assert got.dtype == dtype
    want = evaluate(hi, jax.tree.map(lambda p: p.astype(jnp.float32), low_vars), x)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=5e-2, rtol=0)

    # Training: dropout on, gradients of the low-precision parameters.
    def loss(params):
        out = lo.apply({"params": params}, x, deterministic=False, dropout_rng=jax.random.key(1))
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    grads = jax.jit(jax.grad(loss))(low_vars["params"])
    assert _all_finite(grads)
    assert all(g.dtype == dtype for g in jax.tree.leaves(grads))
    # NNX, the same module in the same precision.
    module = jn.MultiHeadAttention(6, 8, 5, 0.1, 2, num_kv_heads=1, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))  # fmt: skip
    out = module(x, deterministic=False)
    assert out.dtype == dtype and _all_finite(out)


def test_low_precision_kv_cache_decodes_like_float32():
    x = _normal((2, 6, 6))
    module = jn.MultiHeadAttention(6, 8, 6, 0.0, 2, rngs=nnx.Rngs(0))
    outs = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        module.init_cache(x.shape, dtype=dtype)
        steps = [module(x[:, :3], decode=True), module(x[:, 3:5], decode=True)]
        steps.append(module(x[:, 5:], decode=True))
        outs[dtype] = jnp.concatenate(steps, axis=1)
        assert _all_finite(outs[dtype])
    np.testing.assert_allclose(outs[jnp.bfloat16], outs[jnp.float32], atol=3e-2, rtol=0)
    np.testing.assert_allclose(outs[jnp.float32], module(x), atol=2e-6, rtol=0)


# ----------------------------------------------------------------------------------------
# 64-bit mode
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_x64_float64_attention_matches_the_reference_to_float64_precision(implementation):
    with jax.enable_x64(True):
        q, k, v = _qkv(heads=4, kv_heads=2, dtype=jnp.float64)
        lengths = jnp.array([6, 4])  # int64 in 64-bit mode
        segments = jnp.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
        out = jattn.dot_product_attention(
            q, k, v, is_causal=True, key_value_seq_lengths=lengths,
            query_segment_ids=segments, implementation=implementation,
        )  # fmt: skip
        assert out.dtype == jnp.float64
        i, j = np.arange(6)[:, None], np.arange(6)[None, :]
        mask = (j <= i) & (j < np.array([6, 4])[:, None, None, None])
        mask &= np.asarray(segments)[:, None, :, None] == np.asarray(segments)[:, None, None, :]
        np.testing.assert_allclose(out, np_attention(q, k, v, mask=mask), atol=1e-12, rtol=0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_check_grads_in_float64(implementation):
    """Reverse-mode gradients against finite differences.

    Second order too for the dense path; the blockwise path's custom backward pass loops
    over tiles with data-dependent bounds, which JAX cannot differentiate again.
    """
    with jax.enable_x64(True):
        q, k, v = _qkv(batch=(1,), t=5, s=5, heads=2, kv_heads=1, d=3, dtype=jnp.float64)
        options = [
            dict(is_causal=True),
            dict(local_window_size=(2, 1), key_value_seq_lengths=jnp.array([4])),
            dict(query_segment_ids=jnp.array([[0, 0, 1, 1, 1]]), scale=0.7),
            dict(
                is_causal=True,
                dropout_rate=0.3,
                dropout_rng=jax.random.key(3),
                query_seq_lengths=jnp.array([3]),
            ),
        ]
        for kwargs in options:
            check_grads(
                jax.jit(
                    lambda q, k, v, kw=kwargs: jattn.dot_product_attention(
                        q, k, v, implementation=implementation, **kw
                    )
                ),
                (q, k, v),
                order=2 if implementation == "dense" else 1,
                modes=["rev"],
                atol=1e-5,
                rtol=1e-5,
            )


def test_x64_modules_and_decoding_run_in_float64():
    with jax.enable_x64(True):
        x = _normal((2, 4, 3), jnp.float64)
        module = jl.MultiHeadAttention(4, 4, 0.0, 2, param_dtype=jnp.float64)
        variables = module.init(jax.random.key(0), x)
        out = module.apply(variables, x)
        assert out.dtype == jnp.float64
        nnx_module = jn.MultiHeadAttention(3, 4, 4, 0.0, 2, param_dtype=jnp.float64, rngs=nnx.Rngs(0))  # fmt: skip
        full = nnx_module(x)
        nnx_module.init_cache(x.shape, dtype=jnp.float64)
        first = nnx_module(x[:, :3], decode=True, num_new=jnp.array([3, 2]))  # int64 num_new
        assert first.dtype == jnp.float64
        np.testing.assert_allclose(first[0], full[0, :3], atol=1e-12)
        np.testing.assert_allclose(first[1, :2], full[1, :2], atol=1e-12)


def test_float64_inputs_with_x64_off_compute_in_float32():
    q, k, v = (np.asarray(x, np.float64) for x in _qkv())
    out = jattn.dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == jnp.float32  # JAX converts them on entry, as everywhere
    ref = np_attention(q, k, v, mask=np.tril(np.ones((6, 6), bool)))
    np.testing.assert_allclose(out, ref, atol=1e-5)


# ----------------------------------------------------------------------------------------
# jax_debug_nans: no NaN is produced anywhere, not even in a masked-away branch
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mask=MASK),
        dict(query_seq_lengths=jnp.array([0, 3])),
        dict(key_value_seq_lengths=jnp.array([0, 3])),
        dict(mask=MASK, dropout_rate=0.5, dropout_rng=jax.random.key(1)),
        dict(is_causal=True, local_window_size=(0, 0)),
    ],
    ids=["mask", "query-lengths-0", "key-lengths-0", "dropout", "window-0"],
)
def test_debug_nans_attention_forward_and_backward(implementation, kwargs):
    q, k, v = _qkv(scale=30.0)
    fn = lambda q, k, v: jattn.dot_product_attention(  # noqa: E731
        q, k, v, implementation=implementation, **kwargs
    )
    with jax.debug_nans(True):
        eager = _loss_and_grads(fn, q, k, v)
        jitted = jax.jit(lambda *a: _loss_and_grads(fn, *a))(q, k, v)
    assert _all_finite((eager, jitted))


def test_debug_nans_modules_training_and_decoding():
    x = _normal((2, 5, 6), scale=10.0)
    key_valid = jnp.array([[True] * 5, [True, True, False, False, False]])
    mask = jattn.padding_mask(query_valid=key_valid, key_valid=key_valid)
    with jax.debug_nans(True):
        linen = jl.MultiHeadAttention(8, 5, 0.2, 4, num_kv_heads=2)
        variables = linen.init(jax.random.key(0), x, deterministic=True)
        grads = jax.grad(
            lambda p: jnp.sum(
                linen.apply({"params": p}, x, mask, deterministic=False,
                            rngs={"dropout": jax.random.key(1)}) ** 2
            )
        )(variables["params"])  # fmt: skip
        module = jn.MultiHeadAttentionWrapper(6, 4, 5, 0.2, 2, rngs=nnx.Rngs(0))
        out = module(x, mask, deterministic=False)
        # Decoding with padding rows (num_new 0 and 1) and a full cache under jit, where
        # the overflowing token attends nothing.
        module.init_cache((2, 4, 6))
        step = nnx.jit(lambda m, x, n: m(x, deterministic=True, decode=True, num_new=n))
        first = step(module, x[:, :3], jnp.array([3, 0]))
        second = step(module, x[:, 3:5], jnp.array([2, 1]))
    assert _all_finite((grads, out, first, second))
    assert np.all(np.asarray(first[1]) == 0.0)  # no real token yet in row 1
    assert np.all(np.asarray(second[0, 1]) == 0.0)  # row 0's 5th token overflowed


def test_debug_nans_toy_training_step_and_sampling():
    task = CopyTask(num_symbols=4, prefix_len=3, batch_size=4)
    model_cfg = TinyGPTConfig(task.vocab_size, task.context_length, d_model=8, num_layers=1, num_heads=2)  # fmt: skip
    cfg = TrainConfig(steps=3)
    with jax.debug_nans(True):
        step = make_train_step(TinyGPT(model_cfg), cfg)
        state, metrics = step(init_state(model_cfg, cfg), task.train_batch(0))
        logits = TinyGPT(model_cfg).apply({"params": state.params}, task.train_batch(1)[:, :-1])
        tokens = jattn.generate.sample_next(
            logits[:, -1] * 1e4, jax.random.key(0), temperature=0.7, top_k=2
        )
    assert _all_finite((metrics, logits)) and tokens.shape == (4,)


# ----------------------------------------------------------------------------------------
# Value checks and jit: concrete arrays closed over by a jitted function
# ----------------------------------------------------------------------------------------


def test_value_checks_accept_concrete_arrays_under_jit():
    q, k, v = _qkv()
    lengths = jnp.array([6, 2])  # closed over: concrete while the function is traced
    got = jax.jit(lambda q: jattn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths))(q)
    np.testing.assert_allclose(
        got, jattn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths), atol=1e-6
    )
    model = TinyGPT(TinyGPTConfig(5, 4, d_model=8, num_layers=1, num_heads=2))
    tokens = jnp.array([[1, 2, 3, 4]])
    variables = model.init(jax.random.key(0), tokens)
    np.testing.assert_allclose(
        jax.jit(lambda p: model.apply(p, tokens))(variables),
        model.apply(variables, tokens),
        atol=1e-6,
    )
    cache = kvcache.init_cache(2, 4, 2, 4)
    assert np.asarray(jax.jit(lambda: kvcache.fits(cache, jnp.array([4, 5])))()).tolist() == [
        True,
        False,
    ]
