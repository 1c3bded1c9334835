"""Blockwise (FlashAttention-style) attention: O(T) memory, skipped masked blocks, custom VJP.

The forward pass streams the softmax over key blocks with a running max ``m`` and
sum ``l`` (Rabe & Staats 2021; Dao et al. 2022), so the ``[q_len, kv_len]`` score
matrix never exists; only one ``[block_q, block_k]`` tile per (batch, head) does.
A tile that the masks remove entirely is never computed: each query block visits
only the key blocks its causal / sliding-window / length / segment / explicit masks
leave visible. With causal, window and length masks the visited tiles of a row are a
run of boundary tiles, a run of fully visible tiles and a run of boundary tiles, and
only the boundary tiles pay for an elementwise mask; with segment ids or a mask array
(whose visible tiles need not be contiguous) each tile in the row's range is skipped or
masked one by one. The batch shares one loop, so a tile is skipped when it is hidden
for every batch element.

The backward pass is FlashAttention-2's: it keeps only the output and the per-row
log-sum-exp ``lse = m + log(l)`` from the forward pass and recomputes each tile's
probabilities ``exp(s - lse)``, so forward+backward memory is O(T) too.

Dropout is applied inside the tiles with bits that depend only on the key and the
element's global (batch, head, query, key) position (:mod:`jattn._prng`), so the
mask is the dense path's mask, whatever the block sizes.

Score and mask modifiers (:mod:`jattn.mods`), sinks and a bias run inside the tiles
(:mod:`jattn._tile_mods`): ``score_mod`` on each tile's scaled logits with the tile's
absolute (b, h, q_idx, kv_idx), recomputed and differentiated in the backward pass (the
arrays it closes over are hoisted into operands of the custom VJP and get gradients); a
bias sliced per tile, its gradient accumulated in its own broadcast shape; sinks as the
starting point of each row's running max and sum; ``mask_mod`` as one more elementwise
mask, its tile states (from a :class:`jattn.BlockMask`, or evaluated once per call)
deciding which tiles are skipped, masked or computed without a mask. A ready-made
:func:`jattn.mods.causal` becomes the causal band itself (the same schedule and fast
path as ``is_causal=True``). The causal fast path serves calls without score_mod,
mask_mod or bias (sinks included).

This module holds the algorithm only; :func:`jattn.functional.dot_product_attention`
validates arguments, picks the implementation and calls :func:`blockwise_attention`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn import _prng
from jattn import _tile_mods as tm
from jattn import _tiles as _tiles_lib
from jattn import masks as masks_lib
from jattn._call import Operands, Settings

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "blockwise_attention"]

# The internal API that jattn's other paths (ring attention) build on, beside the public
# blockwise_attention: Config / make_config (static description and tiling), tile_length,
# Aux (per-call arrays in tile layout), forward and backward (one pass each).

Array = jax.Array

# Tile sizes: jattn._tiles.default_tiles (a rule per kind of CPU, measured); these are the
# AVX2 rule's, kept as the public defaults that ring attention and the docs name.
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one call (hashable: it keys the custom VJP's trace).

    ``block_q`` x ``block_k`` are the forward pass's tiles, ``bwd_block_q`` x
    ``bwd_block_k`` the backward pass's; ``padded_q`` / ``padded_kv`` (the lengths the
    operands are padded to) are multiples of both. ``diag`` is the sub-tile of the causal
    fast path's diagonal block. ``num_heads`` / ``kv_heads`` count this computation's
    heads, which start at key/value head ``head_offset`` of the call's ``all_heads`` query
    heads (one computation per group of heads: see :func:`attention`).
    """

    q_len: int  # real (unpadded) lengths
    kv_len: int
    block_q: int
    block_k: int
    scale: float
    band_lo: int | None  # visible keys satisfy band_lo <= k - q <= band_hi (None: unbounded)
    band_hi: int | None
    dropout: bool
    dropout_rows_batch: bool  # the dropout row index counts batch / heads (False: shared)
    dropout_rows_heads: bool
    num_heads: int
    kv_heads: int
    batch_size: int  # product of the batch dims
    precision: Any
    padded_q: int = 0  # 0: a multiple of block_q (set by __post_init__)
    padded_kv: int = 0
    bwd_block_q: int = 0  # 0: block_q
    bwd_block_k: int = 0
    diag: int = 64
    head_offset: int = 0
    all_heads: int = 0  # 0: num_heads
    mods: tm.ModSpec | None = None  # score_mod / mask_mod / bias / block states of the call

    def __post_init__(self):
        fill = {
            "padded_q": _round_up(self.q_len, self.block_q),
            "padded_kv": _round_up(self.kv_len, self.block_k),
            "bwd_block_q": self.block_q,
            "bwd_block_k": self.block_k,
            "all_heads": self.num_heads,
        }
        for name, value in fill.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)

    def backward_tiles(self) -> Config:
        """This configuration with the backward pass's tiles as its tiles."""
        return dataclasses.replace(self, block_q=self.bwd_block_q, block_k=self.bwd_block_k)


class Aux(NamedTuple):
    """Per-call arrays of the tile loops, in tile layout (None where absent; a pytree).

    Attributes:
      q_lengths: int32 ``[N]``: real queries per flattened batch row.
      kv_lengths: int32 ``[N]``: real keys per row.
      q_segments: int32 ``[N, Tq_pad]`` (edge-padded).
      kv_segments: int32 ``[N, Tk_pad]``.
      mask: bool ``[Nm, Km, Gm, Lq, Lk]`` (see :func:`jattn._tile_mods.tile_layout`).
      dropout_words: uint32 ``[4]`` from the dropout key (:func:`jattn._prng.key_words`).
      dropout_threshold: uint32 keep threshold (:func:`jattn._prng.keep_threshold`).
      keep_prob: ``1 - rate`` in the softmax dtype.
      mask_consts: the arrays the call's hoisted ``mask_mod`` reads (``cfg.mods.mask``).
      tile_states: int8 ``[nq0, nk0]`` block-mask tile states at ``cfg.mods.states_block``
        (:func:`jattn._tile_mods.block_states`), or None.
    """

    q_lengths: Array | None = None
    kv_lengths: Array | None = None
    q_segments: Array | None = None
    kv_segments: Array | None = None
    mask: Array | None = None
    dropout_words: Array | None = None
    dropout_threshold: Array | None = None
    keep_prob: Array | None = None
    mask_consts: tuple | None = None
    tile_states: Array | None = None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def tile_length(length: int, requested: int) -> int:
    """The tile length for ``length`` tokens: ``requested``, capped at ``length`` rounded up
    to 8 (a sequence shorter than a tile is one tile, not a padded one)."""
    return min(requested, _round_up(length, 8))


def _tiles(q_len: int, kv_len: int, block_q: int | None, block_k: int | None) -> _tiles_lib.Tiles:
    """The rule's tiles (:func:`jattn._tiles.default_tiles`); a tile the caller names is
    used by both passes, the other axis keeps the rule's."""
    rule = _tiles_lib.default_tiles(q_len, kv_len, jax.default_backend())
    if block_q is None and block_k is None:
        return rule
    fwd_q, bwd_q = (rule.fwd_q, rule.bwd_q) if block_q is None else (block_q, block_q)
    fwd_k, bwd_k = (rule.fwd_k, rule.bwd_k) if block_k is None else (block_k, block_k)
    return _tiles_lib.tiles_for(
        q_len, kv_len, (fwd_q, fwd_k), (bwd_q, bwd_k), rule.diag, shrink=False
    )


def make_config(
    *,
    q_len: int,
    kv_len: int,
    num_heads: int,
    kv_heads: int,
    batch_size: int,
    scale: float,
    is_causal: bool = False,
    window: tuple[int, int | None] | None = None,
    dropout: bool = False,
    dropout_shared: tuple[bool, bool] = (False, False),
    precision: Any = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Config:
    """The :class:`Config` of one call: tiles from the measured rule
    (:func:`jattn._tiles.default_tiles`) unless named, masks as a band."""
    band_lo = band_hi = None
    if is_causal:
        band_hi = 0
    if window is not None:
        left, right = window
        band_lo = -int(left)
        if right is not None:
            band_hi = int(right) if band_hi is None else min(band_hi, int(right))
    tiles = _tiles(q_len, kv_len, block_q, block_k)
    return Config(
        q_len=q_len,
        kv_len=kv_len,
        block_q=tiles.fwd_q,
        block_k=tiles.fwd_k,
        scale=float(scale),
        band_lo=band_lo,
        band_hi=band_hi,
        dropout=dropout,
        dropout_rows_batch=not dropout_shared[0],
        dropout_rows_heads=not dropout_shared[1],
        num_heads=num_heads,
        kv_heads=kv_heads,
        batch_size=batch_size,
        precision=precision,
        padded_q=tiles.padded_q,
        padded_kv=tiles.padded_kv,
        bwd_block_q=tiles.bwd_q,
        bwd_block_k=tiles.bwd_k,
        diag=tiles.diag,
    )


# ----------------------------------------------------------------------------------------
# Which tiles to compute
# ----------------------------------------------------------------------------------------


def _position_flags(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """Static ``(needed, full)`` ``[nq, nk]`` flags from positions alone (causal, window, padding).

    ``needed``: some (query, key) pair of the tile is visible. ``full``: every pair with a
    real key is visible, so the tile needs no elementwise mask.
    """
    bq, bk = cfg.block_q, cfg.block_k
    i = np.arange(cfg.padded_q // bq)[:, None]
    j = np.arange(cfg.padded_kv // bk)[None, :]
    q_first, q_last = i * bq, np.minimum((i + 1) * bq, cfg.q_len) - 1
    k_first, k_last = j * bk, np.minimum((j + 1) * bk, cfg.kv_len) - 1
    # k - q takes every integer value in [d_min, d_max] over the tile's real rows and keys.
    d_min, d_max = k_first - q_last, k_last - q_first
    needed = np.ones((i.shape[0], j.shape[1]), bool)
    full = needed & ((j + 1) * bk <= cfg.kv_len)  # padded keys must be masked
    if cfg.band_hi is not None:
        needed &= d_min <= cfg.band_hi
        full &= d_max <= cfg.band_hi
    if cfg.band_lo is not None:
        needed &= d_max >= cfg.band_lo
        full &= d_min >= cfg.band_lo
    return needed, full & needed


def _dynamic_flags(cfg: Config, aux: Aux) -> tuple[Array, Array] | None:
    """Per-call ``(needed, full)`` ``[nq, nk]`` from lengths, segment ids and a mask array.

    A tile is needed if it is needed for *some* batch element (the loop is shared by the
    whole batch) and full only if it is full for every one.
    """
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk = cfg.padded_q // bq, cfg.padded_kv // bk
    needed, full = [], []  # each broadcastable to [batch, nq, nk]
    q_first = jnp.arange(nq) * bq
    q_end = jnp.minimum(q_first + bq, cfg.q_len)
    k_first = jnp.arange(nk) * bk
    k_end = jnp.minimum(k_first + bk, cfg.kv_len)
    if aux.q_lengths is not None:
        lengths = aux.q_lengths[:, None]  # [N, 1]
        needed.append((q_first[None] < lengths)[:, :, None])
        full.append((q_end[None] <= lengths)[:, :, None])
    if aux.kv_lengths is not None:
        lengths = aux.kv_lengths[:, None]
        needed.append((k_first[None] < lengths)[:, None, :])
        full.append((k_end[None] <= lengths)[:, None, :])
    if aux.q_segments is not None:
        # [N, n, block] ranges of ids per tile; disjoint ranges share no id.
        q_ids = aux.q_segments.reshape(-1, nq, bq)
        k_ids = aux.kv_segments.reshape(-1, nk, bk)
        q_lo, q_hi = q_ids.min(-1)[:, :, None], q_ids.max(-1)[:, :, None]
        k_lo, k_hi = k_ids.min(-1)[:, None, :], k_ids.max(-1)[:, None, :]
        needed.append((q_lo <= k_hi) & (k_lo <= q_hi))
        full.append((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo))
    if aux.mask is not None:
        mask = aux.mask  # [Nm, Km, Gm, Lq, Lk]; Lq, Lk are 1 or the padded lengths
        nm, km, gm, lq, lk = mask.shape
        tiles = mask.reshape(
            nm, km, gm, nq if lq > 1 else 1, bq if lq > 1 else 1, nk if lk > 1 else 1, -1
        )
        # [Nm, nq|1, nk|1]: over heads and the tile's rows and keys
        needed.append(tiles.any(axis=(1, 2, 4, 6)))
        full.append(tiles.all(axis=(1, 2, 4, 6)))
    if aux.tile_states is not None:
        # [nq, nk] from the block mask's states, coarsened to these tiles
        need, ful = tm.coarsen(aux.tile_states, cfg.mods.states_block, (bq, bk), nq, nk)
        needed.append(need[None])
        full.append(ful[None])
    if not needed:
        return None
    need, ful = needed[0], full[0]
    for n_, f_ in zip(needed[1:], full[1:], strict=True):
        need, ful = need & n_, ful & f_
    need = jnp.broadcast_to(need.any(axis=0), (nq, nk))
    ful = jnp.broadcast_to(ful.all(axis=0), (nq, nk))
    return need, ful


def _schedule(cfg: Config, aux: Aux) -> _Schedule:
    """Which tiles to compute, and whether each needs an elementwise mask."""
    needed, full = _position_flags(cfg)
    dynamic = _dynamic_flags(cfg, aux)
    if dynamic is not None:
        needed = jnp.asarray(needed) & dynamic[0]
        full = jnp.asarray(full) & dynamic[1] & needed
    # Causal / window / length masks leave, in each row of tiles, one run of needed tiles
    # with one run of full tiles inside it; segment ids and mask arrays may not.
    runs = aux.q_segments is None and aux.mask is None and aux.tile_states is None
    never_masked = dynamic is None and bool(np.all(full == needed))
    return _Schedule(needed, full, runs, never_masked)


@dataclasses.dataclass(frozen=True)
class _Schedule:
    needed: Any  # bool [nq, nk] (numpy when static)
    full: Any  # bool [nq, nk]: needed and no elementwise mask
    runs: bool  # every row is: masked tiles, full tiles, masked tiles
    never_masked: bool

    def transposed(self) -> _Schedule:
        return _Schedule(self.needed.T, self.full.T, self.runs, self.never_masked)

    def bounds(self):
        """Per row ``(lo, full_lo, full_hi, hi)`` int32: masked ``[lo, full_lo)``, full
        ``[full_lo, full_hi)``, masked ``[full_hi, hi)`` (valid when ``runs``)."""
        xp = np if isinstance(self.needed, np.ndarray) else jnp
        lo, hi = _first_last(self.needed, xp)
        full_lo, full_hi = _first_last(self.full, xp)
        has_full = self.full.any(axis=1)
        full_lo = xp.where(has_full, full_lo, hi)
        full_hi = xp.where(has_full, full_hi, hi)
        return tuple(jnp.asarray(b, jnp.int32) for b in (lo, full_lo, full_hi, hi))

    def visit(self, row, tile, carry):
        """Runs ``carry = tile(col, carry, masked=...)`` over the needed tiles of ``row``."""
        if self.never_masked:
            lo, _, _, hi = self.bounds()
            return lax.fori_loop(lo[row], hi[row], functools.partial(tile, masked=False), carry)
        if self.runs:
            lo, full_lo, full_hi, hi = self.bounds()
            masked = functools.partial(tile, masked=True)
            carry = lax.fori_loop(lo[row], full_lo[row], masked, carry)
            carry = lax.fori_loop(
                full_lo[row], full_hi[row], functools.partial(tile, masked=False), carry
            )
            return lax.fori_loop(full_hi[row], hi[row], masked, carry)
        lo, _, _, hi = self.bounds()
        # 0: skip, 1: masked, 2: full (no elementwise mask)
        state = jnp.where(self.needed, jnp.where(self.full, 2, 1), 0).astype(jnp.int32)

        def body(col, c):
            return tile(col, c, masked=True, state=state[row, col])

        return lax.fori_loop(lo[row], hi[row], body, carry)


def _first_last(flags, xp):
    """First and one-past-last True column of each row (0, 0 for a row with none)."""
    n = flags.shape[1]
    any_ = flags.any(axis=1)
    first = xp.where(any_, xp.argmax(flags, axis=1), 0)
    last = xp.where(any_, n - xp.argmax(flags[:, ::-1], axis=1), 0)
    return first, last


# ----------------------------------------------------------------------------------------
# One tile
# ----------------------------------------------------------------------------------------


def _tile_mask(cfg: Config, aux: Aux, i, j) -> Array | None:
    """Visible (query, key) pairs of tile ``(i, j)``, broadcastable to ``[N, K, G, bq, bk]``."""
    bq, bk = cfg.block_q, cfg.block_k
    # [1, 1, 1, bq, 1] and [1, 1, 1, 1, bk] global positions
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (1, 1, 1, bq, 1), 3)
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (1, 1, 1, 1, bk), 4)
    parts = []
    if cfg.band_hi is not None:
        parts.append(k_pos - q_pos <= cfg.band_hi)
    if cfg.band_lo is not None:
        parts.append(k_pos - q_pos >= cfg.band_lo)
    if cfg.padded_kv > cfg.kv_len:
        parts.append(k_pos < cfg.kv_len)
    if aux.q_lengths is not None:
        # [N, 1, 1, bq, 1]
        parts.append(q_pos < aux.q_lengths[:, None, None, None, None])
    if aux.kv_lengths is not None:
        # [N, 1, 1, 1, bk]
        parts.append(k_pos < aux.kv_lengths[:, None, None, None, None])
    if aux.q_segments is not None:
        q_ids = lax.dynamic_slice_in_dim(aux.q_segments, i * bq, bq, axis=1)
        k_ids = lax.dynamic_slice_in_dim(aux.kv_segments, j * bk, bk, axis=1)
        # [N, 1, 1, bq, bk]
        parts.append((q_ids[:, :, None] == k_ids[:, None, :])[:, None, None])
    if aux.mask is not None:
        mask = aux.mask  # [Nm, Km, Gm, Lq, Lk]
        if mask.shape[-2] > 1:
            mask = lax.dynamic_slice_in_dim(mask, i * bq, bq, axis=3)
        if mask.shape[-1] > 1:
            mask = lax.dynamic_slice_in_dim(mask, j * bk, bk, axis=4)
        parts.append(mask)
    if cfg.mods is not None and cfg.mods.mask is not None:
        index = _tile_index(cfg, i * bq, bq, j * bk, bk, key_major=False)
        parts.append(tm.mask_tile(cfg.mods, aux.mask_consts, index))  # [N|1, K|1, G|1, bq, bk]
    visible = masks_lib.combine_masks(*parts)
    # rank 5 explicitly (rank promotion 'raise'): [N|1, K|1, G|1, bq|1, bk|1]
    return None if visible is None else visible.reshape((1,) * (5 - visible.ndim) + visible.shape)


def _tile_index(cfg: Config, row0, rows: int, col0, cols: int, key_major: bool):
    """``(b, h, q_idx, kv_idx)`` of a tile for the call's modifiers (see :mod:`jattn._tile_mods`)."""
    return tm.tile_indices(
        n=cfg.batch_size, k_heads=cfg.kv_heads, groups=cfg.num_heads // cfg.kv_heads,
        head_offset=cfg.head_offset, q_len=cfg.q_len, kv_len=cfg.kv_len, row0=row0, rows=rows,
        col0=col0, cols=cols, key_major=key_major,
    )  # fmt: skip


def _modifies_scores(cfg: Config, mops) -> bool:
    return mops is not None and (
        (cfg.mods is not None and cfg.mods.score is not None) or mops.bias is not None
    )


def _forward_score(cfg: Config, mops, row0, rows: int, col0, cols: int):
    """``s -> score_mod(s) + bias`` for a query-major tile (None: the call has neither)."""
    if not _modifies_scores(cfg, mops):
        return None

    def score(s):
        if cfg.mods.score is not None:
            index = _tile_index(cfg, row0, rows, col0, cols, key_major=False)
            s = tm.score_tile(cfg.mods, mops.score_consts, s, index)
        if mops.bias is not None:
            s = s + tm.bias_tile(mops.bias, row0, rows, col0, cols, key_major=False)
        return s

    return score


def _backward_score(cfg: Config, mops, row0, rows: int, col0, cols: int):
    """``s -> (score_mod(s) + bias, vjp)`` for a key-major tile; ``vjp(ds)`` returns
    ``(d_s, (d_float_consts, ds))`` (``ds`` for the bias gradient). None: no modifier."""
    if not _modifies_scores(cfg, mops):
        return None

    def score(s):
        vjp = None
        if cfg.mods.score is not None:
            index = _tile_index(cfg, row0, rows, col0, cols, key_major=True)
            s, vjp = tm.score_tile_vjp(cfg.mods, mops.score_consts, s, index)
        if mops.bias is not None:
            s = s + tm.bias_tile(mops.bias, row0, rows, col0, cols, key_major=True)

        def backward(ds):
            if vjp is None:
                return ds, ((), ds)
            d_s, d_consts = vjp(ds)
            return d_s, (tuple(d.astype(ds.dtype) for d in d_consts if d is not None), ds)

        return s, backward

    return score


def _dropout_row_keys(cfg: Config, aux: Aux) -> tuple[Array, Array]:
    """Dropout row keys of every query row, ``[N|1, K|1, G|1, Tq_pad]`` (one Philox call each).

    Rows are numbered as in the dense dropout mask ``[batch..., heads, q_len, kv_len]``
    (row-major over all but the key axis; shared axes count as size 1), as
    :func:`jattn._prng.keep_mask` numbers them, so both paths draw the same mask.
    """
    n, k_heads, groups = cfg.batch_size, cfg.kv_heads, cfg.num_heads // cfg.kv_heads
    u32 = jnp.uint32
    row = lax.broadcasted_iota(u32, (1, 1, 1, cfg.padded_q), 3)
    if cfg.dropout_rows_heads:
        # head h = k * G + g, as the dense path's reshape lays them out
        k_index = lax.broadcasted_iota(u32, (1, k_heads, groups, 1), 1) + np.uint32(cfg.head_offset)
        head = k_index * np.uint32(groups) + lax.broadcasted_iota(u32, (1, k_heads, groups, 1), 2)
        row = row + head * np.uint32(cfg.q_len)
    if cfg.dropout_rows_batch:
        heads = cfg.all_heads if cfg.dropout_rows_heads else 1
        row = row + lax.broadcasted_iota(u32, (n, 1, 1, 1), 0) * np.uint32(
            (heads * cfg.q_len) % 2**32
        )
    return _prng.row_keys(aux.dropout_words, row)


class _Dropout(NamedTuple):
    row_keys: tuple[Array, Array]  # _dropout_row_keys
    threshold: Array
    scale: Array  # 1 / keep probability

    def keep(self, row0, rows: int, col0, cols: int, key_major: bool = False) -> Array:
        """Keep decisions of queries ``[row0, row0 + rows)`` x keys ``[col0, col0 + cols)``:
        ``[N|1, K|1, G|1, rows, cols]`` (``key_major``: ``[N|1, K|1, cols, G|1, rows]``)."""
        keys = [lax.dynamic_slice_in_dim(x, row0, rows, axis=3)[..., None] for x in self.row_keys]
        col = (col0 + lax.broadcasted_iota(jnp.int32, (1, 1, 1, 1, cols), 4)).astype(jnp.uint32)
        if key_major:
            keys, col = [_to_key_major(x) for x in keys], _to_key_major(col)
        return _prng.keep_from_counters(tuple(keys), self.threshold, col)


def _dropout(cfg: Config, aux: Aux) -> _Dropout | None:
    if not cfg.dropout:
        return None
    return _Dropout(_dropout_row_keys(cfg, aux), aux.dropout_threshold, 1.0 / aux.keep_prob)


def _to_key_major(x: Array | None) -> Array | None:
    """``[.., G, bq, bk]``-broadcastable (rank <= 5) -> ``[.., bk, G, bq]``-broadcastable."""
    if x is None:
        return None
    x = x.reshape((1,) * (5 - x.ndim) + x.shape)
    return jnp.transpose(x, (0, 1, 4, 2, 3))


def _diag(cfg: Config, block: int) -> int:
    """The causal fast path's diagonal sub-tile for tiles of ``block``."""
    return min(cfg.diag, block)


def _causal_fast(cfg: Config, aux: Aux, block_rows: int, block_cols: int) -> bool:
    """Plain causal self-attention (no other mask, equal lengths), with tiles that nest:
    the causal fast paths below apply. (Padded keys sit after every real query, so the
    causal mask alone hides them.)"""
    return (
        cfg.band_hi == 0
        and cfg.band_lo is None
        and cfg.q_len == cfg.kv_len
        and cfg.padded_q == cfg.padded_kv
        and block_rows % block_cols == 0
        and block_cols % _diag(cfg, block_cols) == 0
        and all(x is None for x in (aux.q_lengths, aux.kv_lengths, aux.q_segments, aux.mask))
        and aux.tile_states is None
        and (cfg.mods is None or not cfg.mods.elementwise)
    )


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------


def _softmax_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _scaled(cfg: Config, q: Array) -> Array:
    """``q * scale`` in q's dtype: the scale is paid once, not on every logit tile."""
    f32 = _softmax_dtype(q.dtype)
    return (q.astype(f32) * jnp.asarray(cfg.scale, f32)).astype(q.dtype)


def _softmax_step(
    cfg: Config, carry, q_rows, kt_c, v_c, visible=None, keep=None, drop=None, score=None
):
    """One key tile of the online softmax: queries ``q_rows [N, K, G, r, D]`` (scaled) against
    keys ``kt_c [N, K, D, c]`` (transposed) and values ``v_c [N, K, c, Dv]``; ``carry`` is
    the running max, sum and output accumulator of the ``r`` rows. ``score``: the call's
    ``score_mod`` and bias on the tile (:func:`_forward_score`), or None."""
    m, row_sum, acc = carry
    f32 = m.dtype
    s = jnp.einsum(
        "nkgqd,nkdc->nkgqc", q_rows, kt_c, precision=cfg.precision, preferred_element_type=f32
    )
    if score is not None:
        s = score(s)
    if visible is not None:
        s = jnp.where(visible, s, masks_lib.large_negative(f32))
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)  # exactly zero, even in fully masked rows
    alpha = jnp.exp(m - m_new)
    row_sum = alpha * row_sum + p.sum(axis=-1)
    if keep is not None:
        p = jnp.where(keep, p * drop.scale, 0.0)
    # [N, K, G, r, c] x [N, K, c, Dv] -> [N, K, G, r, Dv]
    pv = jnp.einsum(
        "nkgqc,nkcd->nkgqd",
        p.astype(v_c.dtype),
        v_c,
        precision=cfg.precision,
        preferred_element_type=f32,
    )
    return m_new, row_sum, alpha[..., None] * acc + pv


def _softmax_init(q_rows: Array, dv: int, sinks: Array | None = None):
    """The running max, sum and accumulator before any key. With ``sinks [K, G]`` each row
    starts from its head's sink logit (max = sink, sum = exp(0) = 1, no value): the sink
    is one more logit of its softmax, and the finished lse includes it."""
    n, k_heads, groups, rows, _ = q_rows.shape
    f32 = _softmax_dtype(q_rows.dtype)
    shape = (n, k_heads, groups, rows)
    if sinks is None:
        m, row_sum = jnp.full(shape, masks_lib.large_negative(f32), f32), jnp.zeros(shape, f32)
    else:
        m = jnp.broadcast_to(sinks.astype(f32)[None, :, :, None], shape)
        row_sum = jnp.ones(shape, f32)
    return m, row_sum, jnp.zeros((*shape, dv), f32)


def _softmax_finish(carry, dtype):
    """``(out, lse)`` of finished rows; a row that saw no key gets zero output and a large
    finite negative lse (an empty sum), which the backward pass only meets in masked tiles,
    where its probabilities are zeroed."""
    m, row_sum, acc = carry
    has_key = row_sum > 0
    safe_sum = jnp.where(has_key, row_sum, 1.0)
    out = acc / safe_sum[..., None]  # acc == 0 in a row that saw no key
    lse = jnp.where(has_key, m + jnp.log(safe_sum), masks_lib.large_negative(m.dtype))
    return out.astype(dtype), lse


def _from_blocks(x: Array, axis: int) -> Array:
    """Per-block results stacked by ``lax.scan``, ``[nb, ...]`` with each block's tile axis
    at ``axis`` (of ``...``), joined along it: ``[..., nb * b, ...]``."""
    x = jnp.moveaxis(x, 0, axis)  # [..., nb, b, ...]
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


def forward(cfg: Config, q, k, v, aux: Aux, mops: tm.ModOperands | None = None):
    """``(out, lse)`` of one call: ``q [N, K, G, Tq_pad, D]``, ``k, v [N, K, Tk_pad, D]`` in,
    out ``[N, K, G, Tq_pad, Dv]`` in q's dtype and lse ``[N, K, G, Tq_pad]`` (large negative
    for rows that see no key) out. ``mops``: the differentiable operands of the call's
    modifiers (score_mod's arrays, sinks, bias), or None."""
    q, kt = _scaled(cfg, q), jnp.swapaxes(k, -1, -2)  # [N, K, D, Tk]: plain tile products
    sinks = None if mops is None else mops.sinks
    if _causal_fast(cfg, aux, cfg.block_q, cfg.block_k):
        return _forward_causal(cfg, q, kt, v, aux, sinks)
    bq, bk = cfg.block_q, cfg.block_k
    schedule = _schedule(cfg, aux)
    drop = _dropout(cfg, aux)

    def q_block(_, i):
        q_i = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)  # [N, K, G, bq, D]

        def update(j, carry, masked: bool):
            kt_j = lax.dynamic_slice_in_dim(kt, j * bk, bk, axis=3)
            v_j = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            visible = _tile_mask(cfg, aux, i, j) if masked else None
            keep = None if drop is None else drop.keep(i * bq, bq, j * bk, bk)
            score = _forward_score(cfg, mops, i * bq, bq, j * bk, bk)
            return _softmax_step(cfg, carry, q_i, kt_j, v_j, visible, keep, drop, score)

        def tile(j, carry, masked: bool, state=None):
            if state is None:
                return update(j, carry, masked)
            # Only the running statistics pass through the branches (small: no [T, D] buffer).
            branches = [
                lambda c: c,  # skipped
                functools.partial(update, j, masked=True),
                functools.partial(update, j, masked=False),  # every pair visible
            ]
            return lax.switch(state, branches, carry)

        carry = schedule.visit(i, tile, _softmax_init(q_i, v.shape[-1], sinks))
        return None, _softmax_finish(carry, q.dtype)

    _, (out, lse) = lax.scan(q_block, None, jnp.arange(cfg.padded_q // bq))
    return _from_blocks(out, 3), _from_blocks(lse, 3)


def _forward_causal(cfg: Config, q, kt, v, aux: Aux, sinks=None):
    """The causal forward pass, exact: each query block attends to the key tiles left of
    its diagonal block unmasked, then to the diagonal block as ``block_q / diag`` static
    sub-tiles, each trimmed to the rows that see it (rows ``[c*d, bq)`` x keys
    ``[c*d, (c+1)*d)``): the masked waste is one ``d``-triangle per sub-tile instead of
    half a ``bq x bq`` block."""
    bq, bk = cfg.block_q, cfg.block_k
    bd = _diag(cfg, bk)
    drop = _dropout(cfg, aux)
    tri = lax.broadcasted_iota(jnp.int32, (bq, bd), 1) <= lax.broadcasted_iota(
        jnp.int32, (bq, bd), 0
    )  # [row, key] of a diagonal sub-tile, both counted from its first key: key <= row

    def q_block(_, i):
        q0 = i * bq
        q_i = lax.dynamic_slice_in_dim(q, q0, bq, axis=3)

        def full_tile(j, carry):
            kt_j = lax.dynamic_slice_in_dim(kt, j * bk, bk, axis=3)
            v_j = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            keep = None if drop is None else drop.keep(q0, bq, j * bk, bk)
            return _softmax_step(cfg, carry, q_i, kt_j, v_j, keep=keep, drop=drop)

        init = _softmax_init(q_i, v.shape[-1], sinks)
        carry = lax.fori_loop(0, i * (bq // bk), full_tile, init)
        for c in range(bq // bd):
            lo = c * bd  # rows [lo, bq) of the block see keys [q0 + lo, q0 + lo + bd)
            kt_c = lax.dynamic_slice_in_dim(kt, q0 + lo, bd, axis=3)
            v_c = lax.dynamic_slice_in_dim(v, q0 + lo, bd, axis=2)
            keep = None if drop is None else drop.keep(q0 + lo, bq - lo, q0 + lo, bd)
            rows = tuple(x[..., lo:] if x.ndim == 4 else x[..., lo:, :] for x in carry)
            rows = _softmax_step(cfg, rows, q_i[..., lo:, :], kt_c, v_c, tri[: bq - lo], keep, drop)
            carry = tuple(
                jnp.concatenate([x[..., :lo], r], -1)
                if x.ndim == 4
                else jnp.concatenate([x[..., :lo, :], r], -2)
                for x, r in zip(carry, rows, strict=True)
            )
        return None, _softmax_finish(carry, q.dtype)

    _, (out, lse) = lax.scan(q_block, None, jnp.arange(cfg.padded_q // bq))
    return _from_blocks(out, 3), _from_blocks(lse, 3)


# ----------------------------------------------------------------------------------------
# Backward (FlashAttention-2): outer loop over key blocks, inner over the query blocks
# that see them; dK, dV accumulate in the carry, dQ in a full-length buffer. Tiles are
# key-major, [bk, G, bq], and every product is a plain (row-major) one: q and dO are
# also kept transposed, and dQ is accumulated transposed (dQ^T += K^T dS^T), so XLA
# makes no transposed copy of a tile (it would for dS otherwise, on every tile).
# ----------------------------------------------------------------------------------------


class _Rows(NamedTuple):
    """The query side of the backward pass, full length (sliced per tile by :meth:`cols`)."""

    qt: Array  # [N, K, D, G, Tq_pad]: scaled q, transposed
    dot: Array  # [N, K, Dv, G, Tq_pad]: dO, transposed
    q: Array  # [N, K, G, Tq_pad, D]: scaled q
    d_out: Array  # [N, K, G, Tq_pad, Dv]
    lse: Array  # [N, K, 1, G, Tq_pad]
    delta: Array  # [N, K, 1, G, Tq_pad]

    def cols(self, start, width: int) -> _Rows:
        axes = (4, 4, 3, 3, 4, 4)
        return _Rows(
            *(
                lax.dynamic_slice_in_dim(x, start, width, axis=a)
                for x, a in zip(self, axes, strict=True)
            )
        )


def _rows(cfg: Config, q, out, lse, d_out, d_lse) -> _Rows:
    f32 = _softmax_dtype(q.dtype)
    # rowsum(dO * O) = sum_j P_ij dP_ij, the softmax backward's row term; a cotangent of
    # lse = log sum_j exp(s_ij) adds P_ij * d_lse_i to dS_ij.
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)
    if d_lse is not None:
        delta = delta - d_lse.astype(f32)
    q = _scaled(cfg, q)
    return _Rows(
        qt=jnp.moveaxis(q, -1, 2),
        dot=jnp.moveaxis(d_out, -1, 2),
        q=q,
        d_out=d_out,
        lse=lse[:, :, None],
        delta=delta[:, :, None],
    )


def _tile_grads(cfg: Config, kv, rows: _Rows, visible=None, keep=None, drop=None, score=None):
    """One key-major tile's ``(dQ^T, dK, dV, extra)`` contributions: ``kv = (k, v, k^T)`` of
    ``c`` keys (``[N, K, c, D]``, ``[N, K, c, Dv]``, ``[N, K, D, c]``), ``rows`` of ``r``
    queries. ``score`` (:func:`_backward_score`) recomputes the call's modified scores and
    gives ``extra = (d_float_consts, dS)`` for the modifiers' gradients (None without)."""
    k_c, v_c, kt_c = kv
    f32 = rows.lse.dtype
    mm = rows.q.dtype  # tile products run in the input dtype, accumulated in f32

    def dot(spec, a, b):
        return jnp.einsum(spec, a, b, precision=cfg.precision, preferred_element_type=f32)

    s = dot("nkcd,nkdgq->nkcgq", k_c, rows.qt)  # [N, K, c, G, r]
    score_vjp = extra = None
    if score is not None:
        s, score_vjp = score(s)
    dp = dot("nkcd,nkdgq->nkcgq", v_c, rows.dot)
    p = jnp.exp(s - rows.lse)
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    p_used = p
    if keep is not None:
        p_used = jnp.where(keep, p * drop.scale, 0.0)
        dp = jnp.where(keep, dp * drop.scale, 0.0)
    dv = dot("nkcgq,nkgqd->nkcd", p_used.astype(mm), rows.d_out)
    ds = p * (dp - rows.delta)
    if score_vjp is not None:  # dS of the modified scores -> of the raw ones (and the mods')
        ds, extra = score_vjp(ds)
    ds = ds.astype(mm)
    dk = dot("nkcgq,nkgqd->nkcd", ds, rows.q)
    dqt = dot("nkdc,nkcgq->nkdgq", kt_c, ds)  # dQ^T = K^T dS^T
    return dqt, dk, dv, extra


def _add_cols(dqt: Array, start, x: Array) -> Array:
    width = x.shape[-1]
    return lax.dynamic_update_slice_in_dim(
        dqt, lax.dynamic_slice_in_dim(dqt, start, width, axis=4) + x, start, axis=4
    )


def _key_block(x: Array, start, width: int, axis: int = 2) -> Array:
    return lax.dynamic_slice_in_dim(x, start, width, axis=axis)


def backward(cfg: Config, q, k, v, aux: Aux, out, lse, d_out, d_lse=None, mops=None):
    """``(dq, dk, dv)`` of one call, given the forward's ``out`` and ``lse`` and the
    cotangents ``d_out [N, K, G, Tq_pad, Dv]`` and ``d_lse [N, K, G, Tq_pad]`` (or None).
    The pass runs on ``cfg``'s backward tiles. With the modifiers' operands ``mops``
    (:class:`jattn._tile_mods.ModOperands`), ``(dq, dk, dv, d_mops)``."""
    cfg = cfg.backward_tiles()
    rows = _rows(cfg, q, out, lse, d_out, d_lse)
    kt = jnp.swapaxes(k, -1, -2)
    d_extra = None
    if _causal_fast(cfg, aux, cfg.block_k, cfg.block_q):
        dqt, dk, dv = _backward_causal(cfg, k, v, kt, aux, rows)
    else:
        dqt, dk, dv, d_extra = _backward_general(cfg, k, v, kt, aux, rows, mops)
    dq = jnp.moveaxis(dqt, 2, -1) * jnp.asarray(cfg.scale, dqt.dtype)
    # dk needs no scale: the tiles' q was scaled already.
    grads = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    if mops is None:
        return grads
    return (*grads, _mod_grads(cfg, mops, rows, d_extra))


def _mod_grads(cfg: Config, mops: tm.ModOperands, rows: _Rows, d_extra) -> tm.ModOperands:
    """The cotangent of ``mops``: the score consts' (floats; None for the others), the
    sinks' (from each row's sink probability) and the bias's."""
    d_consts, d_bias = ((), None) if d_extra is None else d_extra
    it = iter(d_consts)
    floats = cfg.mods.score_float if cfg.mods is not None else ()
    d_score = tuple(
        next(it).astype(c.dtype) if f else None
        for c, f in zip(mops.score_consts, floats, strict=True)
    )
    d_sinks = None
    if mops.sinks is not None:
        d_sinks = tm.sink_grad(mops.sinks, rows.lse[:, :, 0], rows.delta[:, :, 0])
    if d_bias is not None:
        d_bias = d_bias.astype(mops.bias.dtype)
    return tm.ModOperands(d_score, d_sinks, d_bias)


def _extra_zeros(cfg: Config, mops, f32):
    """Zero accumulators of the modifiers' gradients: ``(d_float_consts, d_bias)`` or None."""
    if not _modifies_scores(cfg, mops):
        return None
    floats = cfg.mods.score_float if cfg.mods.score is not None else ()
    consts = tuple(
        jnp.zeros(c.shape, f32) for c, f in zip(mops.score_consts, floats, strict=True) if f
    )
    return consts, None if mops.bias is None else jnp.zeros(mops.bias.shape, f32)


def _add_extra(cfg: Config, acc, extra, i, j):
    """``acc`` (:func:`_extra_zeros`) plus one tile's ``extra`` of :func:`_tile_grads`."""
    if acc is None:
        return None
    d_consts, d_bias = acc
    tile_consts, ds = extra
    d_consts = tuple(a + t.astype(a.dtype) for a, t in zip(d_consts, tile_consts, strict=True))
    if d_bias is not None:
        d_bias = tm.bias_tile_grad(d_bias, ds, i * cfg.block_q, j * cfg.block_k, key_major=True)
    return d_consts, d_bias


def _backward_general(cfg: Config, k, v, kt, aux: Aux, rows: _Rows, mops=None):
    """Every mask, by the schedule: ``(dQ^T, dK, dV)`` in float32, and the modifiers'
    gradient accumulators (:func:`_extra_zeros`; None without modifiers)."""
    n, k_heads, d, groups, _ = rows.qt.shape
    bq, bk = cfg.block_q, cfg.block_k
    f32 = rows.lse.dtype
    schedule = _schedule(cfg, aux).transposed()
    drop = _dropout(cfg, aux)

    def k_block(scan_carry, j):
        dqt, d_extra = scan_carry
        kv = (_key_block(k, j * bk, bk), _key_block(v, j * bk, bk), _key_block(kt, j * bk, bk, 3))

        def grads(i, masked: bool):
            visible = _to_key_major(_tile_mask(cfg, aux, i, j)) if masked else None
            keep = None if drop is None else drop.keep(i * bq, bq, j * bk, bk, key_major=True)
            score = _backward_score(cfg, mops, i * bq, bq, j * bk, bk)
            return _tile_grads(cfg, kv, rows.cols(i * bq, bq), visible, keep, drop, score)

        def tile(i, carry, masked: bool, state=None):
            dqt, dk, dv, d_extra = carry
            if state is None:
                g = grads(i, masked)
            else:
                # The branches return only this tile's small contributions; dQ^T (a [T, D]
                # buffer) is updated outside them, so it stays in place.
                zeros = (
                    jnp.zeros((n, k_heads, d, groups, bq), f32),
                    jnp.zeros(dk.shape, f32),
                    jnp.zeros(dv.shape, f32),
                    _tile_extra_zeros(cfg, mops, (n, k_heads, bk, groups, bq), f32),
                )
                g = lax.switch(
                    state, [lambda: zeros, lambda: grads(i, True), lambda: grads(i, False)]
                )
            d_extra = _add_extra(cfg, d_extra, g[3], i, j)
            return _add_cols(dqt, i * bq, g[0]), dk + g[1], dv + g[2], d_extra

        init = (dqt, jnp.zeros((n, k_heads, bk, d), f32), jnp.zeros(kv[1].shape, f32), d_extra)
        dqt, dk, dv, d_extra = schedule.visit(j, tile, init)
        return (dqt, d_extra), (dk, dv)

    init = (jnp.zeros(rows.qt.shape, f32), _extra_zeros(cfg, mops, f32))
    (dqt, d_extra), (dk, dv) = lax.scan(k_block, init, jnp.arange(cfg.padded_kv // bk))
    return dqt, _from_blocks(dk, 2), _from_blocks(dv, 2), d_extra


def _tile_extra_zeros(cfg: Config, mops, tile_shape, f32):
    """A skipped tile's ``extra`` (zeros shaped as :func:`_tile_grads` returns them)."""
    acc = _extra_zeros(cfg, mops, f32)
    return None if acc is None else (acc[0], jnp.zeros(tile_shape, f32))


def _backward_causal(cfg: Config, k, v, kt, aux: Aux, rows: _Rows):
    """The causal backward pass, exact: key block ``j`` meets the query blocks below its
    diagonal square unmasked, and the square as ``block_k / diag`` static sub-tiles (keys
    ``[0, (c+1)*d)`` x queries ``[c*d, (c+1)*d)`` of the square)."""
    n, k_heads, d, _, t = rows.qt.shape
    bq, bk = cfg.block_q, cfg.block_k
    bd = _diag(cfg, bq)
    f32 = rows.lse.dtype
    drop = _dropout(cfg, aux)

    def k_block(dqt, j):
        k0 = j * bk
        k_j, v_j, kt_j = _key_block(k, k0, bk), _key_block(v, k0, bk), _key_block(kt, k0, bk, 3)
        dk = jnp.zeros((n, k_heads, bk, d), f32)
        dv = jnp.zeros(v_j.shape, f32)
        for c in range(bk // bd):  # (no modifier reaches this fast path: _causal_fast)
            r = (c + 1) * bd  # keys [k0, k0 + r) are seen by queries [k0 + c*bd, k0 + r)
            seen = lax.broadcasted_iota(jnp.int32, (r, 1, bd), 0) <= (
                c * bd + lax.broadcasted_iota(jnp.int32, (r, 1, bd), 2)
            )
            keep = None if drop is None else drop.keep(k0 + c * bd, bd, k0, r, key_major=True)
            kv = (k_j[:, :, :r], v_j[:, :, :r], kt_j[..., :r])
            g = _tile_grads(cfg, kv, rows.cols(k0 + c * bd, bd), seen, keep, drop)
            dqt = _add_cols(dqt, k0 + c * bd, g[0])
            dk, dv = dk.at[:, :, :r].add(g[1]), dv.at[:, :, :r].add(g[2])

        def full_tile(i, carry):
            dqt, dk, dv = carry
            keep = None if drop is None else drop.keep(i * bq, bq, k0, bk, key_major=True)
            g = _tile_grads(cfg, (k_j, v_j, kt_j), rows.cols(i * bq, bq), keep=keep, drop=drop)
            return _add_cols(dqt, i * bq, g[0]), dk + g[1], dv + g[2]

        dqt, dk, dv = lax.fori_loop((j + 1) * (bk // bq), t // bq, full_tile, (dqt, dk, dv))
        return dqt, (dk, dv)

    dqt, (dk, dv) = lax.scan(k_block, jnp.zeros(rows.qt.shape, f32), jnp.arange(t // bk))
    return dqt, _from_blocks(dk, 2), _from_blocks(dv, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: Config, q, k, v, aux: Aux, mops: tm.ModOperands):
    return forward(cfg, q, k, v, aux, mops)


def _attention_fwd(cfg, q, k, v, aux, mops):
    out, lse = forward(cfg, q, k, v, aux, mops)
    return (out, lse), (q, k, v, aux, mops, out, lse)


def _attention_bwd(cfg, residuals, cotangents):
    q, k, v, aux, mops, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv, d_mops = backward(cfg, q, k, v, aux, out, lse, d_out, d_lse, mops)
    return dq, dk, dv, jax.tree.map(lambda _: None, aux), d_mops


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------

def blockwise_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float,
    is_causal: bool = False,
    local_window: tuple[int, int | None] | None = None,
    mask: Array | None = None,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    query_segment_ids: Array | None = None,
    key_value_segment_ids: Array | None = None,
    dropout_rate: float | Array = 0.0,
    dropout_rng: Array | None = None,
    dropout_shared: tuple[bool, bool] = (False, False),
    precision: Any = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Array:
    """Blockwise attention on validated inputs (see ``jattn.dot_product_attention``).

    Args:
      query: ``[batch..., q_len, H, D]`` (already validated and cast).
      key: ``[batch..., kv_len, K, D]`` with ``H % K == 0``.
      value: ``[batch..., kv_len, K, Dv]``.
      scale: logit multiplier (a Python number).
      is_causal: query ``i`` sees keys ``j <= i``.
      local_window: ``(left, right)``: query ``i`` sees keys ``i-left ... i+right``
        (``right=None``: unbounded).
      mask: bool, broadcastable to ``[batch..., H, q_len, kv_len]``; True = attend.
      query_seq_lengths: int ``[batch...]``; later queries give zero output.
      key_value_seq_lengths: int ``[batch...]``; later keys are hidden.
      query_segment_ids: int ``[batch..., q_len]``; with ``key_value_segment_ids``
        ``[batch..., kv_len]``, a query sees only keys of its own segment.
      key_value_segment_ids: see above.
      dropout_rate: drop probability; active when ``dropout_rng`` is given.
      dropout_rng: a ``jax.random`` key, or None for no dropout.
      dropout_shared: ``(over_batch, over_heads)``: whether one mask is shared across the
        batch dims / heads (``broadcast_dropout``).
      precision: ``jax.lax.Precision`` of the tile products.
      block_q: query tile length of both passes (default: the measured rule of
        :func:`jattn._tiles.default_tiles`, per kind of CPU and length; capped at q_len
        rounded up to 8).
      block_k: key tile length (likewise).

    Returns:
      ``[batch..., q_len, H, Dv]`` in the inputs' dtype.
    """
    ops = Operands(
        scale=scale,
        mask=mask,
        q_lengths=query_seq_lengths,
        kv_lengths=key_value_seq_lengths,
        q_segments=query_segment_ids,
        kv_segments=key_value_segment_ids,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
    )
    settings = Settings(
        is_causal=is_causal, window=local_window, dropout_shared=dropout_shared, precision=precision
    )
    return attention(query, key, value, ops, settings, block_q=block_q, block_k=block_k)[0]


def attention(
    query, key, value, ops: Operands, settings: Settings, *, block_q=None, block_k=None
):
    """Blockwise attention of a validated call (see :mod:`jattn._call`).

    Returns:
      ``(out, lse)``: out ``[batch..., q_len, H, Dv]`` in the inputs' dtype; with
      ``settings.return_residual`` the log-sum-exp ``[batch..., q_len, H]`` (float32+,
      :func:`jattn.large_negative` for rows that see no key, differentiable), else None.
    """
    *batch, q_len, num_heads, _ = query.shape
    dv = value.shape[-1]
    cfg, q, k, v, aux, mops = _prepare(query, key, value, ops, settings, block_q, block_k)
    try:
        out, lse = _by_head_groups(cfg, q, k, v, aux, mops)
    except TypeError as e:
        if "forward-mode" not in str(e):
            raise
        raise TypeError(
            "jattn's blockwise attention path has a custom VJP (FlashAttention's backward), "
            "which forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian) cannot go through. "
            "Pass implementation='dense' to jattn.dot_product_attention (modules: "
            "attention_implementation='dense'); the automatic rule picks blockwise on CPU "
            f"from {256} tokens."
        ) from e
    # [N, K, G, Tq_pad, Dv] -> [batch..., q_len, H, Dv]
    out = out[:, :, :, :q_len].transpose(0, 3, 1, 2, 4).reshape(*batch, q_len, num_heads, dv)
    if not settings.return_residual:
        return out, None
    # [N, K, G, Tq_pad] -> [batch..., q_len, H]
    lse = lse[..., :q_len].transpose(0, 3, 1, 2).reshape(*batch, q_len, num_heads)
    return out, lse


def tile_flags(query, key, value, ops: Operands, settings: Settings, *, block_q=None,
               block_k=None):  # fmt: skip
    """The forward pass's schedule of a validated call: ``(needed, full, fast)`` with
    ``needed``/``full`` bool numpy ``[num_q_tiles, num_kv_tiles]`` (computed at all;
    computed without an elementwise mask) and ``fast`` whether the causal fast path runs.

    For inspection and tests (how many tiles a mask skips); eager calls only.
    """
    cfg, _, _, _, aux, _ = _prepare(query, key, value, ops, settings, block_q, block_k)
    schedule = _schedule(cfg, aux)
    fast = _causal_fast(cfg, aux, cfg.block_q, cfg.block_k)
    return np.asarray(schedule.needed), np.asarray(schedule.full), fast


def _prepare(query, key, value, ops: Operands, settings: Settings, block_q, block_k):
    """``(cfg, q, k, v, aux, mops)``: the call in tile layout (see :func:`attention`)."""
    *batch, q_len, num_heads, d = query.shape
    kv_len, k_heads, dv = value.shape[-3:]
    n = math.prod(batch)
    groups = num_heads // k_heads
    # A ready-made causal mask_mod is the causal band: the same schedule (and fast path)
    causal, mask_rest = tm.peel_band(settings.mask_mod)
    cfg = make_config(
        q_len=q_len,
        kv_len=kv_len,
        num_heads=num_heads,
        kv_heads=k_heads,
        batch_size=n,
        scale=ops.scale,
        is_causal=settings.is_causal or causal,
        window=settings.window,
        dropout=ops.dropout_rng is not None,
        dropout_shared=settings.dropout_shared,
        precision=settings.precision,
        block_q=block_q,
        block_k=block_k,
    )
    # [batch..., T, H, D] -> [N, K, G, Tq_pad, D]; keys/values -> [N, K, Tk_pad, D]
    q = query.reshape(n, q_len, k_heads, groups, d).transpose(0, 2, 3, 1, 4)
    q = _pad_len(q, 3, cfg.padded_q)
    k = _pad_len(key.reshape(n, kv_len, k_heads, d).transpose(0, 2, 1, 3), 2, cfg.padded_kv)
    v = _pad_len(value.reshape(n, kv_len, k_heads, dv).transpose(0, 2, 1, 3), 2, cfg.padded_kv)
    aux = _aux(cfg, ops, tuple(batch), query.dtype)
    cfg, aux, mops = _modifiers(cfg, aux, ops, settings, mask_rest, tuple(batch), query.dtype)
    return cfg, q, k, v, aux, mops


def head_groups(cfg: Config) -> int:
    """How many independent computations :func:`attention` splits the heads into.

    On a CPU, each tile product is too small to keep more than one core busy, but XLA
    runs independent loops concurrently: splitting the key/value heads in two loops keeps
    two cores busy (measured on 2 cores: benchmarks/results.md). One group elsewhere, and
    when the heads do not split evenly.
    """
    if jax.default_backend() != "cpu" or _SPLIT_CORES < 2:
        return 1
    return math.gcd(cfg.kv_heads, min(_SPLIT_CORES, 2))


_SPLIT_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _modifiers(cfg: Config, aux: Aux, ops: Operands, settings: Settings, mask_rest, batch, dtype):
    """The call's score_mod, mask_mod, block mask, sinks and bias in the tile loops' terms:
    ``(cfg with its ModSpec, aux with mask consts and tile states, ModOperands)``.

    ``mask_rest`` is the call's mask_mod less a peeled causal part (the band). The tile
    states come from the block mask when the path's tiles (forward and backward) are
    multiples of its tiles; otherwise (or without a block mask) the mask_mod is evaluated
    once per call at tiles dividing both passes' (:func:`jattn._tile_mods.block_states`).
    """
    f32 = _softmax_dtype(dtype)
    spec, mops = tm.ModSpec(), tm.ModOperands()
    if settings.score_mod is not None:
        fn, consts = tm.hoist_modifier(settings.score_mod, "score", f32)
        floats = tuple(bool(jnp.issubdtype(jnp.result_type(c), jnp.floating)) for c in consts)
        spec = dataclasses.replace(spec, score=fn, score_float=floats)
        mops = mops._replace(score_consts=tuple(consts))
    if mask_rest is not None:
        fn, consts = tm.hoist_modifier(mask_rest, "mask", f32)
        spec = dataclasses.replace(spec, mask=fn)
        aux = aux._replace(mask_consts=tuple(consts))
    if mask_rest is not None or ops.block_mask is not None:
        tiles = ((cfg.block_q, cfg.block_k), (cfg.bwd_block_q, cfg.bwd_block_k))
        bm = ops.block_mask
        if bm is not None and all(t[0] % bm.block_q == 0 and t[1] % bm.block_k == 0 for t in tiles):
            block = (bm.block_q, bm.block_k)
        else:
            block = (math.gcd(cfg.block_q, cfg.bwd_block_q), math.gcd(cfg.block_k, cfg.bwd_block_k))
        states = tm.block_states(
            settings.mask_mod, bm, n=cfg.batch_size, num_heads=cfg.num_heads, q_len=cfg.q_len,
            kv_len=cfg.kv_len, block=block,
        )  # fmt: skip
        spec = dataclasses.replace(spec, states_block=block)
        aux = aux._replace(tile_states=states)
    if ops.sinks is not None:
        sinks = ops.sinks.astype(f32).reshape(cfg.kv_heads, cfg.num_heads // cfg.kv_heads)
        mops = mops._replace(sinks=sinks)
    if ops.bias is not None:
        bias = tm.tile_layout(
            ops.bias.astype(f32), batch, cfg.num_heads, cfg.kv_heads, cfg.padded_q, cfg.padded_kv
        )
        spec = dataclasses.replace(spec, has_bias=True)
        mops = mops._replace(bias=bias)
    return dataclasses.replace(cfg, mods=spec), aux, mops


def _by_head_groups(cfg: Config, q, k, v, aux: Aux, mops: tm.ModOperands):
    """:func:`_attention` over groups of key/value heads (:func:`head_groups`), joined."""
    groups = head_groups(cfg)
    if groups == 1:
        return _attention(cfg, q, k, v, aux, mops)
    width = cfg.kv_heads // groups
    outs, lses = [], []
    for g in range(groups):
        part = slice(g * width, (g + 1) * width)
        sub = dataclasses.replace(
            cfg, kv_heads=width, num_heads=cfg.num_heads // groups, head_offset=g * width
        )
        sub_aux = aux._replace(mask=_head_part(aux.mask, part, axis=1))
        sub_mops = mops._replace(
            sinks=_head_part(mops.sinks, part, axis=0), bias=_head_part(mops.bias, part, axis=1)
        )
        out, lse = _attention(sub, q[:, part], k[:, part], v[:, part], sub_aux, sub_mops)
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def _head_part(x: Array | None, part: slice, axis: int) -> Array | None:
    """``x``'s key/value heads ``part`` along ``axis`` (None and size-1 axes pass through)."""
    if x is None or x.shape[axis] == 1:
        return x
    return lax.slice_in_dim(x, part.start, part.stop, axis=axis)


def _pad_len(x, axis, size):
    """``x`` padded to ``size`` along ``axis`` (ints repeat their last value, floats get 0)."""
    extra = size - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, mode="edge" if jnp.issubdtype(x.dtype, jnp.integer) else "constant")


def _aux(cfg: Config, ops: Operands, batch: tuple[int, ...], dtype) -> Aux:
    """The call's masks and dropout operands in tile layout."""
    n = cfg.batch_size
    aux = Aux()
    if ops.q_lengths is not None:
        aux = aux._replace(q_lengths=jnp.asarray(ops.q_lengths, jnp.int32).reshape(n))
    if ops.kv_lengths is not None:
        aux = aux._replace(kv_lengths=jnp.asarray(ops.kv_lengths, jnp.int32).reshape(n))
    if ops.q_segments is not None:
        q_ids = jnp.asarray(ops.q_segments, jnp.int32).reshape(n, cfg.q_len)
        k_ids = jnp.asarray(ops.kv_segments, jnp.int32).reshape(n, cfg.kv_len)
        aux = aux._replace(
            q_segments=_pad_len(q_ids, 1, cfg.padded_q),
            kv_segments=_pad_len(k_ids, 1, cfg.padded_kv),
        )
    if ops.mask is not None:
        mask = tm.tile_layout(
            ops.mask, batch, cfg.num_heads, cfg.kv_heads, cfg.padded_q, cfg.padded_kv
        )
        aux = aux._replace(mask=mask)
    if cfg.dropout:
        keep_prob = 1.0 - ops.dropout_rate
        aux = aux._replace(
            dropout_words=_prng.key_words(ops.dropout_rng),
            dropout_threshold=_prng.keep_threshold(keep_prob),
            keep_prob=jnp.asarray(keep_prob, _softmax_dtype(dtype)),
        )
    return aux

