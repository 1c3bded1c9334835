"""Thin adapters from jattn's attention call to the fused kernels that jax itself ships.

One module per kernel family, each with the same three functions:

* ``obstacle(*, backend, interpret, q_shape, kv_shape, dtype, is_causal, window, has_mask,
  has_bias, has_lengths, has_segments, dropout, return_weights, softcap, ...)``: ``None``
  when the kernel honours the call on ``backend``, else a short reason naming the option
  it lacks. Static: shapes, dtypes and flags only.
* ``attention(q, k, v, *, scale, is_causal, window, q_lengths, kv_lengths, q_segments,
  kv_segments, softcap, interpret) -> (out, lse)``: inputs validated and cast by the public
  entry; ``q [batch..., Tq, H, D]``, ``k, v [batch..., Tk, K, D]``; returns
  ``out [batch..., Tq, H, Dv]`` in q's dtype with jattn's semantics (fully masked query rows
  give zero output and zero gradients) and ``lse [batch..., H, Tq]`` float32 or ``None``
  (:func:`jattn.large_negative` on rows that attend nothing, as jattn's own paths).
* ``available(backend) -> bool``: the kernel can run natively there.
* ``RETURNS_LSE``: whether ``attention`` returns the lse (``return_residual=`` needs it).

:mod:`jattn._routing` routes ``implementation=`` names and the automatic rule to these
adapters.

The kernels:

* :mod:`jattn.kernels.cudnn`: ``jax.nn.dot_product_attention(implementation='cudnn')``
  (NVIDIA GPUs);
* :mod:`jattn.kernels.pallas_triton`: the Pallas GPU (Triton) flash attention,
  ``jax.experimental.pallas.ops.gpu.attention.mha`` (GPUs; CPU in interpret mode);
* :mod:`jattn.kernels.splash`: Pallas splash attention,
  ``jax.experimental.pallas.ops.tpu.splash_attention`` (TPUs; CPU in interpret mode);
* :mod:`jattn.kernels.cpu.adapter`: jattn's own fused CPU kernel (C++ through XLA's FFI,
  ``implementation='cpu_fused'``); ``jattn.kernels.cpu.status()`` says whether it was
  built and loads, or why not.

No module here imports a kernel at import time: jax's kernel modules load on first use
(the Pallas GPU module warns of its deprecation on import from jax 0.12 on).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Protocol

__all__ = [
    "INTERPRET_ENV",
    "KERNELS",
    "Kernel",
    "KernelQuery",
    "adapter",
    "interpret_requested",
]


class KernelQuery(NamedTuple):
    """What a kernel may need to refuse a call: static facts only, built once by routing.

    :mod:`jattn._routing` builds one per call (and per platform it lowers for) from the
    validated :class:`jattn._call.Operands` and :class:`jattn._call.Settings`; an adapter's
    ``obstacle`` reads nothing else.

    Attributes:
      platform: the platform the call is lowered for: ``'cpu'``, ``'cuda'``, ``'rocm'`` or
        ``'tpu'`` (not necessarily the host's default backend).
      interpret: run a Pallas kernel in interpret mode (asked for, off its hardware).
      q_shape: ``[batch..., Tq, H, D]``; kv_shape: ``[batch..., Tk, K, D]`` (the key's).
      v_head_dim: the value head size ``Dv``.
      dtype: the computation dtype of q, k and v.
      is_causal, window: the built-in position masks (``Settings``).
      has_mask, has_bias, has_lengths, has_segments: which optional arrays are present.
      separate_kv_segments: the key segment ids are a different array from the query's.
      dropout: dropout is active (a key was given and the rate is not a static 0).
      return_weights: the call needs the weight matrix (or sows it into a module).
      return_residual: the call returns the log-sum-exp.
      score_mod, mask_mod: the callables (or None), so an adapter can recognise the
        ready-made modifiers of :mod:`jattn.mods` it fuses.
      sinks, block_mask: whether sinks / a :class:`jattn.BlockMask` are given.
      traced_scale: the scale is a tracer, not a Python number.
      default_precision: the matmul precision is None / ``DEFAULT``.
      needs_dense: why only the dense path can run the call (flax's einsum hooks), or None.
    """

    platform: str
    interpret: bool
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    v_head_dim: int
    dtype: Any
    is_causal: bool
    window: tuple[int, int] | None
    has_mask: bool
    has_bias: bool
    has_lengths: bool
    has_segments: bool
    separate_kv_segments: bool
    dropout: bool
    return_weights: bool
    return_residual: bool
    score_mod: Any
    mask_mod: Any
    sinks: bool
    block_mask: bool
    traced_scale: bool
    default_precision: bool
    needs_dense: str | None


class Kernel(Protocol):
    """The contract every kernel adapter module keeps (module-level names).

    * ``NAME``: the ``implementation=`` name it serves.
    * ``RETURNS_LSE``: ``attention`` returns the log-sum-exp (``return_residual`` needs it).
    * ``LSE_HAS_GRADIENT``: that lse is differentiable (its custom VJP takes the lse's
      cotangent); when False, routing adds the gradient itself.
    * ``available(platform) -> bool``: the kernel runs natively on ``platform``.
    * ``obstacle(query: KernelQuery) -> str | None``: None when the kernel honours the call
      exactly as jattn's dense path would, else a short reason naming the option it lacks
      (phrased to follow "cannot honour this call: ").
    * ``attention(q, k, v, ops, settings, *, interpret) -> (out, lse)``: inputs validated
      and cast by the public entry (``ops``/``settings`` are :mod:`jattn._call`'s);
      ``q [batch..., Tq, H, D]``, ``k, v [batch..., Tk, K, D|Dv]``; ``out [batch..., Tq,
      H, Dv]`` in q's dtype with jattn's semantics (fully masked query rows give zero output
      and zero gradients), ``lse [batch..., H, Tq]`` float32 (float64 for float64 inputs;
      :func:`jattn.large_negative` on rows that attend nothing) or None.
    """

    NAME: str
    RETURNS_LSE: bool
    LSE_HAS_GRADIENT: bool

    def available(self, platform: str) -> bool: ...

    def obstacle(self, query: KernelQuery) -> str | None: ...

    def attention(self, q, k, v, ops, settings, *, interpret: bool) -> tuple[Any, Any]: ...


# The implementation names the adapters serve, as `implementation=` spells them.
KERNELS = ("cudnn", "pallas_triton", "splash", "cpu_fused")

# Set to 1 to run the Pallas kernels ('splash', 'pallas_triton') in interpret mode on CPU.
INTERPRET_ENV = "JATTN_PALLAS_INTERPRET"


def interpret_requested() -> bool:
    """True when ``JATTN_PALLAS_INTERPRET`` asks for the Pallas kernels in interpret mode.

    Accepts ``1``, ``true`` or ``yes`` (any case); anything else, or unset, is False.
    Interpret mode runs a Pallas kernel as ordinary XLA operations on any backend: slow,
    but the kernel's own code and its own VJP, so CPU tests check what a TPU or GPU runs.
    """
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes")


def adapter(name: str):
    """The adapter module for ``name`` (one of :data:`KERNELS`), imported on first use."""
    if name == "cudnn":
        from jattn.kernels import cudnn as module
    elif name == "pallas_triton":
        from jattn.kernels import pallas_triton as module
    elif name == "splash":
        from jattn.kernels import splash as module
    elif name == "cpu_fused":
        from jattn.kernels.cpu import adapter as module
    else:
        raise ValueError(f"no kernel adapter named {name!r}; expected one of {KERNELS}.")
    return module
