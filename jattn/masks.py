"""Pure attention-mask builders.

Every mask here is a boolean array where ``True`` means *attend* and ``False``
means *hide*. Masks are built from iota (``jnp.arange``) on the fly, so there is
no stored buffer (the book registers one in PyTorch; JAX needs none), and every
builder works under ``jax.jit`` as long as its *sizes* are static Python ints.
Offsets and lengths may be traced arrays.

All masks broadcast against attention logits of shape
``[batch..., num_heads, q_len, kv_len]``:

* position masks (causal, sliding window) have shape ``[q_len, kv_len]``;
* per-example masks (padding, segments) have shape ``[batch..., 1, q_len, kv_len]``
  (or ``1`` in place of a length that was not given).

Combine them with :func:`combine_masks` (logical AND) and turn them into an
additive bias with :func:`mask_to_bias` when an API wants a bias instead.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jattn import _checks

__all__ = [
    "causal_mask",
    "combine_masks",
    "large_negative",
    "lengths_to_valid",
    "mask_to_bias",
    "padding_mask",
    "padding_mask_from_lengths",
    "segment_mask",
    "sliding_window_mask",
]


def _expand_rank(x, ndim: int):
    """Leading singleton axes up to rank ``ndim`` (explicit, for rank promotion 'raise')."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


def _positions(q_len: int, kv_len: int | None, offset):
    q_len = _checks.size(q_len, "q_len")
    kv_len = q_len if kv_len is None else _checks.size(kv_len, "kv_len")
    offset = jnp.asarray(offset)
    if not jnp.issubdtype(offset.dtype, jnp.integer):
        raise TypeError(f"offset must be an int or an int array, got dtype {offset.dtype}.")
    # [.., q_len, 1] and [.., 1, kv_len]: the query position, shifted by `offset` (which may
    # carry batch dims, e.g. [batch..., 1, 1]), against key positions.
    rank = max(2, offset.ndim)
    q_pos = _expand_rank(jnp.arange(q_len)[:, None], rank) + _expand_rank(
        offset.astype(jnp.int32), rank
    )
    kv_pos = _expand_rank(jnp.arange(kv_len)[None, :], rank)
    return q_pos, kv_pos


def causal_mask(q_len: int, kv_len: int | None = None, *, offset=0) -> jnp.ndarray:
    """Causal mask: query ``i`` may attend key ``j`` iff ``j <= i + offset``.

    ``offset=0`` is the chapter's ``torch.tril`` (aligned top-left). With a KV cache
    the queries are the *last* ``q_len`` of ``kv_len`` positions, so use
    ``offset = kv_len - q_len`` (aligned bottom-right); :func:`jattn.masks.causal_mask`
    accepts a traced ``offset`` for that case.

    Args:
      q_len: number of query positions (static int >= 1).
      kv_len: number of key positions (static int >= 1); defaults to ``q_len``.
      offset: int or int array; shifts the diagonal right by this many keys.

    Returns:
      Boolean ``[q_len, kv_len]`` array, True = attend.
    """
    q_pos, kv_pos = _positions(q_len, kv_len, offset)
    return kv_pos <= q_pos


def sliding_window_mask(
    q_len: int,
    kv_len: int | None = None,
    *,
    local_window_size: int | tuple[int, int | None] | None = None,
    offset=0,
) -> jnp.ndarray:
    """Local attention: query ``i`` sees keys ``i+offset-left ... i+offset+right``.

    ``local_window_size`` has the meaning it has in :func:`jattn.dot_product_attention`
    and ``jax.nn.dot_product_attention``: ``(left, right)``, or an int ``n`` for
    ``(n, n)``. ``(left, 0)`` is causal attention restricted to the last ``left`` keys
    before the query (and the query itself); ``right=None`` means no limit on the right.

    Args:
      q_len: number of query positions (static int >= 1).
      kv_len: number of key positions; defaults to ``q_len``.
      local_window_size: ``(left, right)`` keys visible before and after the (shifted)
        query position (ints >= 0; ``right`` may be None), or an int for both.
      offset: int or int array; shifts the window like :func:`causal_mask`'s offset.

    Returns:
      Boolean ``[q_len, kv_len]`` array, True = attend.
    """
    if local_window_size is None:
        raise TypeError(
            "sliding_window_mask needs local_window_size: (left, right) keys visible before "
            "and after each query (e.g. (128, 0) for a causal window of 128)."
        )
    left, right = _checks.window(local_window_size, open_right=True)
    q_pos, kv_pos = _positions(q_len, kv_len, offset)
    mask = kv_pos >= q_pos - left
    if right is not None:
        mask = mask & (kv_pos <= q_pos + right)
    return mask


def lengths_to_valid(lengths, max_len: int) -> jnp.ndarray:
    """Turns sequence lengths ``[batch...]`` into a valid-token array ``[batch..., max_len]``.

    Position ``t`` of row ``b`` is valid (True) iff ``t < lengths[b]``.
    """
    max_len = _checks.size(max_len, "max_len")
    lengths = _checks.int_array(lengths, "lengths")
    # [batch..., max_len] < [batch..., 1]
    return _expand_rank(jnp.arange(max_len), lengths.ndim + 1) < lengths[..., None]


def _check_valid(valid, name: str) -> jnp.ndarray:
    valid = jnp.asarray(valid)
    if valid.dtype != jnp.bool_:
        raise TypeError(
            f"{name} must be a boolean array [batch..., length] (True = real token), got dtype "
            f"{valid.dtype}. For lengths use padding_mask_from_lengths or lengths_to_valid."
        )
    if valid.ndim < 1:
        raise ValueError(f"{name} must have shape [batch..., length], got a scalar.")
    return valid


def padding_mask(query_valid=None, key_valid=None) -> jnp.ndarray | None:
    """Padding mask from boolean "real token" arrays.

    A query position that is padding attends nothing (its row is fully masked, so
    attention returns zeros there); a key position that is padding is attended by
    no query.

    Args:
      query_valid: bool ``[batch..., q_len]`` or None (all queries are real).
      key_valid: bool ``[batch..., kv_len]`` or None (all keys are real).

    Returns:
      Boolean ``[batch..., 1, q_len or 1, kv_len or 1]``, or None when both are None.
    """
    if query_valid is None and key_valid is None:
        return None
    mask = None
    if query_valid is not None:
        # [batch..., 1, q_len, 1]
        mask = _check_valid(query_valid, "query_valid")[..., None, :, None]
    if key_valid is not None:
        # [batch..., 1, 1, kv_len]
        kv = _check_valid(key_valid, "key_valid")[..., None, None, :]
        mask = kv if mask is None else combine_masks(mask, kv)
    return mask


def padding_mask_from_lengths(
    query_lengths=None,
    key_lengths=None,
    *,
    q_len: int | None = None,
    kv_len: int | None = None,
) -> jnp.ndarray | None:
    """Padding mask from sequence lengths: :func:`padding_mask` of :func:`lengths_to_valid`.

    Args:
      query_lengths: int ``[batch...]`` real query tokens per row, or None.
      key_lengths: int ``[batch...]`` real key tokens per row, or None.
      q_len: padded query length; required with ``query_lengths``.
      kv_len: padded key length; required with ``key_lengths``.

    Returns:
      Boolean ``[batch..., 1, q_len or 1, kv_len or 1]``, or None when no lengths are given.
    """
    q_valid = kv_valid = None
    if query_lengths is not None:
        if q_len is None:
            raise ValueError("q_len is required with query_lengths (the padded query length).")
        q_valid = lengths_to_valid(query_lengths, q_len)
    if key_lengths is not None:
        if kv_len is None:
            raise ValueError("kv_len is required with key_lengths (the padded key length).")
        kv_valid = lengths_to_valid(key_lengths, kv_len)
    return padding_mask(q_valid, kv_valid)


def segment_mask(query_segment_ids, key_segment_ids=None) -> jnp.ndarray:
    """Mask for packed sequences: a token attends only tokens of its own segment.

    Args:
      query_segment_ids: int ``[batch..., q_len]``.
      key_segment_ids: int ``[batch..., kv_len]``; defaults to ``query_segment_ids``.

    Returns:
      Boolean ``[batch..., 1, q_len, kv_len]``.
    """
    q = jnp.asarray(query_segment_ids)
    k = q if key_segment_ids is None else jnp.asarray(key_segment_ids)
    for name, ids in (("query_segment_ids", q), ("key_segment_ids", k)):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must hold integers, got dtype {ids.dtype}.")
        if ids.ndim < 1:
            raise ValueError(f"{name} must have shape [batch..., length], got a scalar.")
    if q.shape[:-1] != k.shape[:-1]:
        raise ValueError(
            f"query_segment_ids and key_segment_ids must share batch dims, got "
            f"{q.shape[:-1]} and {k.shape[:-1]}."
        )
    # [batch..., 1, q_len, kv_len]
    return (q[..., :, None] == k[..., None, :])[..., None, :, :]


def combine_masks(*masks) -> jnp.ndarray | None:
    """Logical AND of masks of any broadcast-compatible shapes; None entries are skipped.

    Each mask is read as :func:`jattn.dot_product_attention` reads ``mask=``: boolean
    (True = attend), or numeric 0/1 (flax's float masks); other values (additive masks)
    and the book's ``triu`` buffer (True = hide) are refused. Masks of different ranks
    broadcast numpy-style (aligned on the right), so a ``[q, kv]`` causal mask combines
    with a ``[batch, 1, q, kv]`` padding mask.

    Returns:
      The combined boolean mask, or None when every argument is None.
    """
    present = [
        _checks.mask_array(m, f"combine_masks argument {i}")
        for i, m in enumerate(masks)
        if m is not None
    ]
    if not present:
        return None
    try:
        np.broadcast_shapes(*(m.shape for m in present))
    except ValueError:
        shapes = ", ".join(str(m.shape) for m in present)
        raise ValueError(f"combine_masks: mask shapes do not broadcast: {shapes}.") from None
    rank = max(m.ndim for m in present)
    out = _expand_rank(present[0], rank)
    for m in present[1:]:
        out = jnp.logical_and(out, _expand_rank(m, rank))
    return out


def large_negative(dtype=jnp.float32) -> jnp.ndarray:
    """jattn's finite large negative in ``dtype``: the bias :func:`mask_to_bias` gives a
    hidden key and the log-sum-exp of a row that attends nothing (never -inf, so no NaN
    appears). The attention paths themselves hide keys with ``-inf`` and shift each row by
    its largest visible logit, so visible logits below this value still count.

    ``-0.7 * finfo(dtype).max``, capped at float32's range because the softmax runs in float32.
    """
    dtype = _checks.float_dtype(dtype)
    big = min(float(jnp.finfo(dtype).max), float(jnp.finfo(jnp.float32).max))
    return jnp.asarray(-0.7 * big, dtype=dtype)


def mask_to_bias(mask, dtype=jnp.float32) -> jnp.ndarray:
    """Turns a boolean mask into an additive bias: 0 where True, a large finite negative where False."""
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend), got dtype {mask.dtype}.")
    return jnp.where(mask, jnp.zeros((), dtype), large_negative(dtype))
