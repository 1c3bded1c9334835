"""Which tiles a blockwise call computes, and which of them need an elementwise mask.

Each query block visits only the key blocks its causal / sliding-window / length / segment
/ explicit masks and block-mask states leave visible. With causal, window and length masks
the visited tiles of a row are a run of boundary tiles, a run of fully visible tiles and a
run of boundary tiles, and only the boundary tiles pay for an elementwise mask; with
segment ids, a mask array or tile states (whose visible tiles need not be contiguous) each
tile in the row's range is skipped or masked one by one. The batch shares one loop, so a
tile is skipped when it is hidden for every batch element.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn._util import round_up
from jattn.block_masks import EMPTY, FULL, PARTIAL
from jattn.blockwise._config import Aux, Config
from jattn.blockwise._mods import elementwise

__all__ = ["Schedule", "block_states", "causal_fast", "coarsen", "diag_tile", "schedule"]

Array = jax.Array


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
        need, ful = coarsen(aux.tile_states, cfg.mods.states_block, (bq, bk), nq, nk)
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


def schedule(cfg: Config, aux: Aux) -> Schedule:
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
    return Schedule(needed, full, runs, never_masked)


@dataclasses.dataclass(frozen=True)
class Schedule:
    needed: Any  # bool [nq, nk] (numpy when static)
    full: Any  # bool [nq, nk]: needed and no elementwise mask
    runs: bool  # every row is: masked tiles, full tiles, masked tiles
    never_masked: bool

    def transposed(self) -> Schedule:
        return Schedule(self.needed.T, self.full.T, self.runs, self.never_masked)

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


def coarsen(states: Array, block: tuple[int, int], tile: tuple[int, int], nq: int, nk: int):
    """``(needed, full)`` bool ``[nq, nk]`` for tiles of ``tile``, from ``states`` at
    ``block`` (each tile length a multiple of the block's). Sub-blocks past the states'
    extent (tile padding) count as neither needed nor partial."""
    fq, fk = tile[0] // block[0], tile[1] // block[1]
    sq, sk = states.shape
    pad = ((0, nq * fq - sq), (0, nk * fk - sk))
    needed = jnp.pad(states != EMPTY, pad, constant_values=False)
    full = jnp.pad(states == FULL, pad, constant_values=True)
    needed = needed.reshape(nq, fq, nk, fk).any(axis=(1, 3))
    full = full.reshape(nq, fq, nk, fk).all(axis=(1, 3))
    return needed, full & needed


def block_states(mask, consts, *, causal: bool, block_mask, n: int, num_heads: int,
                 q_len: int, kv_len: int, block: tuple[int, int]) -> Array:  # fmt: skip
    """int8 ``[nq, nk]`` tile states (EMPTY / PARTIAL / FULL of :mod:`jattn.block_masks`)
    at ``block``, combined over batch rows and heads: EMPTY only if empty for every one,
    FULL only if full for every one.

    From ``block_mask`` when it is given at that block; else evaluated once per call from
    the call's hoisted mask (``mask(b, h, q_idx, kv_idx, *consts)`` of
    :func:`jattn.blockwise._mods.hoist_modifier`, or None) ANDed with the causal band when
    ``causal``, one row of tiles at a time. Unchecked (the entry checked the call), and the
    user's ``mask_mod`` is not traced again: the hoisted function is its traced program.
    """
    if block_mask is not None and (block_mask.block_q, block_mask.block_k) == block:
        needed, full = block_mask.tile_flags()
    else:
        needed, full = _evaluate_states(mask, consts, causal, n, num_heads, q_len, kv_len, block)
    return jnp.where(full, FULL, jnp.where(needed, PARTIAL, EMPTY)).astype(jnp.int8)


def _evaluate_states(mask, consts, causal, n, num_heads, q_len, kv_len, block):
    """``(needed, full)`` bool ``[nq, nk]`` of :func:`block_states`, evaluated (memory
    ``n * num_heads * bq * kv_len`` booleans per row of tiles, or less: a mask that does not
    read ``b`` (``h``) is evaluated for one batch row (head))."""
    bq, bk = block
    nq, nk = round_up(q_len, bq) // bq, round_up(kv_len, bk) // bk
    i32 = jnp.int32
    rows = n if mask is not None and mask.uses(0) else 1
    heads = num_heads if mask is not None and mask.uses(1) else 1
    b = lax.broadcasted_iota(i32, (rows, 1, 1, 1), 0)
    h = lax.broadcasted_iota(i32, (1, heads, 1, 1), 1)
    kv_pos = lax.broadcasted_iota(i32, (1, 1, 1, nk * bk), 3)
    # Positions past the end are clamped (a mask may index arrays with them); those pairs
    # are excluded from the reduction below.
    kv = jnp.minimum(kv_pos, kv_len - 1)

    def row(i):
        q_pos = i * bq + lax.broadcasted_iota(i32, (1, 1, bq, 1), 2)
        q = jnp.minimum(q_pos, q_len - 1)
        shown = jnp.ones((rows, heads, bq, nk * bk), bool)
        if mask is not None:
            shown = shown & elementwise(lambda *idx: mask(*idx, *consts), b, h, q, kv)
        if causal:
            shown = shown & (kv_pos <= q_pos)
        valid = (q_pos < q_len) & (kv_pos < kv_len)  # [1, 1, bq, Tk_pad]
        # [rows, heads, bq, nk, bk] reduced over batch, heads, the tile's rows and keys
        some = (shown & valid).reshape(rows, heads, bq, nk, bk).any(axis=(0, 1, 2, 4))
        every = (shown | ~valid).reshape(rows, heads, bq, nk, bk).all(axis=(0, 1, 2, 4))
        return some, every

    return lax.map(row, jnp.arange(nq, dtype=i32))  # [nq, nk] each


def diag_tile(cfg: Config, block: int) -> int:
    """The causal fast path's diagonal sub-tile for tiles of ``block``."""
    return min(cfg.diag, block)


def causal_fast(cfg: Config, aux: Aux, block_rows: int, block_cols: int) -> bool:
    """Plain causal self-attention (no other mask, equal lengths), with tiles that nest:
    the causal fast paths of :mod:`jattn.blockwise._passes` apply. (Padded keys sit after every real query, so the
    causal mask alone hides them.)"""
    return (
        cfg.band_hi == 0
        and cfg.band_lo is None
        and cfg.q_len == cfg.kv_len
        and cfg.padded_q == cfg.padded_kv
        and block_rows % block_cols == 0
        and block_cols % diag_tile(cfg, block_cols) == 0
        and all(x is None for x in (aux.q_lengths, aux.kv_lengths, aux.q_segments, aux.mask))
        and aux.tile_states is None
        and (cfg.mods is None or not cfg.mods.elementwise)
    )
