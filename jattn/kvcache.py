"""A key/value cache for autoregressive decoding, as a plain pytree and pure functions.

Decoding feeds a model its prompt in one chunk (prefill), then one token per call. Each
attention layer keeps the keys and values of every token seen so far, so a new token
costs one projection and one row of attention instead of a pass over the whole sequence.

* :class:`KVCache` ``(keys, values, lengths)``: fixed-size buffers
  ``[batch..., capacity, num_kv_heads, head_dim]`` and the filled length of each row
  ``[batch...]`` (int32). A NamedTuple, so ``jax.jit``, ``lax.scan``, Flax collections
  and NNX variables carry it as they are.
* :func:`init_cache` makes an empty one; :func:`append` writes a chunk of ``T >= 1``
  tokens at each row's own end; :func:`attend` runs :func:`jattn.dot_product_attention`
  of the chunk's queries over the whole buffer; :func:`update_and_attend` does both, and
  is what the Linen and NNX modules call in ``decode`` mode.

**Ragged rows.** ``num_new [batch...]`` says how many of the chunk's ``T`` tokens are real
in each row (the rest is right padding): a prompt batch with lengths 3 and 5 is one
``T = 5`` chunk with ``num_new = [3, 5]``. Padding is never written, so each row stays
contiguous and the next chunk continues right after its last real token.

**The mask** of query ``t`` of row ``b``, at absolute position ``p = lengths[b] + t``
(``lengths`` before the append): key ``j`` is visible iff ``j <= p`` (causal, aligned
bottom-right per row) and ``j < lengths_after[b]`` (written keys only), and
``p - left <= j <= p + right`` with a sliding window ``local_window_size``. Padding
queries (``t >= num_new[b]``) attend nothing: zero output, as
:func:`jattn.dot_product_attention` gives fully masked rows.
All shapes are fixed (the key axis is always ``capacity``), so a jitted decode step
compiles once, whatever the lengths.

**Cost follows the tokens held.** On CPU, with jattn's fused kernel built, a plain call
(causal or full attention; ``scale``, ``dtype``, ``implementation`` None or
``'cpu_fused'``; no mask, window, modifiers, sinks, dropout or weights; float32, bfloat16
or float16) of up to :data:`jattn.paged.FUSED_MAX_QUERIES` tokens per row (decoding
steps, prefill chunks) attends through :func:`jattn.kernels.cpu.paged_attention`, the
cache read in place as one page per row, and only each row's positions below its length:
a step early in a long cache costs what its tokens cost, not the capacity. Its
derivatives are the XLA formulation's. :func:`fused` says whether a call takes it; any
other call attends over the whole capacity through :func:`jattn.dot_product_attention`
with the mask below (the same result; a rolling cache always does).

**Modifiers.** :func:`attend` and :func:`update_and_attend` take FlexAttention's
``score_mod`` and ``mask_mod`` (:mod:`jattn.mods`) and ``sinks``, as
:func:`jattn.dot_product_attention`, with *absolute* positions: ``q_idx`` of query ``t``
of row ``b`` is ``lengths[b] + t`` (before the append) and ``kv_idx`` the position of the
token a key holds (a :class:`KVCache`'s slot ``j`` holds position ``j``; a rolling
cache's slot holds the latest position congruent to it), so decoding a sequence with a
modifier, token by token or in ragged chunks, equals one full-sequence call with it.
``b`` and ``h`` are the flattened batch row and the query head. Arrays a modifier indexes
by position (document segment ids) must cover every position decoded.

**Capacity.** When the lengths can be read without a device-to-host copy (eager calls on
CPU), a chunk that does not fit raises a ValueError before anything is written. Under
``jax.jit`` the lengths are traced and nothing can raise (and on GPU/TPU an eager check
would block on a copy at every step, so there is none either); there the behaviour is
defined and safe: tokens past ``capacity`` are *not written* (existing keys are never
overwritten), ``lengths`` stops at ``capacity``, and the queries of those tokens attend
nothing (zero attention output).
:func:`fits` gives the per-row answer as an array, for ``checkify.check`` or a
``lax.cond`` inside jitted code.

**Rolling caches** (``init_cache(..., rolling=True)``, a :class:`RollingKVCache`) keep the
last ``capacity`` tokens of each row only, for generating past a model's context with
sliding-window attention: the token at position ``p`` is written to slot
``p % capacity`` (overwriting position ``p - capacity``), and ``lengths`` counts every
token seen, so it stays each row's next position (RoPE positions follow it). Attention
through a rolling cache is windowed: query ``p`` sees keys ``p - left ... p`` with
``left = capacity`` by default (itself and the ``capacity`` tokens before it); a smaller
``local_window_size=(left, right)`` may be given, a larger left side cannot (those keys
are gone) and is a ValueError. :func:`update_and_attend` attends over the cache *before*
the append plus the chunk's own keys (key axis ``capacity + T``), so a chunk of any
length, a long prompt included, equals full windowed attention
(``dot_product_attention(..., local_window_size=(left, 0))``) over the whole sequence;
then it writes the chunk's last ``capacity`` real tokens. A rolling cache never
overflows, and :func:`attend` alone (after :func:`append`) refuses it: the append may
have overwritten keys the chunk's first queries need.

**Paged caches** (:class:`PagedKVCache`, :func:`init_paged_cache`, from :mod:`jattn.paged`)
hold a page pool shared by all rows and a page table per row, so memory follows the tokens
held; :func:`update_and_attend` takes one too (and is then
:func:`jattn.paged.update_and_attend`), so the modules decode through it unchanged.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _fused_cache, functional
from jattn import masks as masks_lib
from jattn._util import axis_specs, sharded_axes, softmax_dtype

__all__ = [
    "KVCache",
    "PagedKVCache",  # noqa: F822 (module __getattr__: from jattn.paged)
    "RollingKVCache",
    "append",
    "attend",
    "capacity",
    "decode_mask",
    "fits",
    "fused",
    "init_cache",
    "init_paged_cache",  # noqa: F822
    "rolling_mask",
    "update_and_attend",
]

# The paged cache lives in jattn.paged, which builds on this module: its names are
# re-exported here lazily by name (as jattn/__init__ loads its submodules), and it
# registers how it updates and attends (register_cache), so this module never imports it.
_PAGED_NAMES = ("PagedKVCache", "init_paged_cache")
_CACHE_KINDS: dict[type, Callable] = {}


def register_cache(cache_type: type, update_and_attend_fn: Callable) -> None:
    """Lets :func:`update_and_attend` serve another cache type (:mod:`jattn.paged`'s)."""
    _CACHE_KINDS[cache_type] = update_and_attend_fn


def __getattr__(name: str):
    if name in _PAGED_NAMES:
        return getattr(importlib.import_module("jattn.paged"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


Array = jax.Array

# dot_product_attention keywords that attend() computes itself from the cache.
_OWN_MASK_ARGS = ("is_causal", "query_seq_lengths", "key_value_seq_lengths", "local_window_size")


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, per batch row.

    Attributes:
      keys: ``[batch..., capacity, num_kv_heads, head_dim]``.
      values: ``[batch..., capacity, num_kv_heads, v_head_dim]``.
      lengths: int32 ``[batch...]``: how many positions of each row are filled
        (positions ``>= lengths`` hold stale or zero entries and are never attended).
    """

    keys: Array
    values: Array
    lengths: Array


class RollingKVCache(NamedTuple):
    """The last ``capacity`` tokens of each row, written modulo capacity (sliding window).

    Attributes:
      keys: ``[batch..., capacity, num_kv_heads, head_dim]``; slot ``j`` holds the latest
        position ``p < lengths`` with ``p % capacity == j``.
      values: ``[batch..., capacity, num_kv_heads, v_head_dim]``.
      lengths: int32 ``[batch...]``: every token each row has seen (not capped), i.e. the
        position of its next token.
    """

    keys: Array
    values: Array
    lengths: Array


AnyCache = KVCache | RollingKVCache


def capacity(cache: AnyCache) -> int:
    """The number of positions each row of ``cache`` can hold (a static int)."""
    return cache.keys.shape[-3]


def init_cache(
    batch_shape: int | tuple[int, ...],
    capacity: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    v_head_dim: int | None = None,
    dtype: Any = jnp.float32,
    rolling: bool = False,
) -> AnyCache:
    """An empty cache: zero buffers and zero lengths.

    Args:
      batch_shape: the batch dims (an int for one batch axis, ``()`` for none).
      capacity: positions per row: the most tokens (prompt plus generated) a row can hold.
      num_kv_heads: key/value heads.
      head_dim: width of each key head.
      v_head_dim: width of each value head; default ``head_dim``.
      dtype: dtype of the key/value buffers (appended chunks are cast to it).
      rolling: a :class:`RollingKVCache` holding the last ``capacity`` tokens (sliding-window
        attention with ``left = capacity``, no overflow; see the module docstring).

    Returns:
      ``KVCache(keys [*batch_shape, capacity, num_kv_heads, head_dim], values [...,
      v_head_dim], lengths int32 [*batch_shape])`` (a ``RollingKVCache`` with ``rolling``).
    """
    batch_shape = _checks.batch_shape(batch_shape)
    capacity = _checks.size(capacity, "capacity")
    num_kv_heads = _checks.size(num_kv_heads, "num_kv_heads")
    head_dim = _checks.size(head_dim, "head_dim")
    v_head_dim = head_dim if v_head_dim is None else _checks.size(v_head_dim, "v_head_dim")
    dtype = _checks.float_dtype(dtype, "dtype")
    _checks.flag(rolling, "rolling")
    return (RollingKVCache if rolling else KVCache)(
        keys=jnp.zeros((*batch_shape, capacity, num_kv_heads, head_dim), dtype),
        values=jnp.zeros((*batch_shape, capacity, num_kv_heads, v_head_dim), dtype),
        lengths=jnp.zeros(batch_shape, jnp.int32),
    )


def _check_cache(cache) -> AnyCache:
    if not isinstance(cache, (KVCache, RollingKVCache)):
        raise TypeError(
            "cache must be a jattn.kvcache.KVCache or RollingKVCache (from init_cache), got "
            f"{type(cache).__name__}."
        )
    if cache.keys.ndim < 3 or cache.keys.shape[:-1] != cache.values.shape[:-1]:
        raise ValueError(
            "cache.keys and cache.values must be [batch..., capacity, num_kv_heads, dim] with "
            f"the same leading dims, got {cache.keys.shape} and {cache.values.shape}."
        )
    if not jnp.issubdtype(cache.lengths.dtype, jnp.integer):
        raise TypeError(f"cache.lengths must hold integers, got dtype {cache.lengths.dtype}.")
    if cache.lengths.shape != cache.keys.shape[:-3]:
        raise ValueError(
            f"cache.lengths must have the batch shape {cache.keys.shape[:-3]}, got "
            f"{cache.lengths.shape}."
        )
    return cache


def _num_new(num_new, batch_shape: tuple[int, ...], chunk_len: int) -> Array:
    """``num_new`` as int32 ``[batch...]`` (default: every token of the chunk is real)."""
    if num_new is None:
        return jnp.full(batch_shape, chunk_len, jnp.int32)
    num_new = jnp.asarray(num_new)
    if not jnp.issubdtype(num_new.dtype, jnp.integer):
        raise TypeError(f"num_new must hold integers, got dtype {num_new.dtype}.")
    try:
        num_new = jnp.broadcast_to(num_new, batch_shape).astype(jnp.int32)
    except ValueError:
        raise ValueError(
            f"num_new must have the batch shape {batch_shape} (real tokens per row) or be a "
            f"scalar, got shape {num_new.shape}."
        ) from None
    if _checks.is_host_value(num_new):
        n = np.asarray(num_new)
        if n.size and (n.min() < 0 or n.max() > chunk_len):
            raise ValueError(
                f"num_new must be in [0, {chunk_len}] (the chunk has {chunk_len} tokens), got "
                f"{n.tolist()}."
            )
    return num_new


def fits(cache: AnyCache, num_new) -> Array:
    """Bool ``[batch...]``: whether appending ``num_new`` real tokens per row fits in ``cache``.

    Works under ``jax.jit``, e.g. ``checkify.check(jnp.all(fits(cache, n)), "cache full")``.
    A rolling cache always fits (it overwrites its oldest tokens).
    """
    cache = _check_cache(cache)
    num_new = jnp.asarray(num_new)
    if not jnp.issubdtype(num_new.dtype, jnp.integer):
        raise TypeError(f"num_new must hold integers, got dtype {num_new.dtype}.")
    if isinstance(cache, RollingKVCache):
        return jnp.ones_like(cache.lengths + num_new.astype(jnp.int32), dtype=bool)
    return cache.lengths + num_new.astype(jnp.int32) <= capacity(cache)


def append(cache: AnyCache, key, value, *, num_new=None) -> AnyCache:
    """Writes a chunk of keys and values at the end of each row.

    Row ``b``'s real tokens (the first ``num_new[b]`` of the chunk) go to positions
    ``lengths[b] ... lengths[b] + num_new[b] - 1``; padding tokens are not written. A
    :class:`RollingKVCache` writes position ``p`` to slot ``p % capacity``, and only the
    last ``capacity`` real tokens of a chunk (the earlier ones would be overwritten anyway).
    On a mesh with explicit axes (``jax.make_mesh``), a chunk whose rows or heads are
    sharded in its type shards the cache's the same way (so a cache built unsharded follows
    a sharded model's keys), and each device writes its own rows and heads.

    Args:
      cache: a :class:`KVCache`.
      key: ``[batch..., T, num_kv_heads, head_dim]``, ``T >= 1``.
      value: ``[batch..., T, num_kv_heads, v_head_dim]``.
      num_new: int ``[batch...]`` (or a scalar): real tokens per row, in ``[0, T]``;
        default ``T`` for every row.

    Returns:
      The updated cache (``lengths + num_new``, capped at the capacity under jit; a
      rolling cache's lengths are never capped).

    Raises:
      ValueError: shapes that do not match the cache; ``num_new`` outside ``[0, T]``; and,
        when the lengths are concrete, a chunk that does not fit (see the module docstring
        for what happens under jit).
    """
    cache = _check_cache(cache)
    key, value, num_new = _check_chunk(cache, key, value, num_new)
    return _append(*_one_layout(cache, key, value, num_new))


def _check_chunk(cache: AnyCache, key, value, num_new):
    """Validates a chunk against ``cache``; returns ``(key, value, num_new int32 [batch...])``.

    For a :class:`KVCache` whose lengths can be read without a device-to-host copy, a chunk
    that does not fit raises here (see the module docstring for jit).
    """
    key = _checks.float_array(key, "key", tokens=True)
    value = _checks.float_array(value, "value", tokens=True)
    batch_shape, cap = cache.keys.shape[:-3], capacity(cache)
    for name, x, buf in (("key", key, cache.keys), ("value", value, cache.values)):
        if x.ndim != buf.ndim or x.shape[:-3] != batch_shape or x.shape[-2:] != buf.shape[-2:]:
            raise ValueError(
                f"{name} must have shape [*{batch_shape}, T, {buf.shape[-2]}, {buf.shape[-1]}] "
                f"to match the cache ({buf.shape}), got {x.shape}."
            )
    chunk_len = key.shape[-3]
    if chunk_len < 1 or value.shape[-3] != chunk_len:
        raise ValueError(
            f"key and value must hold the same chunk of T >= 1 tokens, got {key.shape} and "
            f"{value.shape}."
        )
    num_new = _num_new(num_new, batch_shape, chunk_len)
    # An eager check where reading the lengths costs no device-to-host copy; under jit (or
    # on an accelerator) the overflow is handled as the module docstring says.
    if (
        isinstance(cache, KVCache)
        and _checks.is_host_value(cache.lengths)
        and _checks.is_host_value(num_new)
    ):
        lengths = np.asarray(cache.lengths)
        if lengths.size and lengths.min() < 0:
            raise ValueError(f"cache.lengths must be >= 0 (tokens held), got {lengths.tolist()}.")
        ends = lengths + np.asarray(num_new)
        if ends.size and ends.max() > cap:
            raise ValueError(
                f"KV cache overflow: rows with lengths {lengths.tolist()} "
                f"cannot take {np.asarray(num_new).tolist()} more tokens; the capacity is {cap}. "
                "Build the cache with a larger capacity (Linen: init with a longer input; NNX: "
                "init_cache with a longer input_shape), or generate fewer tokens."
            )
    return key, value, num_new


def _one_layout(cache: AnyCache, key: Array, value: Array, num_new: Array):
    """``(cache, key, value, num_new)`` sharded alike on a mesh with explicit axes: each
    batch axis and the heads axis as the chunk has it, or else as the cache has it; the
    positions and features whole. So a cache built unsharded takes the keys of rows or
    heads split over devices and keeps them there (in a jitted loop, build it sharded so
    its type stays the same). Unchanged when nothing is sharded in its type."""
    if not sharded_axes(cache, key, value, num_new):
        return cache, key, value, num_new
    lead = key.ndim - 3
    ours = jax.typeof(key).sharding
    specs = (axis_specs(key), axis_specs(cache.keys))
    axes = [a if a is not None else b for a, b in zip(*specs, strict=True)]
    rows, heads = axes[:lead], axes[-2]

    def put(x, spec):
        return jax.sharding.reshard(x, ours.update(spec=jax.P(*spec)))

    keys, values = (put(x, (*rows, None, heads, None)) for x in (cache.keys, cache.values))
    key, value = (put(x, (*rows, None, heads, None)) for x in (key, value))
    cache = cache._replace(keys=keys, values=values, lengths=put(cache.lengths, rows))
    return cache, key, value, put(num_new, rows)


def _append(cache: AnyCache, key: Array, value: Array, num_new: Array) -> AnyCache:
    """:func:`append` of a chunk :func:`_check_chunk` validated."""
    if isinstance(cache, RollingKVCache):
        return _rolling_append(cache, key, value, num_new)
    cap, chunk_len = capacity(cache), key.shape[-3]
    n = int(np.prod(cache.lengths.shape, dtype=np.int64))
    t = jnp.arange(chunk_len, dtype=jnp.int32)[None, :]  # [1, T]
    # [B, T]: where each chunk token goes; padding and overflow get index `cap`, which
    # mode="drop" discards, so a write can never clamp onto (and clobber) a real entry.
    starts = cache.lengths.reshape(n, 1)
    dest = jnp.where((t < num_new.reshape(n, 1)) & (starts + t >= 0), starts + t, cap)
    return KVCache(
        keys=_write(cache.keys, key, dest),
        values=_write(cache.values, value, dest),
        lengths=jnp.minimum(cache.lengths + num_new, cap).astype(jnp.int32),
    )


def _write(buf: Array, x: Array, dest: Array) -> Array:
    """``buf [batch..., capacity, K, D]`` with ``x [batch..., T, K, D]`` written at slots
    ``dest [B, T]`` (B = the flattened batch); a slot of ``capacity`` is dropped."""
    n = dest.shape[0]
    flat, x = buf.reshape(n, *buf.shape[-3:]), x.reshape(n, *x.shape[-3:]).astype(buf.dtype)
    # Row by row (vmap): a row's slots index its own row only, so rows sharded over a mesh
    # stay on their devices.
    flat = jax.vmap(lambda row, new, slots: row.at[slots].set(new, mode="drop"))(flat, x, dest)
    return flat.reshape(buf.shape)


def _rolling_append(cache: RollingKVCache, key, value, num_new: Array) -> RollingKVCache:
    """:func:`append` for a rolling cache: position ``p`` to slot ``p % capacity``."""
    n, cap = int(np.prod(cache.lengths.shape, dtype=np.int64)), capacity(cache)
    t = jnp.arange(key.shape[-3], dtype=jnp.int32)[None, :]  # [1, T]
    real = num_new.reshape(n, 1)
    # [B, T]: the last `cap` real tokens of each row get distinct slots; the rest (padding,
    # and real tokens a later one of the same chunk overwrites) get `cap`: dropped.
    kept = (t < real) & (t >= real - cap)
    dest = jnp.where(kept, (cache.lengths.reshape(n, 1) + t) % cap, cap)
    return RollingKVCache(
        keys=_write(cache.keys, key, dest),
        values=_write(cache.values, value, dest),
        lengths=(cache.lengths + num_new).astype(jnp.int32),
    )


def _mask_options(is_causal, local_window_size, mask=None):
    """``(is_causal, (left, right) or None, mask)``, checked (the mask as every entry reads
    masks, :func:`jattn._checks.mask_array`)."""
    _checks.flag(is_causal, "is_causal")
    mask = None if mask is None else _checks.mask_array(mask)
    if local_window_size is None:
        return is_causal, None, mask
    return is_causal, _checks.window(local_window_size, open_right=True), mask


def decode_mask(
    starts,
    lengths,
    q_len: int,
    kv_len: int,
    *,
    num_new=None,
    is_causal: bool = True,
    local_window_size: int | tuple[int, int | None] | None = None,
) -> Array:
    """The decoding mask of a chunk, per row: bool ``[batch..., 1, q_len, kv_len]``.

    Query ``t`` of row ``b`` sits at position ``p = starts[b] + t``. It attends key ``j``
    iff ``j < lengths[b]`` (filled), ``t < num_new[b]`` and ``p < kv_len`` (a real token
    that was stored), and, if ``is_causal``, ``j <= p``; with ``local_window_size=(left,
    right)``, also ``p - left <= j <= p + right``.

    Args:
      starts: int ``[batch...]``: each row's filled length *before* the chunk.
      lengths: int ``[batch...]``: each row's filled length *after* the chunk.
      q_len: chunk length ``T``.
      kv_len: the cache capacity.
      num_new: int ``[batch...]``: real tokens of the chunk per row; default ``q_len``.
      is_causal: hide keys after the query's position.
      local_window_size: ``(left, right)`` keys visible before and after the query's
        position (``right`` may be None: no limit), or an int ``n`` for ``(n, n)``.
    """
    is_causal, window, _ = _mask_options(is_causal, local_window_size)
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths must hold integers (token counts), got dtype {lengths.dtype}.")
    starts = _check_starts(starts, lengths.shape)
    num_new = _num_new(num_new, starts.shape, q_len)
    return _decode_mask(starts, lengths, q_len, kv_len, num_new, is_causal, window)


def _check_starts(starts, batch_shape: tuple[int, ...]) -> Array:
    """``starts`` as int32 ``[batch...]`` (each row's length before a chunk)."""
    starts = jnp.asarray(starts)
    if not jnp.issubdtype(starts.dtype, jnp.integer):
        raise TypeError(f"starts must hold integers (token counts), got dtype {starts.dtype}.")
    if starts.shape != batch_shape:
        raise ValueError(
            f"starts must have the batch shape {batch_shape} (one length per row), got "
            f"{starts.shape}."
        )
    return starts.astype(jnp.int32)


def _decode_mask(starts, lengths, q_len, kv_len, num_new, is_causal, window) -> Array:
    """:func:`decode_mask` of validated arguments (``window`` a ``(left, right)`` or None)."""
    # [batch..., 1, 1]: per-row offsets broadcast against the [q_len, kv_len] builders.
    offset = starts[..., None, None]
    parts = [masks_lib.padding_mask_from_lengths(key_lengths=lengths, kv_len=kv_len)]
    if is_causal:
        parts.append(masks_lib.causal_mask(q_len, kv_len, offset=offset)[..., None, :, :])
    if window is not None:
        window_mask = masks_lib.sliding_window_mask(
            q_len, kv_len, local_window_size=window, offset=offset
        )
        parts.append(window_mask[..., None, :, :])
    # Real queries that were stored: t < num_new and starts + t < capacity.
    real = jnp.minimum(num_new, jnp.maximum(kv_len - starts, 0)).astype(jnp.int32)
    parts.append(masks_lib.padding_mask_from_lengths(query_lengths=real, q_len=q_len))
    return masks_lib.combine_masks(*parts)


# ----------------------------------------------------------------------------------------
# Score and mask modifiers at absolute positions
# ----------------------------------------------------------------------------------------


def _check_modifiers(score_mod, mask_mod, query: Array, kv_len: int) -> None:
    """Validates a decoding call's ``score_mod`` / ``mask_mod`` before they are wrapped.

    Ready-made modifiers check their batch rows and heads; their position-indexed arrays
    (document segment ids) cannot be checked against a length: positions are absolute.
    """
    *batch, q_len, num_heads, _ = query.shape
    shape = (*batch, num_heads, q_len, kv_len)
    _checks.score_mod(score_mod, shape, softmax_dtype(query.dtype))
    _checks.mask_mod(mask_mod, shape)
    for fn in (score_mod, mask_mod):
        _checks.modifier_sizes(fn, math.prod(batch), num_heads, None, None)


def _at_positions(score_mod, mask_mod, q_starts: Array, kv_positions: Array | None = None):
    """``(score_mod, mask_mod)`` that see absolute positions instead of row/slot indices.

    Query ``t`` of flattened row ``b`` is at ``q_starts[b] + t``; key slot ``j`` at
    ``kv_positions[b, j]`` (None: at ``j``, a :class:`KVCache`'s slot is its position).
    ``b`` and ``h`` pass unchanged (the batch and query head, as FlexAttention's).

    Args:
      score_mod: the caller's, or None.
      mask_mod: the caller's, or None.
      q_starts: int32 ``[batch...]``: each row's position of its chunk's first token.
      kv_positions: int32 ``[N, S]`` (N the flattened batch), every entry ``>= 0``.
    """
    starts = q_starts.reshape(-1)  # [N]

    def positions(b, q_idx, kv_idx):
        # [N|1, 1, 1, 1] + [1, 1, Tq, 1] and [N|1, 1, 1, S]: broadcast like the scores
        q = starts[b] + q_idx
        kv = kv_idx if kv_positions is None else kv_positions[b, kv_idx]
        return q, kv

    def absolute_score_mod(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, *positions(b, q_idx, kv_idx))

    def absolute_mask_mod(b, h, q_idx, kv_idx):
        return mask_mod(b, h, *positions(b, q_idx, kv_idx))

    return (
        None if score_mod is None else absolute_score_mod,
        None if mask_mod is None else absolute_mask_mod,
    )


# ----------------------------------------------------------------------------------------
# Attention over the cache
# ----------------------------------------------------------------------------------------


def attend(
    cache: KVCache,
    query,
    *,
    starts,
    num_new=None,
    mask=None,
    is_causal: bool = True,
    local_window_size: int | tuple[int, int | None] | None = None,
    score_mod=None,
    mask_mod=None,
    **attention_kwargs,
):
    """Attention of a chunk's queries over everything in ``cache`` (the chunk included).

    Call it after :func:`append` with the lengths from before the append as ``starts``
    (:func:`update_and_attend` does both).

    Args:
      cache: the cache *after* the chunk was appended.
      query: ``[batch..., T, num_heads, head_dim]``; ``num_heads`` a multiple of the
        cache's ``num_kv_heads``.
      starts: int ``[batch...]``: the lengths before the append (query ``t`` of row ``b``
        is at position ``starts[b] + t``).
      num_new: int ``[batch...]``: real tokens per row of the chunk; default ``T``.
      mask: optional extra bool mask, True = attend, broadcastable to
        ``[batch..., num_heads, T, capacity]`` (key axis = cache positions); ANDed in.
      is_causal: aligned bottom-right per row (default True). False lets the chunk's tokens
        see each other both ways (a non-causal model; not equal to a full forward pass).
      local_window_size: optional sliding window ``(left, right)`` around the query's
        position ``p`` (keys ``p - left ... p + right``; ``right`` may be None), or an int
        ``n`` for ``(n, n)``; with ``is_causal`` the right side is hidden anyway.
      score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` (see
        :mod:`jattn.mods`) with *absolute* positions: ``q_idx = starts[b] + t``, ``kv_idx``
        the key's position in the sequence (here its cache slot), so decoding with a
        modifier equals a full-sequence call with it. Arrays it indexes by position
        (document segment ids) must cover every position reached (a position past their
        end reads their last entry, as ``jnp`` indexing clamps).
      mask_mod: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` at absolute
        positions, ANDed with the decoding mask.
      **attention_kwargs: other keywords of :func:`jattn.dot_product_attention`
        (``scale``, ``sinks``, ``dtype``, ``precision``, ``dropout_rate``, ``dropout_rng``,
        ``deterministic``, ``broadcast_dropout``, ``module``, ``return_weights``, ...).
        ``sinks`` (per-head logits ``[num_heads]``) works as in a full call; a padding
        query attends only its sink: zero output.

    Returns:
      ``[batch..., T, num_heads, v_head_dim]`` (and the weights
      ``[batch..., num_heads, T, capacity]`` with ``return_weights=True``); padding and
      overflowed queries give zeros.
    """
    cache = _check_cache(cache)
    if isinstance(cache, RollingKVCache):
        raise TypeError(
            "attend() reads a cache after append(), and a rolling cache's append may have "
            "overwritten keys the chunk's first queries need. Use update_and_attend(), which "
            "attends over the cache before the append plus the chunk."
        )
    is_causal, window, mask = _mask_options(is_causal, local_window_size, mask)
    _check_attention_kwargs(attention_kwargs, "attend")
    query = _check_query(query, cache)
    starts = _check_starts(starts, cache.lengths.shape)
    num_new = _num_new(num_new, starts.shape, query.shape[-3])
    _check_modifiers(score_mod, mask_mod, query, capacity(cache))
    return _attend(
        cache, query, starts, num_new, mask, is_causal, window, (score_mod, mask_mod),
        attention_kwargs,
    )  # fmt: skip


def fused(cache: AnyCache, query=None, attend_kwargs=None) -> bool:
    """Whether :func:`update_and_attend` (and :func:`attend`) on ``cache`` run the fused CPU
    paged kernel (:func:`jattn.kernels.cpu.paged_attention`, the cache read as one page
    per row): a :class:`KVCache` (not a rolling one) on a CPU host with the kernel built,
    a plain causal or full call (the keywords ``is_causal``, a Python ``scale``, ``dtype``
    and ``implementation`` None or ``'cpu_fused'``; no mask, window, modifiers, sinks,
    dropout or weights), float32, bfloat16 or float16 caches and queries, and chunks of up
    to :data:`jattn.paged.FUSED_MAX_QUERIES` tokens. ``query``/``attend_kwargs`` None: the
    cache alone."""
    if type(cache) is not KVCache:
        return False
    kwargs = {} if attend_kwargs is None else attend_kwargs
    return _fused_cache.takes((cache.keys, cache.values), query, kwargs)


def _attend(cache, query, starts, num_new, mask, is_causal, window, modifiers, kwargs):
    """:func:`attend` of validated arguments (``modifiers``: ``(score_mod, mask_mod)``)."""
    options = dict(kwargs, is_causal=is_causal)
    own = dict(mask=mask, local_window_size=window, score_mod=modifiers[0], mask_mod=modifiers[1])
    if fused(cache, query, dict(options, **own)):
        return _attend_fused(cache, query, starts, num_new, options)
    decoding = _decode_mask(
        starts, cache.lengths, query.shape[-3], capacity(cache), num_new, is_causal, window
    )
    score_mod, mask_mod = _at_positions(*modifiers, starts)
    return functional.dot_product_attention(
        query,
        cache.keys,
        cache.values,
        mask=masks_lib.combine_masks(decoding, mask),
        score_mod=score_mod,
        mask_mod=mask_mod,
        **kwargs,
    )


def _attend_fused(cache: KVCache, query, starts, num_new, kwargs):
    """The fused kernel's attention over ``cache`` read as a pool of one page per row."""
    rows = int(np.prod(cache.lengths.shape, dtype=np.int64))
    k_pages, v_pages = (x.reshape(rows, *x.shape[-3:]) for x in (cache.keys, cache.values))
    table = jnp.arange(rows, dtype=jnp.int32).reshape(*cache.lengths.shape, 1)
    return _fused_cache.attend(
        query, k_pages, v_pages, table, starts, num_new, cache.lengths, kwargs
    )


def _check_attention_kwargs(attention_kwargs, where: str) -> None:
    clash = sorted(set(attention_kwargs) & set(_OWN_MASK_ARGS))
    if clash:
        raise TypeError(
            f"{where}() builds the decoding mask itself; do not pass {clash}. Use is_causal=, "
            "local_window_size= or mask= instead."
        )
    if "block_mask" in attention_kwargs:
        raise TypeError(
            f"{where}() takes no block_mask: a block mask is built for one call's (q_len, "
            "kv_len), and a decoding step's keys are the cache's slots. Pass its mask_mod= "
            "instead (decoding evaluates it at absolute positions)."
        )


def _check_query(query, cache: AnyCache) -> Array:
    query = jnp.asarray(query)
    if query.ndim != cache.keys.ndim or query.shape[:-3] != cache.keys.shape[:-3]:
        raise ValueError(
            f"query must have shape [*{cache.keys.shape[:-3]}, T, num_heads, head_dim] to match "
            f"the cache, got {query.shape}."
        )
    return query


# ----------------------------------------------------------------------------------------
# Rolling caches
# ----------------------------------------------------------------------------------------


def _rolling_window(cap: int, window) -> tuple[int, int | None]:
    """The ``(left, right)`` window of attention through a rolling cache of ``cap`` slots."""
    if window is None:
        return cap, None
    left, right = window
    if left > cap:
        raise ValueError(
            f"local_window_size left side ({left}) exceeds the rolling cache's capacity ({cap}): "
            f"it keeps only the {cap} tokens before a chunk. Build the cache with capacity >= "
            f"{left}, or use a window of at most {cap}."
        )
    return left, right


def rolling_mask(
    starts,
    q_len: int,
    cap: int,
    *,
    num_new=None,
    is_causal: bool = True,
    local_window_size: int | tuple[int, int | None] | None = None,
) -> Array:
    """The mask of a chunk attending through a rolling cache: bool ``[batch..., 1, T, cap + T]``.

    Keys ``0 ... cap-1`` are the cache's slots *before* the chunk (slot ``j`` holds the
    latest position ``p < starts`` with ``p % cap == j``, if any); keys ``cap ... cap+T-1``
    are the chunk's own, at positions ``starts + t``. Query ``t`` (at ``q = starts + t``,
    real iff ``t < num_new``) sees a real key at position ``k`` iff ``q - left <= k``,
    ``k <= q + right`` (when ``right`` is not None) and, if ``is_causal``, ``k <= q``.

    Args:
      starts: int ``[batch...]``: tokens each row had seen before the chunk.
      q_len: chunk length ``T``.
      cap: the cache capacity.
      num_new: int ``[batch...]``: real tokens of the chunk per row; default ``q_len``.
      is_causal: hide keys after the query's position.
      local_window_size: ``(left, right)`` or an int; left at most ``cap`` (the default).
    """
    _checks.flag(is_causal, "is_causal")
    window = (
        None if local_window_size is None else _checks.window(local_window_size, open_right=True)
    )
    window = _rolling_window(cap, window)
    starts = jnp.asarray(starts)
    if not jnp.issubdtype(starts.dtype, jnp.integer):
        raise TypeError(f"starts must hold integers (token counts), got dtype {starts.dtype}.")
    starts = starts.astype(jnp.int32)
    num_new = _num_new(num_new, starts.shape, q_len)
    return _rolling_mask(starts, q_len, cap, num_new, is_causal, window)


def _rolling_keys(starts: Array, q_len: int, cap: int, num_new: Array):
    """``(key_pos, key_real)`` int32 / bool ``[batch..., cap + T]``: each key's position
    (a slot never written has a negative one) and whether it holds a real token."""
    lead = (1,) * starts.ndim
    s = starts[..., None]  # [batch..., 1]
    j = jnp.arange(cap, dtype=jnp.int32).reshape(*lead, cap)
    t = jnp.arange(q_len, dtype=jnp.int32).reshape(*lead, q_len)
    slot_pos = s - 1 - jnp.remainder(s - 1 - j, cap)
    key_pos = jnp.concatenate([slot_pos, s + t], axis=-1)
    key_real = jnp.concatenate([slot_pos >= 0, t < num_new[..., None]], axis=-1)
    return key_pos, key_real


def _rolling_mask(starts, q_len, cap, num_new, is_causal, window) -> Array:
    """:func:`rolling_mask` of validated arguments (``window``: ``(left, right)``)."""
    left, right = window
    lead = (1,) * starts.ndim
    key_pos, key_real = _rolling_keys(starts, q_len, cap, num_new)
    t = jnp.arange(q_len, dtype=jnp.int32).reshape(*lead, q_len)
    q_pos, q_real = starts[..., None] + t, t < num_new[..., None]  # [batch..., T]
    # [batch..., T, cap + T]: distance from each query back to each key
    back = q_pos[..., :, None] - key_pos[..., None, :]
    visible = key_real[..., None, :] & q_real[..., :, None] & (back <= left)
    if right is not None:
        visible &= back >= -right
    if is_causal:
        visible &= back >= 0
    return visible[..., None, :, :]


def _rolling_attend(cache, query, key, value, num_new, mask, is_causal, window, modifiers, kw):
    """Attention of a chunk over a rolling cache *before* its append, plus the chunk."""
    cap, q_len = capacity(cache), query.shape[-3]
    starts = cache.lengths
    visible = _rolling_mask(starts, q_len, cap, num_new, is_causal, window)
    # [batch..., cap + T, K, D]: the keys before the chunk, then the chunk's (in the cache dtype)
    keys = jnp.concatenate([cache.keys, jnp.asarray(key, cache.keys.dtype)], axis=-3)
    values = jnp.concatenate([cache.values, jnp.asarray(value, cache.values.dtype)], axis=-3)
    score_mod, mask_mod = modifiers
    if score_mod is not None or mask_mod is not None:
        key_pos, _ = _rolling_keys(starts, q_len, cap, num_new)
        # [N, cap + T]; never-written slots (hidden by the mask) read position 0, not -1
        kv_positions = jnp.maximum(key_pos, 0).reshape(-1, cap + q_len)
        score_mod, mask_mod = _at_positions(score_mod, mask_mod, starts, kv_positions)
    return functional.dot_product_attention(
        query,
        keys,
        values,
        mask=masks_lib.combine_masks(visible, mask),
        score_mod=score_mod,
        mask_mod=mask_mod,
        **kw,
    )


def update_and_attend(
    cache: AnyCache,
    query,
    key,
    value,
    *,
    num_new=None,
    mask=None,
    is_causal: bool = True,
    local_window_size: int | tuple[int, int | None] | None = None,
    score_mod=None,
    mask_mod=None,
    **attention_kwargs,
):
    """Appends a chunk's keys and values, then attends its queries: one decoding step.

    Args:
      cache: a :class:`KVCache`, :class:`RollingKVCache` or :class:`PagedKVCache` (this
        call is then :func:`jattn.paged.update_and_attend`).
      query: ``[batch..., T, num_heads, head_dim]``.
      key: ``[batch..., T, num_kv_heads, head_dim]``.
      value: ``[batch..., T, num_kv_heads, v_head_dim]``.
      num_new, mask, is_causal, local_window_size, score_mod, mask_mod: as
        :func:`attend` (``q_idx``/``kv_idx`` of the modifiers are absolute positions; with
        a rolling cache ``kv_idx`` is the position each slot holds, not the slot).
      **attention_kwargs: as :func:`attend` (``sinks=`` included).

    Returns:
      ``(output, cache)``: the attention output as :func:`attend` (a pair with
      ``return_weights``) and the updated cache. With a :class:`RollingKVCache` the keys
      are the cache's slots before the chunk, then the chunk's (:func:`rolling_mask`), so
      ``mask`` and the weights have ``capacity + T`` keys.
    """
    other = _CACHE_KINDS.get(type(cache))  # a paged cache (jattn.paged registers it)
    if other is not None:
        return other(
            cache, query, key, value, num_new=num_new, mask=mask, is_causal=is_causal,
            local_window_size=local_window_size, score_mod=score_mod, mask_mod=mask_mod,
            **attention_kwargs,
        )  # fmt: skip
    cache = _check_cache(cache)
    is_causal, window, mask = _mask_options(is_causal, local_window_size, mask)
    _check_attention_kwargs(attention_kwargs, "update_and_attend")
    query = _check_query(query, cache)
    key, value, num_new = _check_chunk(cache, key, value, num_new)
    cache, key, value, num_new = _one_layout(cache, key, value, num_new)
    if query.shape[-3] != key.shape[-3]:
        raise ValueError(
            f"query and key must hold the same chunk of T tokens (query {query.shape}, key "
            f"{key.shape}): each query sits at its key's position."
        )
    rolling = isinstance(cache, RollingKVCache)
    kv_len = capacity(cache) + (query.shape[-3] if rolling else 0)
    _check_modifiers(score_mod, mask_mod, query, kv_len)
    modifiers = (score_mod, mask_mod)
    updated = _append(cache, key, value, num_new)
    if rolling:
        window = _rolling_window(capacity(cache), window)
        out = _rolling_attend(
            cache, query, key, value, num_new, mask, is_causal, window, modifiers,
            attention_kwargs,
        )  # fmt: skip
    else:
        out = _attend(
            updated, query, cache.lengths, num_new, mask, is_causal, window, modifiers,
            attention_kwargs,
        )  # fmt: skip
    return out, updated
