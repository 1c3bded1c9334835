"""Cheap, position-addressed random bits for dropout masks.

JAX's default ``jax.random.bernoulli`` draws a mask from a threefry stream whose
layout depends on the whole array shape, so a mask cannot be produced block by block,
and on CPU it costs more than the attention it drops from (``benchmarks/results.md``
measures every ``jax.random`` implementation). Here each dropout decision is a pure
function of

* four 32-bit words derived once from the caller's ``jax.random`` key, and
* the element's coordinates ``(row, col)``: ``col`` is the index on the last axis
  (the key position) and ``row`` the row-major index over all the other axes of the
  mask (batch..., head, query position), taken modulo 2**32.

Two stages keep it cheap without weakening it:

1. each row gets two 32-bit row keys from Philox-4x32-10 (Salmon et al. 2011, "Parallel
   random numbers: as easy as 1, 2, 3"; also a ``jax.random`` implementation), keyed by
   two of the words, at the counter ``(row, 0, w2, w3)``: one Philox call per row;
2. each element's 32 bits are ``mix(mix(col ^ k0) ^ k1)``, with ``mix`` the "lowbias32"
   multiply-xorshift hash (C. Wellons, hash-prospector): two multiplies per round.

So the same key gives the same mask whether it is built at once (dense path) or one
block at a time (blockwise path), whatever the block sizes; another key gives an
unrelated mask (its row keys are unrelated Philox outputs). The key stays the only
source of randomness and nothing is stored between calls.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "keep_from_counters",
    "keep_mask",
    "keep_threshold",
    "key_words",
    "random_bits",
    "row_keys",
    "row_starts",
]

# Philox-4x32 constants from Random123: round multipliers and Weyl key increments.
_M0 = np.uint32(0xD2511F53)
_M1 = np.uint32(0xCD9E8D57)
_W0 = np.uint32(0x9E3779B9)
_W1 = np.uint32(0xBB67AE85)
_ROUNDS = 10  # Random123's default (7 is the fewest that pass BigCrush)
_THRESHOLD_BITS = 24  # keep iff the top 24 bits < threshold: p exact to 2**-24 (as jax's)


def key_words(rng) -> jax.Array:
    """Four uint32 words derived from a ``jax.random`` key (typed or raw, any impl).

    One tiny draw from the caller's own generator, so keys of every implementation
    work and distinct keys give unrelated words.
    """
    return jax.random.bits(rng, (4,), jnp.uint32)


def _mulhi(a, b) -> jax.Array:
    """High 32 bits of the 64-bit product of uint32 ``a`` and ``b``, from 16-bit limbs.

    Equal to ``lax.mulhi``, which XLA cannot partition under Shardy (jax's default
    partitioner): a data-parallel jitted step with dropout failed to compile with it.
    """
    m = np.uint32(0xFFFF)
    a_lo, a_hi = a & m, a >> np.uint32(16)
    b_lo, b_hi = b & m, b >> np.uint32(16)
    hi_lo, lo_hi = a_hi * b_lo, a_lo * b_hi
    cross = ((a_lo * b_lo) >> np.uint32(16)) + (hi_lo & m) + lo_hi
    return a_hi * b_hi + (hi_lo >> np.uint32(16)) + (cross >> np.uint32(16))


def row_keys(words: jax.Array, row, *, unroll: bool = False) -> tuple[jax.Array, jax.Array]:
    """Two 32-bit keys per row: Philox-4x32-10 at counter ``(row, 0, w2, w3)``, key ``(w0, w1)``.

    The rounds run as a (rolled) loop: XLA never fuses a loop into its consumer, so the
    keys are computed once per row, not once per element of the ``[rows, cols]`` mask.
    ``unroll=True`` unrolls it (the same bits): for callers that keep loops out of the
    program, such as the Pallas kernels' operands.
    """
    row = jnp.asarray(row, jnp.uint32)

    def round_(r, state):
        x0, x1, x2, x3 = state
        # The key bumps by a Weyl constant each round: k_r = k + r * W.
        k0 = words[..., 0] + r.astype(jnp.uint32) * _W0
        k1 = words[..., 1] + r.astype(jnp.uint32) * _W1
        lo0, hi0 = lax.mul(_M0, x0), _mulhi(_M0, x0)
        lo1, hi1 = lax.mul(_M1, x2), _mulhi(_M1, x2)
        return hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0

    start = (
        row,
        jnp.zeros_like(row),
        jnp.broadcast_to(words[..., 2], row.shape),
        jnp.broadcast_to(words[..., 3], row.shape),
    )
    x0, x1, _, _ = lax.fori_loop(0, _ROUNDS, round_, start, unroll=unroll)
    return x0, x1


def row_starts(n: int, heads: int, q_len: int, shared: tuple[bool, bool]) -> jax.Array:
    """uint32 ``[N|1, H|1]``: the mask row of each (flat batch row, head)'s first query, as
    :func:`keep_mask` numbers the rows of a mask ``[batch..., H, Tq, Tk]`` whose axes in
    ``shared = (over_batch, over_heads)`` have size 1 (one mask for them all: size 1 here
    too). Query ``i`` of that row pair is mask row ``start + i``."""
    over_batch, over_heads = shared
    shape = (1 if over_batch else n, 1 if over_heads else heads)
    per_batch = np.uint32((shape[1] * q_len) % 2**32)
    return lax.broadcasted_iota(jnp.uint32, shape, 0) * per_batch + lax.broadcasted_iota(
        jnp.uint32, shape, 1
    ) * np.uint32(q_len % 2**32)


def _mix(x: jax.Array) -> jax.Array:
    """lowbias32: a bijective 32-bit multiply-xorshift hash with near-ideal avalanche."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x21F0AAAD)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x735A2D97)
    return x ^ (x >> np.uint32(15))


def random_bits(keys: tuple[jax.Array, jax.Array], col) -> jax.Array:
    """32 random bits per element: ``mix(mix(col ^ k0) ^ k1)`` for row keys ``(k0, k1)``.

    Args:
      keys: :func:`row_keys` of the elements' rows (uint32, broadcasting against ``col``).
      col: uint32 index on the last mask axis.
    """
    k0, k1 = keys
    return _mix(_mix(jnp.asarray(col, jnp.uint32) ^ k0) ^ k1)


def keep_threshold(keep_prob) -> jax.Array:
    """uint32 ``t`` with ``P(top 24 bits < t) = ceil(keep_prob * 2**24) / 2**24``."""
    scale = float(2**_THRESHOLD_BITS)
    if isinstance(keep_prob, jax.core.Tracer):
        t = jnp.ceil(jnp.asarray(keep_prob, jnp.float32) * scale)
        return jnp.clip(t, 0, scale).astype(jnp.uint32)
    return jnp.asarray(min(math.ceil(float(keep_prob) * scale), 2**_THRESHOLD_BITS), jnp.uint32)


def keep_from_counters(keys: tuple[jax.Array, jax.Array], threshold: jax.Array, col) -> jax.Array:
    """Boolean keep decisions (True = keep) for elements in rows with ``keys`` at columns ``col``.

    Args:
      keys: :func:`row_keys` of the elements' rows.
      threshold: uint32 scalar from :func:`keep_threshold`.
      col: uint32 index on the last mask axis; broadcasts against the keys.
    """
    bits = random_bits(keys, col)
    return (bits >> np.uint32(32 - _THRESHOLD_BITS)) < threshold


def keep_mask(rng, keep_prob, shape: tuple[int, ...]) -> jax.Array:
    """Boolean keep-mask of ``shape``, True with probability ``keep_prob``, from ``rng`` alone.

    Element ``(i..., c)`` is decided by :func:`keep_from_counters` with the row keys of
    ``row`` = the row-major index of ``i...`` in ``shape[:-1]`` and ``col = c``, so any
    block of the mask can be regenerated on its own.
    """
    shape = tuple(shape)
    if not shape:
        return keep_mask(rng, keep_prob, (1,)).reshape(())
    *lead, last = shape
    # [rows, 1] row-major row index and [1, last] column index
    rows = lax.broadcasted_iota(jnp.uint32, (math.prod(lead), 1), 0)
    cols = lax.broadcasted_iota(jnp.uint32, (1, last), 1)
    keys = row_keys(key_words(rng), rows)
    keep = keep_from_counters(keys, keep_threshold(keep_prob), cols)
    return keep.reshape(shape)
