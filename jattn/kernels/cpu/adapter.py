"""jattn's fused CPU attention kernel (``implementation='cpu_fused'``) behind the adapter contract.

What runs fused (float32 arithmetic; float32, bfloat16 and float16 inputs are cast to
float32 and the output cast back): plain and causal attention (``is_causal``, aligned
top-left as jattn's), local windows ``(left, right)`` (``right`` may be None), query and
key lengths, segment ids (one array or separate query/key ids), grouped- and multi-query
attention without repeating K/V, any leading batch dims, any head sizes (``Dv`` may differ
from ``D``), sinks (with their gradient), a bare :func:`jattn.mods.softcap` or
:func:`jattn.mods.alibi` score_mod (plain or symmetric; the slopes get their gradient),
dropout (jattn's position-keyed generator, :mod:`jattn._prng`, evaluated per weight inside
the kernel: the same key drops the same weights as the dense and blockwise paths, and no
mask is stored), the log-sum-exp (``return_residual``, differentiable), a ``bias=`` array
(added after the score_mod, as the dense path does; its gradient comes back in the bias's
own broadcast shape, reduced without atomics), a boolean ``mask=`` array (read per tile in
its broadcast shape, so KV-cache decoding runs fused) and a :func:`jattn.block_mask`
(its EMPTY tiles skipped and FULL tiles computed without a mask, whatever its block sizes;
its PARTIAL tiles read the ``mask_mod`` that XLA evaluates on those tiles alone, a bool
``[n_partial, block_q, block_k]`` found through an int32 tile map, ANDed with a ``mask=``
array: memory follows the partial tiles, not ``Tq * Tk``). ``n_partial`` must be static:
counted on the host from a concrete ``BlockMask.state`` (the usual case: one built eagerly
and closed over). A state traced under ``jax.jit`` (the block mask passed as an argument)
is built again on the host from its ``mask_mod`` when that holds no traced arrays (a
causal or sliding-window one); else (a document mask over traced ids) its bits cost every
tile, ``B|1 * H|1 * Tq * Tk`` rounded up to whole tiles: still correct, as large as the
mask it replaces (close over the block mask to keep it small). The bias and
mask arrays are passed in their own shapes (broadcast axes read with stride 0, never
copied to the logits' shape). Tiles the masks hide are skipped (a
mask array's all-False tiles too); rows that attend nothing give zero output, zero
gradients and :func:`jattn.large_negative` as their lse, as every jattn path. Up to 16
queries against 1024 keys or more (decoding) split the keys over the workers (fixed
512-key splits, merged in order: the result does not depend on the thread count).

Refused (routing falls back to the blockwise or dense path): a ``mask_mod`` callable
without a ``block_mask``, any ``score_mod`` other than a bare softcap or alibi, float64, a
traced scale, an explicit matmul precision, the weight matrix. ``JATTN_CPU_THREADS=n``
caps the kernel's workers (default: XLA's whole intra-op pool).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn import _prng, mods
from jattn._util import expand_rank
from jattn.block_masks import FULL, PARTIAL, block_mask
from jattn.kernels import _common as adapters_common
from jattn.kernels._contract import KernelQuery
from jattn.kernels.cpu import _library, _ops

__all__ = [
    "LSE_HAS_GRADIENT",
    "NAME",
    "RETURNS_LSE",
    "THREADS_ENV",
    "attention",
    "available",
    "max_threads",
    "obstacle",
    "status",
]

NAME = "cpu_fused"
RETURNS_LSE = True
LSE_HAS_GRADIENT = True
THREADS_ENV = "JATTN_CPU_THREADS"
_DTYPES = ("float32", "bfloat16", "float16")
# Tile sizes: query rows (0: the kernel's choice, 16 micro-kernel rows: 192 with AVX-512,
# 96 otherwise) and keys (a multiple of every build's micro-kernel width, 32). 256 keys:
# each row's softmax overheads (max and sum trees, the rescale) spread over twice the
# columns; forward and forward+backward 2-4% faster than 128 at T=1024 and 4096 (CPU
# time on one core of the AVX-512 EPYC).
BLOCK_Q = 0
BLOCK_K = 256

status = _library.status


def available(platform: str) -> bool:
    """True on CPU when the kernel library was built and loads."""
    return platform == "cpu" and _library.library() is not None


def obstacle(query: KernelQuery) -> str | None:
    """Why the fused CPU kernel cannot honour the call (None: it can)."""
    if query.platform != "cpu":
        return f"it runs on CPU only (platform: {query.platform})"
    if _library.library() is None:
        return _library.status()
    if query.needs_dense is not None:
        return query.needs_dense
    for flag, what in (
        (
            query.mask_mod is not None and not query.block_mask,
            "a mask_mod callable without a block_mask (it cannot enter C++; with a "
            "jattn.block_mask cpu_fused reads its tile states and XLA evaluates it)",
        ),
        (query.traced_scale, "a traced scale (cpu_fused compiles the scale in)"),
        (not query.default_precision, "an explicit matmul precision (cpu_fused computes fp32)"),
    ):
        if flag:
            return what
    if (
        query.score_mod is not None
        and mods.native_softcap(query.score_mod) is None
        and not _alibi(query.score_mod)
    ):
        return "a score_mod other than a bare jattn.mods.softcap or alibi (it cannot enter C++)"
    name = jnp.dtype(query.dtype).name
    if name not in _DTYPES:
        return f"dtype {name} (cpu_fused computes in float32 from {', '.join(_DTYPES)})"
    return None


def max_threads() -> int:
    """The most workers a kernel call may take, from ``JATTN_CPU_THREADS`` (0, unset or not
    a number: every thread of XLA's intra-op pool). Read when a call is traced."""
    value = os.environ.get(THREADS_ENV, "").strip()
    return int(value) if value.isdigit() else 0


def _aux(q, k, ops, settings) -> _ops.Aux:
    """Every per-batch operand broadcast to the call's batch dims (see :mod:`._ops`)."""
    batch = q.shape[:-3]
    tq, h, tk = q.shape[-3], q.shape[-2], k.shape[-3]

    def lengths(x, full):
        x = jnp.full((), full, jnp.int32) if x is None else x.astype(jnp.int32)
        return jnp.broadcast_to(x, batch)

    def ids(x, length):
        if x is None:
            return jnp.zeros((*batch, 1), jnp.int32)
        return jnp.broadcast_to(x.astype(jnp.int32), (*batch, length))

    sinks = ops.sinks
    sinks = jnp.zeros((*batch, 1), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    blocks, tile_mask = _block_tiles(batch, tq, tk, ops.block_mask, settings.mask_mod)
    return _ops.Aux(
        q_len=lengths(ops.q_lengths, tq),
        kv_len=lengths(ops.kv_lengths, tk),
        q_seg=ids(ops.q_segments, tq),
        kv_seg=ids(ops.kv_segments, tk),
        sinks=jnp.broadcast_to(sinks, (*batch, h if ops.sinks is not None else 1)),
        slopes=_slopes(batch, h, settings),
        bias=_broadcast_operand(ops.bias, q.ndim, jnp.float32),
        mask=_broadcast_operand(ops.mask, q.ndim, jnp.bool_),
        blocks=blocks,
        tile_mask=tile_mask,
        **_dropout(batch, h, tq, ops, settings),
    )


def _block_tiles(batch, tq: int, tk: int, block_mask, mask_mod):
    """A block mask's int32 tile map ``[batch...|1, H|1, nbq, nbk]`` and its PARTIAL tiles'
    bits, bool ``[1..., n_partial, block_q, block_k]`` (:class:`._ops.Aux`), or placeholders.

    Slots number the PARTIAL tiles of the whole state in row-major order. A concrete state
    counts them on the host; a traced one (module docstring) reserves a slot for every tile.
    """
    rank = len(batch) + 3
    if block_mask is None:
        return jnp.zeros((1,) * rank, jnp.int32), jnp.zeros((1,) * rank, jnp.bool_)
    state = block_mask.state
    if isinstance(state, jax.core.Tracer):
        state = _host_state(block_mask, mask_mod, state.shape[:2])
    if state is None:
        tiles, where = _traced_slots(block_mask.state)
    else:
        tiles, where = _concrete_slots(np.asarray(state))
    bits = _tile_bits(mask_mod, where, block_mask.block_q, block_mask.block_k, tq, tk)
    lead = batch if tiles.shape[0] != 1 else (1,) * len(batch)
    return tiles.reshape(*lead, *tiles.shape[1:]), bits.reshape(*(1,) * len(batch), *bits.shape)


def _host_state(bm, mask_mod, lead: tuple[int, int]) -> np.ndarray | None:
    """A traced block mask's state built again on the host from ``mask_mod`` (the states
    it was built from), or None when ``mask_mod`` needs traced values, or inside
    ``jax.shard_map`` (jax cannot evaluate ops eagerly there on a mesh of explicit axes)."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(mask_mod)):
        return None
    if jax.sharding.get_abstract_mesh().manual_axes:
        return None
    try:
        with jax.ensure_compile_time_eval():
            again = block_mask(mask_mod, q_len=bm.q_len, kv_len=bm.kv_len, batch_shape=lead[0],
                               num_heads=lead[1], block_q=bm.block_q, block_k=bm.block_k)  # fmt: skip
            return np.asarray(again.state)
    except jax.errors.JAXTypeError:
        return None


def _concrete_slots(state: np.ndarray):
    """The tile map of a concrete state and its PARTIAL tiles' ``(b, h, qb, kb)``."""
    partial = state == PARTIAL
    slot = np.cumsum(partial.reshape(-1)).reshape(state.shape) - 1
    tiles = np.where(partial, slot, np.where(state == FULL, _ops.TILE_FULL, _ops.TILE_EMPTY))
    where = tuple(jnp.asarray(x, jnp.int32) for x in np.nonzero(partial))
    return jnp.asarray(tiles, jnp.int32), where


def _traced_slots(state):
    """The tile map of a traced state and ``(b, h, qb, kb)`` of a slot per tile (the
    PARTIAL tiles' first, in order; the rest repeat tile 0 and are never read)."""
    partial = state == PARTIAL
    flat = partial.reshape(-1)
    slot = (jnp.cumsum(flat.astype(jnp.int32)) - 1).reshape(state.shape)
    other = jnp.where(state == FULL, _ops.TILE_FULL, _ops.TILE_EMPTY)
    tiles = jnp.where(partial, slot, other).astype(jnp.int32)
    (index,) = jnp.nonzero(flat, size=flat.size, fill_value=0)
    return tiles, tuple(x.astype(jnp.int32) for x in jnp.unravel_index(index, state.shape))


def _tile_bits(mask_mod, where, bm_q: int, bm_k: int, tq: int, tk: int):
    """bool ``[n, bm_q, bm_k]``: ``mask_mod`` over tile ``(b, h, qb, kb)`` of each slot of
    ``where`` (n index vectors), through its ``(b, h, q_idx, kv_idx)`` broadcasting
    signature; positions past ``tq``, ``tk`` are clamped for the call and False."""
    b, h, qb, kb = (x.reshape(-1, 1, 1, 1) for x in where)
    n = b.shape[0]
    q = qb * bm_q + lax.broadcasted_iota(jnp.int32, (1, 1, bm_q, 1), 2)
    kv = kb * bm_k + lax.broadcasted_iota(jnp.int32, (1, 1, 1, bm_k), 3)
    bits = jnp.asarray(mask_mod(b, h, jnp.minimum(q, tq - 1), jnp.minimum(kv, tk - 1)))
    bits = jnp.broadcast_to(expand_rank(bits, 4), (n, 1, bm_q, bm_k))
    return (bits & (q < tq) & (kv < tk)).reshape(n, bm_q, bm_k)


def _broadcast_operand(x, ndim: int, dtype):
    """A bias or mask in its own broadcast shape ``[batch...|1, H|1, Tq|1, Tk|1]`` (the
    kernel reads broadcast axes with stride 0; no copy to the logits' shape), or an
    all-ones-shaped placeholder."""
    if x is None:
        return jnp.zeros((1,) * ndim, dtype)
    return expand_rank(x, ndim).astype(dtype)


def _alibi(score_mod) -> int:
    """0 without ALiBi; 1 for a bare :func:`jattn.mods.alibi`, 2 for its symmetric form."""
    if not isinstance(score_mod, mods.Alibi):
        return 0
    return 2 if score_mod.symmetric else 1


def _slopes(batch, h, settings):
    """The ALiBi slopes ``[batch..., H]`` (an operand: their gradient flows back to the
    caller's array), or a ``[batch..., 1]`` placeholder."""
    if not _alibi(settings.score_mod):
        return jnp.zeros((*batch, 1), jnp.float32)
    return jnp.broadcast_to(settings.score_mod.slopes.astype(jnp.float32), (*batch, h))


def _dropout(batch, h, tq, ops, settings) -> dict:
    """The dropout operands of :class:`._ops.Aux`: jattn._prng's row keys, numbered as the
    dense mask ``[batch..., H, Tq, Tk]`` numbers its rows (shared axes count as size 1),
    so the kernel drops exactly what the dense and blockwise paths drop."""
    if ops.dropout_rng is None:
        u32 = jnp.zeros((*batch, 1, 1), jnp.uint32)
        return dict(drop_k0=u32, drop_k1=u32, drop_threshold=jnp.zeros(batch, jnp.uint32),
                    drop_scale=jnp.ones(batch, jnp.float32))  # fmt: skip
    starts = adapters_common.dropout_row_starts(ops, settings, math.prod(batch), h, tq)
    row = starts[:, :, None] + lax.broadcasted_iota(jnp.uint32, (1, 1, tq), 2)
    k0, k1 = _prng.row_keys(_prng.key_words(ops.dropout_rng), row)
    keep = 1.0 - ops.dropout_rate

    def per_row(x):  # [N|1, H|1, Tq] -> [batch..., H, Tq]
        return jnp.broadcast_to(x, (math.prod(batch), h, tq)).reshape(*batch, h, tq)

    return dict(
        drop_k0=per_row(k0),
        drop_k1=per_row(k1),
        drop_threshold=jnp.broadcast_to(_prng.keep_threshold(keep), batch),
        drop_scale=jnp.broadcast_to((1.0 / jnp.asarray(keep, jnp.float32)), batch),
    )


def attention(q, k, v, ops, settings, *, interpret: bool):
    """The fused kernel with jattn's semantics (what it takes: module docstring).

    Args:
      q: ``[batch..., Tq, H, D]``; k: ``[batch..., Tk, K, D]``; v: ``[batch..., Tk, K, Dv]``
        (``H % K == 0``), float32, bfloat16 or float16.
      ops, settings: the validated call (:mod:`jattn._call`); see :func:`obstacle` for
        what it may hold.
      interpret: unused (a native kernel).

    Returns:
      ``(out [batch..., Tq, H, Dv]`` in q's dtype, ``lse [batch..., H, Tq]`` float32).
    """
    del interpret
    left, right = settings.window if settings.window is not None else (-1, -1)
    cap = mods.native_softcap(settings.score_mod)
    static = _ops.Static(
        scale=float(ops.scale),
        softcap=0.0 if cap is None else float(cap),
        causal=bool(settings.is_causal),
        window_left=int(left),
        window_right=-1 if right is None else int(right),
        has_segments=ops.q_segments is not None,
        has_sinks=ops.sinks is not None,
        has_dropout=ops.dropout_rng is not None,
        alibi=_alibi(settings.score_mod),
        has_bias=ops.bias is not None,
        has_mask=ops.mask is not None,
        has_blocks=int(ops.block_mask is not None),
        block_mask_q=0 if ops.block_mask is None else ops.block_mask.block_q,
        block_mask_k=0 if ops.block_mask is None else ops.block_mask.block_k,
        block_q=BLOCK_Q,
        block_k=BLOCK_K,
        max_threads=max_threads(),
    )
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out, lse = _ops.attention(*f32, _aux(q, k, ops, settings), static)
    return out.astype(q.dtype), lse
