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

import operator

import jax
import jax.numpy as jnp
import numpy as np

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


def _check_size(value, name: str, *, allow_zero: bool = False) -> int:
    """Returns ``value`` as an int, or raises a clear error."""
    try:
        size = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a Python int (a static size), got {type(value).__name__} {value!r}. "
            "Sizes decide array shapes, so they cannot be traced values; pass e.g. x.shape[-2]."
        ) from None
    if size < 0 or (size == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{name} must be {bound}, got {size}.")
    return size


def _check_float_dtype(dtype, name: str = "dtype"):
    """``dtype`` as a numpy dtype, or a clear error: not a dtype, not floating, or float64
    while ``jax_enable_x64`` is off (JAX would silently compute in float32)."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{name} must be a floating dtype such as jnp.float32 or jnp.bfloat16, got {dtype!r}."
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {dtype}.")
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ValueError(
            f"{name}={dtype} needs 64-bit mode, which is off: enable it with "
            "jax.config.update('jax_enable_x64', True) (or `with jax.enable_x64(True):`), or "
            "use float32."
        )
    return dtype


def _positions(q_len: int, kv_len: int | None, offset):
    q_len = _check_size(q_len, "q_len")
    kv_len = q_len if kv_len is None else _check_size(kv_len, "kv_len")
    offset = jnp.asarray(offset)
    if not jnp.issubdtype(offset.dtype, jnp.integer):
        raise TypeError(f"offset must be an int or an int array, got dtype {offset.dtype}.")
    # [q_len, 1] and [1, kv_len]: the query position, shifted by `offset`, against key positions.
    q_pos = jnp.arange(q_len)[:, None] + offset.astype(jnp.int32)
    kv_pos = jnp.arange(kv_len)[None, :]
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
    window_left: int,
    window_right: int | None = 0,
    offset=0,
) -> jnp.ndarray:
    """Local attention: query ``i`` sees keys ``i+offset-window_left ... i+offset+window_right``.

    With the default ``window_right=0`` this is causal attention restricted to the
    last ``window_left`` keys before the query (and the query itself). ``window_right=None``
    means no limit on the right. Same semantics as ``local_window_size=(left, right)``
    in ``jax.nn.dot_product_attention``.

    Args:
      q_len: number of query positions (static int >= 1).
      kv_len: number of key positions; defaults to ``q_len``.
      window_left: how many keys before the (shifted) query position are visible (int >= 0).
      window_right: how many keys after it are visible (int >= 0), or None for all.
      offset: int or int array; shifts the window like :func:`causal_mask`'s offset.

    Returns:
      Boolean ``[q_len, kv_len]`` array, True = attend.
    """
    window_left = _check_size(window_left, "window_left", allow_zero=True)
    q_pos, kv_pos = _positions(q_len, kv_len, offset)
    mask = kv_pos >= q_pos - window_left
    if window_right is not None:
        window_right = _check_size(window_right, "window_right", allow_zero=True)
        mask = mask & (kv_pos <= q_pos + window_right)
    return mask


def lengths_to_valid(lengths, max_len: int) -> jnp.ndarray:
    """Turns sequence lengths ``[batch...]`` into a valid-token array ``[batch..., max_len]``.

    Position ``t`` of row ``b`` is valid (True) iff ``t < lengths[b]``.
    """
    max_len = _check_size(max_len, "max_len")
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}.")
    return jnp.arange(max_len) < lengths[..., None]


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
    """Logical AND of boolean masks of any broadcast-compatible shapes; None entries are skipped.

    Masks of different ranks broadcast numpy-style (aligned on the right), so a
    ``[q, kv]`` causal mask combines with a ``[batch, 1, q, kv]`` padding mask.

    Returns:
      The combined boolean mask, or None when every argument is None.
    """
    present = [jnp.asarray(m) for m in masks if m is not None]
    if not present:
        return None
    for i, m in enumerate(present):
        if m.dtype != jnp.bool_:
            raise TypeError(
                f"combine_masks takes boolean masks (True = attend); argument {i} has dtype "
                f"{m.dtype}. Convert with `mask.astype(bool)` or build it with jattn.masks."
            )
    try:
        np.broadcast_shapes(*(m.shape for m in present))
    except ValueError:
        shapes = ", ".join(str(m.shape) for m in present)
        raise ValueError(f"combine_masks: mask shapes do not broadcast: {shapes}.") from None
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


def large_negative(dtype=jnp.float32) -> jnp.ndarray:
    """The finite value used for hidden logits in ``dtype`` (never -inf, so no NaN appears).

    ``-0.7 * finfo(dtype).max``, capped at float32's range because the softmax runs in float32.
    """
    dtype = _check_float_dtype(dtype)
    big = min(float(jnp.finfo(dtype).max), float(jnp.finfo(jnp.float32).max))
    return jnp.asarray(-0.7 * big, dtype=dtype)


def mask_to_bias(mask, dtype=jnp.float32) -> jnp.ndarray:
    """Turns a boolean mask into an additive bias: 0 where True, a large finite negative where False."""
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend), got dtype {mask.dtype}.")
    return jnp.where(mask, jnp.zeros((), dtype), large_negative(dtype))
