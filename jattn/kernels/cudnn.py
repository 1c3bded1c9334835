"""cuDNN flash attention (``jax.nn.dot_product_attention(implementation='cudnn')``) behind jattn's call.

What cuDNN takes through ``jax.nn``: ``[B, T, N, H]`` float16/bfloat16 inputs on an NVIDIA
GPU of compute capability >= 8.0, head size a multiple of 8 up to 128 (256 from Hopper on),
value head size equal to the query's, grouped- and multi-query attention without copying
K/V, a scale, causal masks, query and key/value lengths, and a window that looks left only
(``(pos - left, pos]``, causal by construction). How the adapter maps jattn's call:

* batch dims: flattened to one;
* window ``(left, right)``: with ``is_causal`` the right side is hidden anyway, so it is
  passed as ``(left, 0)``; without it only ``right == 0`` fits cuDNN's left-only window;
* lengths: passed to cuDNN (padded queries are skipped there; jax's own tests check their
  output and gradients are zero); a key length of 0 would leave rows with nothing to attend,
  so the adapter passes ``max(kv_length, 1)`` and zeros those rows itself;
* fully masked query rows: with the refusals below, a query attends nothing only when it
  is past its length or its sequence has no key; the adapter zeros exactly those rows (and
  their gradients) with a ``where``;
* lse: not returned (``None``): ``jax.nn`` returns cuDNN's log-sum-exp rounded to the input
  dtype (bfloat16 keeps 3 significant digits), too coarse to merge partial attentions.

Refused: float32/float64 (cuDNN computes in float16/bfloat16), segment ids (cuDNN's packed
layout needs contiguous segments), soft-capping, windows with lengths or reaching right,
``is_causal`` or windows with q_len != kv_len (which diagonal cuDNN aligns to is not
checked here), a traced scale, mask and bias arrays (jattn routes those to its own paths).

None of this runs on CPU: the tests for it skip without a GPU; ``benchmarks/device_check.sh``
runs them on one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import mods
from jattn._call import Operands, Settings
from jattn.kernels import _common
from jattn.kernels._contract import KernelQuery

__all__ = [
    "LSE_HAS_GRADIENT",
    "NAME",
    "RETURNS_LSE",
    "attention",
    "available",
    "compute_capability",
    "obstacle",
]

Array = jax.Array

_DTYPES = ("bfloat16", "float16")
NAME = "cudnn"
RETURNS_LSE = False  # jax.nn rounds cuDNN's lse to the input dtype (module docstring)
LSE_HAS_GRADIENT = False


def compute_capability() -> tuple[int, int] | None:
    """The first GPU's CUDA compute capability, or None (no NVIDIA GPU)."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    capability = getattr(device, "compute_capability", None)
    if capability is None or "nvidia" not in device.device_kind.lower():
        return None
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return major, minor


def available(platform: str) -> bool:
    """True on CUDA with an NVIDIA GPU of compute capability >= 8.0 (cuDNN flash attention's floor)."""
    if platform != "cuda":
        return False
    capability = compute_capability()
    return capability is not None and capability >= (8, 0)


def obstacle(query: KernelQuery) -> str | None:
    """Why cuDNN cannot honour this call (None: it can). Static: ``query`` only."""
    if not available(query.platform):
        return f"it needs an NVIDIA GPU of compute capability >= 8.0 (platform: {query.platform})"
    reason = _common.common_obstacle(query, dtypes=_DTYPES, kernel="cuDNN")
    if reason is not None:
        return reason
    return _shape_obstacle(query)


def _shape_obstacle(query: KernelQuery) -> str | None:
    q_len, kv_len, head_dim = query.q_shape[-3], query.kv_shape[-3], query.q_shape[-1]
    is_causal, window = query.is_causal, query.window
    max_dim = 256 if compute_capability() >= (9, 0) else 128
    if head_dim % 8 or head_dim > max_dim:
        return f"head_dim {head_dim} (cuDNN takes multiples of 8 up to {max_dim} on this GPU)"
    if query.v_head_dim != head_dim:
        return f"a value head size ({query.v_head_dim}) unlike the query's ({head_dim})"
    if query.has_segments:
        return "segment ids (cuDNN packs only contiguous segments)"
    if mods.native_softcap(query.score_mod) is not None:
        return "logit soft-capping"
    if query.traced_scale:
        return "a traced scale (cuDNN compiles the scale in)"
    if (is_causal or window is not None) and q_len != kv_len:
        return f"is_causal or a window with q_len != kv_len ({q_len} vs {kv_len})"
    if window is not None:
        if query.has_lengths:
            return "a window together with lengths (rows could be left with no key)"
        if not is_causal and window[1] != 0:
            return "a window reaching right of the query (cuDNN's window looks left only)"
    return None


def attention(
    q: Array, k: Array, v: Array, ops: Operands, settings: Settings, *, interpret: bool
) -> tuple[Array, None]:
    """cuDNN flash attention with jattn's semantics (mapping: module docstring).

    Args:
      q: ``[batch..., Tq, H, D]`` float16/bfloat16.
      k, v: ``[batch..., Tk, K, D]`` (``H % K == 0``).
      ops: the call's arrays: ``scale`` (a Python float) and the lengths are read (the
        rest is refused by :func:`obstacle`).
      settings: the call's options: ``is_causal`` and ``window`` are read.
      interpret: unused (cuDNN has no interpret mode; part of the adapter contract).

    Returns:
      ``(out [batch..., Tq, H, D]`` in q's dtype, ``None)``.
    """
    q3, batch_shape = _common.flatten_batch(q, 3)
    k3, _ = _common.flatten_batch(k, 3)
    v3, _ = _common.flatten_batch(v, 3)
    tq = q3.shape[1]
    q_len = _common.flat_or_none(ops.q_lengths, 0)
    kv_len = _common.flat_or_none(ops.kv_lengths, 0)
    valid = _common.lengths_valid(q_len, tq)
    if kv_len is not None:
        has_key = jnp.broadcast_to(kv_len[:, None] > 0, (kv_len.shape[0], tq))
        valid = has_key if valid is None else valid & has_key
        kv_len = jnp.maximum(kv_len, 1)
    window = settings.window
    local = None if window is None else (int(window[0]), 0)
    out = jax.nn.dot_product_attention(
        q3,
        k3,
        v3,
        scale=float(ops.scale),
        is_causal=settings.is_causal,
        query_seq_lengths=None if q_len is None else q_len.astype(jnp.int32),
        key_value_seq_lengths=None if kv_len is None else kv_len.astype(jnp.int32),
        local_window_size=local,
        implementation="cudnn",
    )
    out, _ = _common.zero_invalid_rows(out, None, valid)
    return _common.unflatten_batch(out, batch_shape), None
