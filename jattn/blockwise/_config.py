"""The static side of a blockwise call: the tile rule, :class:`Config`, the per-call arrays.

Tiles are chosen per kind of CPU and sequence length, from measurements (one process per
table, torch SDPA and the sgemm rate in the same run):

* ``benchmarks/results.md`` (AVX-512 block) and ``../shared/measurements/avx512-tile-sweep.md``
  (AMD EPYC Zen 4, AVX-512): forward ``512 x 256``, backward ``256 x 256`` won from 1024
  tokens on (the tile products then run near the sgemm rate);
* ``../shared/measurements/avx2-zen3-tiles.md`` (AMD EPYC Zen 3, AVX2 only): the same large
  tiles ran the causal forward at T=4096 in 242 ms instead of 482 with ``128 x 128``, and
  forward+backward in 995 ms instead of 1412;
* the ``128 x 128`` rule (``64 x 64`` up to 512 tokens) was measured on an earlier,
  unnamed AVX2 machine before the causal fast path and the folded scale existed.

So the large-tile rule (named ``'avx512'``, where it was first measured) is keyed on what
was measured, not on the AVX-512 flag alone: it serves every CPU with AVX-512F and the CPU
families measured to want it (:data:`_LARGE_TILE_FAMILIES`); other CPUs keep the
``'other'`` rule, the one measured on them. Timing candidates once per process was
rejected: each candidate is a compile of both passes (seconds on 2 cores), paid by every
process before its first call, and a loaded machine would time noise. Off CPU the
blockwise path is a fallback and keeps the ``'other'`` rule. Every tile size computes the
same function (float rounding aside).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jattn._util import round_up, tile_cap

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "Aux",
    "Config",
    "ModOperands",
    "ModSpec",
    "Tiles",
    "cpu_kind",
    "default_tiles",
    "make_config",
    "tile_rule",
    "tiles_for",
]

Array = jax.Array

# The 'other' rule's long-sequence tiles, kept as the defaults that ring attention and the
# docs name.
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128

# A short sequence gets smaller tiles, so that a causal mask still skips some of them.
_SHORT_LEN = 512
# Sub-tile of the causal fast path's diagonal block (see jattn.blockwise._passes): smaller
# wastes fewer masked entries, larger keeps the products efficient.
_DIAG = {"avx512": 128, "other": 64}
# (vendor_id, cpu family) of /proc/cpuinfo measured to want the large tiles without
# AVX-512: AMD family 25 (0x19: Zen 3 and Zen 4), ../shared/measurements/avx2-zen3-tiles.md.
_LARGE_TILE_FAMILIES = frozenset({("AuthenticAMD", 25)})
RULES = ("avx512", "other")


class Tiles(NamedTuple):
    """Tile lengths of one call: forward ``(fwd_q, fwd_k)``, backward ``(bwd_q, bwd_k)``,
    the causal diagonal sub-tile ``diag``, and the padded lengths every tile divides."""

    fwd_q: int
    fwd_k: int
    bwd_q: int
    bwd_k: int
    diag: int
    padded_q: int
    padded_kv: int


@functools.cache
def _cpuinfo() -> tuple[str, int | None, frozenset[str]]:
    """``(vendor_id, cpu family, flags)`` of the first CPU in ``/proc/cpuinfo``."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "cpu family", "flags") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:  # the end of the first CPU's block
                    break
    except OSError:
        pass
    family = fields.get("cpu family", "")
    flags = frozenset(fields.get("flags", "").split())
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else None, flags


def tile_rule(vendor: str, family: int | None, flags: frozenset[str]) -> str:
    """The tile rule (``'avx512'``: large tiles, ``'other'``) for a CPU described by
    ``/proc/cpuinfo``'s ``vendor_id``, ``cpu family`` and ``flags`` (module docstring)."""
    if "avx512f" in flags or (vendor, family) in _LARGE_TILE_FAMILIES:
        return "avx512"
    return "other"


def cpu_kind() -> str:
    """The host CPU's tile rule: ``'avx512'`` (large tiles) or ``'other'`` (:func:`tile_rule`).

    ``JATTN_CPU_KIND=avx512|other`` overrides the detection (benchmarks compare the rules
    on one machine with it). Read from ``/proc/cpuinfo``; where that does not exist
    (macOS, Windows) the answer is ``'other'``.
    """
    forced = os.environ.get("JATTN_CPU_KIND")
    if forced in RULES:
        return forced
    return tile_rule(*_cpuinfo())


def _axis(length: int, fwd: int, bwd: int, shrink: bool) -> tuple[int, int, int]:
    """``(padded, fwd, bwd)`` for one axis: both tiles divide ``padded``."""
    big = tile_cap(length, max(fwd, bwd))  # one tile covers a short sequence
    # Halve large tiles while padding would waste more than 1/8 of the work.
    while shrink and big > 128 and round_up(length, big) - length > length // 8:
        big //= 2
    padded = round_up(length, big)
    fwd, bwd = min(fwd, big), min(bwd, big)
    fwd = fwd if big % fwd == 0 else big
    bwd = bwd if big % bwd == 0 else big
    return padded, fwd, bwd


def tiles_for(
    q_len: int,
    kv_len: int,
    fwd: tuple[int, int],
    bwd: tuple[int, int],
    diag: int,
    shrink: bool = True,
) -> Tiles:
    """:class:`Tiles` from requested forward / backward tiles (capped and made to divide)."""
    padded_q, fwd_q, bwd_q = _axis(q_len, fwd[0], bwd[0], shrink)
    padded_kv, fwd_k, bwd_k = _axis(kv_len, fwd[1], bwd[1], shrink)
    return Tiles(fwd_q, fwd_k, bwd_q, bwd_k, diag, padded_q, padded_kv)


def default_tiles(q_len: int, kv_len: int, backend: str = "cpu") -> Tiles:
    """The measured rule (module docstring) for a call of ``q_len`` queries, ``kv_len`` keys."""
    kind = cpu_kind() if backend == "cpu" else "other"
    if kind == "avx512":
        fwd = (128 if q_len <= _SHORT_LEN else 512, 128 if kv_len <= _SHORT_LEN else 256)
        bwd = (128 if q_len <= _SHORT_LEN else 256, fwd[1])
    else:  # each axis as measured on AVX2 (benchmarks/results.md)
        fwd = bwd = (64 if q_len <= _SHORT_LEN else 128, 64 if kv_len <= _SHORT_LEN else 128)
    return tiles_for(q_len, kv_len, fwd, bwd, _DIAG[kind])


class ModOperands(NamedTuple):
    """The differentiable operands the modifiers add to a blockwise call (a pytree).

    Attributes:
      score_consts: the arrays ``score_mod`` reads (hoisted), in its hoisted order.
      sinks: float ``[K, G]`` sink logits, or None.
      bias: float ``[Nb, Kb, Gb, Lq, Lk]`` (:func:`jattn.blockwise._mods.tile_layout`), or None.
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


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one call (hashable: it keys the custom VJP's trace).

    ``block_q`` x ``block_k`` are the forward pass's tiles, ``bwd_block_q`` x
    ``bwd_block_k`` the backward pass's; ``padded_q`` / ``padded_kv`` (the lengths the
    operands are padded to) are multiples of both. ``diag`` is the sub-tile of the causal
    fast path's diagonal block. ``num_heads`` / ``kv_heads`` count this computation's
    heads, which start at key/value head ``head_offset`` of the call's ``all_heads`` query
    heads (one computation per split of the heads: see :func:`jattn.blockwise.head_splits`).
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
    mods: ModSpec | None = None  # score_mod / mask_mod / bias / block states of the call

    def __post_init__(self):
        fill = {
            "padded_q": round_up(self.q_len, self.block_q),
            "padded_kv": round_up(self.kv_len, self.block_k),
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
      mask: bool ``[Nm, Km, Gm, Lq, Lk]`` (see :func:`jattn.blockwise._mods.tile_layout`).
      dropout_words: uint32 ``[4]`` from the dropout key (:func:`jattn._prng.key_words`).
      dropout_threshold: uint32 keep threshold (:func:`jattn._prng.keep_threshold`).
      keep_prob: ``1 - rate`` in the softmax dtype.
      mask_consts: the arrays the call's hoisted ``mask_mod`` reads (``cfg.mods.mask``).
      tile_states: int8 ``[nq0, nk0]`` block-mask tile states at ``cfg.mods.states_block``
        (:func:`jattn.blockwise._schedule.block_states`), or None.
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


def _rule_tiles(q_len: int, kv_len: int, block_q: int | None, block_k: int | None) -> Tiles:
    """The rule's tiles (:func:`default_tiles`); a tile the caller names is
    used by both passes, the other axis keeps the rule's."""
    rule = default_tiles(q_len, kv_len, jax.default_backend())
    if block_q is None and block_k is None:
        return rule
    fwd_q, bwd_q = (rule.fwd_q, rule.bwd_q) if block_q is None else (block_q, block_q)
    fwd_k, bwd_k = (rule.fwd_k, rule.bwd_k) if block_k is None else (block_k, block_k)
    return tiles_for(q_len, kv_len, (fwd_q, fwd_k), (bwd_q, bwd_k), rule.diag, shrink=False)


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
    (:func:`default_tiles`) unless named, masks as a band."""
    band_lo = band_hi = None
    if is_causal:
        band_hi = 0
    if window is not None:
        left, right = window
        band_lo = -int(left)
        if right is not None:
            band_hi = int(right) if band_hi is None else min(band_hi, int(right))
    tiles = _rule_tiles(q_len, kv_len, block_q, block_k)
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
