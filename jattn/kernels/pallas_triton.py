"""The Pallas GPU (Triton) flash attention (``jax.experimental.pallas.ops.gpu.attention.mha``) behind jattn's call.

The kernel: ``mha(q, k, v, segment_ids, sm_scale, causal, block_sizes, interpret=...)`` on
``[B, T, H, D]`` inputs, forward and a fused Triton backward, causal masks aligned
top-left, one segment-id array ``[B, T]`` shared by queries and keys, and the base-2
log-sum-exp as a residual. What it lacks, and how the adapter fills it in:

* grouped- and multi-query attention: the kernel reads key/value head ``h`` for query
  head ``h``, so the adapter repeats K and V over the query heads (a copy of K and V,
  ``H/K`` times; the gradient sums the copies back);
* lengths: queries past ``q_length`` are computed and zeroed afterwards; keys past
  ``kv_length`` are hidden by one extra head-dimension column: q gets a column of ones and
  k a column holding ``0`` for real keys and ``-1e30 / scale`` for hidden ones, so a
  hidden key's logit is about ``-1e30`` and its weight exactly 0 (v gets a zero column; the
  kernel pads the head dimension to a power of two anyway, so the column is free unless
  ``head_dim`` already is one, when the matmuls grow to the next power of two);
* padding: the lengths are padded to the kernel's block multiple; padded keys are hidden
  by causality or by a segment id no real token has;
* fully masked query rows (length 0, or a key length that hides every key of a segment):
  the kernel averages the hidden keys there; the adapter finds those rows exactly
  (from the lengths and segment ids, in O(T log T)) and zeros their output and gradients
  with a ``where`` (their lse is :func:`jattn.large_negative`, as on jattn's own paths);
* lse: the kernel's residual (base 2) turned into the natural log, from jax's own forward
  and backward rules (``mha.fwd`` / ``mha.bwd``) joined in a custom VJP, so the output is
  differentiable and the lse comes at no cost; the lse carries no gradient here
  (:mod:`jattn._routing` adds it for ``return_residual=True``).

Refused: q_len != kv_len (one segment array indexes both, and the fused backward needs as
many query blocks as key blocks), windows, separate key/value segment ids, soft-capping,
a value head size unlike the query's, a traced scale (the kernel bakes it in), float64.

From jax 0.12 on, jax deprecates this module in favour of Tokamax (its import warns with a
``DeprecationWarning``); the adapter imports it with that one warning filtered, and it still
works. jax's own GPU tests skip this kernel's backward on compute capability >= 8.0 for
precision issues: run ``benchmarks/device_check.sh`` before trusting its gradients on a GPU.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

from jattn import mods
from jattn._call import Operands, Settings
from jattn._util import round_up
from jattn.kernels import _common
from jattn.kernels._contract import KernelQuery

__all__ = ["LSE_HAS_GRADIENT", "NAME", "RETURNS_LSE", "attention", "available", "obstacle"]

Array = jax.Array

_DTYPES = ("bfloat16", "float16", "float32")
NAME = "pallas_triton"
RETURNS_LSE = True  # the kernel's own residual, in float32
LSE_HAS_GRADIENT = False  # routing adds it (jattn._routing._lse_with_gradient)
_HIDDEN = 1e30  # the logit magnitude of a key hidden by the lengths column


@functools.cache
def _kernel_module():
    """``jax.experimental.pallas.ops.gpu.attention``, imported on first use.

    jax 0.12 deprecates it for Tokamax and warns on import; only that warning is filtered.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r".*pallas\.ops\.gpu\.attention is deprecated",
            category=DeprecationWarning,
        )
        from jax.experimental.pallas.ops.gpu import attention as module
    return module


def available(platform: str) -> bool:
    """True on a GPU (CUDA or ROCm), where Pallas lowers the kernel through Triton
    (elsewhere: interpret mode)."""
    return platform in ("cuda", "rocm")


def obstacle(query: KernelQuery) -> str | None:
    """Why the Pallas Triton kernel cannot honour this call (None: it can). Static only."""
    if not available(query.platform) and not query.interpret:
        return (
            f"it runs on GPU only, not on {query.platform} (set JATTN_PALLAS_INTERPRET=1 to "
            "run it in interpret mode, slowly, for tests)"
        )
    reason = _common.common_obstacle(query, dtypes=_DTYPES, kernel="the Pallas Triton kernel")
    if reason is not None:
        return reason
    q_len, kv_len, head_dim = query.q_shape[-3], query.kv_shape[-3], query.q_shape[-1]
    if q_len != kv_len:
        return f"q_len != kv_len ({q_len} vs {kv_len}; it is a self-attention kernel)"
    if query.window is not None:
        return "local_window_size (the kernel has causal masks only)"
    if mods.native_softcap(query.score_mod) is not None:
        return "logit soft-capping"
    if query.separate_kv_segments:
        return "separate key_value_segment_ids (one segment array serves queries and keys)"
    if query.v_head_dim != head_dim:
        return f"a value head size ({query.v_head_dim}) unlike the query's ({head_dim})"
    if query.traced_scale:
        return "a traced scale (the kernel compiles the scale in)"
    if query.has_lengths and jnp.dtype(query.dtype) == jnp.float16:
        return "lengths in float16 (the key-padding column needs a bias float16 cannot hold)"
    if not query.interpret and not 16 <= head_dim <= 256:
        return f"head_dim {head_dim} (Triton's tiles need 16 <= head_dim <= 256)"
    return None


def _padded_len(t: int) -> int:
    # Triton tiles are powers of two, at least 16; longer sequences pad to the 128 block.
    return max(16, 1 << (t - 1).bit_length()) if t <= 128 else round_up(t, 128)


def _forward_tile(head_dim: int, dtype) -> int:
    """The forward kernel's query/key tile: the largest of 128/64/32 whose tiles fit.

    The forward kernel keeps a q tile and, pipelined over 2 stages, k and v tiles of
    ``tile x next_pow2(head_dim)`` in shared memory: 5 tiles, kept under 160 KiB (an A100
    or H100 has 164 / 228 KiB per SM). bfloat16 at head_dim 128 gets jax's default 128.
    """
    row_bytes = (1 << (head_dim - 1).bit_length()) * jnp.dtype(dtype).itemsize
    for tile in (128, 64):
        if 5 * tile * row_bytes <= 160 * 1024:
            return tile
    return 32


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mha_with_lse(q, k, v, segment_ids, static):
    """``mha`` returning ``(out, lse2)`` and still differentiable in ``out`` (lse2: no gradient).

    ``static``: ``(sm_scale, causal, block_sizes, interpret)``."""
    return _mha_fwd(q, k, v, segment_ids, static)[0]


def _mha_args(static):
    # mha's static arguments after (q, k, v, segment_ids), in its own order.
    sm_scale, causal, block_sizes, interpret = static
    return (sm_scale, causal, block_sizes, "triton", None, 2, None, interpret, False)


def _mha_fwd(q, k, v, segment_ids, static):
    mha = _kernel_module().mha
    return mha.fwd(q, k, v, segment_ids, *_mha_args(static), True)


def _mha_bwd(static, residuals, cotangents):
    d_out, _ = cotangents  # the lse carries no gradient
    mha = _kernel_module().mha
    dq, dk, dv, _ = mha.bwd(*_mha_args(static), False, residuals, d_out)
    return dq, dk, dv, None


_mha_with_lse.defvjp(_mha_fwd, _mha_bwd)


def _row_valid(q_lengths, kv_lengths, segments, t: int):
    """bool ``[B, T]``: which query rows attend at least one key (None: all of them).

    With shared segment ids every query sees its own position, so a row is empty only when
    a key length hides every key of its segment (the first one included), or the query
    itself is past its length.
    """
    valid = _common.lengths_valid(q_lengths, t)
    if kv_lengths is None:
        return valid
    if segments is None:
        has_key = jnp.broadcast_to(kv_lengths[:, None] > 0, (kv_lengths.shape[0], t))
    else:
        has_key = _common.first_occurrence(segments) < kv_lengths[:, None]
    return has_key if valid is None else valid & has_key


def _kernel_segments(segments, batch: int, t: int, t_pad: int, is_causal: bool):
    """The kernel's shared segment ids ``[B, T_padded]`` (None when none are needed).

    Padded keys must be hidden from real queries: causality already does that; otherwise
    padded positions get an id no real token has.
    """
    if segments is None and (t_pad == t or is_causal):
        return None
    ids = jnp.zeros((batch, t), jnp.int32) if segments is None else segments.astype(jnp.int32)
    return _common.pad_axis(ids, 1, t_pad, value=ids.min() - 1) if t_pad != t else ids


def attention(
    q: Array, k: Array, v: Array, ops: Operands, settings: Settings, *, interpret: bool
) -> tuple[Array, Array]:
    """Pallas Triton flash attention with jattn's semantics (mapping: module docstring).

    Args:
      q, k, v: ``[batch..., T, H, D]``, ``[batch..., T, K, D]`` (``H % K == 0``).
      ops: the call's arrays: ``scale`` (a Python float), the lengths and the query
        segment ids ``[batch..., T]`` are read (key ids are the query ids: separate ones
        are refused by :func:`obstacle`, as are the other arrays).
      settings: the call's options: ``is_causal`` is read (windows and soft-capping are
        refused).
      interpret: run the Pallas kernel in interpret mode (any backend, slow).

    Returns:
      ``(out [batch..., T, H, D]`` in q's dtype, ``lse [batch..., H, T]`` float32,
      :func:`jattn.large_negative` on rows that attend nothing, without gradient).
    """
    scale, is_causal = ops.scale, settings.is_causal
    q3, batch_shape = _common.flatten_batch(q, 3)
    k3, _ = _common.flatten_batch(k, 3)
    v3, _ = _common.flatten_batch(v, 3)
    batch, t, num_heads, head_dim = q3.shape
    groups = num_heads // k3.shape[2]
    if groups > 1:  # [B, T, K, D] -> [B, T, H, D], head h reading kv head h // groups
        k3, v3 = jnp.repeat(k3, groups, axis=2), jnp.repeat(v3, groups, axis=2)
    segments = _common.flat_or_none(ops.q_segments, 1)
    q_len_flat = _common.flat_or_none(ops.q_lengths, 0)
    kv_len_flat = _common.flat_or_none(ops.kv_lengths, 0)
    if kv_len_flat is not None:
        q3, k3, v3 = _hide_keys_column(q3, k3, v3, kv_len_flat, scale)
    t_pad = _padded_len(t)
    q3, k3, v3 = (_common.pad_axis(x, 1, t_pad) for x in (q3, k3, v3))
    ids = _kernel_segments(segments, batch, t, t_pad, is_causal)
    tile = _forward_tile(q3.shape[-1], q3.dtype)
    blocks = _kernel_module().BlockSizes(
        block_q=tile, block_k=tile, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
    )
    static = (float(scale), bool(is_causal), blocks, bool(interpret))
    out, lse2 = _mha_with_lse(q3, k3, v3, ids, static)
    out = out[:, :t, :, :head_dim]
    lse = jax.lax.stop_gradient(lse2[:, :, :t]) * math.log(2.0)  # base 2 -> natural log
    valid = _row_valid(q_len_flat, kv_len_flat, segments, t)
    out, lse = _common.zero_invalid_rows(out, lse, valid)
    lse = _common.unflatten_batch(lse, batch_shape)
    return _common.unflatten_batch(out, batch_shape), lse


def _hide_keys_column(q3, k3, v3, kv_lengths, scale: float):
    """Appends the head-dim column that hides keys past ``kv_lengths`` (module docstring)."""
    batch, t, heads, _ = q3.shape
    hidden = jnp.arange(t)[None, :] >= kv_lengths[:, None]  # [B, T]
    bias = jnp.where(hidden, -_HIDDEN / scale, 0.0).astype(k3.dtype)
    k_col = jnp.broadcast_to(bias[:, :, None, None], (batch, t, heads, 1))
    q_col = jnp.ones((batch, t, heads, 1), q3.dtype)
    v_col = jnp.zeros((batch, t, heads, 1), v3.dtype)
    return (
        jnp.concatenate([q3, q_col], -1),
        jnp.concatenate([k3, k_col], -1),
        jnp.concatenate([v3, v_col], -1),
    )
