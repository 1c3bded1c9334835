"""Cheap, position-addressed random bits for dropout masks.

JAX's default ``jax.random.bernoulli`` draws a mask from a threefry stream whose
layout depends on the whole array shape, so a mask cannot be produced block by block,
and on CPU it costs more than the attention it drops from (``benchmarks/bench_dropout.py``
measures it). Here each dropout decision is a pure function of

* four 32-bit words derived once from the caller's ``jax.random`` key, and
* the element's coordinates ``(row, col)``: ``col`` is the index on the last axis
  (the key position) and ``row`` the row-major index over all the other axes of the
  mask (batch..., head, query position), taken modulo 2**32,

computed with Philox-4x32-10, the counter-based generator of Salmon et al. (2011,
"Parallel random numbers: as easy as 1, 2, 3"; also a ``jax.random`` key
implementation), keyed by two of the words, with the counter ``(col, row, w2, w3)``.
So the same key gives the same mask whether it is built at once (dense path) or one
block at a time (blockwise path), whatever the block sizes, and another key gives an
independent mask. The explicit-key contract is unchanged: the key is the only source
of randomness, and nothing is stored between calls.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["keep_from_counters", "keep_mask", "keep_threshold", "key_words"]

# Philox-4x32 constants from Random123: round multipliers and Weyl key increments.
_M0 = np.uint32(0xD2511F53)
_M1 = np.uint32(0xCD9E8D57)
_W0 = np.uint32(0x9E3779B9)
_W1 = np.uint32(0xBB67AE85)
_ROUNDS = 10  # Random123's default; 7 is the fewest that pass BigCrush, 10 keeps a margin.
_THRESHOLD_BITS = 24  # keep iff the top 24 bits < threshold: p is exact to 2**-24 (as jax)


def key_words(rng) -> jax.Array:
    """Four uint32 words derived from a ``jax.random`` key (typed or raw, any impl).

    One tiny draw from the caller's own generator, so keys of every implementation
    work and distinct keys give unrelated words.
    """
    return jax.random.bits(rng, (4,), jnp.uint32)


def _philox_word(words: jax.Array, row: jax.Array, col: jax.Array) -> jax.Array:
    """First output word of Philox-4x32-10 at counter ``(col, row, w2, w3)``, key ``(w0, w1)``."""
    k0, k1 = words[..., 0], words[..., 1]
    x0, x1 = col, row
    x2, x3 = words[..., 2], words[..., 3]
    for r in range(_ROUNDS):
        if r:
            k0 = k0 + _W0
            k1 = k1 + _W1
        lo0, hi0 = lax.mul(_M0, x0), lax.mulhi(_M0, x0)
        lo1, hi1 = lax.mul(_M1, x2), lax.mulhi(_M1, x2)
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
    return x0


def keep_threshold(keep_prob) -> jax.Array:
    """uint32 threshold ``t`` such that ``P(top 24 bits < t) = ceil(keep_prob * 2**24) / 2**24``."""
    scale = float(2**_THRESHOLD_BITS)
    if isinstance(keep_prob, jax.core.Tracer):
        t = jnp.ceil(jnp.asarray(keep_prob, jnp.float32) * scale)
        return jnp.clip(t, 0, scale).astype(jnp.uint32)
    return jnp.asarray(min(math.ceil(float(keep_prob) * scale), 2**_THRESHOLD_BITS), jnp.uint32)


def keep_from_counters(words: jax.Array, threshold: jax.Array, row, col) -> jax.Array:
    """Boolean keep decisions for elements at ``(row, col)`` (uint32 arrays that broadcast).

    Args:
      words: uint32 ``[4]`` from :func:`key_words`.
      threshold: uint32 scalar from :func:`keep_threshold`.
      row: uint32 row-major index over every mask axis but the last (mod 2**32).
      col: uint32 index on the last mask axis.

    Returns:
      Boolean array of the broadcast shape of ``row`` and ``col``; True = keep.
    """
    row, col = jnp.broadcast_arrays(jnp.asarray(row, jnp.uint32), jnp.asarray(col, jnp.uint32))
    bits = _philox_word(words, row, col)
    return (bits >> np.uint32(32 - _THRESHOLD_BITS)) < threshold


def keep_mask(rng, keep_prob, shape: tuple[int, ...]) -> jax.Array:
    """Boolean keep-mask of ``shape``, True with probability ``keep_prob``, from ``rng`` alone.

    Element ``(i..., c)`` is decided by :func:`keep_from_counters` at ``row`` = the
    row-major index of ``i...`` in ``shape[:-1]`` and ``col = c``, so any block of the
    mask can be regenerated on its own.
    """
    shape = tuple(shape)
    if not shape:
        return keep_mask(rng, keep_prob, (1,)).reshape(())
    *lead, last = shape
    # [prod(lead), last]: row-major row index, then the column on the last axis.
    rows = lax.broadcasted_iota(jnp.uint32, (math.prod(lead), last), 0)
    cols = lax.broadcasted_iota(jnp.uint32, (math.prod(lead), last), 1)
    keep = keep_from_counters(key_words(rng), keep_threshold(keep_prob), rows, cols)
    return keep.reshape(shape)
