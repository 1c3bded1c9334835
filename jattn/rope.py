"""Rotary position embeddings (RoPE), the book's formulation, as pure functions.

RoPE encodes a token's position ``p`` by rotating its query and key features: feature
``i`` of the first half of the head and feature ``i`` of the second half form a pair,
rotated by the angle ``p * inv_freq[i]``. The dot product of a query at ``p`` and a key
at ``s`` then depends on ``p - s`` only, so attention sees relative positions.

This module follows the book's Llama 3 / Qwen3 code (``llms_from_scratch.llama3``):

* :func:`compute_rope_params` ``(head_dim, theta_base, context_length, freq_config)``
  gives the book's ``cos``/``sin`` tables ``[context_length, head_dim]``, with Llama 3's
  frequency scaling when ``freq_config`` is given (the book's keys ``factor``,
  ``low_freq_factor``, ``high_freq_factor``, ``original_context_length``);
* :func:`apply_rope` ``(x, cos, sin, positions=...)`` rotates ``x`` in jattn's layout
  ``[batch..., T, heads, head_dim]`` (the book's is ``(b, heads, T, head_dim)``), with the
  book's *rotate-half* pairing (``concat(-x2, x1)``, halves, not interleaved pairs).

What it adds: explicit ``positions`` (default ``0 ... T-1``), so rotations follow a KV
cache's per-row lengths (:func:`positions_from_lengths`: token ``t`` of row ``b`` sits at
``lengths[b] + t``) or restart in packed sequences (:func:`positions_from_segments`); and
:func:`rope_cos_sin` / :class:`RoPE`, which compute ``cos``/``sin`` at the given positions
without a table (what a module uses: no ``context_length`` limit, nothing stored).

Numerics: the angles are ``float32(position) * float32(inv_freq)`` as in the book (and
Hugging Face), where ``inv_freq`` is computed in float64 and rounded once (the book
computes it in float32: some entries differ by an ulp, so cos/sin differ from the book's
by up to ~2e-4 at position 4096 and ~8e-3 at 131072, not bit for bit); the rotation
runs in float32 (float64 stays float64) and the output comes back in the input dtype.
The table path and the on-the-fly path give identical values.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FreqConfig",
    "RoPE",
    "apply_rope",
    "compute_rope_params",
    "inv_frequencies",
    "positions_from_lengths",
    "positions_from_segments",
    "rope_cos_sin",
    "rotate",
]

Array = jax.Array

_FREQ_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_context_length")


# ----------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------


def _check_int(value, name: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return int(value)


def _check_head_dim(head_dim, name: str = "head_dim") -> int:
    head_dim = _check_int(head_dim, name)
    if head_dim % 2:
        raise ValueError(
            f"{name} must be even, got {head_dim}: RoPE rotates pairs of features (feature i "
            "of the first half with feature i of the second half)."
        )
    return head_dim


def _check_positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    value = float(value)
    if not 0.0 < value < math.inf:
        raise ValueError(f"{name} must be positive and finite, got {value}.")
    return value


def _rope_dtype(dtype):
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"dtype must be a floating dtype such as jnp.float32, got {dtype!r}."
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype}.")
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ValueError(
            f"dtype={dtype} needs 64-bit mode (jax.config.update('jax_enable_x64', True)), "
            "or use float32."
        )
    return dtype


def _check_positions(positions, name: str = "positions") -> Array:
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(
            f"{name} must hold integers (token positions), got dtype {positions.dtype}."
        )
    return positions


# ----------------------------------------------------------------------------------------
# Frequencies
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FreqConfig:
    """Llama 3's RoPE frequency scaling (the book's ``freq_config`` / ``cfg['rope_freq']``).

    Wavelengths longer than ``original_context_length / low_freq_factor`` are stretched by
    ``factor``; shorter than ``original_context_length / high_freq_factor`` are kept; those
    between are interpolated smoothly.

    Attributes:
      factor: how much the low frequencies are slowed down (> 0; Llama 3.1/3.2: 8 or 32).
      low_freq_factor: > 0.
      high_freq_factor: > ``low_freq_factor``.
      original_context_length: the context length the model was first trained with.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context_length: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(
                self, name, _check_positive(getattr(self, name), f"freq_config[{name!r}]")
            )
        length = self.original_context_length
        if (
            isinstance(length, numbers.Real)
            and not isinstance(length, bool)
            and float(length).is_integer()
        ):
            length = int(length)  # the book's configs may hold 8192.0
        object.__setattr__(
            self,
            "original_context_length",
            _check_int(length, "freq_config['original_context_length']"),
        )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"freq_config['high_freq_factor'] ({self.high_freq_factor}) must be larger than "
                f"freq_config['low_freq_factor'] ({self.low_freq_factor}): the smooth "
                "interpolation divides by their difference."
            )

    @classmethod
    def from_book(cls, freq_config: Mapping) -> FreqConfig:
        """From the book's dict; missing or unknown keys are a ValueError naming them."""
        if isinstance(freq_config, FreqConfig):
            return freq_config
        if not isinstance(freq_config, Mapping):
            raise TypeError(
                f"freq_config must be a dict with keys {list(_FREQ_KEYS)} (or None for no "
                f"scaling), got {type(freq_config).__name__}."
            )
        missing = [k for k in _FREQ_KEYS if k not in freq_config]
        unknown = sorted(str(k) for k in freq_config if k not in _FREQ_KEYS)
        if missing or unknown:
            raise ValueError(
                f"freq_config must have exactly the keys {list(_FREQ_KEYS)}; missing {missing}, "
                f"unknown {unknown}."
            )
        return cls(**{k: freq_config[k] for k in _FREQ_KEYS})

    def to_book(self) -> dict:
        """The book's dict."""
        return dataclasses.asdict(self)


def inv_frequencies(head_dim: int, theta_base: float = 10_000.0, freq_config=None) -> np.ndarray:
    """The book's ``inv_freq``, in float64: ``theta_base ** (-2i / head_dim)``, i < head_dim/2.

    With ``freq_config``, Llama 3's scaling, line by line as the book's
    ``compute_rope_params``.

    Args:
      head_dim: features per head (even).
      theta_base: the base ``theta`` (Llama 3: 500_000, Qwen3: 1_000_000).
      freq_config: None, a :class:`FreqConfig` or the book's dict.

    Returns:
      numpy float64 ``[head_dim // 2]``.
    """
    head_dim = _check_head_dim(head_dim)
    theta_base = _check_positive(theta_base, "theta_base")
    inv_freq = 1.0 / theta_base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if freq_config is None:
        return inv_freq
    fc = FreqConfig.from_book(freq_config)
    low_freq_wavelen = fc.original_context_length / fc.low_freq_factor
    high_freq_wavelen = fc.original_context_length / fc.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor` ...
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / fc.factor, inv_freq)
    # ... and those between the two thresholds interpolated between slowed and kept.
    smooth = (fc.original_context_length / wavelen - fc.low_freq_factor) / (
        fc.high_freq_factor - fc.low_freq_factor
    )
    smoothed = (1 - smooth) * (inv_freq / fc.factor) + smooth * inv_freq
    is_medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    positions, head_dim: int, theta_base: float = 10_000.0, freq_config=None, *, dtype=jnp.float32
) -> tuple[Array, Array]:
    """``cos`` and ``sin`` of the rotation angles at the given positions (no table).

    Args:
      positions: int ``[...]`` token positions (may be traced).
      head_dim: features per head (even).
      theta_base, freq_config: as :func:`inv_frequencies`.
      dtype: float32 (default) or float64 (needs ``jax_enable_x64``).

    Returns:
      ``(cos, sin)``, each ``[..., head_dim]`` in ``dtype``; the two halves are equal,
      as in the book's ``torch.cat([angles, angles], dim=1)``.
    """
    positions = _check_positions(positions)
    dtype = _rope_dtype(dtype)
    inv_freq = jnp.asarray(inv_frequencies(head_dim, theta_base, freq_config), dtype)
    # [..., head_dim // 2]: the book's positions[:, None] * inv_freq[None, :], in `dtype`
    angles = positions.astype(dtype)[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))
    angles = jnp.concatenate([angles, angles], axis=-1)  # [..., head_dim]
    return jnp.cos(angles), jnp.sin(angles)


def compute_rope_params(
    head_dim: int,
    theta_base: float = 10_000.0,
    context_length: int = 4096,
    freq_config=None,
    *,
    dtype=jnp.float32,
) -> tuple[Array, Array]:
    """The book's ``compute_rope_params``: ``cos``/``sin`` tables for positions ``0 ... L-1``.

    Args:
      head_dim: features per head (even).
      theta_base: the base ``theta``.
      context_length: table rows ``L``.
      freq_config: None, or Llama 3's scaling (the book's dict or a :class:`FreqConfig`).
      dtype: float32 (default) or float64.

    Returns:
      ``(cos, sin)``, each ``[context_length, head_dim]``.
    """
    context_length = _check_int(context_length, "context_length")
    return rope_cos_sin(
        jnp.arange(context_length, dtype=jnp.int32), head_dim, theta_base, freq_config, dtype=dtype
    )


# ----------------------------------------------------------------------------------------
# Rotation
# ----------------------------------------------------------------------------------------


def _check_x(x) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"x must be a float array [batch..., T, heads, head_dim], got dtype {x.dtype}."
        )
    if x.ndim < 3:
        raise ValueError(
            f"x must have shape [batch..., T, heads, head_dim] (rank >= 3), got {x.shape}."
        )
    _check_head_dim(x.shape[-1], f"x's head_dim (last axis of {x.shape})")
    return x


def _per_token(table: Array, x: Array, name: str) -> Array:
    """``[batch'..., T, head_dim]`` -> ``[1..., batch'..., T, 1, head_dim]`` with x's rank.

    Explicit rank, so it also works under ``jax_numpy_rank_promotion='raise'``.
    """
    lead = x.ndim - 1 - table.ndim
    if lead < 0:
        raise ValueError(
            f"{name} has shape {table.shape}, more batch axes than x {x.shape} "
            "([batch..., T, heads, head_dim])."
        )
    table = table.reshape((1,) * lead + table.shape[:-1] + (1, table.shape[-1]))
    try:
        jnp.broadcast_shapes(table.shape, x.shape)
    except ValueError:
        raise ValueError(
            f"{name} has shape {table.shape[lead:-2] + table.shape[-1:]} per token, which does "
            f"not broadcast to x's [batch..., T] + [head_dim] = {x.shape[:-2] + x.shape[-1:]}."
        ) from None
    return table


def rotate(x, cos, sin) -> Array:
    """Rotates ``x`` by angles given per token: the book's ``x * cos + rotate_half(x) * sin``.

    Args:
      x: ``[batch..., T, heads, head_dim]`` float.
      cos: ``[batch'..., T, head_dim]`` (batch dims broadcastable to x's), e.g. from
        :func:`rope_cos_sin` at each token's position.
      sin: same shape as ``cos``.

    Returns:
      ``[batch..., T, heads, head_dim]`` in x's dtype, computed in float32 (or float64).
    """
    x = _check_x(x)
    cos, sin = jnp.asarray(cos), jnp.asarray(sin)
    if cos.shape != sin.shape or cos.ndim < 2 or cos.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"cos and sin must have the same shape [..., T, head_dim={x.shape[-1]}], got "
            f"{cos.shape} and {sin.shape}."
        )
    compute = jnp.promote_types(x.dtype, jnp.float32)
    cos = _per_token(cos, x, "cos").astype(compute)
    sin = _per_token(sin, x, "sin").astype(compute)
    xc = x.astype(compute)
    half = x.shape[-1] // 2
    # [batch..., T, heads, head_dim]: the book's torch.cat((-x2, x1), dim=-1)
    rotated = jnp.concatenate([-xc[..., half:], xc[..., :half]], axis=-1)
    return (xc * cos + rotated * sin).astype(x.dtype)


def apply_rope(x, cos, sin, *, positions=None) -> Array:
    """The book's ``apply_rope`` on jattn's layout, with explicit positions.

    Args:
      x: ``[batch..., T, heads, head_dim]`` float (queries or keys).
      cos: the table ``[L, head_dim]`` from :func:`compute_rope_params`.
      sin: the table ``[L, head_dim]``.
      positions: int ``[batch'..., T]`` (batch dims broadcastable to x's, e.g. ``[T]``):
        the position of each token; default ``0 ... T-1`` (the book). With a KV cache,
        :func:`positions_from_lengths`; packed sequences, :func:`positions_from_segments`.

    Returns:
      ``[batch..., T, heads, head_dim]`` in x's dtype, rotated in float32.

    Raises:
      ValueError: an odd head_dim, tables that do not match x, ``T > L`` without
        positions, or (when the positions are concrete) a position outside ``[0, L)``.
        Under ``jax.jit`` positions are traced and outside positions are clipped to the
        table: a KV cache (capacity <= context length) never stores such a token.
      TypeError: a non-float x, non-integer positions.
    """
    x = _check_x(x)
    cos, sin = jnp.asarray(cos), jnp.asarray(sin)
    if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"cos and sin must be tables [context_length, head_dim={x.shape[-1]}] (from "
            f"compute_rope_params), got {cos.shape} and {sin.shape}."
        )
    table_len, num_tokens = cos.shape[0], x.shape[-3]
    if positions is None:
        if num_tokens > table_len:
            raise ValueError(
                f"x has {num_tokens} tokens but the cos/sin tables hold {table_len} positions: "
                "compute them with a larger context_length."
            )
        positions = jnp.arange(num_tokens, dtype=jnp.int32)
    positions = _check_positions(positions)
    if positions.ndim < 1 or positions.shape[-1] != num_tokens:
        raise ValueError(
            f"positions must have shape [batch..., T={num_tokens}] (one per token of x "
            f"{x.shape}), got {positions.shape}."
        )
    if not isinstance(positions, jax.core.Tracer) and positions.size:
        values = np.asarray(positions)  # numpy: under jit a concrete array's min is traced
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= table_len:
            raise ValueError(
                f"positions must be in [0, {table_len}) (the rows of the cos/sin tables), got "
                f"values from {lo} to {hi}. Compute the tables with a larger context_length."
            )
    # [batch'..., T, head_dim]: each token's row of the tables
    return rotate(
        x,
        jnp.take(cos, positions, axis=0, mode="clip"),
        jnp.take(sin, positions, axis=0, mode="clip"),
    )


# ----------------------------------------------------------------------------------------
# Positions
# ----------------------------------------------------------------------------------------


def positions_from_lengths(lengths, num_tokens: int) -> Array:
    """Positions of a chunk appended to a KV cache: token ``t`` of row ``b`` at ``lengths[b] + t``.

    Args:
      lengths: int ``[batch...]``: tokens already in each row (``KVCache.lengths`` before
        the chunk is appended).
      num_tokens: the chunk length ``T``.

    Returns:
      int32 ``[batch..., T]``.
    """
    lengths = _check_positions(lengths, "lengths")
    num_tokens = _check_int(num_tokens, "num_tokens")
    t = jnp.arange(num_tokens, dtype=jnp.int32).reshape((1,) * lengths.ndim + (num_tokens,))
    return lengths.astype(jnp.int32)[..., None] + t


def positions_from_segments(segment_ids) -> Array:
    """Positions in packed sequences: ``0, 1, ...`` again wherever the segment id changes.

    Args:
      segment_ids: int ``[batch..., T]``; a run of equal ids is one sequence (padding
        included: give it its own id).

    Returns:
      int32 ``[batch..., T]``: ``t`` minus the index where ``t``'s run starts.
    """
    segment_ids = _check_positions(segment_ids, "segment_ids")
    if segment_ids.ndim < 1 or segment_ids.shape[-1] < 1:
        raise ValueError(
            f"segment_ids must have shape [batch..., T] with T >= 1, got {segment_ids.shape}."
        )
    num_tokens = segment_ids.shape[-1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    t = jnp.broadcast_to(t, segment_ids.shape)
    # A run starts at t = 0 and wherever the id differs from the one before.
    starts = jnp.concatenate(
        [
            jnp.ones((*segment_ids.shape[:-1], 1), bool),
            segment_ids[..., 1:] != segment_ids[..., :-1],
        ],
        axis=-1,
    )
    run_start = jax.lax.cummax(jnp.where(starts, t, 0), axis=segment_ids.ndim - 1)
    return t - run_start


# ----------------------------------------------------------------------------------------
# What a module holds
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RoPE:
    """Static RoPE settings for a module: rotate queries and keys at given positions.

    Hashable (a frozen dataclass), so it can be a static module attribute or a jit
    static argument. Computes ``cos``/``sin`` at the positions (no table, no length limit).

    Attributes:
      theta_base: the base ``theta`` (the book's ``cfg['rope_base']``).
      freq_config: None or Llama 3's scaling (a :class:`FreqConfig`; the book's dict is
        converted).
    """

    theta_base: float = 10_000.0
    freq_config: FreqConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "theta_base", _check_positive(self.theta_base, "theta_base"))
        if self.freq_config is not None:
            object.__setattr__(self, "freq_config", FreqConfig.from_book(self.freq_config))

    def cos_sin(self, positions, head_dim: int, dtype: Any = jnp.float32) -> tuple[Array, Array]:
        """:func:`rope_cos_sin` with these settings: ``[..., head_dim]`` each."""
        return rope_cos_sin(positions, head_dim, self.theta_base, self.freq_config, dtype=dtype)

    def __call__(self, x, positions) -> Array:
        """Rotates ``x [batch..., T, heads, head_dim]`` at ``positions`` int ``[batch'..., T]``."""
        x = _check_x(x)
        positions = _check_positions(positions)
        if positions.ndim < 1 or positions.shape[-1] != x.shape[-3]:
            raise ValueError(
                f"positions must have shape [batch..., T={x.shape[-3]}] (one per token of x "
                f"{x.shape}), got {positions.shape}."
            )
        compute = jnp.promote_types(x.dtype, jnp.float32)
        cos, sin = self.cos_sin(positions, x.shape[-1], compute)
        return rotate(x, cos, sin)
