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

**Capacity.** When the lengths can be read without a device-to-host copy (eager calls on
CPU), a chunk that does not fit raises a ValueError before anything is written. Under
``jax.jit`` the lengths are traced and nothing can raise (and on GPU/TPU an eager check
would block on a copy at every step, so there is none either); there the behaviour is
defined and safe: tokens past ``capacity`` are *not written* (existing keys are never
overwritten), ``lengths`` stops at ``capacity``, and the queries of those tokens attend
nothing (zero attention output).
:func:`fits` gives the per-row answer as an array, for ``checkify.check`` or a
``lax.cond`` inside jitted code.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, functional
from jattn import masks as masks_lib

__all__ = [
    "KVCache",
    "append",
    "attend",
    "capacity",
    "decode_mask",
    "fits",
    "init_cache",
    "update_and_attend",
]

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


def capacity(cache: KVCache) -> int:
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
) -> KVCache:
    """An empty cache: zero buffers and zero lengths.

    Args:
      batch_shape: the batch dims (an int for one batch axis, ``()`` for none).
      capacity: positions per row: the most tokens (prompt plus generated) a row can hold.
      num_kv_heads: key/value heads.
      head_dim: width of each key head.
      v_head_dim: width of each value head; default ``head_dim``.
      dtype: dtype of the key/value buffers (appended chunks are cast to it).

    Returns:
      ``KVCache(keys [*batch_shape, capacity, num_kv_heads, head_dim], values [...,
      v_head_dim], lengths int32 [*batch_shape])``.
    """
    try:
        batch_shape = (batch_shape,) if isinstance(batch_shape, int) else tuple(batch_shape)
    except TypeError:
        raise TypeError(
            f"batch_shape must be an int or a tuple of ints (the batch dims), got {batch_shape!r}."
        ) from None
    for i, d in enumerate(batch_shape):
        _checks.size(d, f"batch_shape[{i}]")
    capacity = _checks.size(capacity, "capacity")
    num_kv_heads = _checks.size(num_kv_heads, "num_kv_heads")
    head_dim = _checks.size(head_dim, "head_dim")
    v_head_dim = head_dim if v_head_dim is None else _checks.size(v_head_dim, "v_head_dim")
    dtype = _checks.float_dtype(dtype, "dtype")
    return KVCache(
        keys=jnp.zeros((*batch_shape, capacity, num_kv_heads, head_dim), dtype),
        values=jnp.zeros((*batch_shape, capacity, num_kv_heads, v_head_dim), dtype),
        lengths=jnp.zeros(batch_shape, jnp.int32),
    )


def _check_cache(cache) -> KVCache:
    if not isinstance(cache, KVCache):
        raise TypeError(
            f"cache must be a jattn.kvcache.KVCache (from init_cache), got {type(cache).__name__}."
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


def fits(cache: KVCache, num_new) -> Array:
    """Bool ``[batch...]``: whether appending ``num_new`` real tokens per row fits in ``cache``.

    Works under ``jax.jit``, e.g. ``checkify.check(jnp.all(fits(cache, n)), "cache full")``.
    """
    cache = _check_cache(cache)
    num_new = jnp.asarray(num_new)
    if not jnp.issubdtype(num_new.dtype, jnp.integer):
        raise TypeError(f"num_new must hold integers, got dtype {num_new.dtype}.")
    return cache.lengths + num_new.astype(jnp.int32) <= capacity(cache)


def append(cache: KVCache, key, value, *, num_new=None) -> KVCache:
    """Writes a chunk of keys and values at the end of each row.

    Row ``b``'s real tokens (the first ``num_new[b]`` of the chunk) go to positions
    ``lengths[b] ... lengths[b] + num_new[b] - 1``; padding tokens are not written.

    Args:
      cache: a :class:`KVCache`.
      key: ``[batch..., T, num_kv_heads, head_dim]``, ``T >= 1``.
      value: ``[batch..., T, num_kv_heads, v_head_dim]``.
      num_new: int ``[batch...]`` (or a scalar): real tokens per row, in ``[0, T]``;
        default ``T`` for every row.

    Returns:
      The updated cache (``lengths + num_new``, capped at the capacity under jit).

    Raises:
      ValueError: shapes that do not match the cache; ``num_new`` outside ``[0, T]``; and,
        when the lengths are concrete, a chunk that does not fit (see the module docstring
        for what happens under jit).
    """
    cache = _check_cache(cache)
    key, value = _checks.float_array(key, "key"), _checks.float_array(value, "value")
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
    if _checks.is_host_value(cache.lengths) and _checks.is_host_value(num_new):
        ends = np.asarray(cache.lengths) + np.asarray(num_new)
        if ends.size and ends.max() > cap:
            raise ValueError(
                f"KV cache overflow: rows with lengths {np.asarray(cache.lengths).tolist()} "
                f"cannot take {np.asarray(num_new).tolist()} more tokens; the capacity is {cap}. "
                "Build the cache with a larger capacity (Linen: init with a longer input; NNX: "
                "init_cache with a longer input_shape), or generate fewer tokens."
            )

    n = int(np.prod(batch_shape, dtype=np.int64))
    t = jnp.arange(chunk_len, dtype=jnp.int32)[None, :]  # [1, T]
    # [B, T]: where each chunk token goes; padding and overflow get index `cap`, which
    # mode="drop" discards, so a write can never clamp onto (and clobber) a real entry.
    starts = cache.lengths.reshape(n, 1)
    dest = jnp.where(t < num_new.reshape(n, 1), starts + t, cap)
    rows = jnp.arange(n)[:, None]

    def write(buf, x):
        # [B, capacity, K, D] <- [B, T, K, D] at (rows, dest)
        flat = buf.reshape(n, *buf.shape[-3:])
        flat = flat.at[rows, dest].set(x.reshape(n, *x.shape[-3:]).astype(buf.dtype), mode="drop")
        return flat.reshape(buf.shape)

    return KVCache(
        keys=write(cache.keys, key),
        values=write(cache.values, value),
        lengths=jnp.minimum(cache.lengths + num_new, cap).astype(jnp.int32),
    )


def _mask_options(is_causal, local_window_size, causal, window, where: str):
    """``(is_causal, (left, right) or None)``, from the current names or the deprecated ones."""
    is_causal = _checks.renamed(is_causal, causal, "is_causal", "causal", where)
    _checks.flag(is_causal, "is_causal")
    if window is not None:
        if local_window_size is not None:
            raise TypeError(f"{where}: pass local_window_size only (window is its old name).")
        local_window_size = (
            _checks.renamed(None, window, "local_window_size", "window", where),
            None,
        )
    if local_window_size is None:
        return is_causal, None
    return is_causal, _checks.window(local_window_size, open_right=True)


def decode_mask(
    starts,
    lengths,
    q_len: int,
    kv_len: int,
    *,
    num_new=None,
    is_causal: bool = True,
    local_window_size: int | tuple[int, int | None] | None = None,
    causal: bool | None = None,
    window: int | None = None,
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
      causal: deprecated name of ``is_causal``.
      window: deprecated: ``window=n`` is ``local_window_size=(n, None)``.
    """
    is_causal, window = _mask_options(is_causal, local_window_size, causal, window, "decode_mask")
    starts, lengths = jnp.asarray(starts), jnp.asarray(lengths)
    for name, x in (("starts", starts), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must hold integers (token counts), got dtype {x.dtype}.")
    if starts.shape != lengths.shape:
        raise ValueError(
            f"starts must have the batch shape {lengths.shape} (one length per row), got "
            f"{starts.shape}."
        )
    starts = starts.astype(jnp.int32)
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
    real = jnp.minimum(
        _num_new(num_new, starts.shape, q_len), jnp.maximum(kv_len - starts, 0)
    ).astype(jnp.int32)
    parts.append(masks_lib.padding_mask_from_lengths(query_lengths=real, q_len=q_len))
    return masks_lib.combine_masks(*parts)


def attend(
    cache: KVCache,
    query,
    *,
    starts,
    num_new=None,
    mask=None,
    is_causal: bool = True,
    local_window_size: int | tuple[int, int | None] | None = None,
    causal: bool | None = None,
    window: int | None = None,
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
      causal: deprecated name of ``is_causal``.
      window: deprecated: ``window=n`` is ``local_window_size=(n, None)``.
      **attention_kwargs: other keywords of :func:`jattn.dot_product_attention`
        (``scale``, ``dtype``, ``precision``, ``dropout_rate``, ``dropout_rng``,
        ``deterministic``, ``broadcast_dropout``, ``module``, ``return_weights``, ...).

    Returns:
      ``[batch..., T, num_heads, v_head_dim]`` (and the weights
      ``[batch..., num_heads, T, capacity]`` with ``return_weights=True``); padding and
      overflowed queries give zeros.
    """
    cache = _check_cache(cache)
    is_causal, window = _mask_options(is_causal, local_window_size, causal, window, "attend")
    clash = sorted(set(attention_kwargs) & set(_OWN_MASK_ARGS))
    if clash:
        raise TypeError(
            f"attend() builds the decoding mask itself; do not pass {clash}. Use is_causal=, "
            "local_window_size= or mask= instead."
        )
    query = jnp.asarray(query)
    if query.ndim != cache.keys.ndim or query.shape[:-3] != cache.keys.shape[:-3]:
        raise ValueError(
            f"query must have shape [*{cache.keys.shape[:-3]}, T, num_heads, head_dim] to match "
            f"the cache, got {query.shape}."
        )
    decoding = decode_mask(
        starts,
        cache.lengths,
        query.shape[-3],
        capacity(cache),
        num_new=num_new,
        is_causal=is_causal,
        local_window_size=window,
    )
    return functional.dot_product_attention(
        query,
        cache.keys,
        cache.values,
        mask=masks_lib.combine_masks(decoding, mask),
        **attention_kwargs,
    )


def update_and_attend(
    cache: KVCache,
    query,
    key,
    value,
    *,
    num_new=None,
    mask=None,
    is_causal: bool = True,
    local_window_size: int | tuple[int, int | None] | None = None,
    causal: bool | None = None,
    window: int | None = None,
    **attention_kwargs,
):
    """Appends a chunk's keys and values, then attends its queries: one decoding step.

    Args:
      cache: a :class:`KVCache`.
      query: ``[batch..., T, num_heads, head_dim]``.
      key: ``[batch..., T, num_kv_heads, head_dim]``.
      value: ``[batch..., T, num_kv_heads, v_head_dim]``.
      num_new, mask, is_causal, local_window_size, causal, window: as :func:`attend`.
      **attention_kwargs: as :func:`attend`.

    Returns:
      ``(output, cache)``: the attention output as :func:`attend` (a pair with
      ``return_weights``) and the updated cache.
    """
    cache = _check_cache(cache)
    is_causal, window = _mask_options(
        is_causal, local_window_size, causal, window, "update_and_attend"
    )
    starts = cache.lengths
    cache = append(cache, key, value, num_new=num_new)
    out = attend(
        cache,
        query,
        starts=starts,
        num_new=num_new,
        mask=mask,
        is_causal=is_causal,
        local_window_size=window,
        **attention_kwargs,
    )
    return out, cache
