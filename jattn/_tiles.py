"""Tile sizes of the blockwise path, chosen per machine and sequence length.

The rule comes from measurements on two kinds of 2-core CPU (``benchmarks/results.md``,
one table per kind): on CPUs with AVX-512 large tiles win (forward ``512 x 256``, backward
``256 x 256``: the tile products then run near the machine's sgemm rate), on AVX2 CPUs
tiles of 64-256 were within ~15% of each other and 512 was slower, so they keep
``128 x 128`` (``64 x 64`` up to 512 tokens). Off CPU the blockwise path is a fallback and
keeps the AVX2 rule. The rule never changes results beyond float rounding: every tile size
computes the same function.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

__all__ = ["Tiles", "cpu_kind", "default_tiles", "tiles_for"]

# A short sequence gets smaller tiles, so that a causal mask still skips some of them.
_SHORT_LEN = 512
# Sub-tile of the causal fast path's diagonal block (see jattn.blockwise): smaller wastes
# fewer masked entries, larger keeps the products efficient.
_DIAG = {"avx512": 128, "other": 64}


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
def _cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_kind() -> str:
    """``'avx512'`` when the host CPU has AVX-512F, else ``'other'`` (AVX2 and the rest).

    ``JATTN_CPU_KIND=avx512|other`` overrides the detection (benchmarks compare the rules
    on one machine with it). Read from ``/proc/cpuinfo``; where that does not exist
    (macOS, Windows) the answer is ``'other'``, today's measured-safe rule.
    """
    forced = os.environ.get("JATTN_CPU_KIND")
    if forced in ("avx512", "other"):
        return forced
    return "avx512" if "avx512f" in _cpuinfo_flags() else "other"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _axis(length: int, fwd: int, bwd: int, shrink: bool) -> tuple[int, int, int]:
    """``(padded, fwd, bwd)`` for one axis: both tiles divide ``padded``."""
    big = min(max(fwd, bwd), _round_up(length, 8))  # one tile covers a short sequence
    # Halve large tiles while padding would waste more than 1/8 of the work.
    while shrink and big > 128 and _round_up(length, big) - length > length // 8:
        big //= 2
    padded = _round_up(length, big)
    fwd, bwd = min(fwd, big), min(bwd, big)
    fwd = fwd if big % fwd == 0 else big
    bwd = bwd if big % bwd == 0 else big
    return padded, fwd, bwd


def tiles_for(q_len: int, kv_len: int, fwd: tuple[int, int], bwd: tuple[int, int], diag: int,
              shrink: bool = True) -> Tiles:
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
