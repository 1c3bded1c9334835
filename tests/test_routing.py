"""The routing table (jattn._routing): the automatic rule per backend, explicit names, refusals.

Everything runs on CPU. Another backend is simulated by monkeypatching
``jax.default_backend`` (and cuDNN's compute capability, which its ``available`` reads);
which implementation a call takes is read by a spy on ``_routing.choose`` that stops the
call once the choice is made, so nothing runs on hardware that is not here. Where a routed
call does run: cuDNN's kernel call is replaced by jax.nn's XLA path (as in
tests/test_kernels.py) and the Pallas kernels run in interpret mode. The kernels' own
conformance (forward, gradients, every option) is tests/test_kernels.py.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _fake_devices import run_checks
from flax import nnx

import jattn
from jattn import _routing, kernels, kvcache, mods
from jattn import nnx as jn
from jattn.kernels import cudnn as cudnn_adapter
from jattn.kernels import splash as splash_adapter


@pytest.fixture(autouse=True)
def no_interpret_mode(monkeypatch):
    """Every test starts without JATTN_PALLAS_INTERPRET, whatever the environment says."""
    monkeypatch.delenv(kernels.INTERPRET_ENV, raising=False)


@pytest.fixture
def interpret_mode(monkeypatch):
    monkeypatch.setenv(kernels.INTERPRET_ENV, "1")


def on_backend(monkeypatch, backend: str, capability=(9, 0)) -> None:
    """Makes the routing see ``backend`` (on 'gpu': an NVIDIA GPU of ``capability``)."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(cudnn_adapter, "compute_capability", lambda: capability)


class Chosen(Exception):
    """Raised by the spy with the chosen implementation's name."""


def route_of(monkeypatch, query, key=None, value=None, **kwargs) -> str:
    """The implementation ``jattn.dot_product_attention(query, key, value, **kwargs)`` takes."""
    real = _routing.choose

    def spy(*args):
        raise Chosen(real(*args))

    key = query if key is None else key
    with monkeypatch.context() as patch:
        patch.setattr(_routing, "choose", spy)
        with pytest.raises(Chosen) as chosen:
            jattn.dot_product_attention(query, key, key if value is None else value, **kwargs)
    return chosen.value.args[0]


def qkv(t=64, heads=4, kv_heads=2, dim=32, dtype=jnp.bfloat16, batch=2):
    """Random q ``[batch, t, heads, dim]`` and k, v ``[batch, t, kv_heads, dim]``."""
    rng = np.random.default_rng(t)
    shapes = [(batch, t, heads, dim), (batch, t, kv_heads, dim), (batch, t, kv_heads, dim)]
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype) for s in shapes)


def einsum_hooks():
    qk = lambda q, k: jnp.einsum("...qhd,...khd->...hqk", q, k)  # noqa: E731
    wv = lambda w, v: jnp.einsum("...hqk,...khd->...qhd", w, v)  # noqa: E731
    return dict(qk_attn_weights_einsum=qk, attn_weights_value_einsum=wv)


# Options and what they do to the automatic rule; shared by the GPU and TPU tables.
KEY = jax.random.key(0)
MASK = jnp.tril(jnp.ones((64, 64), bool))
FALLBACK_OPTIONS = {
    "mask array": dict(mask=MASK),
    "dropout": dict(dropout_rate=0.1, dropout_rng=KEY),
    "bias": dict(bias=jnp.zeros((64, 64), jnp.bfloat16)),
    "return_weights": dict(return_weights=True),
    "return_residual": dict(return_residual=True),  # neither cuDNN nor splash return an lse
    "precision": dict(precision=jax.lax.Precision.HIGHEST),
    "einsum hooks": einsum_hooks(),
}


# ----------------------------------------------------------------------------------------
# The automatic rule, per backend
# ----------------------------------------------------------------------------------------


def test_gpu_picks_cudnn_where_it_can(monkeypatch):
    on_backend(monkeypatch, "gpu")
    q, k, v = qkv()
    assert route_of(monkeypatch, q, k, v, is_causal=True) == "cudnn"
    assert route_of(monkeypatch, q, k, v) == "cudnn"
    lengths = jnp.array([30, 64])
    assert route_of(monkeypatch, q, k, v, query_seq_lengths=lengths) == "cudnn"
    assert route_of(monkeypatch, q, k, v, is_causal=True, local_window_size=(8, 0)) == "cudnn"
    assert route_of(monkeypatch, *qkv(dtype=jnp.float16), is_causal=True) == "cudnn"
    assert route_of(monkeypatch, q, k, v, precision=jax.lax.Precision.DEFAULT) == "cudnn"


# What jattn's own Pallas kernel takes on a GPU when cuDNN cannot (the rest runs dense).
PALLAS_TAKES = ("dropout", "bias", "return_residual")


@pytest.mark.parametrize("option", FALLBACK_OPTIONS)
def test_gpu_falls_back_for_what_cudnn_lacks(option, monkeypatch):
    on_backend(monkeypatch, "gpu")
    q, k, v = qkv()
    expected = "pallas" if option in PALLAS_TAKES else "dense"
    assert route_of(monkeypatch, q, k, v, is_causal=True, **FALLBACK_OPTIONS[option]) == expected


@pytest.mark.parametrize(
    ("why", "inputs", "options"),
    [
        ("float32", dict(dtype=jnp.float32), {}),
        ("head_dim 36", dict(dim=36), {}),
        ("segment ids", {}, dict(query_segment_ids=jnp.zeros((2, 64), jnp.int32))),
        ("window reaching right", {}, dict(local_window_size=(4, 4))),
    ],
)
def test_gpu_takes_jattns_kernel_for_inputs_cudnn_rejects(why, inputs, options, monkeypatch):
    on_backend(monkeypatch, "gpu")
    assert route_of(monkeypatch, *qkv(**inputs), **options) == "pallas"
    # The same at a length where the XLA fallback would be blockwise (q_len * kv_len >= 4096²).
    long = qkv(t=4096, heads=1, kv_heads=1, batch=1, **{"dim": 8, **inputs})
    if why == "segment ids":
        options = dict(query_segment_ids=jnp.zeros((1, 4096), jnp.int32))
    assert route_of(monkeypatch, *long, **options) == "pallas"


def test_gpu_without_a_capable_nvidia_gpu_uses_jattn(monkeypatch):
    q, k, v = qkv()
    on_backend(monkeypatch, "gpu", capability=(7, 5))
    assert route_of(monkeypatch, q, k, v, is_causal=True) == "dense"
    on_backend(monkeypatch, "gpu", capability=None)  # a GPU that is not NVIDIA's
    assert route_of(monkeypatch, q, k, v, is_causal=True) == "dense"


def test_gpu_never_picks_pallas_triton(monkeypatch, interpret_mode):
    """Pallas Triton takes float32 and segment ids, but runs only when asked for by name
    (the automatic rule takes jattn's own kernel)."""
    on_backend(monkeypatch, "gpu")
    q, k, v = qkv(dtype=jnp.float32)
    ids = jnp.zeros((2, 64), jnp.int32)
    assert route_of(monkeypatch, q, k, v, query_segment_ids=ids) == "pallas"
    name = route_of(monkeypatch, q, k, v, query_segment_ids=ids, implementation="pallas_triton")
    assert name == "pallas_triton"


def test_tpu_picks_splash_from_128_queries(monkeypatch):
    on_backend(monkeypatch, "tpu")
    for dtype in (jnp.bfloat16, jnp.float32):
        assert route_of(monkeypatch, *qkv(t=128, dtype=dtype), is_causal=True) == "splash"
    ids = jnp.zeros((2, 128), jnp.int32)
    options = dict(query_segment_ids=ids, local_window_size=(16, 16), scale=0.5)
    assert route_of(monkeypatch, *qkv(t=128), **options) == "splash"
    # Short query blocks: splash would pad them to 128; jattn's dense path instead.
    assert _routing.SPLASH_MIN_Q_LEN == 128
    assert route_of(monkeypatch, *qkv(t=127), is_causal=True) == "dense"
    q, _, _ = qkv(t=1)
    _, k, v = qkv(t=512)
    assert route_of(monkeypatch, q, k, v) == "dense"  # one-query decoding


@pytest.mark.parametrize("option", FALLBACK_OPTIONS)
def test_tpu_falls_back_for_what_splash_lacks(option, monkeypatch):
    on_backend(monkeypatch, "tpu")
    q, k, v = qkv(t=128)
    options = dict(FALLBACK_OPTIONS[option])
    for name in ("mask", "bias"):
        if name in options:
            options[name] = jnp.ones((128, 128), options[name].dtype)
    expected = "pallas" if option in PALLAS_TAKES else "dense"  # jattn's Mosaic kernel
    assert route_of(monkeypatch, q, k, v, is_causal=True, **options) == expected


def test_tpu_falls_back_for_float16(monkeypatch):
    on_backend(monkeypatch, "tpu")
    assert route_of(monkeypatch, *qkv(t=128, dtype=jnp.float16)) == "dense"
    long = qkv(t=4096, heads=1, kv_heads=1, batch=1, dim=8, dtype=jnp.float16)
    assert route_of(monkeypatch, *long) == "blockwise"


def test_cpu_rule_and_never_interprets(monkeypatch, interpret_mode):
    """On CPU: jattn's fused kernel (where it was built) from 128 keys for the calls it
    takes; else dense below 256 tokens, blockwise from there; no Pallas kernel even in
    interpret mode."""
    on_backend(monkeypatch, "cpu")
    assert _routing.AUTO_MIN_LEN == 256 and _routing.CPU_FUSED_MIN_KV_LEN == 128
    fused = "cpu_fused" if kernels.adapter("cpu_fused").available("cpu") else None
    assert route_of(monkeypatch, *qkv(t=127), is_causal=True) == "dense"
    assert route_of(monkeypatch, *qkv(t=128), is_causal=True) == (fused or "dense")
    assert route_of(monkeypatch, *qkv(t=256), is_causal=True) == (fused or "blockwise")
    assert route_of(monkeypatch, *qkv(t=255), bias=jnp.zeros((255, 255))) == (fused or "dense")
    assert route_of(monkeypatch, *qkv(t=256), bias=jnp.zeros((256, 256))) == (fused or "blockwise")
    # a mask_mod callable without a block mask cannot enter C++: XLA's paths
    assert route_of(monkeypatch, *qkv(t=256), mask_mod=mods.causal()) == "blockwise"
    # Asked for by name, the Pallas kernels run there in interpret mode.
    assert route_of(monkeypatch, *qkv(), implementation="splash") == "splash"


def test_cpu_rule_for_few_queries(monkeypatch):
    """Fewer than CPU_FUSED_FEW_QUERIES queries take the fused kernel from
    CPU_FUSED_MIN_KV_LEN keys, as longer calls; under jax.grad they take dense (the
    kernel's backward on so few queries was measured slower), whatever the keys."""
    on_backend(monkeypatch, "cpu")
    if not kernels.adapter("cpu_fused").available("cpu"):
        pytest.skip("the fused CPU kernel was not built")
    few = _routing.CPU_FUSED_FEW_QUERIES
    assert few == 16
    k = qkv(t=32, dtype=jnp.float32)[1]
    long_k = qkv(t=300, dtype=jnp.float32)[1]
    for t_q in (1, few - 1):
        q = qkv(t=t_q, dtype=jnp.float32)[0]
        assert route_of(monkeypatch, q, k, k) == "dense"
        assert route_of(monkeypatch, q, long_k, long_k) == "cpu_fused"
        names = []

        def loss(x, names=names):
            names.append(route_of(monkeypatch, x, long_k, long_k))
            return jnp.sum(x)

        jax.grad(loss)(q)
        assert names == ["dense"]
    # from CPU_FUSED_FEW_QUERIES queries on, differentiated calls take the kernel too
    q = qkv(t=few, dtype=jnp.float32)[0]
    names = []
    jax.grad(lambda x: names.append(route_of(monkeypatch, x, long_k, long_k)) or jnp.sum(x))(q)
    assert names == ["cpu_fused"]


def test_the_table_lists_every_backend_and_ends_with_dense():
    assert set(_routing.AUTO) == {"cpu", "gpu", "tpu"}
    for candidates in _routing.AUTO.values():
        assert candidates[-1] == "dense"
        assert set(candidates) <= set(_routing.ROUTES)
    assert "pallas_triton" not in _routing.AUTO["gpu"]
    assert set(_routing.ROUTES) == {"dense", "blockwise", *kernels.KERNELS}


# ----------------------------------------------------------------------------------------
# Routed calls that run: the automatic rule's kernel is the one that computes
# ----------------------------------------------------------------------------------------


def count_calls(monkeypatch, module, **overrides) -> list:
    """Counts ``module.attention`` calls, passing ``overrides`` (e.g. interpret=True) to it."""
    calls, real = [], module.attention

    def attention(*args, **kwargs):
        calls.append(1)
        return real(*args, **{**kwargs, **overrides})

    monkeypatch.setattr(module, "attention", attention)
    return calls


def test_gpu_automatic_call_runs_cudnn_with_xla_standing_in(monkeypatch):
    """bfloat16 causal GQA with lengths on a (simulated) GPU: cuDNN's adapter computes it."""
    on_backend(monkeypatch, "gpu")
    real = jax.nn.dot_product_attention

    def xla_instead(*args, implementation=None, **kwargs):
        assert implementation == "cudnn"
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", xla_instead)
    calls = count_calls(monkeypatch, cudnn_adapter)
    q, k, v = qkv()
    options = dict(is_causal=True, key_value_seq_lengths=jnp.array([0, 40]))

    def loss(q, k, v, implementation):
        out = jattn.dot_product_attention(q, k, v, implementation=implementation, **options)
        return out.astype(jnp.float32).sum(), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (dq, dk, dv), out = grad(q, k, v, None)
    assert calls == [1]
    (dq_ref, dk_ref, dv_ref), ref = grad(q, k, v, "dense")
    for name, a, b in [
        ("out", out, ref),
        ("dq", dq, dq_ref),
        ("dk", dk, dk_ref),
        ("dv", dv, dv_ref),
    ]:
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=3e-2, rtol=3e-2, err_msg=name)
    assert not np.asarray(out[0]).any()  # the first row has no key: zeros


def test_tpu_automatic_call_runs_splash(monkeypatch):
    """A (simulated) TPU's automatic call runs splash (in interpret mode here) = dense."""
    on_backend(monkeypatch, "tpu")
    calls = count_calls(monkeypatch, splash_adapter, interpret=True)
    q, k, v = qkv(t=128, batch=1, dtype=jnp.float32)
    out = jattn.dot_product_attention(q, k, v, is_causal=True)
    assert calls == [1]
    ref = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="dense")
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# Explicit names: interpret mode, and every refusal
# ----------------------------------------------------------------------------------------

PALLAS = ("splash", "pallas_triton")


@pytest.mark.parametrize("name", PALLAS)
def test_pallas_kernels_need_their_device_or_interpret_mode(name, monkeypatch):
    on_backend(monkeypatch, "cpu")
    q, k, v = qkv(dtype=jnp.float32)
    with pytest.raises(ValueError, match="set JATTN_PALLAS_INTERPRET=1 to run it") as error:
        jattn.dot_product_attention(q, k, v, implementation=name)
    assert "runs on " + ("TPU" if name == "splash" else "GPU") + " only" in str(error.value)
    monkeypatch.setenv(kernels.INTERPRET_ENV, "1")
    assert route_of(monkeypatch, q, k, v, implementation=name) == name


def test_cudnn_needs_an_nvidia_gpu(monkeypatch, interpret_mode):
    on_backend(monkeypatch, "cpu")
    with pytest.raises(ValueError, match=r"it needs an NVIDIA GPU of compute capability >= 8\.0"):
        jattn.dot_product_attention(*qkv(), implementation="cudnn")


RANGE = jnp.arange(2, dtype=jnp.int32)
# (implementation, backend, input changes, options, message fragment, what to use instead)
REFUSALS = [
    ("splash", "cpu", {}, dict(dropout_rate=0.1, dropout_rng=KEY), "dropout (jattn's", "'blockwise' or 'dense'"),
    ("pallas_triton", "cpu", {}, dict(dropout_rate=0.1, dropout_rng=KEY), "dropout", "'blockwise' or 'dense'"),
    ("splash", "cpu", {}, dict(mask=MASK), "a mask array (only causal", "'blockwise' or 'dense'"),
    ("splash", "cpu", {}, dict(bias=jnp.zeros((64, 64))), "a bias array", "'blockwise' or 'dense'"),
    ("pallas_triton", "cpu", {}, dict(return_weights=True), "return_weights=True and module=", "or 'dense'."),
    ("splash", "cpu", {}, einsum_hooks(), "flax's einsum hooks", "or 'dense'."),
    ("pallas_triton", "cpu", {}, dict(scale="traced"), "a traced scale", "or 'dense'."),
    ("cudnn", "gpu", {}, dict(scale="traced"), "a traced scale", "or 'dense'."),
    ("splash", "cpu", dict(dtype=jnp.float16), {}, "dtype float16 (splash computes in bfloat16 or float32)", "'blockwise'"),
    ("cudnn", "gpu", dict(dtype=jnp.float32), {}, "dtype float32 (cuDNN computes in bfloat16 or float16)", "'blockwise'"),
    ("cudnn", "gpu", dict(dim=36), {}, "head_dim 36 (cuDNN takes multiples of 8 up to 256", "'blockwise'"),
    ("cudnn", "gpu", {}, dict(query_segment_ids=jnp.zeros((2, 64), jnp.int32)), "segment ids", "'blockwise'"),
    ("splash", "cpu", {}, dict(return_residual=True), "return_residual=True (splash does not return its log-sum-exp)", "'blockwise'"),
    ("cudnn", "gpu", {}, dict(return_residual=True), "return_residual=True (cudnn does not return its log-sum-exp)", "'blockwise'"),
    ("splash", "cpu", {}, dict(precision="highest"), "precision='highest' (the kernel picks its own matmul precision)", "'blockwise'"),
    ("pallas_triton", "cpu", {}, dict(local_window_size=(4, 4)), "local_window_size", "'blockwise'"),
    ("pallas_triton", "cpu", {}, dict(query_segment_ids=jnp.zeros((2, 64), jnp.int32), key_value_segment_ids=jnp.zeros((2, 64), jnp.int32)), "separate key_value_segment_ids", "'blockwise'"),
    ("pallas_triton", "cpu", {}, dict(query_seq_lengths=RANGE), "", ""),  # accepted
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "backend", "inputs", "options", "reason", "instead"),
    REFUSALS,
    ids=[f"{r[0]}-{r[4][:24] or 'accepted'}" for r in REFUSALS],
)
def test_explicit_kernel_refusals(name, backend, inputs, options, reason, instead, monkeypatch):
    """The whole message: which option the kernel lacks, and what to use instead."""
    on_backend(monkeypatch, backend)
    monkeypatch.setenv(kernels.INTERPRET_ENV, "1")  # past the device check on CPU
    q, k, v = qkv(**inputs)
    if options.get("scale") == "traced":

        def call(scale):
            return jattn.dot_product_attention(q, k, v, scale=scale, implementation=name)

        def attempt():
            jax.jit(call)(0.5)
    else:

        def attempt():
            route_of(monkeypatch, q, k, v, implementation=name, **options)

    if not reason:
        attempt()
        return
    with pytest.raises(ValueError) as error:
        attempt()
    message = str(error.value)
    assert message.startswith(f"implementation={name!r} cannot be used here: {reason}"), message
    assert message.endswith(".") and instead in message.split(". Use ")[-1], message
    assert "implementation=None (automatic" in message


def test_self_attention_segment_ids_are_one_array_for_pallas_triton(monkeypatch, interpret_mode):
    """One id array (or the same array passed twice) is what the Triton kernel takes."""
    on_backend(monkeypatch, "cpu")
    q, k, v = qkv(dtype=jnp.float32)
    ids = jnp.zeros((2, 64), jnp.int32)
    for options in (
        dict(query_segment_ids=ids),
        dict(query_segment_ids=ids, key_value_segment_ids=ids),
    ):
        assert (
            route_of(monkeypatch, q, k, v, implementation="pallas_triton", **options)
            == "pallas_triton"
        )


def test_jattn_paths_name_their_alternative():
    q, k, v = qkv(dtype=jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"\. Use implementation=None \(automatic: the fastest path that can\) or 'dense'\.$",
    ):
        jattn.dot_product_attention(q, k, v, return_weights=True, implementation="blockwise")


# ----------------------------------------------------------------------------------------
# The modules and the KV cache route through the same table
# ----------------------------------------------------------------------------------------


def decode_step(implementation):
    """One KV-cache decoding step (prefill 5 tokens, then attend one) with ``implementation``.

    Jitted afresh each time (one compile instead of many eager ops; a new trace routes anew).
    """

    def step(q, k, v):
        cache = kvcache.init_cache(2, 8, 2, 32)
        _, cache = kvcache.update_and_attend(cache, q[:, :5], k[:, :5], v[:, :5])
        out, _ = kvcache.update_and_attend(
            cache, q[:, 5:], k[:, 5:], v[:, 5:], implementation=implementation
        )
        return out

    return jax.jit(step)(*qkv(t=6, dtype=jnp.float32))


def test_decoding_falls_back_automatically(monkeypatch):
    """The cache's decode mask is a mask array: every kernel refuses it, jattn's paths run."""
    expected = decode_step("dense")
    reference = jattn.dot_product_attention(*qkv(t=6, dtype=jnp.float32), is_causal=True)
    np.testing.assert_allclose(expected, reference[:, 5:], atol=1e-5)
    chosen, real = [], _routing.choose
    monkeypatch.setattr(_routing, "choose", lambda *a: chosen.append(real(*a)) or chosen[-1])
    for backend in ("tpu", "gpu"):
        on_backend(monkeypatch, backend)
        chosen.clear()
        np.testing.assert_allclose(decode_step(None), expected, atol=1e-6)
        assert chosen == ["dense", "dense"], (backend, chosen)  # prefill and step


@pytest.mark.parametrize("name", PALLAS)
def test_decoding_with_an_explicit_kernel_is_refused(name, interpret_mode):
    with pytest.raises(
        ValueError, match=f"implementation='{name}' cannot be used here: a mask array"
    ):
        decode_step(name)


def test_modules_route_through_the_same_table(interpret_mode):
    """NNX MultiHeadAttention(attention_implementation='splash') runs splash; decoding is refused."""
    x = jax.random.normal(jax.random.key(1), (2, 8, 6))

    def module(implementation):
        return jn.MultiHeadAttention(
            6, 8, 8, 0.0, 2, attention_implementation=implementation, rngs=nnx.Rngs(0)
        )

    forward = nnx.jit(lambda m, x: m(x))  # one compile, not many eager ops
    splash = module("splash")
    np.testing.assert_allclose(forward(splash, x), forward(module("dense"), x), atol=1e-5)
    splash.init_cache((2, 8, 6))
    with pytest.raises(
        ValueError, match="implementation='splash' cannot be used here: a mask array"
    ):
        splash(x[:, :3], decode=True)


def test_forward_mode_autodiff_keeps_the_kernels_out(monkeypatch):
    # Every kernel has a custom VJP: under jax.jvp the automatic rule must skip cuDNN (and
    # blockwise) for the dense path, which supports forward mode.
    on_backend(monkeypatch, "gpu")
    q, k, v = qkv()
    names = []

    def f(x):
        names.append(route_of(monkeypatch, x, k, v, is_causal=True))
        return x

    jax.jvp(f, (q,), (q,))
    assert names == ["dense"]
    assert route_of(monkeypatch, q, k, v, is_causal=True) == "cudnn"


def test_splash_takes_a_bare_softcap_and_kernels_refuse_other_modifiers(
    monkeypatch, interpret_mode
):
    q, k, v = qkv(t=128, dtype=jnp.float32)
    cap = mods.softcap(2.0)
    got = jattn.dot_product_attention(
        q, k, v, is_causal=True, score_mod=cap, implementation="splash"
    )
    ref = jattn.dot_product_attention(
        q, k, v, is_causal=True, score_mod=cap, implementation="dense"
    )
    np.testing.assert_allclose(got, ref, atol=2e-5)
    slopes = mods.alibi_slopes(q.shape[-2])
    with pytest.raises(ValueError, match=r"splash does not take score_mod \(only a bare"):
        jattn.dot_product_attention(q, k, v, score_mod=mods.alibi(slopes), implementation="splash")
    with pytest.raises(ValueError, match="splash does not take sinks"):
        sinks = jnp.zeros(q.shape[-2])
        jattn.dot_product_attention(q, k, v, score_mod=cap, sinks=sinks, implementation="splash")
    on_backend(monkeypatch, "tpu")
    assert route_of(monkeypatch, q, k, v, is_causal=True, score_mod=cap) == "splash"
    assert route_of(monkeypatch, q, k, v, is_causal=True, mask_mod=mods.causal()) == "pallas"
    on_backend(monkeypatch, "gpu")
    bf = qkv(t=128)
    assert route_of(monkeypatch, *bf, is_causal=True) == "cudnn"
    assert route_of(monkeypatch, *bf, is_causal=True, score_mod=cap) == "pallas"


# ----------------------------------------------------------------------------------------
# The query every adapter reads, built once by the routing
# ----------------------------------------------------------------------------------------


def test_kernel_query_describes_the_call():
    """``kernel_query`` turns a validated call into the adapters' static question."""
    from jattn._call import DenseExtras, Operands, Settings

    q, k, _ = qkv()
    v = jnp.zeros((*k.shape[:-1], 16), k.dtype)
    ids = jnp.zeros((2, 64), jnp.int32)
    ops = Operands(scale=0.5, mask=MASK, q_lengths=RANGE, q_segments=ids, kv_segments=ids)
    settings = Settings(is_causal=True, window=(4, 0), score_mod=mods.softcap(3.0))
    query = _routing.kernel_query(
        q, k, v, ops, settings, DenseExtras(), platform="tpu", interpret=False
    )
    assert isinstance(query, kernels.KernelQuery)
    assert (query.platform, query.interpret) == ("tpu", False)
    assert query.q_shape == q.shape and query.kv_shape == k.shape and query.v_head_dim == 16
    assert query.dtype == q.dtype and query.is_causal and query.window == (4, 0)
    assert query.has_mask and not query.has_bias and query.has_lengths and query.has_segments
    assert not query.separate_kv_segments  # one array for queries and keys
    assert not query.dropout and not query.return_weights and not query.return_residual
    assert query.score_mod == mods.softcap(3.0) and query.mask_mod is None
    assert not query.sinks and not query.block_mask and not query.traced_scale
    assert query.default_precision and query.needs_dense is None
    other = _routing.kernel_query(
        q, k, v, ops._replace(kv_segments=ids + 1), Settings(precision="highest"),
        DenseExtras(return_weights=True), platform="cpu", interpret=True,
    )  # fmt: skip
    assert other.separate_kv_segments and other.return_weights
    assert not other.default_precision and not other.is_causal


def test_lowering_platforms():
    assert [_routing.lowering_platform(b) for b in ("cpu", "tpu")] == ["cpu", "tpu"]
    if jax.default_backend() != "gpu":  # no GPU answers: CUDA, the GPU most have
        assert _routing.lowering_platform("gpu") == "cuda"
    else:
        assert _routing.lowering_platform("gpu") in ("cuda", "rocm")


# ----------------------------------------------------------------------------------------
# Explicitly sharded operands (2 fake devices, in a process of their own)
# ----------------------------------------------------------------------------------------

EXPLICIT_CHECKS = Path(__file__).with_name("_explicit_mesh_checks.py")
SHARDED_SPECS = {"batch": ["b", None, None, None], "heads": [None, None, "b", None]}


# The kernel by name on each device's share of the operands (_explicit_mesh_checks.py's
# per-device cases, each about 1.5 s): these in the default leg, in the attention section;
PER_DEVICE_CASES = [
    "bias per row",
    "mask and lengths",
    "dropout",
    "alibi",
    "document block mask",
    "one key/value head",
]
# these in the slow leg, in a section of their own.
PER_DEVICE_SLOW = [
    "bias shared by the rows",
    "sinks",
    "two segment arrays",
    "log-sum-exp",
    "dropout shared by the heads",
    "dropout shared by the rows",
    "softcap",
    "block mask",
]


@pytest.fixture(scope="module")
def explicit() -> dict:
    """tests/_explicit_mesh_checks.py: causal, segment-masked GQA attention at T = 256
    on a ('b',) mesh of explicit axes, against a float64 numpy reference."""
    return run_checks(EXPLICIT_CHECKS, "attention", *PER_DEVICE_CASES)


@pytest.fixture(scope="module")
def explicit_slow() -> dict:
    """tests/_explicit_mesh_checks.py's per-device cases of the slow leg (about 12 s)."""
    return run_checks(EXPLICIT_CHECKS, "per_device", *PER_DEVICE_SLOW)


@pytest.mark.parametrize("sharded", list(SHARDED_SPECS))
@pytest.mark.parametrize("how", ["auto", "blockwise", "pallas"])
def test_explicitly_sharded_operands_keep_their_sharding(explicit, sharded, how):
    """The kernel ran on gathered arrays, and its replicated gradients failed jax's type
    check; blockwise's tile loops failed on the sharded types. Now the automatic rule takes
    the fused CPU kernel on each device's rows or heads (jax.shard_map), blockwise runs with
    the mesh's axes made automatic inside, jattn's Pallas kernel (interpret mode) runs per
    device too, and the results and gradients keep the operands' specs."""
    assert explicit["axis_types"] == ["AxisType.Explicit"]
    got = explicit[sharded][how]
    kernel = "cpu_fused" if explicit["built"] else "blockwise"
    assert got["routes"] == [{"auto": kernel}.get(how, how)]
    assert got["err"] < 1e-5 and got["grad_err"] < 1e-4, got
    assert got["spec"] == got["grad_spec"] == SHARDED_SPECS[sharded]


@pytest.mark.parametrize("sharded", list(SHARDED_SPECS))
def test_each_device_computes_its_own_rows_or_heads(explicit, sharded):
    """The automatic rule's forward and gradient move nothing between devices but, on
    blockwise, the tile schedule (bool flags): no split of the heads across the sharded
    axis, no gathered operands."""
    assert set(explicit[sharded]["collectives"]) <= {"pred"}


@pytest.mark.parametrize(
    "case", [*PER_DEVICE_CASES, *(pytest.param(c, marks=pytest.mark.slow) for c in PER_DEVICE_SLOW)]
)
@pytest.mark.parametrize("sharded", list(SHARDED_SPECS))
def test_the_kernel_runs_on_each_devices_share_of_every_operand(request, sharded, case):
    """cpu_fused by name on batch- or head-sharded queries, with each operand it reads per
    row or per head laid out to match (a bias per row or shared by the rows, a mask with
    query and key lengths, sinks, separate query/key segment ids, the log-sum-exp, one
    key/value head for every query head): output and every gradient (q, k, v, bias, sinks,
    ALiBi's slopes; a shared operand's summed over the devices) equal the unsharded dense
    call's. Dropout (its mask keyed by the global batch and head indices, also shared by
    the heads or the rows) drops what the unsharded call drops with the same key: each
    device is given its rows' numbers in the whole call; ALiBi's slopes go with the heads;
    a block mask whose mask_mod reads no batch or head index is one state for all; a
    block mask of packed documents per row takes the device's rows of tiles and of segment
    ids."""
    checks = request.getfixturevalue("explicit_slow" if case in PER_DEVICE_SLOW else "explicit")
    if not checks["built"]:
        pytest.skip("the fused CPU kernel is not built")
    got = checks[sharded]["per_device"][case]
    assert got["routes"] == ["cpu_fused"]
    assert got["err"] < 1e-5, got
    assert got["spec"] == SHARDED_SPECS[sharded]


@pytest.fixture(scope="module")
def pallas_per_device() -> dict:
    """tests/_explicit_mesh_checks.py's Pallas per-device cases (interpret mode, ~16 s)."""
    return run_checks(EXPLICIT_CHECKS, "pallas_per_device")


@pytest.mark.slow  # jattn's Pallas kernel interpreted on 2 devices (about 16 s of CPU)
@pytest.mark.parametrize(
    "case",
    ["dropout", "alibi", "score_mod", "mask_mod", "relative_bias", "document", "prefix_lm"],
)
@pytest.mark.parametrize("sharded", list(SHARDED_SPECS))
def test_the_pallas_kernel_runs_per_device_with_dropout_and_modifiers(
    pallas_per_device, sharded, case
):
    """jattn's Pallas kernel (interpret mode) by name, batch- or head-sharded: the same
    dropout mask and ALiBi slopes as the unsharded dense call, a score_mod and a mask_mod
    of the user's that read no batch or head index, and jattn.mods' modifiers that read
    arrays by row or head (a T5 relative bias, packed documents, prefix lengths: each
    device is given its share of them); output and gradients."""
    got = pallas_per_device[sharded][case]
    assert got["routes"] == ["pallas"]
    assert got["err"] < 1e-5, got
    assert got["spec"] == SHARDED_SPECS[sharded]


REFUSALS = {  # the case's key suffix: (kernel named, the reason given)
    "": ("cpu_fused", "a score_mod that reads its batch or head index would see a device's own"),
    "_mask_mod": ("pallas", "a mask_mod that reads its batch or head index would see a device's"),
    "_block_mask": ("cpu_fused", "a mask_mod that reads its batch or head index would see"),
}


@pytest.mark.parametrize("option", list(REFUSALS))
@pytest.mark.parametrize("sharded", list(SHARDED_SPECS))
def test_the_kernel_refuses_sharded_calls_keyed_by_global_indices(explicit, sharded, option):
    """A score_mod or mask_mod of the user's that reads its batch or head index (also as a
    block mask's, with tiles per head) would see a device's own indices, not the global
    ones: the kernel by name refuses, saying why."""
    message = explicit[sharded][f"refused{option}"]
    kernel, reason = REFUSALS[option]
    assert message.startswith(f"implementation='{kernel}' cannot be used here")
    assert "sharded over mesh axes ('b',)" in message and "jax.shard_map" in message
    assert reason in message and "'blockwise' or 'dense'" in message


@pytest.mark.parametrize("case", ["cpu_fused", "shard_map"])
def test_block_masks_built_under_jit_run_per_device(explicit, case):
    """A block mask built under jax.jit (a traced state), batch-sharded: cpu_fused by name
    runs on each device's share; and inside a jax.shard_map of the user's on a mesh of
    explicit axes, where rebuilding the state on the host raised an internal jax error."""
    if not explicit["built"]:
        pytest.skip("the fused CPU kernel is not built")
    got = explicit["traced_block_masks"][case]
    assert got["routes"] == ["cpu_fused"] and got["err"] < 1e-5, got


def test_a_modifier_closing_over_traced_arrays_is_not_taken_per_device(explicit):
    """jax.shard_map cannot close over arrays traced by the enclosing jit or placed on a
    mesh of explicit axes (the automatic rule raised on the latter): the automatic rule
    takes another path, with the right answer, and the kernel by name says why."""
    if not explicit["built"]:
        pytest.skip("the fused CPU kernel is not built")
    got = explicit["traced_block_masks"]
    for case in ("closure", "placed"):  # a traced array; a concrete one placed on the mesh
        assert "cpu_fused" not in got[case]["routes"] and got[case]["err"] < 1e-5, got[case]
    assert "a mask_mod closes over arrays (pass them as segment ids" in got["closure_refused"]


@pytest.fixture(scope="module")
def placed_modifiers() -> dict:
    """tests/_explicit_mesh_checks.py's modifiers reading arrays placed on the mesh (~20 s)."""
    return run_checks(EXPLICIT_CHECKS, "placed_modifiers")


@pytest.mark.slow  # a process of its own: blockwise compiled on 2 devices, forward and gradient
@pytest.mark.parametrize(
    "case, route",
    [
        ("alibi blockwise", "blockwise"),
        ("composed auto", None),
        ("document auto", None),
        ("document blockwise", "blockwise"),
        ("prefix blockwise", "blockwise"),
        ("closure auto", "dense"),
        ("document without set_mesh", None),
    ],
)
def test_modifiers_reading_arrays_placed_on_the_mesh(placed_modifiers, case, route):
    """Batch-sharded queries at blockwise's lengths with jattn.mods' modifiers whose arrays
    are placed on the mesh (ALiBi's slopes replicated; segment ids and prefix lengths over
    the batch): blockwise raised jax's "Context mesh ... should match", and the document
    and prefix masks jax's ShardingTypeError. Now their output and gradients (q; the
    slopes) equal the unsharded dense call's, also called with no jax.set_mesh; a lambda
    closing over a placed array goes to dense, and blockwise by name says why."""
    got = placed_modifiers[case]
    if route is not None:
        assert got["routes"] == [route], got
    assert got["err"] < 2e-5 and got["spec"] == ["b", None, None, None], got
    refused = placed_modifiers["closure refused"]
    assert refused.startswith("implementation='blockwise' cannot be used here: a mask_mod")
    assert "closes over an array placed on a mesh of explicit axes" in refused


def test_rows_of_a_flattened_batch_split_past_its_first_axis_are_refused(explicit):
    """Two batch axes, the second sharded: a block mask's tiles per row (of the flattened
    batch) would not split into each device's rows; cpu_fused by name says so, and the
    automatic rule takes a path that partitions itself, with the right answer."""
    if not explicit["built"]:
        pytest.skip("the fused CPU kernel is not built")
    got = explicit["rows_past_first"]
    assert "cpu_fused" not in got["routes"] and got["err"] < 1e-5, got
    assert "rows (flattened batch) would split across batch axes past the first" in got["refused"]


@pytest.mark.slow  # in the placed_modifiers section's process
@pytest.mark.parametrize("sharded", list(SHARDED_SPECS))
@pytest.mark.parametrize("option", ["dropout", "alibi"])
def test_sharded_blockwise_equals_unsharded_with_options(placed_modifiers, sharded, option):
    """The same dropout mask from the same key, and ALiBi's slopes by the global head."""
    assert placed_modifiers[f"options {sharded}"][option] < 1e-6


def test_the_kernel_refuses_key_value_heads_split_across_a_group(explicit):
    """6 query heads over 3 key/value heads, heads over 2 devices: a device's query heads
    would need a key/value head another device holds."""
    if not explicit["built"]:
        pytest.skip("the fused CPU kernel is not built")
    assert "3 key/value heads cannot follow the query heads over 2" in explicit["split_groups"]


@pytest.mark.parametrize("sharded", list(SHARDED_SPECS))
def test_an_automatic_mesh_still_takes_the_kernel(explicit, sharded):
    """No sharding in the types: the rule cannot see it, and the kernel's answer is right."""
    got = explicit[sharded]["auto_mesh"]
    assert got["routes"] == (["cpu_fused"] if explicit["built"] else ["blockwise"])
    assert got["err"] < 1e-5 and got["grad_err"] < 1e-4, got


def test_sharded_operands_need_no_set_mesh(explicit):
    """Operands placed with jax.device_put on an explicit mesh, no jax.set_mesh: the
    automatic rule's call and gradient take the mesh from their types."""
    got = explicit["without_set_mesh"]
    assert got["routes"] == ["cpu_fused" if explicit["built"] else "blockwise"]
    assert got["err"] < 1e-5 and got["grad_err"] < 1e-4, got
    assert got["spec"] == got["grad_spec"] == SHARDED_SPECS["batch"]


def test_the_kernel_runs_inside_shard_map_on_an_explicit_mesh(explicit):
    if not explicit["built"]:
        pytest.skip("the fused CPU kernel is not built")
    got = explicit["shard_map"]
    assert got["routes"] == ["cpu_fused"]
    assert got["err"] < 1e-5 and got["grad_err"] < 1e-4, got
    assert got["spec"] == got["grad_spec"] == SHARDED_SPECS["batch"]


@pytest.mark.parametrize("case", ["module", "module_dropout"])
def test_tensor_parallel_module_gradient_on_an_explicit_mesh(explicit, case):
    """The NNX module, heads over 'b' (model_axis), T = 256, also training with dropout:
    its jitted gradient equals the unsharded module's (it failed jax's type check through
    the kernel; with dropout the kernel now drops what the unsharded module drops)."""
    assert explicit[case]["routes"] == ["cpu_fused" if explicit["built"] else "blockwise"]
    assert explicit[case]["err"] < 1e-5, explicit[case]
