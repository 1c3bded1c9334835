"""Conformance of the fused-kernel adapters (jattn.kernels) with jattn's semantics.

Every adapter that can run here is checked, forward and gradients (dq, dk, dv), against a
float64 numpy reference (tests/reference.py for the output; the hand-derived VJP below for
the gradients and the log-sum-exp) and against jattn's dense path in the same dtype. On CPU
the Pallas kernels run in interpret mode (their own kernel code and VJP, as XLA ops);
cuDNN runs only on an NVIDIA GPU and is skipped elsewhere, but its adapter's mapping is
checked on CPU with jax.nn's XLA path standing in for the kernel.

Sizes are small on purpose (interpret mode compiles every kernel as XLA loops).
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import np_attention

import jattn
from jattn import _routing, kernels
from jattn._call import Operands, Settings
from jattn.kernels import _common
from jattn.kernels import cudnn as cudnn_adapter
from jattn.kernels import pallas as pallas_adapter
from jattn.kernels import pallas_triton as triton_adapter
from jattn.kernels import splash as splash_adapter

BACKEND = _routing.lowering_platform(jax.default_backend())  # 'cpu', 'cuda', 'rocm', 'tpu'


def query_of(*, softcap=None, v_head_dim=None, **fields) -> kernels.KernelQuery:
    """A :class:`jattn.kernels.KernelQuery` of ``fields`` (the rest absent or off);
    ``softcap=`` stands for a bare ``jattn.mods.softcap`` score_mod, and ``v_head_dim``
    defaults to the query's head size."""
    defaults = dict(
        has_mask=False, has_bias=False, has_lengths=False, has_segments=False,
        separate_kv_segments=False, dropout=False, return_weights=False,
        return_residual=False, score_mod=None if softcap is None else jattn.mods.softcap(softcap),
        mask_mod=None, sinks=False, block_mask=False, traced_scale=False,
        default_precision=True, needs_dense=None, window=None, is_causal=False,
    )  # fmt: skip
    fields = {**defaults, **fields}
    fields["v_head_dim"] = fields["q_shape"][-1] if v_head_dim is None else v_head_dim
    return kernels.KernelQuery(**fields)


# ----------------------------------------------------------------------------------------
# The float64 references
# ----------------------------------------------------------------------------------------


def np_mask(case: Case, q_ids, kv_ids) -> np.ndarray:
    """bool ``[batch..., 1, Tq, Tk]`` built from the case's options with numpy alone."""
    i = np.arange(case.tq)[:, None]
    j = np.arange(case.tk)[None, :]
    mask = np.ones((*case.batch, 1, case.tq, case.tk), bool)
    if case.causal:
        mask &= j <= i
    if case.window is not None:
        left, right = case.window
        mask &= j >= i - left
        if right is not None:
            mask &= j <= i + right
    if case.q_lengths is not None:
        lengths = np.asarray(case.q_lengths).reshape(case.batch)
        mask &= (np.arange(case.tq) < lengths[..., None])[..., None, :, None]
    if case.kv_lengths is not None:
        lengths = np.asarray(case.kv_lengths).reshape(case.batch)
        mask &= (np.arange(case.tk) < lengths[..., None])[..., None, None, :]
    if q_ids is not None:
        mask &= (np.asarray(q_ids)[..., :, None] == np.asarray(kv_ids)[..., None, :])[
            ..., None, :, :
        ]
    return mask


def np_attention_vjp(q, k, v, mask, scale, softcap, d_out, d_lse=None):
    """float64 forward, log-sum-exp and VJP of masked, optionally soft-capped attention.

    Derived by hand (independent of jax): with logits ``s = cap * tanh(z / cap)`` of the
    scaled scores ``z``, weights ``p = softmax(s)`` (zero rows where nothing is visible),
    ``dv = pᵀ do``, ``dp = do vᵀ``, ``ds = p (dp - Σ p dp)``, ``dz = ds (1 - tanh²)``,
    ``dq = dz k * scale``, ``dk = dzᵀ q * scale``; grouped heads sum into their K/V head.
    A cotangent ``d_lse [.., H, Tq]`` of ``lse = log Σ exp(s)`` adds ``p d_lse`` to ``ds``.

    Returns:
      ``(out [.., Tq, H, Dv], lse [.., H, Tq]`` (0 on rows that see nothing),
      ``(dq, dk, dv))``.
    """
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    *batch, _, h, d = q.shape
    tk, kh, dv_dim = k.shape[-3], k.shape[-2], v.shape[-1]
    g = h // kh
    kf, vf = np.repeat(k, g, axis=-2), np.repeat(v, g, axis=-2)
    z = np.einsum("...thd,...shd->...hts", q, kf) * scale
    tanh = np.tanh(z / softcap) if softcap else None
    logits = softcap * tanh if softcap else z
    mask = np.broadcast_to(mask, logits.shape)
    row = mask.any(-1, keepdims=True)
    masked = np.where(mask, logits, -np.inf)
    m = np.where(row, masked.max(-1, keepdims=True), 0.0)
    e = np.where(mask, np.exp(np.where(mask, masked - m, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    p = np.where(row, e / np.where(row, total, 1.0), 0.0)
    lse = np.where(row, m + np.log(np.where(row, total, 1.0)), 0.0)[..., 0]
    out = np.einsum("...hts,...shd->...thd", p, vf)
    dp = np.einsum("...thd,...shd->...hts", d_out, vf)
    dvf = np.einsum("...hts,...thd->...shd", p, d_out)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    if d_lse is not None:
        ds = ds + p * np.asarray(d_lse, np.float64)[..., None]
    if softcap:
        ds = ds * (1.0 - tanh**2)
    dq = np.einsum("...hts,...shd->...thd", ds, kf) * scale
    dkf = np.einsum("...hts,...thd->...shd", ds, q) * scale
    dk = dkf.reshape(*batch, tk, kh, g, d).sum(-2)
    dv = dvf.reshape(*batch, tk, kh, g, dv_dim).sum(-2)
    return out, lse, (dq, dk, dv)


def assert_close(actual, expected, tol: float, what: str) -> None:
    """max |actual - expected| <= tol * max(1, max |expected|), finite everywhere."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(actual).all(), f"{what}: not finite"
    err = np.abs(actual - expected).max()
    bound = tol * max(1.0, np.abs(expected).max())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


# ----------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: tuple[int, ...] = (2,)
    tq: int = 40
    tk: int = 40
    h: int = 4
    kh: int = 2
    d: int = 16
    dtype: str = "float32"
    causal: bool = False
    window: tuple[int, int | None] | None = None
    q_lengths: tuple[int, ...] | None = None  # one per batch element (flattened)
    kv_lengths: tuple[int, ...] | None = None
    segments: str | None = None  # "self": one id array; "cross": separate q and kv ids
    softcap: float | None = None

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("causal_gqa", causal=True),
    Case("window", window=(5, 3)),
    Case("window_q_longer", tq=50, tk=20, window=(2, 1)),  # rows past the keys see nothing
    Case("cross_causal", tq=24, tk=56, causal=True, q_lengths=(20, 24)),
    Case("segments_causal", causal=True, segments="self"),
    Case("cross_segments", tq=40, tk=56, segments="cross"),  # some query ids match no key
    Case("lengths", q_lengths=(30, 0), kv_lengths=(12, 40)),
    Case("fully_masked_rows", causal=True, segments="self", kv_lengths=(5, 0)),
    Case("mqa", kh=1, causal=True, kv_lengths=(33, 7)),
    Case("bfloat16", dtype="bfloat16", causal=True, segments="self", kv_lengths=(30, 17)),
    Case("batch_dims", batch=(2, 3), kh=1, causal=True, kv_lengths=(1, 0, 40, 9, 2, 30)),
    Case("softcap", causal=True, softcap=5.0),
    Case("multi_block", batch=(1,), tq=300, tk=300, h=2, kh=1, causal=True, segments="self"),
]

# What each Pallas adapter refuses among the cases (the rest must run and match).
REFUSED = {
    "pallas_triton": {
        "window": "local_window_size",
        "window_q_longer": "q_len != kv_len",
        "cross_causal": "q_len != kv_len",
        "cross_segments": "q_len != kv_len",
        "softcap": "soft-capping",
    },
    "splash": {},
}

ADAPTERS = {
    "cudnn": cudnn_adapter,
    "pallas_triton": triton_adapter,
    "splash": splash_adapter,
    "pallas": pallas_adapter,
}


def make_inputs(case: Case):
    """q, k, v, the output cotangent, and the segment ids (numpy) of a case."""
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    dtype = jnp.dtype(case.dtype)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    q = normal(*case.batch, case.tq, case.h, case.d)
    k = normal(*case.batch, case.tk, case.kh, case.d)
    v = normal(*case.batch, case.tk, case.kh, case.d)
    d_out = normal(*case.batch, case.tq, case.h, case.d)
    q_ids = kv_ids = None
    if case.segments == "self":  # arbitrary (non-contiguous, non-zero) ids
        q_ids = kv_ids = rng.choice([5, 7, 9], size=(*case.batch, case.tq)).astype(np.int32)
    elif case.segments == "cross":
        q_ids = rng.choice([1, 2], size=(*case.batch, case.tq)).astype(np.int32)
        kv_ids = rng.choice([2, 3], size=(*case.batch, case.tk)).astype(np.int32)
    return q, k, v, d_out, q_ids, kv_ids


def lengths(case: Case, which: str):
    values = getattr(case, which)
    return None if values is None else jnp.asarray(values, jnp.int32).reshape(case.batch)


def obstacle_of(module, case: Case, *, interpret: bool) -> str | None:
    return module.obstacle(
        query_of(
            platform=BACKEND,
            interpret=interpret,
            q_shape=(*case.batch, case.tq, case.h, case.d),
            kv_shape=(*case.batch, case.tk, case.kh, case.d),
            dtype=jnp.dtype(case.dtype),
            is_causal=case.causal,
            window=case.window,
            has_mask=False,
            has_bias=False,
            has_lengths=case.q_lengths is not None or case.kv_lengths is not None,
            has_segments=case.segments is not None,
            dropout=False,
            return_weights=False,
            softcap=case.softcap,
            separate_kv_segments=case.segments == "cross",
        )
    )


def run_adapter(module, case: Case, *, interpret: bool):
    """The adapter's output, lse and (dq, dk, dv) for the case's cotangent, in one jit."""
    q, k, v, d_out, q_ids, kv_ids = make_inputs(case)

    def f(q, k, v):
        ops = Operands(
            scale=case.d**-0.5,
            q_lengths=lengths(case, "q_lengths"),
            kv_lengths=lengths(case, "kv_lengths"),
            q_segments=None if q_ids is None else jnp.asarray(q_ids),
            kv_segments=None if kv_ids is None else jnp.asarray(kv_ids),
        )
        score_mod = None if case.softcap is None else jattn.mods.softcap(case.softcap)
        settings = Settings(is_causal=case.causal, window=case.window, score_mod=score_mod)
        return module.attention(q, k, v, ops, settings, interpret=interpret)

    @jax.jit
    def forward_and_vjp(q, k, v, d_out):
        out, vjp, lse = jax.vjp(f, q, k, v, has_aux=True)
        return out, lse, vjp(d_out)

    return forward_and_vjp(q, k, v, d_out)


def public(case: Case, implementation: str | None, d_lse=None):
    """``jattn.dot_product_attention(implementation=...)`` on the case, in the case's dtype.

    Returns ``(out, lse, (dq, dk, dv))``: with ``d_lse [.., H, Tq]`` the call returns its
    residual too, ``lse`` is that residual as ``[.., H, Tq]`` and the gradients take
    ``d_lse`` as its cotangent; without it ``lse`` is None.
    """
    q, k, v, d_out, q_ids, kv_ids = make_inputs(case)

    def f(q, k, v):
        return jattn.dot_product_attention(
            q,
            k,
            v,
            is_causal=case.causal,
            local_window_size=case.window,
            query_seq_lengths=lengths(case, "q_lengths"),
            key_value_seq_lengths=lengths(case, "kv_lengths"),
            query_segment_ids=q_ids,
            key_value_segment_ids=kv_ids,
            return_residual=d_lse is not None,
            implementation=implementation,
        )

    @jax.jit
    def forward_and_vjp(q, k, v, d_out, d_lse):
        result, vjp = jax.vjp(f, q, k, v)
        if d_lse is None:
            return result, None, vjp(d_out)
        out, residual = result  # residual [.., Tq, H]
        # The residual comes back in the input dtype (as jax.nn's), and so does its cotangent.
        d_residual = jnp.swapaxes(d_lse, -1, -2).astype(residual.dtype)
        return out, jnp.swapaxes(residual, -1, -2), vjp((d_out, d_residual))

    # The cross-length causal cases are top-left on purpose (as the references): the
    # CausalAlignmentWarning their calls give is expected.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jattn.CausalAlignmentWarning)
        return forward_and_vjp(q, k, v, d_out, d_lse)


def tolerance(dtype: str) -> float:
    """Relative tolerance against float64 (and the dense path) for a result in ``dtype``."""
    if dtype in ("bfloat16", "float16"):
        return 3e-2
    # float32 products on a GPU may run in TF32 (a 10-bit mantissa), in a kernel as in XLA.
    return 1e-4 if BACKEND == "cpu" else 5e-3


def assert_lse(lse, expected, empty, tol: float, what: str) -> None:
    """lse ``[.., H, Tq]`` in the inputs' dtype (float32 for float32 and float64-free calls,
    as jax.nn's residual): ``expected`` on rows that see a key, large_negative elsewhere."""
    assert lse.dtype in (jnp.float32, jnp.bfloat16, jnp.float16), lse.dtype
    rows = np.broadcast_to(empty[..., None, :], lse.shape)
    lse32 = np.asarray(lse.astype(jnp.float32))
    # A low-precision residual is the float32 lse rounded: allow its half-ulp near |lse|.
    rounding = float(jnp.finfo(lse.dtype).eps) * np.abs(np.asarray(expected)).max()
    assert_close(np.where(rows, 0.0, lse32), np.where(rows, 0.0, expected), tol + rounding, what)
    assert (np.asarray(lse)[rows] == jattn.large_negative(lse.dtype)).all(), what


def check_results(case: Case, out, lse, grads, d_lse=None) -> None:
    """One implementation's ``(out, lse or None, grads)`` against float64 numpy and dense.

    ``d_lse``: the lse's cotangent the gradients include (None: no lse term).
    """
    tol = tolerance(case.dtype)
    q, k, v, d_out, q_ids, kv_ids = make_inputs(case)
    assert out.dtype == q.dtype and out.shape == q.shape

    mask = np_mask(case, q_ids, kv_ids)
    scale = case.d**-0.5
    ref_out, ref_lse, ref_grads = np_attention_vjp(q, k, v, mask, scale, case.softcap, d_out, d_lse)
    if case.softcap is None:  # the shared reference has no soft-capping
        np.testing.assert_allclose(
            ref_out, np_attention(q, k, v, mask=mask, scale=scale), atol=1e-12
        )
    assert_close(out, ref_out, tol, "output vs float64")
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(grad, ref, tol, f"{name} vs float64")
    # Rows that attend nothing: zero output and zero dq, exactly.
    empty = ~mask.any(-1)[..., 0, :]  # [batch..., Tq]
    assert not np.asarray(out)[empty].any() and not np.asarray(grads[0])[empty].any()
    if lse is not None:
        assert_lse(lse, ref_lse, empty, tol, "lse vs float64")
    if case.softcap is None:  # jattn's dense path has no soft-capping
        dense_out, dense_lse, dense_grads = public(case, "dense", d_lse)
        assert_close(out, dense_out, tol, "output vs dense")
        for name, grad, ref in zip(("dq", "dk", "dv"), grads, dense_grads, strict=True):
            assert_close(grad, ref, tol, f"{name} vs dense")
        if lse is not None and d_lse is not None:
            assert_lse(lse, dense_lse, empty, tol, "lse vs dense")


def check_case(module, case: Case, *, interpret: bool, check_lse: bool) -> None:
    """The adapter itself (its lse carries no gradient: none is asked of it)."""
    out, lse, grads = run_adapter(module, case, interpret=interpret)
    check_results(case, out, lse if check_lse else None, grads)


# ----------------------------------------------------------------------------------------
# Conformance: the Pallas kernels (interpret mode off their own hardware), cuDNN on a GPU
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", ["pallas_triton", "splash"])
def test_pallas_kernel_conformance(name, case):
    module = ADAPTERS[name]
    interpret = not module.available(BACKEND)
    reason = obstacle_of(module, case, interpret=interpret)
    expected = REFUSED[name].get(case.name)
    if expected is not None:
        assert reason is not None and expected in reason, reason
        return
    assert reason is None, reason
    check_case(module, case, interpret=interpret, check_lse=name == "pallas_triton")


# ----------------------------------------------------------------------------------------
# The same kernels through the public API: jattn.dot_product_attention(implementation=NAME)
# ----------------------------------------------------------------------------------------

CASE_BY_NAME = {case.name: case for case in CASES}
# At least six option cases per kernel, among those it takes (REFUSED): causal, windows,
# segment ids, lengths, fully masked rows, GQA/MQA, float32 and bfloat16, batch dims.
PUBLIC_CASES = {
    "pallas_triton": (
        "causal_gqa", "segments_causal", "lengths", "fully_masked_rows", "mqa", "bfloat16",
        "batch_dims",
    ),
    "splash": (
        "causal_gqa", "window", "cross_causal", "segments_causal", "cross_segments", "lengths",
        "fully_masked_rows", "mqa", "bfloat16",
    ),
}  # fmt: skip


@pytest.fixture
def interpret_mode(monkeypatch):
    """``JATTN_PALLAS_INTERPRET=1``: the Pallas kernels run off their own hardware too."""
    monkeypatch.setenv(kernels.INTERPRET_ENV, "1")


def spy_on(monkeypatch, module) -> list:
    """Records every call of ``module.attention`` (proves the route ran the kernel)."""
    calls, real = [], module.attention

    def attention(*args, **kwargs):
        calls.append(kwargs["interpret"])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "attention", attention)
    return calls


@pytest.mark.parametrize(
    ("name", "case"),
    [(name, CASE_BY_NAME[c]) for name, cases in PUBLIC_CASES.items() for c in cases],
    ids=lambda x: str(x),
)
def test_public_api_runs_the_kernel(name, case, interpret_mode, monkeypatch):
    """``implementation=NAME`` runs the kernel (interpret mode off its hardware) with jattn's answers."""
    module = ADAPTERS[name]
    calls = spy_on(monkeypatch, module)
    out, _, grads = public(case, name)
    assert calls == [not module.available(BACKEND)]
    check_results(case, out, None, grads)


@pytest.mark.parametrize("case", ["fully_masked_rows", "mqa", "lengths"])
def test_pallas_triton_residual_and_its_gradient(case, interpret_mode):
    """``return_residual=True`` on the Pallas Triton kernel: jattn's lse, differentiable.

    The residual equals float64's log-sum-exp (large_negative where a row sees nothing),
    and gradients through output *and* residual equal float64's and the dense path's.
    """
    case = CASE_BY_NAME[case]
    rng = np.random.default_rng(1)
    d_lse = jnp.asarray(rng.standard_normal((*case.batch, case.h, case.tq)), jnp.float32)
    out, lse, grads = public(case, "pallas_triton", d_lse)
    check_results(case, out, lse, grads, d_lse)


CUDNN_CASES = [
    Case("cudnn_causal_gqa", dtype="bfloat16", tq=64, tk=64, causal=True),
    Case("cudnn_lengths", dtype="bfloat16", q_lengths=(30, 0), kv_lengths=(12, 40)),
    Case("cudnn_causal_lengths", dtype="bfloat16", causal=True, kv_lengths=(0, 17)),
    Case("cudnn_window", dtype="bfloat16", causal=True, window=(5, 3)),
    Case("cudnn_left_window", dtype="bfloat16", window=(4, 0)),
    Case("cudnn_cross", dtype="bfloat16", tq=24, tk=56, q_lengths=(20, 24)),
    Case("cudnn_mqa_batch", dtype="bfloat16", batch=(2, 3), kh=1, kv_lengths=(1, 0, 40, 9, 2, 30)),
    Case("cudnn_float16", dtype="float16", causal=True),
]


@pytest.mark.parametrize("case", CUDNN_CASES, ids=str)
def test_cudnn_conformance(case):
    if not cudnn_adapter.available(BACKEND):
        pytest.skip("cuDNN flash attention needs an NVIDIA GPU (compute capability >= 8.0)")
    case = dataclasses.replace(case, d=32)  # cuDNN: head_dim a multiple of 8
    assert obstacle_of(cudnn_adapter, case, interpret=False) is None
    check_case(cudnn_adapter, case, interpret=False, check_lse=False)


@pytest.mark.parametrize("case", CUDNN_CASES[:3], ids=str)
def test_automatic_rule_runs_cudnn_on_a_gpu(case, monkeypatch):
    """On an NVIDIA GPU, ``implementation=None`` takes cuDNN for the calls it honours."""
    if not cudnn_adapter.available(BACKEND):
        pytest.skip("cuDNN flash attention needs an NVIDIA GPU (compute capability >= 8.0)")
    case = dataclasses.replace(case, d=32)
    calls = spy_on(monkeypatch, cudnn_adapter)
    out, _, grads = public(case, None)
    assert calls == [False]
    check_results(case, out, None, grads)


@pytest.mark.parametrize("case", CUDNN_CASES[:-1], ids=str)
def test_cudnn_adapter_mapping_with_xla_standing_in(case, monkeypatch):
    """The cuDNN adapter's own work (windows, lengths, empty rows, batch dims) on any machine.

    jax.nn's XLA path computes what its cuDNN path does (jax's own tests compare them), so
    with the kernel call routed there the adapter's mapping must give jattn's answers.
    """
    real = jax.nn.dot_product_attention

    def xla_instead(*args, implementation=None, **kwargs):
        assert implementation == "cudnn"
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", xla_instead)
    check_case(cudnn_adapter, case, interpret=False, check_lse=False)


# ----------------------------------------------------------------------------------------
# Refusals: every obstacle each adapter reports
# ----------------------------------------------------------------------------------------

BASE = dict(
    platform="cpu",
    interpret=True,
    q_shape=(2, 64, 4, 32),
    kv_shape=(2, 64, 2, 32),
    dtype=jnp.dtype(jnp.float32),
    is_causal=True,
    window=None,
    has_mask=False,
    has_bias=False,
    has_lengths=False,
    has_segments=False,
    dropout=False,
    return_weights=False,
    softcap=None,
)

COMMON_REFUSALS = [
    (dict(return_weights=True), "return_weights"),
    (dict(has_mask=True), "mask array"),
    (dict(has_bias=True), "bias array"),
    (dict(dropout=True), "dropout"),
    (dict(dtype=jnp.dtype(jnp.float64)), "dtype float64"),
]

TRITON_REFUSALS = [
    *COMMON_REFUSALS,
    (dict(interpret=False), "runs on GPU only"),
    (dict(kv_shape=(2, 32, 2, 32)), "q_len != kv_len"),
    (dict(window=(4, 0)), "local_window_size"),
    (dict(softcap=30.0), "soft-capping"),
    (dict(has_segments=True, separate_kv_segments=True), "separate key_value_segment_ids"),
    (dict(v_head_dim=16), "value head size"),
    (dict(traced_scale=True), "traced scale"),
    (dict(dtype=jnp.dtype(jnp.float16), has_lengths=True), "lengths in float16"),
    (
        dict(platform="cuda", interpret=False, q_shape=(2, 64, 4, 8), kv_shape=(2, 64, 2, 8)),
        "head_dim 8",
    ),
]

SPLASH_REFUSALS = [
    *COMMON_REFUSALS,
    (dict(interpret=False), "runs on TPU only"),
    (dict(dtype=jnp.dtype(jnp.float16)), "dtype float16"),
]


@pytest.mark.parametrize(("change", "expected"), TRITON_REFUSALS)
def test_pallas_triton_refusals(change, expected):
    reason = triton_adapter.obstacle(query_of(**{**BASE, **change}))
    assert reason is not None and expected in reason, reason


@pytest.mark.parametrize(("change", "expected"), SPLASH_REFUSALS)
def test_splash_refusals(change, expected):
    reason = splash_adapter.obstacle(query_of(**{**BASE, **change}))
    assert reason is not None and expected in reason, reason


def test_pallas_adapters_accept_what_they_take():
    """The options each Pallas adapter takes leave obstacle() at None."""
    assert (
        triton_adapter.obstacle(query_of(**{**BASE, "has_lengths": True, "has_segments": True}))
        is None
    )
    assert (
        triton_adapter.obstacle(query_of(**{**BASE, "platform": "cuda", "interpret": False}))
        is None
    )
    splash_all = dict(window=(8, None), has_lengths=True, has_segments=True, softcap=30.0)
    splash_all.update(kv_shape=(2, 96, 1, 32), separate_kv_segments=True, v_head_dim=16)
    splash_all.update(dtype=jnp.dtype(jnp.bfloat16), traced_scale=True)
    assert splash_adapter.obstacle(query_of(**{**BASE, **splash_all})) is None
    assert (
        splash_adapter.obstacle(query_of(**{**BASE, "platform": "tpu", "interpret": False})) is None
    )


def test_cudnn_refuses_off_gpu(hopper):
    reason = cudnn_adapter.obstacle(query_of(**{**BASE, "dtype": jnp.dtype(jnp.bfloat16)}))
    assert reason is not None and "NVIDIA GPU" in reason


CUDNN_REFUSALS = [
    *COMMON_REFUSALS[:-1],
    (dict(dtype=jnp.dtype(jnp.float32)), "dtype float32"),
    (dict(q_shape=(2, 64, 4, 36), kv_shape=(2, 64, 2, 36)), "head_dim 36"),
    (dict(v_head_dim=16), "value head size"),
    (dict(has_segments=True), "segment ids"),
    (dict(softcap=30.0), "soft-capping"),
    (dict(traced_scale=True), "traced scale"),
    (dict(kv_shape=(2, 32, 2, 32)), "q_len != kv_len"),
    (dict(window=(4, 0), has_lengths=True), "window together with lengths"),
    (dict(window=(4, 2), is_causal=False), "reaching right"),
]


@pytest.fixture
def hopper(monkeypatch):
    """Makes the cuDNN adapter see a compute-capability-9.0 GPU (its checks are static)."""
    monkeypatch.setattr(cudnn_adapter, "compute_capability", lambda: (9, 0))


@pytest.mark.parametrize(("change", "expected"), CUDNN_REFUSALS)
def test_cudnn_refusals(change, expected, hopper):
    base = {**BASE, "platform": "cuda", "dtype": jnp.dtype(jnp.bfloat16)}
    assert cudnn_adapter.obstacle(query_of(**base)) is None
    reason = cudnn_adapter.obstacle(query_of(**{**base, **change}))
    assert reason is not None and expected in reason, reason


def test_cudnn_head_dim_limit_follows_the_gpu(monkeypatch):
    base = {**BASE, "platform": "cuda", "dtype": jnp.dtype(jnp.bfloat16)}
    base.update(q_shape=(2, 64, 4, 256), kv_shape=(2, 64, 2, 256))
    monkeypatch.setattr(cudnn_adapter, "compute_capability", lambda: (9, 0))
    assert cudnn_adapter.obstacle(query_of(**base)) is None
    monkeypatch.setattr(cudnn_adapter, "compute_capability", lambda: (8, 0))
    assert "up to 128" in cudnn_adapter.obstacle(query_of(**base))
    monkeypatch.setattr(cudnn_adapter, "compute_capability", lambda: (7, 5))
    assert "compute capability >= 8.0" in cudnn_adapter.obstacle(query_of(**base))
    monkeypatch.setattr(cudnn_adapter, "compute_capability", lambda: None)
    assert "NVIDIA GPU" in cudnn_adapter.obstacle(query_of(**base))


# ----------------------------------------------------------------------------------------
# The package's small pieces
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), ("true", True), ("0", False), ("", False)]
)
def test_interpret_requested(value, expected, monkeypatch):
    monkeypatch.setenv(kernels.INTERPRET_ENV, value)
    assert kernels.interpret_requested() is expected


def test_interpret_not_requested_when_unset(monkeypatch):
    monkeypatch.delenv(kernels.INTERPRET_ENV, raising=False)
    assert kernels.interpret_requested() is False


def test_adapter_lookup():
    from jattn.kernels.cpu import adapter as cpu_adapter  # tests/test_cpu_kernel.py checks it

    for name in kernels.KERNELS:
        assert kernels.adapter(name) is {**ADAPTERS, "cpu_fused": cpu_adapter}[name]
    with pytest.raises(ValueError, match="no kernel adapter named 'flash'"):
        kernels.adapter("flash")


def test_first_occurrence_matches_numpy():
    ids = np.random.default_rng(0).integers(-3, 4, size=(3, 50)).astype(np.int32)
    expected = np.array([[list(row).index(x) for x in row] for row in ids])
    np.testing.assert_array_equal(_common.first_occurrence(jnp.asarray(ids)), expected)


@pytest.mark.parametrize("name", kernels.KERNELS)
def test_every_adapter_keeps_the_contract(name):
    """The module-level names and signatures of :class:`jattn.kernels.Kernel`."""
    import inspect

    module = kernels.adapter(name)
    assert module.NAME == name
    assert isinstance(module.RETURNS_LSE, bool) and isinstance(module.LSE_HAS_GRADIENT, bool)
    assert list(inspect.signature(module.available).parameters) == ["platform"]
    assert list(inspect.signature(module.obstacle).parameters) == ["query"]
    params = inspect.signature(module.attention).parameters
    # The contract's parameters first; an adapter may add keyword-only ones with defaults.
    assert list(params)[:6] == ["q", "k", "v", "ops", "settings", "interpret"]
    assert params["interpret"].kind is inspect.Parameter.KEYWORD_ONLY
    for extra in list(params.values())[6:]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not extra.empty
    if name == "cpu_fused":  # jattn's CPU kernel runs natively on CPU where it was built
        built = not kernels.adapter("cpu_fused").status().startswith("off")
        assert module.available("cpu") is built and not module.available("tpu")
    else:  # the accelerator kernels run on CPU only in interpret mode
        assert module.available("cpu") is False
