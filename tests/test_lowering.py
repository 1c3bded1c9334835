"""Lowering jattn calls for other platforms from this host: each platform's route is chosen
when the program is lowered, and GPU and TPU programs carry jattn's own Pallas kernels.

Under :func:`jattn.kernels.lowering_platforms` the routing picks a route per platform; the
lowered module must hold the kernels' custom calls (``__gpu$xla.gpu.triton`` for Triton,
``tpu_custom_call`` for Mosaic: one for the forward pass, three with the gradient:
forward, dK/dV, dQ) and no XLA tile loop (``stablehlo.while``) or attention product
(``stablehlo.dot_general``) of its own.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _counting import counted_mask_mod

import jattn
from jattn import _routing, kernels, mods

TRITON = "__gpu$xla.gpu.triton"
CUSTOM_CALL = {"cuda": TRITON, "tpu": "tpu_custom_call"}
B, T, H, K, D = 2, 128, 4, 2, 64


def _inputs(dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    kv = jnp.asarray(rng.standard_normal((B, T, K, D)), dtype)
    return q, kv, kv


IDS = jnp.asarray(np.repeat(np.arange(4), T // 4)[None].repeat(B, 0), jnp.int32)
OPTIONS = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(32, 0)),
    "lengths": dict(
        is_causal=True,
        query_seq_lengths=jnp.array([100, 7]),
        key_value_seq_lengths=jnp.array([90, 128]),
    ),
    "segments": dict(query_segment_ids=IDS),
    "bias": dict(bias=jnp.zeros((1, H, T, T), jnp.bfloat16)),
    "sinks": dict(is_causal=True, sinks=jnp.zeros((H,))),
    "softcap": dict(is_causal=True, score_mod=mods.softcap(30.0)),
    "alibi": dict(is_causal=True, score_mod=mods.alibi(mods.alibi_slopes(H))),
    "elementwise score_mod": dict(
        score_mod=lambda s, b, h, q, k: 0.5 * s + jnp.where(q >= k, 0.0, -1.0)
    ),
    "dropout": dict(is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    "document": dict(mask_mod=mods.causal() & mods.document(IDS)),
    "mask_mod": dict(mask_mod=lambda b, h, q, k: (q - k) % 4 != 3),
    "return_residual": dict(is_causal=True, return_residual=True),
}


def _loss(options, implementation):
    def loss(q, k, v):
        out = jattn.dot_product_attention(q, k, v, implementation=implementation, **options)
        if isinstance(out, tuple):
            return jnp.sum(out[0].astype(jnp.float32)) + jnp.sum(out[1])
        return jnp.sum(out.astype(jnp.float32))

    return loss


def _lowered(fn, *args, platforms=("cuda",), routed: bool = True) -> str:
    """The module of ``fn`` lowered for ``platforms``: under lowering_platforms
    (``routed``), or as a new user would lower it (the automatic rule defers the other
    platforms' routes to lowering time)."""
    if not routed:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=platforms).as_text()
    with kernels.lowering_platforms(*platforms):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=platforms).as_text()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize(
    "implementation, routed",
    [("pallas", True), ("pallas", False), (None, True), (None, False)],
    ids=["pallas-routed", "pallas", "auto-routed", "auto"],
)  # fmt: skip
@pytest.mark.parametrize("option", OPTIONS)
def test_lowering_carries_the_kernel(option, implementation, routed, platform):
    """Forward and gradient carry the kernel, named or picked by the automatic rule, under
    lowering_platforms (routed) and by default (no context manager: deferred)."""
    loss = _loss(OPTIONS[option], implementation)
    args = _inputs()
    lower = functools.partial(_lowered, platforms=(platform,), routed=routed)
    forward = lower(loss, *args)
    backward = lower(jax.grad(loss, argnums=(0, 1, 2)), *args)
    splash = implementation is None and platform == "tpu" and "splash_m" in forward
    if splash:  # lowered for a TPU alone, the automatic rule takes splash where it suffices
        assert backward.count(CUSTOM_CALL[platform]) >= 2
    else:  # deferred too: the gradient starts from the forward's outputs (no recompute)
        assert forward.count(CUSTOM_CALL[platform]) == 1
        assert backward.count(CUSTOM_CALL[platform]) == 3
    for text in (forward, backward):
        if not splash:  # (splash's own backward computes its row sums with XLA)
            assert "stablehlo.dot_general" not in text
        if option != "mask_mod":  # a mask_mod's tile states are evaluated once, by a loop
            assert "stablehlo.while" not in text


def test_cuda_lowering_of_float32_and_a_bias_gradient():
    q, k, v = _inputs(jnp.float32)
    bias = jnp.zeros((B, 1, 1, T), jnp.float32)

    def loss(q, bias):
        out = jattn.dot_product_attention(q, k, v, bias=bias, implementation="pallas")
        return jnp.sum(out)

    assert _lowered(jax.grad(loss, argnums=(0, 1)), q, bias).count(TRITON) == 3


def test_pallas_triton_lowers_for_cuda_from_this_host():
    """The old adapters judge by the one platform routed for, not by the host."""
    q, k, v = _inputs()
    loss = _loss(dict(is_causal=True), "pallas_triton")
    assert _lowered(jax.grad(loss, argnums=(0, 1, 2)), q, k, v).count(TRITON) >= 2


def test_export_for_cpu_and_cuda_runs_on_cpu():
    """One exported program holds the CPU route and the CUDA kernels; on this CPU host it
    runs the CPU route and agrees with the dense path."""
    q, k, v = _inputs(jnp.float32)
    options = dict(is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(1))
    loss = _loss(options, None)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    # Triton's custom calls and jattn's fused CPU kernel (an FFI target registered by the
    # process that runs the program) carry no serialization guarantee of jax's.
    targets = (TRITON, "jattn_cpu_attention_forward", "jattn_cpu_attention_backward")
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
    with kernels.lowering_platforms("cpu", "cuda"):
        exported = jax.export.export(
            jax.jit(grad), platforms=["cpu", "cuda"], disabled_checks=checks
        )(q, k, v)
    assert exported.platforms == ("cpu", "cuda")
    assert exported.mlir_module().count(TRITON) == 3
    got = exported.call(q, k, v)
    expected = jax.grad(_loss(options, "dense"), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=2e-5)


def test_refusals_name_their_reason():
    q, k, v = _inputs()
    on_cpu = r"runs on NVIDIA GPUs \('cuda'\) and TPUs, not on cpu"
    with pytest.raises(ValueError, match=on_cpu):
        jattn.dot_product_attention(q, k, v, implementation="pallas")
    # Traced, it is deferred for GPUs and TPUs, and refuses when lowered for this host.
    with pytest.raises(ValueError, match=on_cpu):
        jax.jit(lambda q: jattn.dot_product_attention(q, k, v, implementation="pallas"))(q)
    mask = jnp.ones((T, T), bool)

    def masked(q):
        return jattn.dot_product_attention(q, k, v, mask=mask, implementation="pallas")

    with kernels.lowering_platforms("cuda"), pytest.raises(ValueError, match="a mask array"):
        jax.jit(masked).trace(q)
    with kernels.lowering_platforms("cpu", "tpu"), pytest.raises(ValueError, match="on cpu: "):
        jax.jit(lambda q: jattn.dot_product_attention(q, k, v, implementation="pallas")).trace(q)
    gather = dict(score_mod=lambda s, b, h, q, k: s + jnp.arange(H, dtype=s.dtype)[h])
    with (
        kernels.lowering_platforms("cuda"),
        pytest.raises(ValueError, match="score_mod using gather"),
    ):
        jax.jit(
            lambda q: jattn.dot_product_attention(q, k, v, implementation="pallas", **gather)
        ).trace(q)
    with pytest.raises(ValueError, match="lowering_platforms takes"):
        with kernels.lowering_platforms("gpu"):
            pass


def test_a_gathering_modifier_keeps_the_xla_route_on_gpu():
    """The automatic rule never answers differently: a gather keeps the XLA route on GPU."""
    q, k, v = _inputs()
    gather = dict(score_mod=lambda s, b, h, q, k: s + jnp.arange(H, dtype=s.dtype)[h])
    text = _lowered(_loss(gather, None), q, k, v)
    assert TRITON not in text


# ----------------------------------------------------------------------------------------
# The default: every platform's route, the others' deferred to lowering time
# ----------------------------------------------------------------------------------------


def _export(fn, *args, platforms):
    # Triton's and Mosaic's custom calls and jattn's fused CPU kernel (an FFI target the
    # running process registers) carry no serialization guarantee of jax's.
    targets = (TRITON, "tpu_custom_call", "jattn_cpu_attention_forward")
    checks = [
        jax.export.DisabledSafetyCheck.custom_call(t)
        for t in (*targets, "jattn_cpu_attention_backward")
    ]
    return jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=checks)(*args)


@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "gradient"])
def test_a_default_export_carries_each_platforms_kernel_and_runs_on_cpu(gradient):
    """No context manager: one program exported for three platforms holds the Triton and
    the Mosaic kernels and, run on this CPU host, agrees with the dense path."""
    q, k, v = _inputs(jnp.float32)
    options = dict(is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(1))
    fn, expected = _loss(options, None), _loss(options, "dense")
    if gradient:
        fn, expected = (jax.grad(f, argnums=(0, 1, 2)) for f in (fn, expected))
    exported = _export(fn, q, k, v, platforms=["cpu", "cuda", "tpu"])
    text = exported.mlir_module()
    assert text.count(TRITON) == (3 if gradient else 1)
    assert text.count("tpu_custom_call") == (3 if gradient else 1)
    got, want = exported.call(q, k, v), expected(q, k, v)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, e, atol=2e-5, rtol=2e-5)


def _small(t=64, h=2, kvh=2, d=16, batch=(2,)):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((*batch, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((*batch, t, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((*batch, t, kvh, d)), jnp.float32)
    return q, k, v


def _weighted(out):
    """A loss whose cotangent differs per element (a plain sum hides transposed grads)."""
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(out * jnp.sin(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)))


def _deferred_vs_direct(fn, *args, argnums=(0, 1, 2)):
    """``fn``'s value and gradients with the host's branch deferred (lowered through
    jattn_deferred_attention) and as routed today: they must agree."""
    grad = jax.value_and_grad(fn, argnums=argnums)
    with _routing._defer_host():
        jaxpr = str(jax.make_jaxpr(grad)(*args))
        got = jax.jit(grad)(*args)
    assert "jattn_deferred_attention_grad" in jaxpr
    want = jax.jit(grad)(*args)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-5)
    return got


SLOPES = mods.alibi_slopes(2)
DEFERRED_OPTIONS = {
    "causal": dict(is_causal=True),
    "segments": dict(query_segment_ids=jnp.asarray(np.repeat([[0, 1]] * 2, 32, axis=1))),
    "lengths": dict(is_causal=True, key_value_seq_lengths=jnp.array([40, 64])),
    "dropout": dict(is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(3)),
    "residual": dict(is_causal=True, return_residual=True),
    "sinks": dict(sinks=jnp.array([0.5, -1.0])),
}


@pytest.mark.parametrize("option", DEFERRED_OPTIONS)
def test_the_deferred_branch_computes_the_route(option):
    q, k, v = _small()

    def loss(q, k, v):
        out = jattn.dot_product_attention(q, k, v, **DEFERRED_OPTIONS[option])
        residual = jnp.sum(jnp.cos(out[1])) if isinstance(out, tuple) else 0.0
        return _weighted(out) + residual

    _deferred_vs_direct(loss, q, k, v)


def test_the_deferred_branch_differentiates_a_bias_and_the_modifiers_arrays():
    """A bias, ALiBi's slopes (a ready-made modifier's leaves) and an array a lambda
    closes over (a tracer of the caller's) are operands with gradients."""
    q, k, v = _small(t=128)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((1, 2, 1, 128)), jnp.float32)

    def loss(q, bias, slopes, table):
        def score_mod(s, b, h, qi, ki):
            return s + table[h] * jnp.where(qi >= ki, 1.0, 0.5)

        out = jattn.dot_product_attention(q, k, v, bias=bias, score_mod=score_mod)
        out2 = jattn.dot_product_attention(q, k, v, is_causal=True, score_mod=mods.alibi(slopes))
        return _weighted(out) + _weighted(out2)

    got = _deferred_vs_direct(loss, q, bias, SLOPES, jnp.array([0.3, -0.2]), argnums=(0, 1, 2, 3))
    assert all(np.abs(np.asarray(g)).sum() > 0 for g in jax.tree.leaves(got[1]))


def test_the_deferred_branch_under_vmap_and_grad_of_vmap():
    q, k, v = _small(batch=(3, 2))

    def attend(q, k, v):
        return jattn.dot_product_attention(q, k, v, is_causal=True, bias=jnp.ones((1, 64)))

    def loss(q, k, v):
        return _weighted(jax.vmap(attend)(q, k, v))

    _deferred_vs_direct(loss, q, k, v)
    single = jax.vmap(lambda q: jax.grad(lambda q: _weighted(attend(q, k[0], v[0])))(q))
    with _routing._defer_host():
        got = jax.jit(single)(q)
    np.testing.assert_allclose(got, jax.jit(single)(q), atol=1e-5, rtol=1e-5)


def test_the_deferred_branch_under_checkpoint():
    q, k, v = _small()
    loss = jax.checkpoint(lambda q, k, v: _weighted(jattn.dot_product_attention(q, k, v)))
    _deferred_vs_direct(loss, q, k, v)


@pytest.mark.parametrize("grad", [False, True])
def test_a_default_call_traces_nothing_more_on_the_host(grad, monkeypatch):
    """The deferred branches trace no kernel and no mask_mod on the host: a default jitted
    call traces the mask_mod and pallas_call as often as with the host's route alone."""
    from jax.experimental import pallas as pl

    calls = []
    pallas_call = pl.pallas_call
    monkeypatch.setattr(pl, "pallas_call", lambda *a, **k: calls.append(1) or pallas_call(*a, **k))

    def traces(host_only: bool) -> tuple[int, int]:
        mask_mod, traced = counted_mask_mod()
        calls.clear()

        def f(q):
            return _weighted(jattn.dot_product_attention(q, q, q, mask_mod=mask_mod))

        q = jnp.ones((1, 300, 2, 8), jnp.float32)
        fn = jax.jit(jax.grad(f) if grad else f)
        if host_only:
            with kernels.lowering_platforms():
                jax.block_until_ready(fn(q))
        else:
            jax.block_until_ready(fn(q))
        return len(traced), len(calls)

    assert traces(host_only=False) == traces(host_only=True)


PALLAS_OPTIONS = {
    "causal, padded rows": dict(is_causal=True),
    "bias, sinks": dict(
        bias=jnp.linspace(-1.0, 1.0, 40 * 40).reshape(1, 1, 40, 40), sinks=jnp.ones(2)
    ),
    "alibi, lengths": dict(
        is_causal=True, score_mod=mods.alibi(SLOPES), query_seq_lengths=jnp.array([30, 40])
    ),
    "dropout, residual": dict(
        is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(4), return_residual=True
    ),
}


@pytest.mark.parametrize("option", PALLAS_OPTIONS)
def test_the_deferred_pallas_gradient_runs_the_backward_kernels_alone(option, monkeypatch):
    """Where the deferred route is jattn's Pallas kernel (here forced on CPU, in interpret
    mode), its gradient starts from the forward's outputs (no recomputed forward kernel),
    and value and gradients equal the dense path's."""
    from jax.experimental import pallas as pl

    monkeypatch.setenv(kernels.INTERPRET_ENV, "1")
    monkeypatch.setitem(_routing.AUTO, "cpu", ("pallas", "dense"))
    names = []
    pallas_call = pl.pallas_call
    monkeypatch.setattr(
        pl, "pallas_call", lambda *a, **k: names.append(k.get("name")) or pallas_call(*a, **k)
    )
    q, k, v = _small(t=40)
    options = PALLAS_OPTIONS[option]

    def loss(implementation):
        def f(q, k, v):
            out = jattn.dot_product_attention(q, k, v, implementation=implementation, **options)
            residual = jnp.sum(jnp.cos(out[1])) if isinstance(out, tuple) else 0.0
            return _weighted(out) + residual

        return jax.value_and_grad(f, argnums=(0, 1, 2))

    with _routing._defer_host():
        got = jax.jit(loss(None))(q, k, v)
    # One forward kernel for the avals the hook takes from the host's route, one in the
    # deferred forward pass; the backward pass adds dK/dV and dQ and no forward (a
    # recomputed gradient would trace a third).
    assert sorted(names) == ["jattn_flash_dkv", "jattn_flash_dq"] + ["jattn_flash_fwd"] * 2
    want = jax.jit(loss("dense"))(q, k, v)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, e, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("deferred_host", [False, True])
def test_forward_mode_over_a_jitted_call_takes_the_dense_path(deferred_host):
    """jax.hessian of a jitted call: the deferred branches have no forward mode of their
    own and differentiate the dense path, as the rule does when it sees jax.jvp. (jax.jvp
    of a jitted call stages the custom VJP's linearization, which a deferred branch, as
    every kernel route, cannot lower: JAX's documented error, the limit named in the
    guide; the host's branch, never deferred, runs it.)"""
    q, k, v = _small(t=8, d=4, batch=(1,))

    def f(implementation):
        return jax.jit(
            lambda q: _weighted(
                jattn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
            )
        )

    context = _routing._defer_host() if deferred_host else contextlib.nullcontext()
    with context:
        got = jax.hessian(f(None))(q)
    np.testing.assert_allclose(got, jax.hessian(f("dense"))(q), atol=1e-5, rtol=1e-5)
    if not deferred_host:
        got_jvp = jax.jvp(f(None), (q,), (jnp.cos(q),))
        want_jvp = jax.jvp(f("dense"), (q,), (jnp.cos(q),))
        for g, e in zip(got_jvp, want_jvp, strict=True):
            np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-5)
