"""Score/mask modifiers, sinks and a bias on the blockwise path's tiles.

:mod:`jattn.blockwise` computes scores tile by tile, in two layouts: query-major
``[N, K, G, rows, cols]`` (the forward pass) and key-major ``[N, K, cols, G, rows]`` (the
backward pass), with ``N`` the flattened batch, ``K`` key/value heads, ``G`` query heads
per key/value head (query head ``h = k * G + g``). This module holds what a call's
modifiers add to such a tile, whatever its layout and size:

* **score_mod / mask_mod** (FlexAttention's functions, :mod:`jattn.mods`) are hoisted
  once (:func:`jattn._closure.hoist`) at one-element shapes ``[1, 1, 1, 1]``: the arrays
  they close over become explicit operands (the custom VJP differentiates the float
  ones), and the hoisted function is applied to a tile elementwise by nested ``jax.vmap``
  over the tile's axes (:func:`elementwise`). The modifier itself still sees rank-4
  arrays (one element each) and the tile's absolute (b, h, q_idx, kv_idx); operands that
  do not vary along an axis are not mapped there, so ``slopes[h]`` is gathered once per
  head, not once per score.
* **a bias** broadcastable to ``[batch..., H, Tq, Tk]`` is laid out as
  ``[Nb, Kb, Gb, Lq, Lk]`` (size-1 axes stay size 1, nothing is materialised along them;
  full axes are zero-padded to the tiled lengths) and sliced per tile; its gradient is
  accumulated in that same layout (:func:`bias_tile_grad`), so its memory is the bias's own.
* **sinks** ``[H]`` become ``[K, G]``: each row's online softmax starts from its head's
  sink (running max = sink, running sum = 1), which makes the sink one more logit of the
  row with no value; the log-sum-exp then includes it.
* **block masks** (:class:`jattn.BlockMask`) give the schedule its tile states: a
  block mask's per-tile states, combined over batch rows and heads, are coarsened to the
  path's tiles when those are multiples of the block mask's (:func:`coarsen`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import _closure, block_masks, mods

__all__ = [
    "ModOperands",
    "ModSpec",
    "bias_tile",
    "bias_tile_grad",
    "block_states",
    "coarsen",
    "elementwise",
    "hoist_modifier",
    "mask_tile",
    "peel_band",
    "score_tile",
    "score_tile_vjp",
    "sink_grad",
    "tile_indices",
    "tile_layout",
]

Array = jax.Array
_ONE = (1, 1, 1, 1)


class ModOperands(NamedTuple):
    """The differentiable operands the modifiers add to a blockwise call (a pytree).

    Attributes:
      score_consts: the arrays ``score_mod`` reads (hoisted), in its hoisted order.
      sinks: float ``[K, G]`` sink logits, or None.
      bias: float ``[Nb, Kb, Gb, Lq, Lk]`` (:func:`tile_layout`), or None.
    """

    score_consts: tuple = ()
    sinks: Array | None = None
    bias: Array | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ModSpec:
    """The static side of a call's modifiers (hashed by identity: one per call).

    Attributes:
      score: hoisted ``score_mod(score, b, h, q_idx, kv_idx, *score_consts)`` at
        one-element shapes, or None.
      mask: hoisted ``mask_mod(b, h, q_idx, kv_idx, *mask_consts)``, or None.
      score_float: per score const, whether it is floating (gets a gradient).
      states_block: ``(block_q, block_k)`` of the tile states in ``Aux``, or None.
      has_bias: the call adds a bias (``ModOperands.bias``).
    """

    score: Callable | None = None
    mask: Callable | None = None
    score_float: tuple[bool, ...] = ()
    states_block: tuple[int, int] | None = None
    has_bias: bool = False

    @property
    def elementwise(self) -> bool:
        """Whether tiles need more than the band: a score_mod, a mask_mod or a bias."""
        return self.score is not None or self.mask is not None or self.has_bias


def hoist_modifier(fn: Callable, kind: str, dtype) -> tuple[Callable, list]:
    """``fn`` hoisted at one-element rank-4 shapes: ``(converted, consts)``."""
    index = [jax.ShapeDtypeStruct(_ONE, jnp.int32)] * 4
    if kind == "score":
        return _closure.hoist(fn, jax.ShapeDtypeStruct(_ONE, dtype), *index)
    return _closure.hoist(fn, *index)


def peel_band(mask_mod) -> tuple[bool, Any]:
    """``(causal, rest)``: a ready-made :func:`jattn.mods.causal` (alone or ANDed with other
    masks) becomes the path's causal band (its fast path and exact tile skipping), and
    ``rest`` is what remains of ``mask_mod`` (None: nothing)."""
    if isinstance(mask_mod, mods.Causal):
        return True, None
    if isinstance(mask_mod, mods.MaskAnd):
        parts = [m for m in mask_mod.mods if not isinstance(m, mods.Causal)]
        if len(parts) < len(mask_mod.mods):
            rest = None if not parts else parts[0] if len(parts) == 1 else mods.and_masks(*parts)
            return True, rest
    return False, mask_mod


# ----------------------------------------------------------------------------------------
# Elementwise application to tiles
# ----------------------------------------------------------------------------------------


def tile_indices(*, n, k_heads, groups, head_offset, q_len, kv_len, row0, rows, col0, cols,
                 key_major: bool):  # fmt: skip
    """``(b, h, q_idx, kv_idx)`` int32 of a tile, rank 5, in the tile's layout.

    Query-major ``[N, K, G, rows, cols]``: ``b [N,1,1,1,1]``, ``h [1,K,G,1,1]``,
    ``q [1,1,1,rows,1]``, ``kv [1,1,1,1,cols]``; key-major ``[N, K, cols, G, rows]``: the
    same values in that layout. ``h`` counts the call's query heads (``head_offset``: the
    first key/value head of this computation). Positions past the real lengths (tile
    padding, masked anyway) are clamped to the last real one, so a modifier indexing an
    array by position stays in bounds.
    """
    i32 = jnp.int32
    b = jax.lax.broadcasted_iota(i32, (n, 1, 1, 1, 1), 0)
    kk = jax.lax.broadcasted_iota(i32, (1, k_heads, groups), 1) + head_offset
    h = kk * groups + jax.lax.broadcasted_iota(i32, (1, k_heads, groups), 2)
    q = jnp.minimum(row0 + jnp.arange(rows, dtype=i32), q_len - 1)
    kv = jnp.minimum(col0 + jnp.arange(cols, dtype=i32), kv_len - 1)
    if key_major:
        return b, h.reshape(1, k_heads, 1, groups, 1), q.reshape(1, 1, 1, 1, rows), kv.reshape(
            1, 1, cols, 1, 1
        )
    return b, h.reshape(1, k_heads, groups, 1, 1), q.reshape(1, 1, 1, rows, 1), kv.reshape(
        1, 1, 1, 1, cols
    )


def elementwise(fn: Callable, *args: Array) -> Array:
    """``fn`` (a rank-4 modifier) on every element of ``args`` (broadcastable arrays of one
    rank), by nested ``jax.vmap``: an argument is mapped only along the axes where it
    varies. Returns the broadcast shape of ``args``."""
    shape = jnp.broadcast_shapes(*(a.shape for a in args))

    def level(depth: int):
        if depth == len(shape):
            return lambda *xs: jnp.reshape(fn(*(x.reshape(_ONE) for x in xs)), ())
        inner = level(depth + 1)

        def mapped(*xs):
            axes = tuple(0 if x.shape[0] > 1 else None for x in xs)
            xs = tuple(x if a == 0 else x[0] for x, a in zip(xs, axes, strict=True))
            if all(a is None for a in axes):
                return inner(*xs)[None]
            return jax.vmap(inner, in_axes=axes)(*xs)

        return mapped

    return jnp.broadcast_to(level(0)(*args), shape)


def score_tile(spec: ModSpec, consts, s: Array, index) -> Array:
    """``score_mod`` on a tile of scores (any layout; ``index`` from :func:`tile_indices`)."""
    return elementwise(lambda x, *idx: spec.score(x, *idx, *consts), s, *index).astype(s.dtype)


def score_tile_vjp(spec: ModSpec, consts, s: Array, index):
    """``(score_mod(s), vjp)``: ``vjp(ds) -> (d_s, d_consts)`` with ``d_consts`` a tuple
    holding the cotangent of each float const (None for the others)."""
    floats = [c for c, f in zip(consts, spec.score_float, strict=True) if f]

    def apply(x, *float_consts):
        it = iter(float_consts)
        all_consts = [next(it) if f else c for c, f in zip(consts, spec.score_float, strict=True)]
        return score_tile(spec, all_consts, x, index)

    out, vjp = jax.vjp(apply, s, *floats)

    def backward(ds):
        d_s, *d_floats = vjp(ds)
        it = iter(d_floats)
        return d_s, tuple(next(it) if f else None for f in spec.score_float)

    return out, backward


def mask_tile(spec: ModSpec, consts, index) -> Array:
    """``mask_mod`` on a tile: bool, the broadcast shape of ``index``."""
    return elementwise(lambda *idx: spec.mask(*idx, *consts), *index)


# ----------------------------------------------------------------------------------------
# Bias
# ----------------------------------------------------------------------------------------


def tile_layout(x: Array, batch, num_heads, k_heads, padded_q, padded_kv) -> Array:
    """A mask or bias broadcastable to ``[batch..., H, Tq, Tk]`` as ``[N|1, K|1, G|1, Lq, Lk]``:
    size-1 axes stay size 1 (nothing is materialised along them); full query / key axes are
    padded with zeros (False) to the tiled lengths."""
    x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)
    if all(s == 1 for s in x.shape[: len(batch)]):
        x = x.reshape(1, *x.shape[len(batch) :])
    else:
        x = jnp.broadcast_to(x, (*batch, *x.shape[len(batch) :]))
        x = x.reshape(math.prod(batch), *x.shape[len(batch) :])
    _, h, lq, lk = x.shape
    groups = num_heads // k_heads
    x = x.reshape(x.shape[0], k_heads, groups, lq, lk) if h > 1 else x[:, :, None]
    pad_q = padded_q - lq if lq > 1 else 0
    pad_k = padded_kv - lk if lk > 1 else 0
    if pad_q or pad_k:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad_q), (0, pad_k)))
    return x


def _slice(x: Array, start, width: int, axis: int) -> Array:
    return x if x.shape[axis] == 1 else jax.lax.dynamic_slice_in_dim(x, start, width, axis)


def bias_tile(bias: Array, row0, rows: int, col0, cols: int, key_major: bool) -> Array:
    """The bias of a tile, broadcastable to it (rank 5, in the tile's layout)."""
    tile = _slice(_slice(bias, row0, rows, 3), col0, cols, 4)
    return jnp.transpose(tile, (0, 1, 4, 2, 3)) if key_major else tile


def bias_tile_grad(d_bias: Array, ds: Array, row0, col0, key_major: bool) -> Array:
    """``d_bias`` (the bias's layout) plus a tile's score cotangent ``ds`` summed over the
    axes the bias broadcasts along."""
    if key_major:  # [N, K, c, G, r] -> [N, K, G, r, c]
        ds = jnp.transpose(ds, (0, 1, 3, 4, 2))
    axes = tuple(a for a in range(5) if d_bias.shape[a] == 1 and ds.shape[a] > 1)
    ds = ds.sum(axis=axes, keepdims=True).astype(d_bias.dtype)
    rows, cols = ds.shape[3], ds.shape[4]
    start = [0, 0, 0, row0 if d_bias.shape[3] > 1 else 0, col0 if d_bias.shape[4] > 1 else 0]
    current = jax.lax.dynamic_slice(d_bias, start, (*d_bias.shape[:3], rows, cols))
    return jax.lax.dynamic_update_slice(d_bias, current + ds, start)


# ----------------------------------------------------------------------------------------
# Sinks and block states
# ----------------------------------------------------------------------------------------


def sink_grad(sinks: Array, lse: Array, delta: Array) -> Array:
    """``d sinks [K, G]`` from the per-row ``lse`` and ``delta = rowsum(dO * O) - d_lse``
    (``[N, K, G, T]``): the sink's probability in each row is ``exp(sink - lse)`` and
    ``d out / d sink = -p_sink * out``, ``d lse / d sink = p_sink``."""
    p_sink = jnp.exp(sinks[None, :, :, None].astype(lse.dtype) - lse)
    return -jnp.sum(p_sink * delta, axis=(0, 3)).astype(sinks.dtype)


def block_states(mask_mod, block_mask, *, n, num_heads, q_len, kv_len, block) -> Array:
    """int8 ``[nq, nk]`` tile states (EMPTY / PARTIAL / FULL of :mod:`jattn.block_masks`)
    at ``block``, combined over batch rows and heads: EMPTY only if empty for every one,
    FULL only if full for every one. From ``block_mask`` when given at that block, else
    evaluated from ``mask_mod`` once (one row of tiles at a time)."""
    if block_mask is None or (block_mask.block_q, block_mask.block_k) != block:
        block_mask = block_masks.block_mask(
            mask_mod, q_len=q_len, kv_len=kv_len, batch_shape=n, num_heads=num_heads,
            block_q=block[0], block_k=block[1],
        )  # fmt: skip
    needed, full = block_mask.tile_flags()
    return jnp.where(full, block_masks.FULL, jnp.where(needed, block_masks.PARTIAL, 0)).astype(
        jnp.int8
    )


def coarsen(states: Array, block: tuple[int, int], tile: tuple[int, int], nq: int, nk: int):
    """``(needed, full)`` bool ``[nq, nk]`` for tiles of ``tile``, from ``states`` at
    ``block`` (each tile length a multiple of the block's). Sub-blocks past the states'
    extent (tile padding) count as neither needed nor partial."""
    fq, fk = tile[0] // block[0], tile[1] // block[1]
    sq, sk = states.shape
    pad = ((0, nq * fq - sq), (0, nk * fk - sk))
    needed = jnp.pad(states != 0, pad, constant_values=False)
    full = jnp.pad(states == block_masks.FULL, pad, constant_values=True)
    needed = needed.reshape(nq, fq, nk, fk).any(axis=(1, 3))
    full = full.reshape(nq, fq, nk, fk).all(axis=(1, 3))
    return needed, full & needed
