"""Which implementation runs an attention call: the one routing table.

Each implementation has a *route*: a function saying why it cannot honour a call (None
when it can) and a function running it. An explicit ``implementation=`` that cannot
honour the call raises a ValueError with that reason; the automatic rule (``None``)
walks :data:`AUTO`, the candidates of the backend in order, and takes the first that
pays off at these lengths and can honour the call (``'dense'`` honours every call).

The accelerator kernels (``'cudnn'``, ``'pallas_triton'``, ``'splash'``) are routed
through their adapters in :mod:`jattn.kernels`: the route translates the validated call
into the adapter's static question (``obstacle``), adds what only jattn knows
(``return_residual`` needs a log-sum-exp, flax's einsum hooks and an explicit matmul
``precision`` need jattn's own einsums), and turns the kernel's lse into jattn's
residual. The Pallas kernels run off their own hardware only in interpret mode, and only
when asked for by name with ``JATTN_PALLAS_INTERPRET=1``; the automatic rule never picks
interpret mode (no CPU candidate is a kernel).

jattn's own Pallas kernel (``'pallas'``) goes through the kernel contract
(:func:`kernel_query` builds its :class:`jattn.kernels.KernelQuery` per platform).

Routes are chosen per platform at lowering time. The automatic rule of a traced call
(:func:`run`) emits one ``jax.lax.platform_dependent`` branch per platform: the host's
route, traced now (:func:`choose`, as on the host alone), and for every other platform a
deferred branch (:mod:`jattn.kernels._deferred`) whose route is chosen
(:func:`_auto_on`) and traced only when the program is lowered for that platform, so
``jax.jit(f).trace(...).lower(lowering_platforms=('cuda',))`` or ``jax.export(...,
platforms=['cpu', 'cuda', 'tpu'])`` from a CPU host carries each platform's kernel at no
tracing cost on the host. Under :func:`jattn.kernels.lowering_platforms` the platforms
named get their routes traced at once (none named: the host's route only, no deferred
branch); the old adapters then judge by that platform too when only one is routed for
(:func:`_adapter_platform`), as they do inside a deferred branch's lowering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import types
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jattn import _checks, _per_device, _util, blockwise, dense, kernels, mods
from jattn._call import DenseExtras, Operands, Settings
from jattn.kernels import _deferred

Array = jax.Array

# The automatic rule's thresholds. On CPU the blockwise path is used when q_len and kv_len
# are both at least AUTO_MIN_LEN: from there on it measured faster, below it dense was as
# fast or faster (benchmarks/results.md), and one-query decoding stays dense. Elsewhere
# dense is kept unless its [q_len, kv_len] logits per (batch, head) reach
# AUTO_DENSE_MAX_SCORES elements.
AUTO_MIN_LEN = 256
AUTO_DENSE_MAX_SCORES = 4096 * 4096
# Splash pads both lengths to a multiple of 128 (the TPU lane width): a shorter query
# block is mostly padding, and XLA's dense path is as good there.
SPLASH_MIN_Q_LEN = 128
# The fused CPU kernel (jattn.kernels.cpu) from this many keys on: below it XLA's dense
# path measured as fast or faster (CPU time, B=1 H=8 D=64: T=64 dense 0.16 ms vs 0.25
# fused; T=128 0.89 vs 0.54).
CPU_FUSED_MIN_KV_LEN = 128
# ... except for fewer queries than this under reverse-mode autodiff: dense, whatever the
# keys (the kernel's backward on so few queries measured 2-3x slower than dense, 1-15
# queries against 16-4096 keys, B=1-2 H=8 D=64).
CPU_FUSED_FEW_QUERIES = 16


class Route(NamedTuple):
    """How to refuse and how to run one implementation."""

    obstacle: Callable[..., str | None]  # (q, k, v, ops, settings, extras) -> reason or None
    run: Callable[..., tuple]  # (q, k, v, ops, settings, extras) -> (out, weights, residual)


def _autodiff_kinds(x) -> list[str]:
    """The autodiff traced around ``x``, outermost first: "jvp" (forward mode) or "lin"
    (linearize: reverse mode), one entry per level."""
    kinds = []
    while isinstance(x, jax.core.Tracer):
        # Tracer classes are matched by name: jax exports no stable type for linearize's.
        kind = {"JVPTracer": "jvp", "LinearizeTracer": "lin"}.get(type(x).__name__)
        if kind:
            kinds.append(kind)
        x = x.primal if hasattr(x, "primal") else getattr(x, "val", None)
    return kinds


def _custom_vjp_obstacle(*arrays) -> str | None:
    """Why the custom VJP cannot serve the autodiff applied to ``arrays`` (None: it can).

    Walks each array's tracers from the outermost transformation inward. A custom VJP
    serves reverse mode (``jax.grad``) and forward mode *over* it (``jax.hessian``), but not
    forward mode applied to the call itself (``jax.jvp``, ``jax.jacfwd``), nor reverse
    mode of reverse mode (``jax.grad(jax.grad(f))``: blockwise's backward pass loops over a
    dynamic number of tiles, the kernels' are kernels). The blockwise path and every kernel
    have a custom VJP. Only transformations traced around this call are visible:
    ``jax.jvp(jax.jit(f))`` is not (JAX then raises its own error).
    """
    for x in arrays:
        kinds = _autodiff_kinds(x)
        if kinds[:1] == ["jvp"]:
            return (
                "forward-mode autodiff (jax.jvp, jax.jacfwd) is applied to this call, and the "
                "path has a custom VJP (reverse mode only)"
            )
        if kinds.count("lin") > 1:
            return (
                "reverse mode is nested (jax.grad of jax.grad), and the path's custom "
                "backward pass cannot itself be differentiated in reverse mode"
            )
    return None


def _kernel_autodiff_obstacle(*arrays) -> str | None:
    """:func:`_custom_vjp_obstacle`, and forward mode anywhere around the call: a kernel's
    backward pass is a kernel too (C++, Pallas, cuDNN) with no forward-mode rule, so forward
    over reverse (``jax.hessian``, ``jax.jacfwd(jax.grad(f))``) cannot differentiate it; the
    blockwise path's backward pass is JAX code and can."""
    reason = _custom_vjp_obstacle(*arrays)
    if reason is None and any("jvp" in _autodiff_kinds(x) for x in arrays):
        reason = (
            "forward mode over reverse mode (jax.hessian, jax.jacfwd of jax.grad) is applied "
            "to this call, and the kernel's backward pass has no forward-mode rule"
        )
    return reason


# The kernels whose calls carry their own partitioning rule (jax's cuDNN attention; no GPU
# here to check it on): they take explicitly sharded operands as they are. The others run
# on each device's rows and heads inside jax.shard_map where that is the same call
# (jattn._per_device), else are refused (:func:`_sharding_obstacle`); blockwise takes
# every sharded call (its loops run with the mesh's axes made automatic), and dense is
# XLA's own ops.
PARTITIONED_KERNELS = ("cudnn",)


def _sharding_obstacle(
    name: str, query, key, value, ops: Operands, settings: Settings
) -> str | None:
    """Why kernel ``name`` cannot take explicitly sharded operands (None: it can, or they
    are not). Its custom call runs on whole arrays with no partitioning rule: XLA would
    gather the operands to every device and compute the whole call on each, and the
    gradients would come back replicated, which jax's types refuse; so it runs on each
    device's share (:func:`_per_device.run`) unless that would be another call."""
    if name in PARTITIONED_KERNELS:
        return None
    reason = _per_device.obstacle(query, key, value, ops, settings)
    if reason is None:
        return None
    return (
        f"the operands are sharded over mesh axes {_util.sharded_axes(query, key, value, ops)} "
        f"(explicit sharding, jax.make_mesh's default), and the {name} kernel, which has no "
        f"partitioning rule, runs on each device's rows and heads only when that is the same "
        f"call: here {reason}; call it inside jax.shard_map on each device's shard to use it"
    )


def _per_device_check(name: str, obstacle: Callable[..., str | None]) -> Callable[..., str | None]:
    """``obstacle`` after :func:`_sharding_obstacle`."""

    def check(query, key, value, ops, settings, extras):
        reason = _sharding_obstacle(name, query, key, value, ops, settings)
        return reason if reason is not None else obstacle(query, key, value, ops, settings, extras)

    return check


def _per_device_run(name: str, run: Callable) -> Callable:
    """Kernel ``name``'s ``run`` on each device's rows and heads of explicitly sharded
    operands (as it is for a kernel with its own partitioning rule)."""
    if name in PARTITIONED_KERNELS:
        return run

    def sharded(query, key, value, ops, settings, extras):
        return _per_device.run(run, query, key, value, ops, settings, extras)

    return sharded


def _dense_run(query, key, value, ops, settings, extras):
    return dense.attention(query, key, value, ops, settings, extras)


def _blockwise_obstacle(query, key, value, ops: Operands, settings, extras: DenseExtras):
    autodiff = _custom_vjp_obstacle(query, key, value)
    if autodiff is not None:
        return autodiff
    needed = extras.needed()
    if needed is not None:
        return needed
    if not isinstance(ops.scale, numbers.Real):
        return f"scale must be a Python number for it, got {type(ops.scale).__name__}"
    if _util.sharded_axes(query, key, value, ops):
        return blockwise.explicit_closure(settings)
    return None


def _blockwise_run(query, key, value, ops, settings, extras):
    out, lse = blockwise.attention(query, key, value, ops, settings)
    return out, None, lse


# ----------------------------------------------------------------------------------------
# The accelerator kernels
# ----------------------------------------------------------------------------------------


def lowering_platform(backend: str) -> str:
    """The lowering platform name (``'cpu'``, ``'cuda'``, ``'rocm'``, ``'tpu'``) of a
    ``jax.default_backend()`` name: ``'gpu'`` is CUDA or ROCm by the GPU's platform
    version (CUDA when no GPU device answers, e.g. a simulated backend)."""
    if backend != "gpu":
        return backend
    try:
        version = jax.devices("gpu")[0].client.platform_version.lower()
    except (RuntimeError, AttributeError):
        return "cuda"
    return "rocm" if "rocm" in version else "cuda"


def _interpret(module: kernels.Kernel, platform: str) -> bool:
    """Interpret mode: asked for (``JATTN_PALLAS_INTERPRET``) and off the kernel's hardware."""
    return kernels.interpret_requested() and not module.available(platform)


def _default_precision(precision) -> bool:
    """True for None / ``Precision.DEFAULT`` (or a pair of them): what the kernels compute."""
    if isinstance(precision, (tuple, list)):
        return all(_default_precision(p) for p in precision)
    if precision is None:
        return True
    try:
        return jax.lax.Precision(precision) == jax.lax.Precision.DEFAULT
    except (TypeError, ValueError):  # a DotAlgorithm or another explicit choice
        return False


def kernel_query(
    query, key, value, ops: Operands, settings: Settings, extras: DenseExtras, *, platform: str,
    interpret: bool,
) -> kernels.KernelQuery:  # fmt: skip
    """The static description of a validated call that a kernel adapter reads (built once).

    Args:
      query, key, value: ``[batch..., Tq, H, D]``, ``[batch..., Tk, K, D]``,
        ``[batch..., Tk, K, Dv]`` (arrays or tracers; only shapes and dtypes are read).
      ops, settings, extras: the call (:mod:`jattn._call`).
      platform: the lowering platform (:func:`lowering_platform`).
      interpret: whether the adapter would run in interpret mode (:func:`_interpret`).
    """
    return kernels.KernelQuery(
        platform=platform,
        interpret=interpret,
        q_shape=tuple(query.shape),
        kv_shape=tuple(key.shape),
        v_head_dim=value.shape[-1],
        dtype=query.dtype,
        is_causal=settings.is_causal,
        window=settings.window,
        has_mask=ops.mask is not None,
        has_bias=ops.bias is not None,
        has_lengths=ops.q_lengths is not None or ops.kv_lengths is not None,
        has_segments=ops.q_segments is not None,
        separate_kv_segments=ops.kv_segments is not ops.q_segments,
        dropout=ops.dropout_rng is not None and not _static_zero(ops.dropout_rate),
        return_weights=extras.return_weights or extras.module is not None,
        return_residual=settings.return_residual,
        score_mod=settings.score_mod,
        mask_mod=settings.mask_mod,
        sinks=ops.sinks is not None,
        block_mask=ops.block_mask is not None,
        traced_scale=not isinstance(ops.scale, numbers.Real),
        default_precision=_default_precision(settings.precision),
        needs_dense=extras.needed(),
    )


# The kernels that soft-cap the logits natively (splash's attn_logits_soft_cap): they take
# a bare jattn.mods.softcap score_mod; every kernel refuses any other modifier.
NATIVE_SOFTCAP = ("splash",)


def _modifiers_given(q: kernels.KernelQuery) -> str:
    """The FlexAttention-style options of the call, named for a refusal ('' if none)."""
    given = [
        name
        for name, present in (
            ("score_mod", q.score_mod is not None),
            ("mask_mod", q.mask_mod is not None and not q.block_mask),
            ("sinks", q.sinks),
            ("block_mask", q.block_mask),
        )
        if present
    ]
    return ", ".join(given)


def _kernel_modifiers(name: str, q: kernels.KernelQuery) -> str | None:
    """Why the kernel cannot take the call's modifiers (None: it can)."""
    given = _modifiers_given(q)
    if name in NATIVE_SOFTCAP and mods.native_softcap(q.score_mod) is not None:
        given = ", ".join(g for g in given.split(", ") if g != "score_mod")
    if not given:
        return None
    native = " (only a bare jattn.mods.softcap(cap) score_mod)" if name in NATIVE_SOFTCAP else ""
    return f"{name} does not take {given}{native}"


def _kernel_obstacle(name: str):
    def obstacle(query, key, value, ops: Operands, settings: Settings, extras: DenseExtras):
        module = kernels.adapter(name)
        platform = _adapter_platform()
        q = kernel_query(
            query, key, value, ops, settings, extras, platform=platform,
            interpret=_interpret(module, platform),
        )  # fmt: skip
        reason = _kernel_modifiers(name, q)
        if reason is None:
            reason = module.obstacle(q)
        if reason is None:
            reason = q.needs_dense  # flax's einsum hooks
        if reason is None:
            reason = _kernel_autodiff_obstacle(query, key, value)
        if reason is None and q.return_residual and not module.RETURNS_LSE:
            reason = f"return_residual=True ({name} does not return its log-sum-exp)"
        if reason is None and not q.default_precision:
            reason = f"precision={settings.precision!r} (the kernel picks its own matmul precision)"
        return reason

    return obstacle


def _kernel_run(name: str):
    def run(query, key, value, ops: Operands, settings: Settings, extras):
        module = kernels.adapter(name)
        interpret = _interpret(module, _adapter_platform())

        def attend(q, k, v):
            return module.attention(q, k, v, ops, settings, interpret=interpret)

        out, lse = attend(query, key, value)
        if not settings.return_residual:
            return out, None, None
        if not module.LSE_HAS_GRADIENT:
            lse = _lse_with_gradient(attend, query, key, lse, ops.scale)
        return out, None, jnp.swapaxes(lse, -1, -2)  # [batch..., H, Tq] -> [batch..., Tq, H]

    return run


def _lse_with_gradient(attend, query, key, lse, scale) -> Array:
    """The kernel's lse ``[batch..., H, Tq]`` (values, no gradient) made differentiable.

    With weights ``p = softmax(s)`` of the scaled logits ``s_ij = scale q_i . k_j``,
    ``d lse_i / d q_i = scale sum_j p_ij k_j`` and ``d lse_i / d k_j = scale p_ij q_i``.
    Both come from the kernel itself with the keys as values: ``b = attend(q, k, k)`` is
    ``sum_j p_ij k_j`` and its value gradient is ``sum_i p_ij (cotangent)_i``. So
    ``f_i = scale (q_i . sg(b_i) + sg(q_i) . b_i)``, with ``b`` differentiable in its values
    only, has lse's gradient, and ``lse + f - sg(f)`` keeps lse's values (``f - sg(f)`` is
    exactly 0). Rows that attend nothing have ``b = 0`` and no gradient. Exact without
    soft-capping (which no route uses yet). Costs one more kernel call, only for
    ``return_residual=True``.
    """
    sg = jax.lax.stop_gradient
    b = attend(sg(query), sg(key), key)[0].astype(jnp.float32)  # [batch..., Tq, H, D]
    q32 = query.astype(jnp.float32)
    f = scale * (jnp.sum(q32 * sg(b), axis=-1) + jnp.sum(sg(q32) * b, axis=-1))  # [.., Tq, H]
    f = jnp.swapaxes(f, -1, -2)  # [batch..., H, Tq]
    return sg(lse) + (f - sg(f))


# ----------------------------------------------------------------------------------------
# jattn's own Pallas kernel ('pallas'), routed through the kernel contract per platform
# ----------------------------------------------------------------------------------------


def host_platform() -> str:
    """The default backend as a lowering platform name (:func:`lowering_platform`)."""
    return lowering_platform(jax.default_backend())


def _adapter_platform() -> str:
    """The platform the kernel adapters judge a call by: the one platform routed for under
    :func:`jattn.kernels.lowering_platforms`, else the host's."""
    platforms = kernels.route_platforms()
    if platforms is not None and len(platforms) == 1:
        return platforms[0]
    return host_platform()


def _routed_platforms() -> tuple[str, ...]:
    return kernels.route_platforms() or (host_platform(),)


def _pallas_interpret(platform: str) -> bool:
    return kernels.interpret_requested() and not kernels.adapter("pallas").available(platform)


def _host_gpu_obstacle(platform: str) -> str | None:
    """On a GPU host, the Triton kernel needs an NVIDIA GPU of compute capability >= 8.0."""
    if platform != "cuda" or jax.default_backend() != "gpu":
        return None  # lowered from another host: the device is the program's business
    capability = kernels.adapter("cudnn").compute_capability()
    if capability is None or capability < (8, 0):
        return f"an NVIDIA GPU of compute capability >= 8.0 (this GPU: {capability})"
    return None


def _pallas_obstacle_on(platform: str, query, key, value, ops, settings, extras) -> str | None:
    """Why jattn's Pallas kernel cannot honour the call lowered for ``platform``."""
    sharded = _sharding_obstacle("pallas", query, key, value, ops, settings)
    if sharded is not None:
        return sharded
    module = kernels.adapter("pallas")
    gpu = _host_gpu_obstacle(platform)
    if gpu is not None and not _pallas_interpret(platform):
        return f"jattn's Pallas kernel needs {gpu}"
    interpret = _pallas_interpret(platform)
    reason = module.obstacle(
        kernel_query(
            query, key, value, ops, settings, extras, platform=platform, interpret=interpret
        )
    )
    return reason if reason is not None else _kernel_autodiff_obstacle(query, key, value)


def _pallas_obstacle(*call) -> str | None:
    """Asked for by name: it must honour the call on every platform routed for."""
    platforms = _routed_platforms()
    for platform in platforms:
        reason = _pallas_obstacle_on(platform, *call)
        if reason is not None:
            return reason if len(platforms) == 1 else f"on {platform}: {reason}"
    return None


def _pallas_run_on(platform: str):
    def run(query, key, value, ops: Operands, settings: Settings, extras):
        module = kernels.adapter("pallas")
        interpret = _pallas_interpret(platform)
        out, lse = module.attention(
            query, key, value, ops, settings, interpret=interpret, platform=platform
        )
        residual = jnp.swapaxes(lse, -1, -2) if settings.return_residual else None
        return out, None, residual

    return run


# ----------------------------------------------------------------------------------------
# jattn's own CPU kernel: the adapter judges the modifiers it fuses itself
# ----------------------------------------------------------------------------------------

# The kernels that take modifiers (sinks, soft-cap, ALiBi) and judge them in obstacle().
CONTRACT_KERNELS = ("cpu_fused",)


def _static_zero(rate) -> bool:
    return isinstance(rate, numbers.Real) and float(rate) == 0.0


def _contract_obstacle(name: str):
    def obstacle(query, key, value, ops: Operands, settings: Settings, extras: DenseExtras):
        module = kernels.adapter(name)
        platform = _adapter_platform()
        interpret = _interpret(module, platform)
        call = kernel_query(
            query, key, value, ops, settings, extras, platform=platform, interpret=interpret
        )
        reason = module.obstacle(call)
        if reason is None:
            reason = _kernel_autodiff_obstacle(query, key, value)
        if reason is None and settings.return_residual and not module.RETURNS_LSE:
            reason = f"return_residual=True ({name} does not return its log-sum-exp)"
        return reason

    return obstacle


def _contract_run(name: str):
    def run(query, key, value, ops: Operands, settings: Settings, extras):
        module = kernels.adapter(name)
        interpret = _interpret(module, _adapter_platform())
        out, lse = module.attention(query, key, value, ops, settings, interpret=interpret)
        if not settings.return_residual:
            return out, None, None
        if not module.LSE_HAS_GRADIENT:
            lse = _lse_with_gradient(
                lambda q, k, v: module.attention(q, k, v, ops, settings, interpret=False),
                query, key, lse, ops.scale,
            )  # fmt: skip
        return out, None, jnp.swapaxes(lse, -1, -2)  # [batch..., H, Tq] -> [batch..., Tq, H]

    return run


def _pallas_variant(platform: str) -> tuple[bool, bool]:
    """What makes the kernel differ between platforms: interpret mode, the TPU layout."""
    return _pallas_interpret(platform), platform == "tpu"


def _pallas_run(*call):
    return _per_platform({p: ("pallas", _pallas_variant(p)) for p in _routed_platforms()}, call)


def _route_runner(name: str, platform: str):
    return _pallas_run_on(platform) if name == "pallas" else ROUTES[name].run


def _per_platform(choices: dict[str, tuple], call):
    """Runs ``call`` on each platform's route ``{platform: (name, variant)}``: directly when
    they all agree, else one ``jax.lax.platform_dependent`` branch per platform (each
    lowered only for its platform)."""
    query, key, value, ops, settings, extras = call
    if len(set(choices.values())) == 1:
        platform, (name, _) = next(iter(choices.items()))
        return _route_runner(name, platform)(*call)
    branches = {
        platform: (lambda q, k, v, name=name, platform=platform:
                   _route_runner(name, platform)(q, k, v, ops, settings, extras))
        for platform, (name, _) in choices.items()
    }  # fmt: skip
    return jax.lax.platform_dependent(query, key, value, **branches)


ROUTES: dict[str, Route] = {
    "dense": Route(lambda *args: None, _dense_run),
    "blockwise": Route(_blockwise_obstacle, _blockwise_run),
    # The adapters of jax's kernels: modifiers refused here; the others judge their own.
    **{
        name: Route(
            _per_device_check(name, _kernel_obstacle(name)),
            _per_device_run(name, _kernel_run(name)),
        )
        for name in kernels.KERNELS
        if name not in (*CONTRACT_KERNELS, "pallas")
    },
    **{
        name: Route(
            _per_device_check(name, _contract_obstacle(name)),
            _per_device_run(name, _contract_run(name)),
        )
        for name in CONTRACT_KERNELS
    },
    "pallas": Route(_pallas_obstacle, _per_device_run("pallas", _pallas_run)),
}
ALIASES = _util.ALIASES  # jax.nn's names
# Every implementation name is routed (the one list: jattn._util.IMPLEMENTATIONS).
assert set(ROUTES) | set(ALIASES) == set(_util.IMPLEMENTATIONS), "a name without a route"


# ----------------------------------------------------------------------------------------
# The automatic rule
# ----------------------------------------------------------------------------------------


def _blockwise_pays(query, key, backend: str) -> bool:
    q_len, kv_len = query.shape[-3], key.shape[-3]
    if backend == "cpu":
        return min(q_len, kv_len) >= AUTO_MIN_LEN
    return q_len * kv_len >= AUTO_DENSE_MAX_SCORES


def _splash_pays(query, key, backend: str) -> bool:
    return query.shape[-3] >= SPLASH_MIN_Q_LEN


def _pallas_pays(query, key, backend: str) -> bool:
    # Its tiles hold at least 16 query rows (Triton's dot), 128 on TPUs (as splash's);
    # shorter query blocks (decoding) are mostly padding, and XLA's dense path is as good.
    return query.shape[-3] >= (SPLASH_MIN_Q_LEN if backend == "tpu" else 16)


def _cpu_fused_pays(query, key, backend: str) -> bool:
    if query.shape[-3] < CPU_FUSED_FEW_QUERIES and any(_autodiff_kinds(x) for x in (query, key)):
        return False
    return key.shape[-3] >= CPU_FUSED_MIN_KV_LEN


# When a candidate pays off at the call's lengths (no entry: always).
PAYS = {
    "blockwise": _blockwise_pays,
    "splash": _splash_pays,
    "pallas": _pallas_pays,
    "cpu_fused": _cpu_fused_pays,
}

# The automatic rule: per backend, the candidates in order; the first that pays off and
# can honour the call wins. The kernels come first wherever they take the call, and jattn's
# own paths take everything they refuse (dropout, mask arrays, bias, returned weights,
# dtypes and head sizes a kernel rejects).
# * gpu: cuDNN (NVIDIA, compute capability >= 8.0, bfloat16/float16). Not 'pallas_triton':
#   jax's own GPU tests skip its backward on compute capability >= 8.0 for precision
#   issues and jax 0.12 deprecates it, so it runs only when asked for by name.
# * gpu: cuDNN for the plain calls it takes, then jattn's own Pallas kernel ('pallas') for
#   every option it covers (dropout, modifiers, block masks, sinks, bias).
# * tpu: splash, from SPLASH_MIN_Q_LEN queries on, then jattn's Pallas kernel (Mosaic) for
#   what splash lacks (dropout, bias, sinks, score_mod, mask_mod, return_residual).
# * cpu (and any other backend): jattn's fused CPU kernel where it was built and takes the
#   call, from CPU_FUSED_MIN_KV_LEN keys on (not for fewer than CPU_FUSED_FEW_QUERIES
#   queries under reverse-mode autodiff); then jattn's own paths; never a kernel in
#   interpret mode.
AUTO: dict[str, tuple[str, ...]] = {
    "gpu": ("cudnn", "pallas", "blockwise", "dense"),
    "tpu": ("splash", "pallas", "blockwise", "dense"),
    "cpu": ("cpu_fused", "blockwise", "dense"),
}


def _alternatives(name: str, *call) -> str:
    """What to use instead of ``name``: the automatic rule and jattn's paths that can."""
    own = [
        repr(n) for n in ("blockwise", "dense") if n != name and ROUTES[n].obstacle(*call) is None
    ]
    return "implementation=None (automatic: the fastest path that can) or " + " or ".join(own)


def choose(implementation, query, key, value, ops, settings, extras) -> str:
    """The implementation that runs the call (raises if an explicit one cannot honour it)."""
    _checks.implementation(implementation)
    call = (query, key, value, ops, settings, extras)
    if implementation is not None:
        name = ALIASES.get(implementation, implementation)
        reason = ROUTES[name].obstacle(*call)
        if reason is not None:
            raise ValueError(
                f"implementation={implementation!r} cannot be used here: {reason}. Use "
                f"{_alternatives(name, *call)}."
            )
        return name
    backend = jax.default_backend()
    for name in AUTO.get(backend, AUTO["cpu"]):
        pays = PAYS.get(name)
        if (pays is None or pays(query, key, backend)) and ROUTES[name].obstacle(*call) is None:
            return name
    raise AssertionError("'dense' honours every call")  # unreachable: dense is last


def _auto_on(platform: str, *call) -> str:
    """The automatic rule's route for ``platform`` (the old adapters judge by the host)."""
    query, key = call[0], call[1]
    kind = "gpu" if platform in ("cuda", "rocm") else platform
    for name in AUTO.get(kind, AUTO["cpu"]):
        pays = PAYS.get(name)
        if pays is not None and not pays(query, key, kind):
            continue
        if name == "pallas":
            reason = _pallas_obstacle_on(platform, *call)
        else:
            reason = ROUTES[name].obstacle(*call)
        if reason is None:
            return name
    raise AssertionError("'dense' honours every call")  # unreachable: dense is last


# ----------------------------------------------------------------------------------------
# The default: the host's route traced now, every other platform's deferred
# ----------------------------------------------------------------------------------------

# What the branch of a platform without a rule of its own runs (jax plugins): jattn's XLA
# paths, the first that pays off and can.
AUTO_ELSEWHERE = ("blockwise", "dense")

# True while _defer_host() is active (tests): the host's branch is deferred too.
_DEFER_HOST = [False]


@contextlib.contextmanager
def _defer_host():
    """Defers the host's branch too (tests check the deferred machinery on the host)."""
    _DEFER_HOST.append(True)
    try:
        yield
    finally:
        _DEFER_HOST.pop()


def _deferrable(call) -> bool:
    """Whether the automatic rule may defer the other platforms' routes: the call is traced
    (eager calls run where they are) and some kernel may take it (forward-mode or nested
    autodiff, returned weights and flax's hooks make every platform's route dense)."""
    query, key, value, _, _, extras = call
    if not any(isinstance(x, jax.core.Tracer) for x in (query, key, value)):
        return False
    return extras.needed() is None and _custom_vjp_obstacle(query, key, value) is None


def _closure(fn):
    """The contents of a plain function's closure cells when some hold a tracer (they
    become operands of the deferred branch), else None."""
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return None
    try:
        values = tuple(cell.cell_contents for cell in fn.__closure__)
    except ValueError:  # a cell not yet filled
        return None
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(values))
    return values if traced else None


def _with_closure(fn, values):
    """``fn`` with its closure cells holding ``values``."""
    cells = tuple(types.CellType(v) for v in values)
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def _split_call(call):
    """``(operands, rebuild)``: the call's arrays, each once (tracers included: the query,
    the operands, the modifiers' arrays and closed-over tracers), and ``rebuild(arrays)``,
    the call again with ``arrays`` in their places (identical arrays stay identical)."""
    query, key, value, ops, settings, extras = call
    cells = (_closure(settings.score_mod), _closure(settings.mask_mod))
    leaves, tree = jax.tree.flatten(
        (query, key, value, ops, settings.score_mod, settings.mask_mod, cells)
    )
    operands, index, slots = [], {}, []
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            if id(leaf) not in index:
                index[id(leaf)] = len(operands)
                operands.append(leaf)
            slots.append((True, index[id(leaf)]))
        else:
            slots.append((False, leaf))

    def rebuild(arrays):
        new = [arrays[x] if is_operand else x for is_operand, x in slots]
        q, k, v, new_ops, score_mod, mask_mod, new_cells = jax.tree.unflatten(tree, new)
        if new_cells[0] is not None:
            score_mod = _with_closure(score_mod, new_cells[0])
        if new_cells[1] is not None:
            mask_mod = _with_closure(mask_mod, new_cells[1])
        new_settings = dataclasses.replace(settings, score_mod=score_mod, mask_mod=mask_mod)
        return q, k, v, new_ops, new_settings, extras

    return operands, rebuild


def _auto_elsewhere(*call) -> str:
    """The route of a platform without a rule of its own (:data:`AUTO_ELSEWHERE`)."""
    for name in AUTO_ELSEWHERE:
        pays = PAYS.get(name)
        if (pays is None or pays(call[0], call[1], "other")) and ROUTES[name].obstacle(
            *call
        ) is None:
            return name
    raise AssertionError("'dense' honours every call")  # unreachable: dense is last


def _route_outputs(out, residual) -> list:
    return [out] if residual is None else [out, residual]


def _lse_aval(out_aval):
    """The deferred branch's extra output: jattn's Pallas kernel's lse ``[batch..., Tq,
    H, 1]`` float32 (the rank of ``out``, so it keeps out's sharding), for its backward
    pass; zeros on the other routes."""
    return out_aval.update(shape=(*out_aval.shape[:-1], 1), dtype=jnp.float32, weak_type=False)


def _pallas_outputs(out, lse, settings) -> list:
    """A deferred branch's outputs from the Pallas kernel's ``(out, lse [batch..., H,
    Tq])``: out, the residual if asked for, the lse for the backward pass."""
    lse = jnp.swapaxes(lse, -1, -2)  # [batch..., Tq, H]
    return [*_route_outputs(out, lse if settings.return_residual else None), lse[..., None]]


class _Named(NamedTuple):
    """``implementation='pallas'`` deferred: the platforms it runs on, the host's refusal."""

    platforms: tuple[str, ...]
    refusal: str


def _deferred_route(platform, call, named: _Named | None = None) -> list:
    """The automatic rule's route for ``platform`` (``named``: jattn's Pallas kernel),
    chosen and traced now (lowering time), the old adapters judging by that platform
    (:func:`jattn.kernels.lowering_platforms`): the deferred branch's outputs."""
    if named is not None and platform not in named.platforms:
        raise ValueError(f"implementation='pallas' cannot be used here: {named.refusal}.")
    if platform is None:
        out, _, residual = ROUTES[_auto_elsewhere(*call)].run(*call)
    else:
        with kernels.lowering_platforms(platform):
            name = "pallas" if named is not None else _auto_on(platform, *call)
            if name == "pallas":
                module = kernels.adapter("pallas")
                out, lse = module.attention(
                    *call[:5], interpret=_pallas_interpret(platform), platform=platform
                )
                return _pallas_outputs(out, lse, call[4])
            out, _, residual = _route_runner(name, platform)(*call)
    query = call[0]
    return [*_route_outputs(out, residual), jnp.zeros((*query.shape[:-1], 1), jnp.float32)]


def _pallas_chosen(platform, call, named: _Named | None) -> bool:
    if platform is None:
        return False
    if named is not None:
        return True
    with kernels.lowering_platforms(platform):
        return _auto_on(platform, *call) == "pallas"


def _pallas_given(platform, call, outs) -> list:
    """The deferred branch's outputs ``outs`` as the Pallas route's with its forward pass
    given: differentiating them runs its backward kernels alone (no recomputed forward)."""
    out, lse = outs[0], jnp.swapaxes(outs[-1][..., 0], -1, -2)  # [batch..., H, Tq]
    with kernels.lowering_platforms(platform):
        out, lse = kernels.adapter("pallas").attention_given(
            *call[:5], out=out, lse=lse, interpret=_pallas_interpret(platform), platform=platform
        )
    return _pallas_outputs(out, lse, call[4])


def _deferred_branch(platform, ops, settings, extras, avals: list, named: _Named | None = None):
    def branch(q, k, v):
        operands, rebuild = _split_call((q, k, v, ops, settings, extras))

        def build(platform):
            return lambda *arrays: _deferred_route(platform, rebuild(arrays), named)

        def given(platform):
            def with_outs(arrays, outs):
                if not _pallas_chosen(platform, rebuild(arrays), named):
                    return None  # the gradient recomputes the route's forward pass
                return lambda *arrays: _pallas_given(platform, rebuild(arrays), outs)

            return with_outs

        def dense(*arrays):
            if named is not None:
                raise ValueError(
                    "implementation='pallas' cannot be used here: forward-mode autodiff "
                    "(jax.jvp, jax.jacfwd, jax.hessian) is applied to the call, and the kernel "
                    "has a custom VJP (reverse mode only). Use implementation=None or 'dense'."
                )
            call = rebuild(arrays)
            out, _, residual = ROUTES["dense"].run(*call)
            lse = jnp.zeros((*call[0].shape[:-1], 1), jnp.float32)
            return [*_route_outputs(out, residual), lse]

        outs = _deferred.attend(
            build, platform, operands, [*avals, _lse_aval(avals[0])], given, dense
        )
        return outs[0], None, (outs[1] if len(outs) > 2 else None)

    return branch


def _run_deferred(name: str, call):
    """The host's route ``name`` traced now in the host's branch, every other platform's
    a deferred branch (:mod:`jattn.kernels._deferred`), one ``platform_dependent``."""
    query, key, value, ops, settings, extras = call
    host = host_platform()
    avals: list = []  # the host's output avals: filled by its branch, traced first

    def host_branch(q, k, v):
        out, weights, residual = ROUTES[name].run(q, k, v, ops, settings, extras)
        avals[:] = [jax.typeof(x) for x in _route_outputs(out, residual)]
        return out, weights, residual

    if _DEFER_HOST[-1]:
        shapes = jax.eval_shape(lambda q, k, v: host_branch(q, k, v)[::2], query, key, value)
        avals[:] = [jax.core.ShapedArray(s.shape, s.dtype) for s in shapes if s is not None]
        host_branch = _deferred_branch(host, ops, settings, extras, avals)
    branches = {host: host_branch}
    for platform in _deferred.PLATFORMS:
        if platform != host:
            branches[platform] = _deferred_branch(platform, ops, settings, extras, avals)
    default = _deferred_branch(None, ops, settings, extras, avals)
    return jax.lax.platform_dependent(query, key, value, default=default, **branches)


def _pallas_elsewhere(call) -> _Named | None:
    """For ``implementation='pallas'`` traced on a host it does not run on (a CPU host
    without interpret mode): the platforms it runs on, when it honours the call there."""
    query, key, value = call[:3]
    host = host_platform()
    if not any(isinstance(x, jax.core.Tracer) for x in (query, key, value)):
        return None
    refusal = _pallas_obstacle_on(host, *call)
    if refusal is None or kernels.adapter("pallas").available(host):
        return None  # it runs here, or refuses the call itself, not the host
    platforms = tuple(p for p in ("cuda", "tpu") if _pallas_obstacle_on(p, *call) is None)
    return _Named(platforms, refusal) if platforms else None


def _run_named_pallas(named: _Named, call):
    """``implementation='pallas'`` on another platform than the host: a deferred branch
    per platform it runs on, and one that refuses (at lowering) for every other."""
    query, key, value, ops, settings, extras = call
    avals = [jax.core.ShapedArray((*query.shape[:-1], value.shape[-1]), query.dtype)]
    if settings.return_residual:
        avals.append(jax.core.ShapedArray(query.shape[:-1], jnp.float32))
    # Every platform has a branch (those it does not run on refuse when lowered for).
    branches = {
        p: _deferred_branch(p, ops, settings, extras, avals, named) for p in _deferred.PLATFORMS
    }
    default = _deferred_branch(None, ops, settings, extras, avals, named)
    return jax.lax.platform_dependent(query, key, value, default=default, **branches)


def run(implementation, query, key, value, ops: Operands, settings: Settings, extras):
    """Runs the call on the chosen implementation: ``(out, weights, residual)``.

    The automatic rule (``implementation=None``) of a traced call routes for every
    platform: the host's route is traced now, every other platform's is chosen and traced
    only if the program is lowered for it (:func:`_run_deferred`). Under
    :func:`jattn.kernels.lowering_platforms` it picks a route for each platform named
    there, traced now (none named: the host's route only). ``implementation='pallas'``
    traced on a host it cannot run on is deferred for GPUs and TPUs, and refuses when
    lowered for the host (:func:`_run_named_pallas`).
    """
    call = (query, key, value, ops, settings, extras)
    platforms = kernels.route_platforms()
    if implementation is None and platforms:
        choices = {}
        for p in platforms:
            name = _auto_on(p, *call)
            choices[p] = (name, _pallas_variant(p) if name == "pallas" else None)
        return _per_platform(choices, call)
    if implementation == "pallas" and platforms is None:
        named = _pallas_elsewhere(call)
        if named is not None:
            return _run_named_pallas(named, call)
    name = choose(implementation, *call)
    if implementation is None and platforms is None and _deferrable(call):
        return _run_deferred(name, call)
    return ROUTES[name].run(*call)
