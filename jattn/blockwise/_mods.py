"""Score/mask modifiers, sinks and a bias on the blockwise path's tiles.

The passes compute scores tile by tile, in two layouts: query-major ``[N, K, G, rows,
cols]`` (the forward pass) and key-major ``[N, K, cols, G, rows]`` (the backward pass),
with ``N`` the flattened batch, ``K`` key/value heads, ``G`` query heads per key/value head
(query head ``h = k * G + g``). This module holds what a call's modifiers add to such a
tile, whatever its layout and size:

* **score_mod / mask_mod** (FlexAttention's functions, :mod:`jattn.mods`) are hoisted
  once (:func:`jattn.blockwise._closure.hoist`) at one-element shapes ``[1, 1, 1, 1]``:
  the arrays they close over become explicit operands (the custom VJP differentiates the
  float ones), and the hoisted function is applied to a tile elementwise by nested
  ``jax.vmap`` over the tile's axes (:func:`elementwise`). The modifier itself still sees
  rank-4 arrays (one element each) and the tile's absolute (b, h, q_idx, kv_idx);
  operands that do not vary along an axis are not mapped there, so ``slopes[h]`` is
  gathered once per head, not once per score. The hoisting is the path's only trace of
  the modifier: tile states are evaluated from the hoisted function too.
* **a bias** laid out by :func:`jattn.blockwise._layout.tile_layout` is sliced per tile;
  its gradient is accumulated in that same layout (:func:`bias_tile_grad`), so its memory
  is the bias's own.
* **sinks** ``[H]`` become ``[K, G]``: each row's online softmax starts from its head's
  sink (running max = sink, running sum = 1), which makes the sink one more logit of the
  row with no value; the log-sum-exp then includes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jattn import mods
from jattn.blockwise import _closure
from jattn.blockwise._config import Config, ModOperands, ModSpec

__all__ = [
    "add_extra",
    "backward_score",
    "bias_tile",
    "bias_tile_grad",
    "elementwise",
    "extra_zeros",
    "forward_score",
    "hoist_modifier",
    "mask_tile",
    "mod_grads",
    "modifies_scores",
    "peel_band",
    "score_tile",
    "score_tile_vjp",
    "sink_grad",
    "tile_extra_zeros",
    "tile_index",
    "tile_indices",
]

Array = jax.Array
_ONE = (1, 1, 1, 1)


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
    # loop counters are int64 with jax_enable_x64 on: the modifier sees int32 whatever
    row0, col0, head_offset = (jnp.asarray(x).astype(i32) for x in (row0, col0, head_offset))
    b = jax.lax.broadcasted_iota(i32, (n, 1, 1, 1, 1), 0)
    kk = jax.lax.broadcasted_iota(i32, (1, k_heads, groups), 1) + head_offset
    h = kk * groups + jax.lax.broadcasted_iota(i32, (1, k_heads, groups), 2)
    q = jnp.minimum(row0 + jnp.arange(rows, dtype=i32), q_len - 1)
    kv = jnp.minimum(col0 + jnp.arange(cols, dtype=i32), kv_len - 1)
    if key_major:
        return (
            b,
            h.reshape(1, k_heads, 1, groups, 1),
            q.reshape(1, 1, 1, 1, rows),
            kv.reshape(1, 1, cols, 1, 1),
        )
    return (
        b,
        h.reshape(1, k_heads, groups, 1, 1),
        q.reshape(1, 1, 1, rows, 1),
        kv.reshape(1, 1, 1, 1, cols),
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


def sink_grad(sinks: Array, lse: Array, delta: Array) -> Array:
    """``d sinks [K, G]`` from the per-row ``lse`` and ``delta = rowsum(dO * O) - d_lse``
    (``[N, K, G, T]``): the sink's probability in each row is ``exp(sink - lse)`` and
    ``d out / d sink = -p_sink * out``, ``d lse / d sink = p_sink``."""
    p_sink = jnp.exp(sinks[None, :, :, None].astype(lse.dtype) - lse)
    return -jnp.sum(p_sink * delta, axis=(0, 3)).astype(sinks.dtype)


# ----------------------------------------------------------------------------------------
# The modifiers of a call (its Config and ModOperands) on one tile
# ----------------------------------------------------------------------------------------


def tile_index(cfg: Config, row0, rows: int, col0, cols: int, key_major: bool):
    """``(b, h, q_idx, kv_idx)`` of a tile for the call's modifiers (:func:`tile_indices`)."""
    return tile_indices(
        n=cfg.batch_size, k_heads=cfg.kv_heads, groups=cfg.num_heads // cfg.kv_heads,
        head_offset=cfg.head_offset, q_len=cfg.q_len, kv_len=cfg.kv_len, row0=row0, rows=rows,
        col0=col0, cols=cols, key_major=key_major,
    )  # fmt: skip


def modifies_scores(cfg: Config, mops) -> bool:
    return mops is not None and (
        (cfg.mods is not None and cfg.mods.score is not None) or mops.bias is not None
    )


def forward_score(cfg: Config, mops, row0, rows: int, col0, cols: int):
    """``s -> score_mod(s) + bias`` for a query-major tile (None: the call has neither)."""
    if not modifies_scores(cfg, mops):
        return None

    def score(s):
        if cfg.mods.score is not None:
            index = tile_index(cfg, row0, rows, col0, cols, key_major=False)
            s = score_tile(cfg.mods, mops.score_consts, s, index)
        if mops.bias is not None:
            s = s + bias_tile(mops.bias, row0, rows, col0, cols, key_major=False)
        return s

    return score


def backward_score(cfg: Config, mops, row0, rows: int, col0, cols: int):
    """``s -> (score_mod(s) + bias, vjp)`` for a key-major tile; ``vjp(ds)`` returns
    ``(d_s, (d_float_consts, ds))`` (``ds`` for the bias gradient). None: no modifier."""
    if not modifies_scores(cfg, mops):
        return None

    def score(s):
        vjp = None
        if cfg.mods.score is not None:
            index = tile_index(cfg, row0, rows, col0, cols, key_major=True)
            s, vjp = score_tile_vjp(cfg.mods, mops.score_consts, s, index)
        if mops.bias is not None:
            s = s + bias_tile(mops.bias, row0, rows, col0, cols, key_major=True)

        def backward(ds):
            if vjp is None:
                return ds, ((), ds)
            d_s, d_consts = vjp(ds)
            return d_s, (tuple(d.astype(ds.dtype) for d in d_consts if d is not None), ds)

        return s, backward

    return score


def mod_grads(cfg: Config, mops: ModOperands, rows, d_extra) -> ModOperands:
    """The cotangent of ``mops``: the score consts' (floats; None for the others), the
    sinks' (from each row's sink probability; ``rows``: the backward pass's query side, with
    its ``lse`` and ``delta``) and the bias's."""
    d_consts, d_bias = ((), None) if d_extra is None else d_extra
    it = iter(d_consts)
    floats = cfg.mods.score_float if cfg.mods is not None else ()
    d_score = tuple(
        next(it).astype(c.dtype) if f else None
        for c, f in zip(mops.score_consts, floats, strict=True)
    )
    d_sinks = None
    if mops.sinks is not None:
        d_sinks = sink_grad(mops.sinks, rows.lse[:, :, 0], rows.delta[:, :, 0])
    if d_bias is not None:
        d_bias = d_bias.astype(mops.bias.dtype)
    return ModOperands(d_score, d_sinks, d_bias)


def extra_zeros(cfg: Config, mops, f32):
    """Zero accumulators of the modifiers' gradients: ``(d_float_consts, d_bias)`` or None."""
    if not modifies_scores(cfg, mops):
        return None
    floats = cfg.mods.score_float if cfg.mods.score is not None else ()
    consts = tuple(
        jnp.zeros(c.shape, f32) for c, f in zip(mops.score_consts, floats, strict=True) if f
    )
    return consts, None if mops.bias is None else jnp.zeros(mops.bias.shape, f32)


def add_extra(cfg: Config, acc, extra, i, j):
    """``acc`` (:func:`extra_zeros`) plus one tile's ``extra`` (the backward pass's tile gradients)."""
    if acc is None:
        return None
    d_consts, d_bias = acc
    tile_consts, ds = extra
    d_consts = tuple(a + t.astype(a.dtype) for a, t in zip(d_consts, tile_consts, strict=True))
    if d_bias is not None:
        d_bias = bias_tile_grad(d_bias, ds, i * cfg.block_q, j * cfg.block_k, key_major=True)
    return d_consts, d_bias


def tile_extra_zeros(cfg: Config, mops, tile_shape, f32):
    """A skipped tile's ``extra`` (zeros shaped as the backward pass's tile gradients)."""
    acc = extra_zeros(cfg, mops, f32)
    return None if acc is None else (acc[0], jnp.zeros(tile_shape, f32))
