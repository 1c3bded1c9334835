"""jattn's own Pallas kernel ('pallas') against the dense path and float64 numpy.

In interpret mode off a GPU; compiled (Triton) on one (``benchmarks/device_check.sh`` runs
this file there with ``JAX_DEFAULT_MATMUL_PRECISION=highest``, so that the dense path's
float32 products are exact as the kernel's are).

Every option the kernel takes, forward, log-sum-exp and gradients (q, k, v and each
differentiable operand: bias, sinks, ALiBi slopes, a score_mod's closed-over array), on
small shapes with several tiles per axis (tiles 32 x 32 forward, 16 x 32 backward), so
tile skipping, boundary tiles and the online softmax are all exercised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import np_attention

import jattn
from jattn import dense, mods
from jattn._call import Operands, Settings
from jattn.kernels import pallas as kernel

N, T, S, H, K, D = 2, 64, 48, 2, 1, 16
RNG = np.random.default_rng(0)


def normal(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


Q, KEY, VAL = normal(N, T, H, D), normal(N, S, K, D), normal(N, S, K, D)
BASE = Operands(scale=1 / np.sqrt(D))
IDS_Q = jnp.asarray(np.sort(RNG.integers(0, 3, (N, T))), jnp.int32)
IDS_K = jnp.asarray(np.sort(RNG.integers(0, 3, (N, S))), jnp.int32)
TABLE = normal(H)


def _case(name):
    """``(ops, settings, names of differentiable ops fields, modifier factory or None)``."""
    if name == "plain":
        return BASE, Settings(), ()
    if name == "causal":
        return BASE, Settings(is_causal=True), ()
    if name == "window":
        return BASE, Settings(window=(10, 5)), ()
    if name == "lengths":  # a query length 0: a batch row that attends nothing
        lengths = dict(
            q_lengths=jnp.array([50, 0], jnp.int32), kv_lengths=jnp.array([33, 40], jnp.int32)
        )
        return BASE._replace(**lengths), Settings(is_causal=True), ()
    if name == "segments":
        return BASE._replace(q_segments=IDS_Q, kv_segments=IDS_K), Settings(), ()
    if name == "bias_full":
        return BASE._replace(bias=normal(1, H, T, S)), Settings(is_causal=True), ("bias",)
    if name == "bias_keys":
        return BASE._replace(bias=normal(N, 1, 1, S)), Settings(), ("bias",)
    if name == "bias_queries":
        return BASE._replace(bias=normal(H, T, 1)), Settings(), ("bias",)
    if name == "sinks":
        ops = BASE._replace(sinks=normal(H), q_lengths=jnp.array([50, 0], jnp.int32))
        return ops, Settings(is_causal=True), ("sinks",)
    if name == "softcap":
        return BASE, Settings(score_mod=mods.softcap(2.0)), ()
    if name == "dropout":
        ops = BASE._replace(dropout_rate=0.5, dropout_rng=jax.random.key(3))
        return ops, Settings(is_causal=True), ()
    if name == "dropout_shared":
        ops = BASE._replace(dropout_rate=0.3, dropout_rng=jax.random.key(4))
        return ops, Settings(dropout_shared=(True, False)), ()
    if name == "mask_mod":
        return BASE, Settings(mask_mod=lambda b, h, qi, ki: (qi - ki) % 3 != 1), ()
    if name == "document":
        return BASE, Settings(mask_mod=mods.causal() & mods.document(IDS_Q, IDS_K)), ()
    raise KeyError(name)


def _loss(attend, q, k, v, ops, settings, names, values):
    ops = ops._replace(**dict(zip(names, values, strict=True)))
    out, lse = attend(q, k, v, ops, settings)
    weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape) * 0.1)
    return jnp.sum(out * weights) + 0.3 * jnp.sum(jnp.sin(lse)), (out, lse)


INTERPRET = not kernel.available(jax.default_backend())


def _kernel(q, k, v, ops, settings, platform=None):
    return kernel.attention(q, k, v, ops, settings, interpret=INTERPRET, platform=platform)


def _dense(q, k, v, ops, settings):
    out, _, lse = dense.attention(q, k, v, ops, settings)
    return out, jnp.swapaxes(lse, -1, -2)


def _value_and_grads(attend, ops, settings, names):
    settings = Settings(**{**settings.__dict__, "return_residual": True})
    values = [getattr(ops, n) for n in names]

    def loss(q, k, v, *values):
        return _loss(attend, q, k, v, ops, settings, names, values)

    argnums = tuple(range(3 + len(names)))
    with kernel.block_sizes((32, 32), (16, 32)):
        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums, has_aux=True)(
            Q, KEY, VAL, *values
        )
    return out, lse, grads


CASES = [
    "plain", "causal", "window", "lengths", "segments", "bias_full", "bias_keys",
    "bias_queries", "sinks", "softcap", "dropout", "dropout_shared", "mask_mod", "document",
]  # fmt: skip


# Interpret mode is slow (seconds per case): the default run keeps one case of each kind
# (a band, a bias with its gradient, in-kernel dropout, a traced mask_mod); CI's slow leg
# runs them all.
DEFAULT_CASES = ("causal", "bias_keys", "dropout", "mask_mod")


@pytest.mark.parametrize(
    "name",
    [n if n in DEFAULT_CASES else pytest.param(n, marks=pytest.mark.slow) for n in CASES],
)
def test_matches_the_dense_path(name):
    ops, settings, names = _case(name)
    out, lse, grads = _value_and_grads(_kernel, ops, settings, names)
    out_d, lse_d, grads_d = _value_and_grads(_dense, ops, settings, names)
    np.testing.assert_allclose(out, out_d, atol=2e-5)
    np.testing.assert_allclose(lse, lse_d, atol=2e-5, rtol=1e-6)
    for g, g_d in zip(grads, grads_d, strict=True):
        np.testing.assert_allclose(g, g_d, atol=5e-5)


@pytest.mark.skipif(not INTERPRET, reason="the TPU layout off a TPU runs in interpret mode")
@pytest.mark.parametrize(
    "name",
    [pytest.param("lengths", marks=pytest.mark.slow), "bias_keys",
     pytest.param("dropout", marks=pytest.mark.slow)],
)  # fmt: skip
def test_the_tpu_layout_matches_the_dense_path(name):
    """The Mosaic variant (heads before positions, scalars in SMEM), in interpret mode."""
    ops, settings, names = _case(name)

    def tpu_kernel(q, k, v, ops, settings):
        return _kernel(q, k, v, ops, settings, platform="tpu")

    out, lse, grads = _value_and_grads(tpu_kernel, ops, settings, names)
    out_d, lse_d, grads_d = _value_and_grads(_dense, ops, settings, names)
    np.testing.assert_allclose(out, out_d, atol=2e-5)
    np.testing.assert_allclose(lse, lse_d, atol=2e-5, rtol=1e-6)
    for g, g_d in zip(grads, grads_d, strict=True):
        np.testing.assert_allclose(g, g_d, atol=5e-5)


def test_causal_against_numpy_float64():
    ops, settings, _ = _case("causal")
    with kernel.block_sizes((32, 32), (16, 32)):
        out, lse = _kernel(Q, KEY, VAL, ops, settings)
    expected = np_attention(Q, KEY, VAL, mask=np.tril(np.ones((T, S), bool)), scale=ops.scale)
    np.testing.assert_allclose(out, expected, atol=2e-6)
    q = np.asarray(Q, np.float64)
    k = np.repeat(np.asarray(KEY, np.float64), H // K, axis=2)
    logits = np.einsum("nthd,nshd->nhts", q, k) * ops.scale
    logits = np.where(np.tril(np.ones((T, S), bool)), logits, -np.inf)
    np.testing.assert_allclose(lse, np.logaddexp.reduce(logits, axis=-1), atol=2e-5)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    ops = BASE._replace(q_lengths=jnp.array([50, 0], jnp.int32))
    settings = Settings(is_causal=True)

    def loss(q):
        with kernel.block_sizes((32, 32), (16, 32)):
            return jnp.sum(_kernel(q, KEY, VAL, ops, settings)[0] ** 2)

    out, lse = _kernel(Q, KEY, VAL, ops, settings)
    grad = jax.grad(loss)(Q)
    assert np.all(np.asarray(out[0, 50:]) == 0) and np.all(np.asarray(out[1]) == 0)
    assert np.all(np.asarray(lse[1]) == float(jattn.large_negative()))
    assert np.all(np.asarray(grad[0, 50:]) == 0) and np.all(np.asarray(grad[1]) == 0)


def test_dropout_mask_is_the_blockwise_paths():
    # v = one-hot keys: out[q, h, j] is the dropped, rescaled weight of key j, so the
    # kernel's and the blockwise path's masks are compared element by element.
    t = 48
    q = normal(1, t, 2, D)
    k = normal(1, t, 2, D)
    v = jnp.broadcast_to(jnp.eye(t, dtype=jnp.float32)[None, :, None, :], (1, t, 2, t))
    key = jax.random.key(11)
    kwargs = dict(is_causal=True, dropout_rate=0.5, dropout_rng=key, scale=float(BASE.scale))
    with kernel.block_sizes((16, 16), (16, 16)):
        out = _kernel(
            q, k, v, BASE._replace(dropout_rate=0.5, dropout_rng=key), Settings(is_causal=True)
        )[0]
    ref = jattn.dot_product_attention(q, k, v, implementation="blockwise", **kwargs)
    np.testing.assert_array_equal(np.asarray(out) == 0, np.asarray(ref) == 0)
    np.testing.assert_allclose(out, ref, atol=1e-6)


@pytest.mark.slow
def test_modifier_arrays_get_gradients():
    """ALiBi slopes (native) and a score_mod's closed-over table (traced) get their gradients."""
    settings_of = {
        "alibi": lambda x: Settings(is_causal=True, score_mod=mods.alibi(x)),
        "table": lambda x: Settings(
            score_mod=lambda s, b, h, qi, ki: s + x[h] * jnp.tanh((ki - qi) * 0.1)
        ),
    }
    if not INTERPRET:  # compiled, a traced modifier may not gather (the route refuses it)
        del settings_of["table"]
    for name, make in settings_of.items():
        start = jnp.asarray(mods.alibi_slopes(H)) if name == "alibi" else TABLE

        def loss(x, attend, make=make):
            out, lse = attend(
                Q, KEY, VAL, BASE, Settings(**{**make(x).__dict__, "return_residual": True})
            )
            return jnp.sum(out * out) + jnp.sum(lse)

        with kernel.block_sizes((32, 32), (16, 32)):
            got = jax.grad(loss)(start, _kernel)
        np.testing.assert_allclose(got, jax.grad(loss)(start, _dense), rtol=1e-4, atol=1e-4)
