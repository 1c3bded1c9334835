"""The fused CPU kernel (``implementation='cpu_fused'``, jattn.kernels.cpu) against references.

Every option it takes is checked through the public entry, forward (output and
log-sum-exp) and backward (dq, dk, dv, and the sinks' gradient), against the float64 numpy
reference and VJP of tests/test_kernels.py and against jattn's dense path; plus boundary
lengths around its tiles, determinism (run to run and across thread counts), jit/vmap,
the other instruction-set builds (in subprocesses) and its routing and refusals; then bias
and mask arrays in their broadcast shapes (the bias's gradient in its own shape, against
a float64 reference of this file), block masks, split-KV decoding and the KV cache.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from functools import partial

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from reference import np_flex_attention
from test_kernels import (
    CASES,
    Case,
    assert_close,
    check_results,
    lengths,
    make_inputs,
    np_attention_vjp,
    np_mask,
    public,
    tolerance,
)

import jattn
from jattn import _routing, kernels
from jattn.kernels.cpu import _library
from jattn.kernels.cpu import adapter as cpu_adapter

BUILT = _library.library() is not None
needs_kernel = pytest.mark.skipif(not BUILT, reason=f"fused CPU kernel {_library.status()}")
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


def test_kernel_is_built_where_a_compiler_is():
    """A failed build must not hide behind the skips: with a C++ compiler, it is on."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        assert _library.status().startswith("off: "), _library.status()
        pytest.skip("no C++ compiler here: the kernel is off and says why")
    assert BUILT, _library.status()
    assert _library.status().startswith("on: ")
    assert cpu_adapter.available("cpu") and not cpu_adapter.available("gpu")


def d_lse_of(case: Case):
    rng = np.random.default_rng(7)
    return jnp.asarray(rng.standard_normal((*case.batch, case.h, case.tq)), jnp.float32)


@needs_kernel
@pytest.mark.parametrize("case", [c for c in CASES if c.softcap is None], ids=str)
def test_conformance(case):
    """Output, lse and gradients (with an lse cotangent) against float64 and dense."""
    d_lse = d_lse_of(case)
    out, lse, grads = public(case, "cpu_fused", d_lse)
    check_results(case, out, lse, grads, d_lse)


def fused_call(case: Case, *, softcap=None, sinks=None, implementation="cpu_fused"):
    """``(out, lse [.., H, Tq], (dq, dk, dv, d_sinks))`` of the public call with modifiers."""
    q, k, v, d_out, q_ids, kv_ids = make_inputs(case)
    d_lse = d_lse_of(case)
    score_mod = None if softcap is None else jattn.mods.softcap(softcap)

    def f(q, k, v, sinks):
        out, residual = jattn.dot_product_attention(
            q, k, v, is_causal=case.causal, local_window_size=case.window,
            query_seq_lengths=lengths(case, "q_lengths"),
            key_value_seq_lengths=lengths(case, "kv_lengths"),
            query_segment_ids=q_ids, key_value_segment_ids=kv_ids, score_mod=score_mod,
            sinks=sinks, return_residual=True, implementation=implementation,
        )  # fmt: skip
        return out, jnp.swapaxes(residual, -1, -2)

    @jax.jit
    def run(q, k, v, sinks):
        (out, lse), vjp = jax.vjp(f, q, k, v, sinks)
        return out, lse, vjp((d_out, d_lse))

    return run(q, k, v, sinks)


@needs_kernel
@pytest.mark.parametrize("case", [c for c in CASES if c.softcap is not None], ids=str)
def test_softcap(case):
    out, lse, grads = fused_call(case, softcap=case.softcap)
    check_results(case, out, lse, grads[:3], d_lse_of(case))


@needs_kernel
@pytest.mark.parametrize(
    "case",
    [
        Case("sinks_causal", causal=True, kv_lengths=(40, 0)),  # rows of the sink alone
        Case("sinks_window", tq=70, tk=90, window=(9, 4), segments="cross"),
    ],
    ids=str,
)
@pytest.mark.parametrize("second", [-1.0, -np.inf], ids=["finite", "a_head_without"])
def test_sinks_and_their_gradient(case, second):
    """Sinks: float64 FlexAttention reference for out/lse, dense path for every gradient.
    A -inf sink is a head without one: in the rows that see no key its gradient was NaN."""
    sinks = jnp.asarray([0.5, second, 2.0, 0.0], jnp.float32)
    out, lse, grads = fused_call(case, sinks=sinks)
    q, k, v, _, q_ids, kv_ids = make_inputs(case)
    mask = np_mask(case, q_ids, kv_ids).reshape(-1, 1, case.tq, case.tk)
    flat = [np.asarray(x).reshape(-1, *x.shape[-3:]) for x in (q, k, v)]
    ref_out, _, ref_lse = np_flex_attention(*flat, mask=mask, sinks=np.asarray(sinks))
    assert_close(np.asarray(out).reshape(ref_out.shape), ref_out, 1e-4, "out vs float64")
    lse = np.asarray(lse).reshape(ref_lse.shape)
    seen = np.isfinite(ref_lse)  # -inf: a row without keys in a head without a sink
    np.testing.assert_array_equal(lse[~seen], ref_lse[~seen])
    assert_close(lse[seen], ref_lse[seen], 1e-4, "lse vs float64")
    dense = fused_call(case, sinks=sinks, implementation="dense")
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, dense[2], strict=True):
        assert_close(got, want, 1e-4, f"{name} vs dense")


@needs_kernel
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("batch, kh", [(2, 2), (8, 2)], ids=["two_pass", "single_pass"])
def test_alibi_and_its_slopes_gradient(symmetric, batch, kh):
    """ALiBi against the float64 FlexAttention reference (out, lse) and dense (every
    gradient, the slopes' included), in both backward modes."""
    case = Case("alibi", batch=(batch,), tq=130, tk=150, h=4, kh=kh, d=32, window=(60, 10),
                kv_lengths=(150, 40) * (batch // 2))  # fmt: skip
    q, k, v, d_out, q_ids, kv_ids = make_inputs(case)
    slopes = jattn.mods.alibi_slopes(4)

    def call(impl):
        def f(q, k, v, slopes):
            out, res = jattn.dot_product_attention(
                q, k, v, local_window_size=case.window,
                key_value_seq_lengths=lengths(case, "kv_lengths"), return_residual=True,
                score_mod=jattn.mods.alibi(slopes, symmetric=symmetric), implementation=impl,
            )  # fmt: skip
            return out, jnp.swapaxes(res, -1, -2)

        (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v, slopes)
        return out, lse, vjp((d_out, d_lse_of(case)))

    out, lse, grads = call("cpu_fused")
    sl = np.asarray(slopes, np.float64)

    def score(s, b, h, qi, ki):
        dist = -np.abs(ki - qi) if symmetric else ki - qi
        return s + sl[h] * dist

    mask = np_mask(case, q_ids, kv_ids)
    ref_out, _, ref_lse = np_flex_attention(q, k, v, score=score, mask=mask)
    assert_close(out, ref_out, 1e-4, "out vs float64")
    seen = mask.any(-1)[:, 0]  # [N, Tq]
    assert_close(np.where(seen[:, None], lse, 0), np.where(seen[:, None], ref_lse, 0), 1e-4, "lse")
    for name, got, want in zip(("dq", "dk", "dv", "dslopes"), grads, call("dense")[2], strict=True):
        assert_close(got, want, 1e-4, f"{name} vs dense")


@needs_kernel
@pytest.mark.parametrize(
    "t, causal, d, dv",
    [(1, True, 8, 8), (255, True, 64, 64), (256, False, 32, 32), (257, True, 40, 24),
     (130, True, 256, 256), (97, False, 80, 112)],
)  # fmt: skip
def test_boundary_lengths_and_head_sizes(t, causal, d, dv):
    """Lengths at and around the tiles (128 keys, 96/48 queries), head sizes up to 256,
    a value head size unlike the query's."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((1, t, 2, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, t, 1, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, t, 1, dv)), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal((1, t, 2, dv)), jnp.float32)
    mask = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)

    def f(q, k, v):
        return jattn.dot_product_attention(q, k, v, is_causal=causal, implementation="cpu_fused")

    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    ref_out, _, ref_grads = np_attention_vjp(q, k, v, mask, d**-0.5, None, d_out)
    assert_close(out, ref_out, 1e-4, "out")
    for name, got, want in zip(("dq", "dk", "dv"), vjp(d_out), ref_grads, strict=True):
        assert_close(got, want, 1e-4, name)


@needs_kernel
@pytest.mark.parametrize("tq", [1, 3, 15, 16])
def test_decoding_against_a_long_cache(tq):
    """Few queries read the keys in place (no transposed copy below 16 queries)."""
    case = Case(f"decode{tq}", batch=(2,), tq=tq, tk=700, h=4, kh=1, d=64,
                kv_lengths=(700, 333))  # fmt: skip
    d_lse = d_lse_of(case)
    out, lse, grads = public(case, "cpu_fused", d_lse)
    check_results(case, out, lse, grads, d_lse)


@needs_kernel
@pytest.mark.slow
def test_long_sequence_4097():
    case = Case("long", batch=(1,), tq=4097, tk=4097, h=2, kh=1, d=32, causal=True)
    d_lse = d_lse_of(case)
    out, lse, grads = public(case, "cpu_fused", d_lse)
    dense_out, dense_lse, dense_grads = public(case, "blockwise", d_lse)
    assert_close(out, dense_out, 1e-4, "out vs blockwise")
    assert_close(lse, dense_lse, 1e-4, "lse vs blockwise")
    for name, got, want in zip(("dq", "dk", "dv"), grads, dense_grads, strict=True):
        assert_close(got, want, 1e-4, f"{name} vs blockwise")


DETERMINISM_CASE = Case("determinism", batch=(3,), tq=200, tk=330, h=4, kh=2, d=32,
                        causal=False, window=(150, 60), segments="cross")  # fmt: skip


# 16 (batch, kv head) pairs: the backward's single pass per pair (dQ accumulated in place).
SINGLE_PASS_CASE = Case("single_pass", batch=(4,), tq=150, tk=170, h=8, kh=4, d=32,
                        causal=True, segments="cross", kv_lengths=(170, 0, 99, 150))  # fmt: skip


@needs_kernel
def test_single_pass_backward_conformance():
    d_lse = d_lse_of(SINGLE_PASS_CASE)
    out, lse, grads = public(SINGLE_PASS_CASE, "cpu_fused", d_lse)
    check_results(SINGLE_PASS_CASE, out, lse, grads, d_lse)


def fused_results(case: Case):
    out, lse, grads = public(case, "cpu_fused", d_lse_of(case))
    return [np.asarray(x) for x in (out, lse, *grads)]


# One (batch, kv head) pair: one worker takes the backward's single pass, two take the two
# passes (finer items), which must give the same bits.
ONE_PAIR_CASE = Case("one_pair", batch=(1,), tq=170, tk=170, h=2, kh=1, d=32, causal=True,
                     segments="cross", window=(120, None))  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("case", [DETERMINISM_CASE, SINGLE_PASS_CASE, ONE_PAIR_CASE], ids=str)
def test_bit_identical_across_runs_and_thread_counts(case, monkeypatch):
    """Each output element is computed by one worker in a fixed order: no dependence on
    scheduling or on the number of threads (JATTN_CPU_THREADS caps the workers), nor on the
    backward's schedule, which follows it."""
    first = fused_results(case)
    again = fused_results(case)
    monkeypatch.setenv(cpu_adapter.THREADS_ENV, "1")
    one = fused_results(case)
    monkeypatch.setenv(cpu_adapter.THREADS_ENV, "2")
    two = fused_results(case)
    for a, b, c, d in zip(first, again, one, two, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(a, d)


@needs_kernel
@pytest.mark.top_left  # 50 queries, 70 keys
def test_vmap_jit_and_eager_agree():
    case = Case("vmap", batch=(3, 2), tq=50, tk=70, causal=True, kv_lengths=(70, 3, 9, 0, 50, 1))
    q, k, v, _, _, _ = make_inputs(case)
    kv_len = lengths(case, "kv_lengths")

    def f(q, k, v, kv_len):
        return jattn.dot_product_attention(
            q, k, v, is_causal=True, key_value_seq_lengths=kv_len, implementation="cpu_fused"
        )

    batched = f(q, k, v, kv_len)
    np.testing.assert_array_equal(jax.jit(f)(q, k, v, kv_len), batched)
    mapped = jax.vmap(f)(q, k, v, kv_len)  # the outer batch axis under vmap
    np.testing.assert_allclose(mapped, batched, rtol=0, atol=1e-6)
    grad = jax.vmap(jax.grad(lambda q, k, v, n: (f(q, k, v, n) ** 2).sum()))(q, k, v, kv_len)
    want = jax.grad(lambda q, k, v, n: (f(q, k, v, n) ** 2).sum())(q, k, v, kv_len)
    np.testing.assert_allclose(grad, want, rtol=0, atol=1e-5)


ISA_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, jax, jax.numpy as jnp, jattn
    from jattn.kernels.cpu import _library
    assert _library.library().isa == sys.argv[1], (_library.library().isa, sys.argv[1])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 150, 4, 40)), jnp.float32) for _ in "qkv")
    k, v = k[..., :2, :], v[..., :2, :]
    bias = jnp.asarray(rng.standard_normal((2, 1, 150, 150)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 4, 1, 150)) < 0.7)
    def loss(impl):
        def f(q, k, v, bias):
            out = jattn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(70, 5),
                                              bias=bias, mask=mask, implementation=impl)
            return (out * jnp.sin(out)).sum()
        return jax.value_and_grad(f, (0, 1, 2, 3))(q, k, v, bias)
    (a, ga), (b, gb) = loss("cpu_fused"), loss("dense")
    err = max(float(jnp.abs(x - y).max()) for x, y in zip((a, *ga), (b, *gb)))
    print("max error", err)
    assert err < 1e-3, err
    """
)


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_narrower_instruction_sets(isa, tmp_path):
    """The AVX2 and portable builds (JATTN_CPU_ISA picks them) against the dense path, with
    a bias (and its gradient) and a mask array."""
    if isa == "avx2" and _library.library().isa == "generic":
        pytest.skip("this CPU has no AVX2")
    script = tmp_path / "isa_check.py"
    script.write_text(ISA_SCRIPT)
    env = {**os.environ, "JATTN_CPU_ISA": isa, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, str(script), isa], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


# ----------------------------------------------------------------------------------------
# Routing and refusals
# ----------------------------------------------------------------------------------------


@needs_kernel
def test_automatic_rule_takes_it_and_falls_back():
    q = jnp.zeros((1, 512, 2, 16))
    parts = dict(query=q, key=q, value=q)

    def chosen(**kwargs):
        ops, settings, extras = kwargs.pop("call")
        return _routing.choose(None, *parts.values(), ops, settings, extras)

    from jattn._call import DenseExtras, Operands, Settings

    plain = (Operands(scale=0.25), Settings(is_causal=True), DenseExtras())
    assert chosen(call=plain) == "cpu_fused"
    mask = (Operands(scale=0.25, mask=jnp.ones((512, 512), bool)), Settings(), DenseExtras())
    assert chosen(call=mask) == "cpu_fused"
    bias = (Operands(scale=0.25, bias=jnp.ones((2, 1, 512))), Settings(), DenseExtras())
    assert chosen(call=bias) == "cpu_fused"
    weights = (Operands(scale=0.25), Settings(), DenseExtras(return_weights=True))
    assert chosen(call=weights) == "dense"
    key = jax.random.key(0)
    drop = (Operands(scale=0.25, dropout_rate=0.1, dropout_rng=key), Settings(), DenseExtras())
    assert chosen(call=drop) == "cpu_fused"
    f64 = jnp.zeros((1, 512, 2, 16), jnp.float64) if jax.config.jax_enable_x64 else None
    if f64 is not None:
        assert _routing.choose(None, f64, f64, f64, *plain) != "cpu_fused"


@needs_kernel
@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(score_mod=lambda s, b, h, qi, ki: 2 * s), "score_mod"),
        (dict(mask_mod=jattn.mods.causal()), "mask_mod"),
        (dict(return_weights=True), "weight matrix"),
        (dict(precision=jax.lax.Precision.HIGHEST), "precision"),
    ],
)
def test_explicit_request_refuses_what_it_lacks(kwargs, reason):
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match=f"cpu_fused.*{reason}"):
        jattn.dot_product_attention(q, q, q, implementation="cpu_fused", **kwargs)


@needs_kernel
@pytest.mark.parametrize("scale_up", [False, True])
def test_huge_logits_and_pad_biases_match_dense(scale_up):
    """A -1e10 additive bias on left-padding keys (a padding query sees only those), or
    logits near 4e9: the kernel's exponent once came from two rounded products that stopped
    cancelling (NaN outputs, NaN gradients that poison a model's parameters)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 128, 2, 16)), jnp.float32) for _ in range(3))
    if scale_up:
        q, k, bias = q * 3e4, k * 3e4, None
    else:
        bias = jnp.zeros((2, 1, 1, 128)).at[0, ..., :4].set(-1e10)
    real = jnp.ones((2, 1, 128, 1), bool).at[0, :, :4].set(False)  # the loss skips pad rows

    def loss(impl):
        def f(q, k, v):
            out = jattn.dot_product_attention(q, k, v, bias=bias, is_causal=True,
                                              implementation=impl)  # fmt: skip
            return jnp.sum(jnp.where(jnp.swapaxes(real, 1, 2), out, 0.0) ** 2), out

        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (_, want), want_grads = loss("dense")
    for impl in ("cpu_fused", None):
        (_, out), grads = loss(impl)
        assert np.isfinite(np.asarray(out)).all()
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
        for g, w in zip(grads, want_grads, strict=True):
            assert np.isfinite(np.asarray(g)).all()
            if not scale_up:  # logits near 4e9: a saturated softmax, its gradient ill-posed
                np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3 * float(jnp.abs(w).max()))


@needs_kernel
def test_forward_over_reverse_leaves_the_kernel():
    """jax.hessian differentiates the backward pass in forward mode: the kernel's is C++,
    so the automatic rule takes another path, and an explicit request names why."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 128, 1, 4)), jnp.float32) for _ in range(3))

    def f(impl):
        return lambda x: jnp.sum(
            jattn.dot_product_attention(x, k, v, is_causal=True, implementation=impl) ** 2
        )

    def at(impl):  # of the first two queries (a small Hessian)
        return lambda y: f(impl)(q.at[0, :2].set(y))

    def hessian(impl):
        return jax.hessian(at(impl))(q[0, :2])

    np.testing.assert_allclose(hessian(None), hessian("dense"), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"cpu_fused.*forward mode over reverse mode"):
        hessian("cpu_fused")
    # Applied from outside a jax.jit holding the call, the routing cannot see it: the kernel
    # names the fix (JAX's own error named the FFI target alone).
    hidden = jax.jit(at(None))
    for second in (jax.hessian(hidden), jax.grad(lambda y: jnp.sum(jax.grad(hidden)(y)))):
        with pytest.raises(ValueError, match=r"second derivative.*Apply jax.jit outside"):
            second(q[0, :2])
    np.testing.assert_allclose(
        jax.jit(jax.hessian(at(None)))(q[0, :2]), hessian("dense"), rtol=1e-4, atol=1e-5
    )


def test_adapter_contract_names():
    module = kernels.adapter("cpu_fused")
    assert module is cpu_adapter and module.NAME == "cpu_fused" and "cpu_fused" in kernels.KERNELS
    assert module.RETURNS_LSE and module.LSE_HAS_GRADIENT
    query = _routing.kernel_query(
        jnp.zeros((2, 8, 4, 16)), jnp.zeros((2, 9, 2, 16)), jnp.zeros((2, 9, 2, 8)),
        jattn._call.Operands(scale=0.25), jattn._call.Settings(is_causal=True),
        jattn._call.DenseExtras(), platform="gpu", interpret=False,
    )  # fmt: skip
    assert query.v_head_dim == 8 and query.kv_shape == (2, 9, 2, 16) and query.is_causal
    assert "CPU only" in cpu_adapter.obstacle(query)
    if BUILT:
        assert cpu_adapter.obstacle(query._replace(platform="cpu")) is None
        f64 = query._replace(platform="cpu", dtype=jnp.dtype("float64"))
        assert "float64" in cpu_adapter.obstacle(f64)


@needs_kernel
def test_bfloat16_rounds_like_dense():
    case = dataclasses.replace(CASES[0], dtype="bfloat16", name="bf16_plain")
    out, _, grads = public(case, "cpu_fused")
    dense_out, _, dense_grads = public(case, "dense")
    tol = tolerance("bfloat16")
    assert out.dtype == jnp.bfloat16
    assert_close(out, dense_out, tol, "out")
    for got, want in zip(grads, dense_grads, strict=True):
        assert_close(got, want, tol, "grad")


# ----------------------------------------------------------------------------------------
# Dropout: jattn's position-keyed generator, inside the kernel
# ----------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("shared", [False, True, "batch", "heads"])
def test_dropout_pattern_is_the_blockwise_and_dense_one(shared):
    """With q = 0 every visible key weighs 1/n and v = I makes out[i, j] = keep_ij / (keep
    n): the kept pattern itself, compared exactly with the other paths'."""
    b, t, h = 2, 150, 4
    q = jnp.zeros((b, t, h, t))
    v = jnp.broadcast_to(jnp.eye(t)[:, None, :], (b, t, 2, t))
    k = jnp.ones((b, t, 2, t))

    def pattern(impl):
        out = jattn.dot_product_attention(
            q, k, v, is_causal=True, dropout_rate=0.4, dropout_rng=jax.random.key(5),
            broadcast_dropout=shared, implementation=impl,
        )  # fmt: skip
        return np.asarray(out) != 0, out

    fused, out = pattern("cpu_fused")
    for impl in ("blockwise", "dense"):
        np.testing.assert_array_equal(fused, pattern(impl)[0], err_msg=impl)
    kept = fused[..., 0, :][:, np.tril_indices(t)[0], np.tril_indices(t)[1]].mean()
    assert 0.5 < kept < 0.7  # keep probability 0.6
    n = np.arange(1, t + 1)[None, :, None, None]
    np.testing.assert_allclose(np.asarray(out)[fused], (1 / (0.6 * n) * fused)[fused], rtol=1e-6)


@needs_kernel
def test_dropout_outputs_and_gradients_match_blockwise():
    case = Case("dropout", batch=(2,), tq=140, tk=160, h=4, kh=2, d=32, window=(50, 20),
                segments="cross", kv_lengths=(150, 90))  # fmt: skip
    q, k, v, d_out, q_ids, kv_ids = make_inputs(case)

    def run(impl):
        def f(q, k, v):
            return jattn.dot_product_attention(
                q, k, v, local_window_size=case.window, query_segment_ids=q_ids,
                key_value_segment_ids=kv_ids, key_value_seq_lengths=lengths(case, "kv_lengths"),
                dropout_rate=0.3, dropout_rng=jax.random.key(1), implementation=impl,
            )  # fmt: skip

        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        return out, vjp(d_out)

    (out, grads), (ref, ref_grads) = run("cpu_fused"), run("blockwise")
    assert_close(out, ref, 1e-4, "out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(got, want, 1e-4, name)


# ----------------------------------------------------------------------------------------
# Bias and mask arrays (in their own broadcast shapes), their gradient; decoding
# ----------------------------------------------------------------------------------------


def np_biased_vjp(q, k, v, bias, mask, scale, d_out, d_lse):
    """float64 ``(out, lse, (dq, dk, dv, dbias))`` of ``softmax(s + bias)`` with the mask
    (True = attend; rows that see nothing give 0), by hand: ``ds = p (dp - Σ p dp) + p
    d_lse``, ``dbias = ds`` summed over the bias's broadcast axes (its own shape)."""
    q, k, v, d_out, bias = (np.asarray(a, np.float64) for a in (q, k, v, d_out, bias))
    *batch, _, h, d = q.shape
    tk, kh = k.shape[-3:-1]
    g = h // kh
    kf, vf = np.repeat(k, g, axis=-2), np.repeat(v, g, axis=-2)
    logits = np.einsum("...thd,...shd->...hts", q, kf) * scale
    bias_full = bias.reshape((1,) * (logits.ndim - bias.ndim) + bias.shape)
    logits = logits + bias_full
    mask = np.broadcast_to(mask, logits.shape)
    row = mask.any(-1, keepdims=True)
    m = np.where(row, np.where(mask, logits, -np.inf).max(-1, keepdims=True), 0.0)
    e = np.where(mask, np.exp(np.where(mask, logits - m, 0.0)), 0.0)
    total = np.where(row, e.sum(-1, keepdims=True), 1.0)
    p = e / total
    lse = np.where(row, m + np.log(total), 0.0)[..., 0]
    out = np.einsum("...hts,...shd->...thd", p, vf)
    dp = np.einsum("...thd,...shd->...hts", np.asarray(d_out, np.float64), vf)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) + p * np.asarray(d_lse)[..., None]
    dq = np.einsum("...hts,...shd->...thd", ds, kf) * scale
    dk = (np.einsum("...hts,...thd->...shd", ds, q) * scale).reshape(*batch, tk, kh, g, d)
    dv = np.einsum("...hts,...thd->...shd", p, d_out).reshape(*batch, tk, kh, g, -1)
    axes = tuple(a for a in range(ds.ndim) if bias_full.shape[a] == 1 and ds.shape[a] != 1)
    dbias = ds.sum(axis=axes, keepdims=True).reshape(bias.shape)
    return out, lse, (dq, dk.sum(-2), dv.sum(-2), dbias)


def biased_call(q, k, v, bias, mask, d_out, d_lse, implementation, **kwargs):
    """``(out, lse [.., H, Tq], (dq, dk, dv, dbias))`` of the public call, jitted."""

    def f(q, k, v, bias):
        out, res = jattn.dot_product_attention(
            q, k, v, bias=bias, mask=mask, return_residual=True, implementation=implementation,
            **kwargs,
        )  # fmt: skip
        return out, jnp.swapaxes(res, -1, -2)

    @jax.jit
    def run(q, k, v, bias):
        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        return out, lse, vjp((d_out, d_lse.astype(lse.dtype)))

    return run(q, k, v, bias)


def array_inputs(batch, tq, tk, h, kh, d, bias_shape, mask_shape, dtype="float32", seed=0):
    """q, k, v, d_out, d_lse, a bias and a mask (with fully masked rows where it has rows)."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dt)

    q, k, v = normal(*batch, tq, h, d), normal(*batch, tk, kh, d), normal(*batch, tk, kh, d)
    d_out, d_lse = normal(*batch, tq, h, d), normal(*batch, h, tq).astype(jnp.float32)
    bias = None if bias_shape is None else normal(*bias_shape)
    mask = None
    if mask_shape is not None:
        mask = rng.random(mask_shape) < 0.6
        if mask_shape[-2] > 3:
            mask[..., 3, :] = False  # a row that attends nothing
        mask = jnp.asarray(mask)
    return q, k, v, d_out, d_lse, bias, mask


def check_biased(results, reference, dtype, what):
    out, lse, grads = results
    ref_out, ref_lse, ref_grads = reference
    tol = tolerance(dtype)
    assert_close(out, ref_out, tol, f"{what}: out")
    seen = ref_lse != 0.0
    assert_close(np.where(seen, lse, 0.0), ref_lse, tol, f"{what}: lse")
    assert (np.asarray(lse)[~seen] == jattn.large_negative(jnp.float32)).all(), what
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        assert_close(got, want, tol, f"{what}: {name}")


def _rebatch(shape, n):
    """A 4-D shape whose batch axis is 2, with n instead (others unchanged)."""
    if shape is None or len(shape) != 4 or shape[0] != 2:
        return shape
    return (n, *shape[1:])


@needs_kernel
@pytest.mark.parametrize(
    "bias_shape, mask_shape",
    [
        ((2, 4, 70, 150), None),  # the logits' own shape: dS itself
        ((1, 4, 70, 150), (2, 1, 70, 150)),  # shared over the batch: summed by XLA
        ((2, 1, 1, 150), (70, 150)),  # a padding bias per key: column sums
        ((2, 4, 70, 1), (2, 1, 1, 150)),  # one value per row: row sums
        ((70, 150), (2, 4, 70, 150)),  # a 2-D bias for every batch row and head
        ((1,), None),  # a scalar
    ],
    ids=str,
)
def test_bias_and_mask_arrays_with_the_bias_gradient(bias_shape, mask_shape):
    """out, lse and dq, dk, dv, dbias (in the bias's own shape) against float64 and dense,
    GQA, rows the mask hides entirely, both backward modes."""
    for batch in ((2,), (8,)):  # the two-pass backward; the single pass (16 kv head pairs)
        shape, mshape = (_rebatch(x, batch[0]) for x in (bias_shape, mask_shape))
        q, k, v, d_out, d_lse, bias, mask = array_inputs(batch, 70, 150, 4, 2, 16, shape, mshape)
        mask_np = True if mask is None else np.asarray(mask)
        ref = np_biased_vjp(q, k, v, bias, mask_np, 0.25, d_out, d_lse)
        fused = biased_call(q, k, v, bias, mask, d_out, d_lse, "cpu_fused")
        check_biased(fused, ref, "float32", f"float64, batch {batch}")
        dense = biased_call(q, k, v, bias, mask, d_out, d_lse, "dense")
        for name, got, want in zip(("dq", "dk", "dv", "dbias"), fused[2], dense[2], strict=True):
            assert_close(got, want, 1e-4, f"{name} vs dense")


@needs_kernel
@pytest.mark.parametrize("t", [1, 255, 256, 257])
def test_bias_and_mask_at_tile_boundaries(t):
    """Causal, a per-head bias [1, H, T, T] and a per-key padding mask [B, 1, 1, T]."""
    q, k, v, d_out, d_lse, bias, _ = array_inputs((2,), t, t, 2, 1, 32, (1, 2, t, t), None)
    pad = np.arange(t)[None, :] < np.array([[t], [max(t // 2, 1)]])
    mask = jnp.asarray(pad[:, None, None, :])
    full = np.tril(np.ones((t, t), bool)) & np.asarray(mask)
    ref = np_biased_vjp(q, k, v, bias, full, 32**-0.5, d_out, d_lse)
    fused = biased_call(q, k, v, bias, mask, d_out, d_lse, "cpu_fused", is_causal=True)
    check_biased(fused, ref, "float32", f"T={t}")


@needs_kernel
def test_bias_and_mask_in_bfloat16_round_like_dense():
    args = array_inputs((2,), 60, 140, 4, 2, 32, (2, 1, 60, 140), (2, 4, 60, 140), "bfloat16")
    fused = biased_call(*args[:3], args[5], args[6], args[3], args[4], "cpu_fused")
    dense = biased_call(*args[:3], args[5], args[6], args[3], args[4], "dense")
    assert fused[0].dtype == jnp.bfloat16 and fused[2][3].dtype == jnp.bfloat16
    tol = tolerance("bfloat16")
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dbias"),
                               (*fused[:2], *fused[2]), (*dense[:2], *dense[2]), strict=True):  # fmt: skip
        assert_close(got, want, tol, name)


@needs_kernel
@pytest.mark.parametrize("score_mod", ["softcap", "alibi"])
def test_bias_is_added_after_the_score_mod(score_mod):
    """jattn.dense's order: scale, score_mod (soft-cap, ALiBi), then the bias; with sinks."""
    q, k, v, d_out, d_lse, bias, mask = array_inputs(
        (2,), 50, 130, 4, 2, 16, (2, 4, 50, 130), (2, 1, 50, 130), seed=3
    )
    bias = 4.0 * bias  # large enough to matter against a cap of 2
    mod = jattn.mods.softcap(2.0) if score_mod == "softcap" else jattn.mods.alibi(
        jattn.mods.alibi_slopes(4))  # fmt: skip
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    kwargs = dict(score_mod=mod, sinks=sinks, local_window_size=(40, 30))
    fused = biased_call(q, k, v, bias, mask, d_out, d_lse, "cpu_fused", **kwargs)
    dense = biased_call(q, k, v, bias, mask, d_out, d_lse, "dense", **kwargs)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dbias"),
                               (*fused[:2], *fused[2]), (*dense[:2], *dense[2]), strict=True):  # fmt: skip
        assert_close(got, want, 1e-4, name)


@needs_kernel
def test_bias_and_mask_under_vmap():
    q, k, v, _, _, bias, mask = array_inputs((3, 2), 40, 130, 2, 1, 16,
                                             (3, 1, 1, 40, 130), (2, 1, 1, 130))  # fmt: skip

    def loss(impl):
        def f(q, k, v, bias, mask):
            out = jattn.dot_product_attention(q, k, v, bias=bias, mask=mask, implementation=impl)
            return (out * jnp.sin(out)).sum()

        return jax.vmap(jax.value_and_grad(f, (0, 3)), in_axes=(0, 0, 0, 0, None))

    (a, (ga, gba)) = loss("cpu_fused")(q, k, v, bias, mask)
    (b, (gb, gbb)) = loss("dense")(q, k, v, bias, mask)
    assert gba.shape == bias.shape
    for name, x, y in (("loss", a, b), ("dq", ga, gb), ("dbias", gba, gbb)):
        assert_close(x, y, 1e-4, name)


@needs_kernel
@pytest.mark.parametrize("tq", [1, 5, 16])
def test_split_kv_decoding(tq, monkeypatch):
    """Up to 16 queries against >= 1024 keys split the keys (512 each) over the workers and
    merge the partial softmaxes: float64 values (a mask, a per-key bias, key lengths, GQA),
    the same bits with 1 and 2 threads."""
    tk = 1500
    q, k, v, d_out, d_lse, bias, mask = array_inputs((2,), tq, tk, 4, 2, 32, (2, 1, 1, tk),
                                                     (2, 1, tq, tk), seed=tq)  # fmt: skip
    kv_len = jnp.asarray([tk, 700], jnp.int32)
    seen = np.asarray(mask) & (np.arange(tk) < np.asarray(kv_len)[:, None, None, None])
    ref = np_biased_vjp(q, k, v, bias, seen, 32**-0.5, d_out, d_lse)

    def run():
        out = biased_call(q, k, v, bias, mask, d_out, d_lse, "cpu_fused",
                          key_value_seq_lengths=kv_len)  # fmt: skip
        return [np.asarray(x) for x in (out[0], out[1], *out[2])]

    fused = run()
    check_biased((fused[0], fused[1], fused[2:]), ref, "float32", f"tq={tq}")
    for threads in ("1", "2"):
        monkeypatch.setenv(cpu_adapter.THREADS_ENV, threads)
        for a, b in zip(fused, run(), strict=True):
            np.testing.assert_array_equal(a, b)


@needs_kernel
@pytest.mark.parametrize("capacity", [200, 1100])
def test_kv_cache_decoding_runs_fused(capacity, monkeypatch):
    """A decoding step through jattn.kvcache: a plain one reads the cache in place through
    the paged kernel (no routing), one with a mask array takes this kernel by the automatic
    rule; both equal the dense path."""
    rng = np.random.default_rng(capacity)
    cache = jattn.kvcache.init_cache(2, capacity, 2, 16)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    prompt = [normal(2, 90, 2, 16) for _ in "kv"]
    cache = jattn.kvcache.append(cache, *prompt, num_new=jnp.asarray([90, 40]))
    step = [normal(2, 1, h, 16) for h in (4, 2, 2)]
    chosen = []
    choose = _routing.choose

    def spy(implementation, *call):
        chosen.append(choose(implementation, *call))
        return chosen[-1]

    monkeypatch.setattr(_routing, "choose", spy)
    want, _ = jattn.kvcache.update_and_attend(cache, *step, implementation="dense")
    plain, _ = jattn.kvcache.update_and_attend(cache, *step)
    assert chosen == ["dense"]  # the paged kernel's call does not route
    mask = jnp.asarray(rng.random((2, 4, 1, capacity)) < 0.9).at[..., :1].set(True)
    masked, _ = jattn.kvcache.update_and_attend(cache, *step, mask=mask)
    assert chosen == ["dense", "cpu_fused"]
    masked_dense, _ = jattn.kvcache.update_and_attend(
        cache, *step, mask=mask, implementation="dense"
    )
    assert_close(plain, want, 1e-5, "plain decode step vs dense")
    assert_close(masked, masked_dense, 1e-5, "masked decode step vs dense")


def _documents(batch, t, seed):
    """Per-row packed documents: int32 ``[batch, t]`` ids of 2-4 contiguous runs."""
    rng = np.random.default_rng(seed)
    ids = [np.repeat(np.arange(4), np.diff([0, *sorted(rng.choice(t, 3, replace=False)), t]))
           for _ in range(batch)]  # fmt: skip
    return jnp.asarray(np.stack(ids), jnp.int32)


@needs_kernel
@pytest.mark.parametrize(
    "mods_name, block, with_mask",
    [
        ("causal_window", None, False),  # 128 x 128 tiles against the kernel's
        ("causal_documents", (64, 32), False),  # per-batch-row states, smaller tiles, FULL ones
        ("documents", (128, 64), True),  # ANDed with a mask array: FULL tiles still read it
    ],
)
def test_block_mask_tile_states(mods_name, block, with_mask):
    """A jattn.block_mask: its EMPTY tiles skipped, FULL tiles unmasked, PARTIAL ones read
    the mask_mod XLA evaluates; out, lse and gradients against float64 and dense."""
    b, t = 2, 300
    q, k, v, d_out, d_lse, _, mask = array_inputs((b,), t, t, 4, 2, 16, None, (b, 1, t, t))
    mask = mask if with_mask else None
    ids = _documents(b, t, 7)
    mod = {
        "causal_window": jattn.mods.and_masks(jattn.mods.causal(), jattn.mods.sliding_window(90)),
        "causal_documents": jattn.mods.and_masks(jattn.mods.causal(), jattn.mods.document(ids)),
        "documents": jattn.mods.document(ids),
    }[mods_name]
    bq, bk = block if block is not None else (None, None)
    batch_shape = None if mods_name == "causal_window" else (b,)
    bm = jattn.block_mask(mod, q_len=t, kv_len=t, batch_shape=batch_shape, block_q=bq, block_k=bk)
    states = set(np.unique(np.asarray(bm.state)).tolist())
    assert states >= ({0, 1} if mods_name == "causal_window" else {0, 1, 2}), states
    zero_bias = jnp.zeros((1,), jnp.float32)

    def run(impl):
        return biased_call(q, k, v, zero_bias, mask, d_out, d_lse, impl, block_mask=bm)

    shape = (b, 4, t, t)
    allowed = np.broadcast_to(np.asarray(jattn.mods.evaluate_mask_mod(mod, shape)), shape)
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    fused = run("cpu_fused")
    ref = np_biased_vjp(q, k, v, zero_bias, allowed, 0.25, d_out, d_lse)
    check_biased(fused, ref, "float32", mods_name)
    dense = run("dense")
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"),
                               (*fused[:2], *fused[2][:3]), (*dense[:2], *dense[2][:3]),
                               strict=True):  # fmt: skip
        assert_close(got, want, 1e-4, f"{name} vs dense")


@needs_kernel
def test_dropout_with_bias_and_mask_matches_blockwise():
    """The same key drops the same weights with a bias and a mask array: out and every
    gradient (dbias included) equal the blockwise path's."""
    q, k, v, d_out, d_lse, bias, mask = array_inputs((2,), 140, 160, 4, 2, 32, (2, 1, 1, 160),
                                                     (2, 4, 140, 160), seed=11)  # fmt: skip
    kwargs = dict(dropout_rate=0.3, dropout_rng=jax.random.key(2), local_window_size=(60, 20))
    fused = biased_call(q, k, v, bias, mask, d_out, d_lse, "cpu_fused", **kwargs)
    blockwise = biased_call(q, k, v, bias, mask, d_out, d_lse, "blockwise", **kwargs)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dbias"),
                               (*fused[:2], *fused[2]), (*blockwise[:2], *blockwise[2]),
                               strict=True):  # fmt: skip
        assert_close(got, want, 1e-4, f"{name} vs blockwise")


@needs_kernel
@pytest.mark.parametrize("batch", [2, 8], ids=["two_pass", "single_pass"])
@pytest.mark.parametrize("bias_shape", [(1, 4, 100, 170), (1, 1, 1, 170), (1, 4, 100, 1)], ids=str)
def test_bias_gradient_is_bit_identical_across_thread_counts(batch, bias_shape, monkeypatch):
    """Each bias-gradient element is written or summed by one worker in a fixed order."""
    q, k, v, d_out, d_lse, bias, mask = array_inputs((batch,), 100, 170, 4, 2, 16, bias_shape,
                                                     (batch, 1, 100, 170), seed=5)  # fmt: skip

    def run():
        out = biased_call(q, k, v, bias, mask, d_out, d_lse, "cpu_fused",
                          local_window_size=(50, 0))  # fmt: skip
        return [np.asarray(x) for x in (out[0], out[1], *out[2])]

    first = run()
    for threads in ("1", "2"):
        monkeypatch.setenv(cpu_adapter.THREADS_ENV, threads)
        for a, b in zip(first, run(), strict=True):
            np.testing.assert_array_equal(a, b)


@needs_kernel
def test_inside_shard_map_with_keys_replicated_over_the_sharded_heads():
    """Under ``shard_map`` (types checked, ``check_vma``) the kernel's results and
    gradients vary over the mesh axes its operands do, and keys replicated over the
    head-sharded axis get their gradient summed over it: equal to the dense path's."""
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((1,), ("heads",))
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (2, 40, 4, 16))
    k, v = jax.random.normal(kk, (2, 40, 1, 16)), jax.random.normal(kv, (2, 40, 1, 16))
    placed = [jax.device_put(x, jax.NamedSharding(mesh, s)) for x, s in
              ((q, P(None, None, "heads")), (k, P()), (v, P()))]  # fmt: skip

    def loss(implementation, shard):
        def f(q, k, v):
            out = jattn.dot_product_attention(
                q, k, v, is_causal=True, implementation=implementation
            )
            return jnp.sum(out * jnp.cos(out))

        if shard:
            local = f
            f = jax.shard_map(
                lambda q, k, v: jax.lax.psum(local(q, k, v), "heads"),
                mesh=mesh,
                in_specs=(P(None, None, "heads"), P(), P()),
                out_specs=P(),
            )
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    got = loss("cpu_fused", shard=True)(*placed)
    want = loss("dense", shard=False)(q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


def _partial_tile_mod(name, ids):
    """A mask_mod and the block_mask keywords it needs (batch_shape, num_heads)."""
    causal = jattn.mods.causal()
    return {
        "documents": (jattn.mods.document(ids), dict(batch_shape=(2,))),
        "causal_documents": (
            jattn.mods.and_masks(causal, jattn.mods.document(ids)),
            dict(batch_shape=(2,)),
        ),
        "sliding_window": (jattn.mods.sliding_window(37, 11), {}),
        "causal": (causal, {}),
        # per head: head h sees 20 + 30 h keys back
        "per_head": (lambda b, h, q, kv: (kv <= q) & (q - kv < 20 + 30 * h), dict(num_heads=4)),
    }[name]


@needs_kernel
@pytest.mark.parametrize(
    "mods_name, block, with_mask",
    [
        ("documents", (48, 80), False),  # per-batch states, tiles across the kernel's
        ("documents", (48, 80), True),  # ANDed with a mask array
        ("causal_documents", (64, 32), True),
        ("sliding_window", (48, 80), False),
        ("causal", (80, 48), False),
        ("per_head", (48, 80), True),  # a state per head
        ("per_head", (200, 200), False),  # one tile
    ],
    ids=str,
)
def test_block_mask_partial_tiles_read_compact_bits(mods_name, block, with_mask):
    """A block mask's PARTIAL tiles read the mask_mod evaluated on those tiles alone (block
    sizes that divide neither T nor the kernel's tiles): out, lse, dq, dk, dv against the
    float64 reference and the dense path; the tile mask holds the partial tiles only."""
    b, t = 2, 200
    q, k, v, d_out, d_lse, _, mask = array_inputs((b,), t, t, 4, 2, 16, None, (b, 1, t, t), seed=9)
    mask = mask if with_mask else None
    mod, sizes = _partial_tile_mod(mods_name, _documents(b, t, 3))
    bm = jattn.block_mask(mod, q_len=t, block_q=block[0], block_k=block[1], **sizes)
    assert (np.asarray(bm.state) == jattn.block_masks.PARTIAL).any()
    zero_bias = jnp.zeros((1,), jnp.float32)

    def run(impl):
        return biased_call(q, k, v, zero_bias, mask, d_out, d_lse, impl, block_mask=bm)

    shape = (b, 4, t, t)
    allowed = np.broadcast_to(np.asarray(jattn.mods.evaluate_mask_mod(mod, shape)), shape)
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    fused = run("cpu_fused")
    check_biased(fused, np_biased_vjp(q, k, v, zero_bias, allowed, 0.25, d_out, d_lse),
                 "float32", mods_name)  # fmt: skip
    dense = run("dense")
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"),
                               (*fused[:2], *fused[2][:3]), (*dense[:2], *dense[2][:3]),
                               strict=True):  # fmt: skip
        assert_close(got, want, 1e-4, f"{name} vs dense")
    tile_mask = _fused_operands(lambda q: jattn.dot_product_attention(
        q, k, v, mask=mask, block_mask=bm, implementation="cpu_fused"), q)[-1]  # fmt: skip
    n_partial = int((np.asarray(bm.state) == jattn.block_masks.PARTIAL).sum())
    assert tile_mask.shape == (1, n_partial, *block), tile_mask.shape


def _fused_operands(f, *args):
    """The operand types of the forward kernel's ffi_call in ``f``'s jaxpr."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ffi_call" and "forward" in str(eqn.params):
                found.append([x.aval for x in eqn.invars])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(f)(*args).jaxpr)
    assert len(found) == 1, found
    return found[0]


@needs_kernel
def test_block_mask_tile_mask_is_small():
    """A concrete document block mask at T=2048: the kernel's tile mask has
    n_partial * block_q * block_k bits (not Tq * Tk), and so does the compiled call's memory."""
    t = 2048
    ids = jnp.asarray(np.repeat(np.arange(4), [300, 700, 548, 500])[None], jnp.int32)
    bm = jattn.block_mask(jattn.mods.document(ids), q_len=t, batch_shape=(1,))
    n_partial = int((np.asarray(bm.state) == jattn.block_masks.PARTIAL).sum())
    assert 0 < n_partial * 128 * 128 < t * t // 4  # 49 of 256 tiles
    q = k = v = jnp.zeros((1, t, 2, 16), jnp.float32)

    def f(q, k, v):
        return jattn.dot_product_attention(q, k, v, block_mask=bm, implementation="cpu_fused")

    operands = _fused_operands(f, q, k, v)
    assert operands[-1].shape == (1, n_partial, 128, 128) and operands[-1].dtype == jnp.bool_
    assert all(x.size < t * t // 4 for x in operands if x.dtype == jnp.bool_)
    memory = jax.jit(f).lower(q, k, v).compile().memory_analysis()
    if memory is not None:  # a Tq x Tk mask alone would be 4 MiB (the tile mask: 0.8 MiB)
        assert memory.temp_size_in_bytes < t * t // 2, memory.temp_size_in_bytes


@needs_kernel
@pytest.mark.parametrize("mods_name", ["causal_documents", "sliding_window"])
def test_block_mask_traced_state(mods_name):
    """A block mask passed to jax.jit as an argument (its state traced): the same bits as
    closed over (a sliding window's state built again on the host, a document mask over
    traced ids with a slot per tile), equal to the dense path; under vmap too."""
    b, t = 2, 200
    q, k, v, *_ = array_inputs((b,), t, t, 4, 2, 16, None, None, seed=4)
    mod, sizes = _partial_tile_mod(mods_name, _documents(b, t, 5))
    bm = jattn.block_mask(mod, q_len=t, block_q=48, block_k=80, **sizes)

    def loss(q, k, v, bm, impl="cpu_fused"):
        out = jattn.dot_product_attention(q, k, v, block_mask=bm, implementation=impl)
        return jnp.sum(out * jnp.cos(out))

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    traced = jax.jit(grad)(q, k, v, bm)
    closed = jax.jit(lambda q, k, v: grad(q, k, v, bm))(q, k, v)
    dense = jax.jit(lambda q, k, v: jax.value_and_grad(loss, (0, 1, 2))(q, k, v, bm, "dense"))(
        q, k, v)  # fmt: skip
    for x, y, z in zip(jax.tree.leaves(traced), jax.tree.leaves(closed), jax.tree.leaves(dense),
                       strict=True):  # fmt: skip
        np.testing.assert_array_equal(x, y)
        assert_close(x, z, 1e-4, mods_name)
    n_partial = int((np.asarray(bm.state) == jattn.block_masks.PARTIAL).sum())
    slots = n_partial if mods_name == "sliding_window" else bm.state.size
    tile_mask = _fused_operands(lambda q, bm: loss(q, k, v, bm), q, bm)[-1]
    assert tile_mask.shape == (1, slots, 48, 80), tile_mask.shape
    if mods_name == "sliding_window":  # one batch row per vmapped example: the same sum
        per_row = jax.jit(jax.vmap(lambda q, k, v: loss(q[None], k[None], v[None], bm)))
        assert_close(per_row(q, k, v).sum(), dense[0], 1e-4, "vmap")


@needs_kernel
def test_block_mask_with_dropout_bias_sinks_lengths_and_segments():
    """A block mask with every other option: out and gradients equal the blockwise path's
    (the same dropout pattern), lse included."""
    b, t = 2, 200
    q, k, v, d_out, d_lse, bias, _ = array_inputs((b,), t, t, 4, 2, 16, (1, 4, 1, t), None,
                                                  seed=6)  # fmt: skip
    mod, sizes = _partial_tile_mod("causal_documents", _documents(b, t, 8))
    bm = jattn.block_mask(mod, q_len=t, block_q=48, block_k=80, **sizes)
    segments = jnp.asarray(np.arange(t) // 150 * np.ones((b, 1), np.int64), jnp.int32)
    kwargs = dict(
        block_mask=bm, dropout_rate=0.2, dropout_rng=jax.random.key(3),
        sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32),
        query_seq_lengths=jnp.asarray([200, 170]), key_value_seq_lengths=jnp.asarray([190, 200]),
        query_segment_ids=segments, key_value_segment_ids=segments,
    )  # fmt: skip
    fused = biased_call(q, k, v, bias, None, d_out, d_lse, "cpu_fused", **kwargs)
    blockwise = biased_call(q, k, v, bias, None, d_out, d_lse, "blockwise", **kwargs)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dbias"),
                               (*fused[:2], *fused[2]), (*blockwise[:2], *blockwise[2]),
                               strict=True):  # fmt: skip
        assert_close(got, want, 1e-4, f"{name} vs blockwise")


# ----------------------------------------------------------------------------------------
# The greedy pick (jattn.kernels.cpu.argmax)
# ----------------------------------------------------------------------------------------


def _hard_rows(rng, shape) -> np.ndarray:
    """float32 logits whose rows hold, where wide enough: +inf then a NaN, a tie for the
    largest, -0.0 / 0.0 only, -inf only, a NaN first, a NaN in the last (tail) column."""
    x = rng.normal(size=shape).astype(np.float32)
    rows, v = x.reshape(-1, shape[-1]), shape[-1]
    cases = [
        lambda r: r.__setitem__([1, v - 1], [np.inf, np.nan]),
        lambda r: r.__setitem__([v // 3, v - 2], r.max() + 1.0),
        lambda r: r.__setitem__(slice(None), np.where(rng.random(v) < 0.5, -0.0, 0.0)),
        lambda r: r.__setitem__(slice(None), -np.inf),
        lambda r: r.__setitem__(0, np.nan),
        lambda r: r.__setitem__(v - 1, np.nan),
    ]
    for row, case in zip(rows, cases if v >= 3 else cases[2:], strict=False):
        case(row)
    return x


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "xla"])
@pytest.mark.parametrize("shape", [(1, 1), (6, 17), (2, 3, 33), (16, 8192), (7, 50257)], ids=str)
def test_argmax_is_jnp_argmax(shape, fused, monkeypatch):
    """Both formulations (the kernel; the two reductions of another platform, or of no
    kernel) give numpy's argmax: the first NaN, else the first largest; in bfloat16 and
    float16 too, eager, jitted and vmapped; the kernel is the call's one custom call."""
    if fused and not BUILT:
        pytest.skip(f"fused CPU kernel {_library.status()}")
    if not fused:
        monkeypatch.setattr(_library, "library", lambda: None)
    x = _hard_rows(np.random.default_rng(shape[-1]), shape)
    jitted = jax.jit(lambda x: kernels.cpu.argmax(x))  # its own trace cache: not the other case's
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        logits = jnp.asarray(x, dtype)
        want = np.argmax(np.asarray(logits, np.float32), axis=-1)
        for got in (kernels.cpu.argmax(logits), jitted(logits)):
            assert got.dtype == jnp.int32 and got.shape == shape[:-1]
            np.testing.assert_array_equal(got, want, err_msg=str(dtype))
    stacked = jnp.stack([jnp.asarray(x), -jnp.asarray(x)])
    np.testing.assert_array_equal(
        jax.vmap(jitted)(stacked), np.argmax(np.asarray(stacked), axis=-1)
    )
    assert ("jattn_cpu_argmax" in jitted.lower(x).as_text()) == fused


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_argmax_with_each_instruction_set(isa):
    """Each build of the row kernel (JATTN_CPU_ISA picks a narrower one; vectors of 16, 8
    and 4 floats) on the hard rows: ``test_argmax_is_jnp_argmax`` in a process of its own."""
    cpus = {"avx512": ["avx512"], "avx2": ["avx512", "avx2"], "generic": None}[isa]
    if cpus is not None and _library.library().isa not in cpus:
        pytest.skip(f"this CPU has no {isa}")
    env = {**os.environ, "JATTN_CPU_ISA": isa}
    isa_code = "from jattn.kernels.cpu import _library; print(_library.library().isa)"
    chosen = subprocess.run([sys.executable, "-c", isa_code], env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert chosen.stdout.strip() == isa, chosen.stdout + chosen.stderr
    test = f"{__file__}::test_argmax_is_jnp_argmax"  # every case, those marked slow too
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "", test],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "10 passed in" in done.stdout, done.stdout + done.stderr


def test_argmax_lowers_without_the_cpu_target_for_gpu():
    """Lowered for CUDA from this host, the pick is XLA's reductions, no CPU custom call."""
    x = jnp.zeros((4, 100), jnp.float32)
    text = jax.jit(kernels.cpu.argmax).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "jattn_cpu_argmax" not in text and "stablehlo.reduce" in text


@needs_kernel
def test_argmax_inside_a_differentiated_function_is_a_constant_like_jnp_argmax():
    """A loss that picks with the kernel differentiates as with ``jnp.argmax`` (the pick
    contributes nothing), in reverse and forward mode, through a jit, the kernel still
    called: the call itself has no derivative rule."""
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 40)), jnp.float32)

    def loss(pick):
        return lambda x: jnp.sum(x * jax.nn.one_hot(pick(x), x.shape[-1]) * x)

    ours, ref = loss(kernels.cpu.argmax), loss(partial(jnp.argmax, axis=-1))
    for transform in (jax.grad, jax.jacfwd, lambda f: jax.hessian(jax.jit(f))):
        np.testing.assert_array_equal(transform(ours)(x), transform(ref)(x))
    assert "jattn_cpu_argmax" in jax.jit(jax.grad(ours)).lower(x).as_text()
