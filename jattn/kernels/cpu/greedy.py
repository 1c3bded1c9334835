"""The greedy pick on CPU: ``jnp.argmax`` over the last axis as one kernel call.

Decoding picks each row's next token from ``[rows, vocab]`` logits. XLA's CPU argmax is a
reduction over (value, index) pairs, and even as two plain reductions (the largest value,
then the first index holding it) it takes about a fifth of a small model's decoding step
on ``[16, 8192]`` logits. On CPU with jattn's kernel built, :func:`argmax` is one
``jax.ffi.ffi_call`` (``jattn_cpu_argmax``) that reads each row once, in the widest
vectors the CPU has (those of the attention kernels' instruction set); elsewhere (another
platform's lowering, no kernel, or logits sharded over a mesh in their type, which the
kernel's call would gather) it is the two reductions. Both give ``jnp.argmax``'s
answer: the first NaN of a row that holds one, else its first largest value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn._util import sharded_axes
from jattn.kernels.cpu import _library

__all__ = ["argmax"]

Array = jax.Array


def argmax(logits) -> Array:
    """int32 ``[batch...]``: ``jnp.argmax(logits, axis=-1)`` of float ``[batch..., V]``.

    Raises:
      TypeError: logits that are not floating point.
      ValueError: a 0-d array, or an empty last axis.
    """
    logits = jnp.asarray(logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"logits must be floating point, got {logits.dtype}.")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [batch..., V] with V >= 1, got shape {logits.shape}.")
    if _library.library() is None or logits.dtype == jnp.float64 or sharded_axes(logits):
        return _xla(logits)
    # float32 holds bfloat16 and float16 exactly: the order, ties and NaNs are kept. An
    # index has no derivative: a stopped gradient keeps jax.grad / jax.jvp away from the
    # kernel call, which has no rule of its own (jnp.argmax's is zero too).
    logits = jax.lax.stop_gradient(logits.astype(jnp.float32))
    return jax.lax.platform_dependent(logits, cpu=_fused, default=_xla)


def _fused(logits: Array) -> Array:
    """The kernel's ``ffi_call``."""
    out_type = jax.ShapeDtypeStruct(logits.shape[:-1], jnp.int32)
    call = jax.ffi.ffi_call(_library.ARGMAX_TARGET, out_type, vmap_method="broadcast_all")
    return call(logits)


def _xla(logits: Array) -> Array:
    """Two plain reductions: XLA's CPU argmax takes 3-6x longer on ``[16, 8192]`` logits.

    NaNs are looked for, not left to the max: XLA's CPU max reduction of a large row can
    drop them (``jnp.max`` of ``[16, 8192]`` logits with a NaN column returned numbers, in
    jax 0.10), which picked a number's index where ``argmax`` picks the NaN's.
    """
    vocab = logits.shape[-1]
    nan = jnp.isnan(logits)
    top = jnp.max(jnp.where(nan, jnp.inf, logits), axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(
        jnp.int32, logits.shape, logits.ndim - 1, out_sharding=jax.typeof(logits).sharding
    )
    # a NaN's index ranks before every largest's (index + vocab); the rest after both
    rank = jnp.where(nan, index, jnp.where(logits == top, index + vocab, 2 * vocab))
    first = jnp.min(rank, axis=-1)
    return jnp.where(first >= vocab, first - vocab, first)
