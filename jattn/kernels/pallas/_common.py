"""The in-kernel pieces of jattn's Pallas attention, shared by its GPU and TPU kernels.

Every function here runs inside a kernel body on 2-D tiles: scores ``[bq, bk]``, per-row
columns ``[bq, 1]`` and per-key rows ``[1, bk]`` (the shapes both Triton and Mosaic take).
They compute what jattn's dense path computes for the same elements:

* the scores: ``scale q k^T`` in float32, soft-capped / ALiBi / ``score_mod``, plus a bias;
* the mask: the causal / window band, the real lengths, segment ids, ``mask_mod``;
* dropout: jattn's position-keyed bits (:mod:`jattn._prng`): the per-row Philox keys come
  in as a ``[bq, 1]`` column each (one Philox call per row, outside the kernel), and each
  element's 32 bits are the ``lowbias32`` hash of its key position with them, here, so no
  ``[T, T]`` mask ever exists.

:class:`Spec` holds the static side of a call (hashable: it keys the kernels' traces).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _prng

Array = jax.Array

# The lse of a row that sees no key: jattn.masks.large_negative(float32). (Hidden logits
# are -inf in the online softmax, shifted by 0 until a row meets a finite one.)
NEG = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """The static description of one kernel call (hashed by identity: one per call).

    Lengths: ``q_len`` / ``kv_len`` real, ``padded_q`` / ``padded_kv`` multiples of every
    tile. Heads: ``num_heads`` query heads, ``kv_heads`` key/value heads (query head
    ``h`` reads key/value head ``h // groups``). ``band``: visible keys satisfy
    ``band[0] <= k - q <= band[1]`` (None: unbounded). The rest says which operands the
    kernels receive (see :mod:`jattn.kernels.pallas._flash`).
    """

    batch: int
    q_len: int
    kv_len: int
    padded_q: int
    padded_kv: int
    num_heads: int
    kv_heads: int
    head_dim: int  # padded (the kernels' D)
    v_dim: int  # padded (the kernels' Dv)
    scale: float
    band: tuple[int | None, int | None]
    fwd_block: tuple[int, int]
    bwd_block: tuple[int, int]
    q_lengths: bool = False
    kv_lengths: bool = False
    segments: bool = False
    bias: tuple[bool, bool, bool, bool] | None = None  # full along (N, H, Tq, Tk)
    sinks: bool = False
    dropout: bool = False
    softcap: float | None = None
    alibi: bool | None = None  # None: no ALiBi; else symmetric
    # The generic modifiers, hoisted (jattn.blockwise.hoist) once per tile shape the kernels
    # use: ``{(bq, bk): fn}`` with the constants trailing; None without one.
    score_mods: dict | None = None
    score_float: tuple[bool, ...] = ()
    mask_mods: dict | None = None
    num_mask_consts: int = 0
    states: bool = False  # block-mask tile states at fwd_block (and bwd_block)
    mosaic: bool = False  # the TPU layout: heads before positions, scalars in SMEM

    @property
    def groups(self) -> int:
        return self.num_heads // self.kv_heads

    @property
    def num_score_consts(self) -> int:
        return len(self.score_float)

    @property
    def score_mod(self) -> bool:
        return self.score_mods is not None

    @property
    def mask_mod(self) -> bool:
        return self.mask_mods is not None

    @property
    def elementwise_mask(self) -> bool:
        """Whether a tile's mask needs more than the band and the lengths."""
        return self.segments or self.mask_mod


class Tile:
    """Where a tile sits: ``(b, h)`` (program ids), rows ``[row0, row0 + bq)``, keys
    ``[col0, col0 + bk)``, with the row / key index vectors ``[bq, 1]`` / ``[1, bk]``."""

    def __init__(self, b, h, row0, rows: int, col0, cols: int):
        self.b, self.h = b, h
        self.row0, self.col0 = row0, col0
        self.q = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        self.k = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, cols), 1)


def dot(a: Array, b: Array, contract: tuple[int, int]) -> Array:
    """A 2-D product in float32: ``a`` and ``b`` contracted on axes ``contract``."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _index4(spec: Spec, t: Tile):
    """``(b, h, q_idx, kv_idx)`` of a tile as the rank-4 arrays a modifier sees, clamped
    to the real lengths (tile padding is masked anyway)."""
    one = jnp.zeros((1, 1, 1, 1), jnp.int32)
    q = jnp.minimum(t.q, spec.q_len - 1)
    k = jnp.minimum(t.k, spec.kv_len - 1)
    return one + t.b, one + t.h, q.reshape(1, 1, -1, 1), k.reshape(1, 1, 1, -1)


def raw_scores(spec: Spec, q: Array, k: Array) -> Array:
    """``scale q k^T`` in float32 ``[bq, bk]`` from ``q [bq, D]`` and ``k [bk, D]``."""
    return dot(q, k, (1, 1)) * spec.scale


def modify(spec: Spec, s: Array, t: Tile, alibi_slope, score_consts) -> Array:
    """The call's score modifiers on raw scores ``s [bq, bk]`` (soft-cap, ALiBi, score_mod)."""
    if spec.softcap is not None:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    if spec.alibi is not None:
        distance = (t.k - t.q).astype(jnp.float32)
        if spec.alibi:
            distance = -jnp.abs(distance)
        s = s + alibi_slope * distance
    if spec.score_mod:
        s4 = spec.score_mods[s.shape](s.reshape(1, 1, *s.shape), *_index4(spec, t), *score_consts)
        s = jnp.broadcast_to(s4, (1, 1, *s.shape)).reshape(s.shape).astype(jnp.float32)
    return s


def modify_vjp(spec: Spec, s: Array, t: Tile, alibi_slope, score_consts):
    """``(modify(s), vjp)`` with ``vjp(ds) -> (d_s, d_slope, d_consts)`` (None where the
    call has no such operand, or a const is not floating)."""
    floats = [c for c, f in zip(score_consts, spec.score_float, strict=True) if f]

    def apply(x, slope, *float_consts):
        it = iter(float_consts)
        consts = [next(it) if f else c for c, f in zip(score_consts, spec.score_float, strict=True)]
        return modify(spec, x, t, slope, consts)

    slope = jnp.zeros((1, 1), jnp.float32) if alibi_slope is None else alibi_slope
    out, vjp = jax.vjp(apply, s, slope, *floats)

    def backward(ds):
        d_s, d_slope, *d_floats = vjp(ds)
        it = iter(d_floats)
        d_consts = tuple(next(it) if f else None for f in spec.score_float)
        return d_s, (None if alibi_slope is None else d_slope), d_consts

    return out, backward


def band_mask(spec: Spec, t: Tile) -> Array | None:
    """The causal / window band of a tile, bool ``[bq, bk]`` (None: no band)."""
    lo, hi = spec.band
    mask = None
    if lo is not None:
        mask = t.k - t.q >= lo
    if hi is not None:
        upper = t.k - t.q <= hi
        mask = upper if mask is None else mask & upper
    return mask


def tile_mask(spec: Spec, t: Tile, q_len, kv_len, q_seg, kv_seg, mask_consts, band=True):
    """Every mask of the call on a tile: bool ``[bq, bk]``, or None when nothing is hidden.

    Args:
      spec, t: the call and the tile.
      q_len, kv_len: the batch row's real lengths (int32 scalars), or None.
      q_seg, kv_seg: segment ids ``[bq, 1]`` / ``[1, bk]``, or None.
      mask_consts: the arrays the hoisted ``mask_mod`` reads.
      band: include the causal / window band (False on tiles known to lie inside it).
    """
    parts = [band_mask(spec, t)] if band else []
    if spec.padded_kv != spec.kv_len:
        parts.append(t.k < spec.kv_len)
    if q_len is not None:
        parts.append(t.q < q_len)
    if kv_len is not None:
        parts.append(t.k < kv_len)
    if q_seg is not None:
        parts.append(q_seg == kv_seg)
    if spec.mask_mod:
        shape = (t.q.shape[0], t.k.shape[1])
        m4 = spec.mask_mods[shape](*_index4(spec, t), *mask_consts)
        parts.append(jnp.broadcast_to(m4, (1, 1, *shape)).reshape(shape))
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    mask = parts[0]
    for p in parts[1:]:
        mask = mask & p
    return jnp.broadcast_to(mask, (t.q.shape[0], t.k.shape[1]))


def keep(t: Tile, key0: Array, key1: Array, threshold: Array) -> Array:
    """Dropout keep decisions of a tile, bool ``[bq, bk]``: :func:`jattn._prng.keep_from_counters`
    with the rows' Philox keys ``key0, key1 [bq, 1]`` and the tile's key positions."""
    return _prng.keep_from_counters((key0, key1), threshold, t.k.astype(jnp.uint32))
