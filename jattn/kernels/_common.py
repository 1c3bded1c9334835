"""What the kernel adapters share: refusals every kernel makes, batch flattening, padding."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jattn import _prng, masks
from jattn._call import Operands, Settings
from jattn.kernels._contract import KernelQuery

Array = jax.Array


def common_obstacle(query: KernelQuery, *, dtypes: tuple[str, ...], kernel: str) -> str | None:
    """The options no fused kernel behind jattn takes, and the dtypes ``kernel`` computes in.

    Args:
      query: the call (:class:`jattn.kernels.KernelQuery`).
      dtypes: the dtype names the kernel accepts (e.g. ``("bfloat16", "float32")``).
      kernel: the kernel's name, for the message.

    Returns:
      None, or the first option the kernel lacks, phrased to follow "cannot honour this
      call: ".
    """
    if query.return_weights:
        return "return_weights=True and module= need the full [q_len, kv_len] weight matrix"
    if query.has_mask:
        return "a mask array (only causal, window, lengths and segment ids are built in)"
    if query.has_bias:
        return "a bias array"
    if query.dropout:
        return "dropout (jattn's explicit-key dropout lives in its own paths)"
    name = jnp.dtype(query.dtype).name
    if name not in dtypes:
        return f"dtype {name} ({kernel} computes in {' or '.join(dtypes)})"
    return None


def dropout_row_starts(ops: Operands, settings: Settings, n: int, heads: int, q_len: int):
    """uint32 ``[N|1, H|1]``: the dropout mask's row of each (flat batch row, head)'s first
    query (:func:`jattn._prng.row_starts`): the caller's numbering when the call is one
    device's share of a larger one (``ops.dropout_rows``), else this call's own."""
    if ops.dropout_rows is not None:
        return ops.dropout_rows.reshape(n, heads)
    return _prng.row_starts(n, heads, q_len, settings.dropout_shared)


def flatten_batch(x: Array, tail_ndim: int) -> tuple[Array, tuple[int, ...]]:
    """``[batch..., *tail] -> [B, *tail]`` with ``B = prod(batch)``; returns the batch shape too."""
    batch_shape = x.shape[: x.ndim - tail_ndim]
    return x.reshape(math.prod(batch_shape), *x.shape[x.ndim - tail_ndim :]), batch_shape


def unflatten_batch(x: Array, batch_shape: tuple[int, ...]) -> Array:
    """``[B, *tail] -> [batch..., *tail]``, the inverse of :func:`flatten_batch`."""
    return x.reshape(*batch_shape, *x.shape[1:])


def flat_or_none(x: Array | None, tail_ndim: int) -> Array | None:
    """:func:`flatten_batch` for an optional array, dropping the batch shape."""
    return None if x is None else flatten_batch(x, tail_ndim)[0]


def pad_axis(x: Array, axis: int, length: int, value=0) -> Array:
    """Pads ``x`` at the end of ``axis`` to ``length`` with ``value`` (no copy when equal)."""
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def first_occurrence(ids: Array) -> Array:
    """For each position, the first position of its row holding the same id.

    Args:
      ids: int ``[B, T]``.

    Returns:
      int32 ``[B, T]``: ``out[b, t] = min{s : ids[b, s] == ids[b, t]}``, in O(T log T)
      (a stable sort groups equal ids with their first position leading).
    """
    t = ids.shape[-1]
    order = jnp.argsort(ids, axis=-1, stable=True)  # [B, T]
    sorted_ids = jnp.take_along_axis(ids, order, axis=-1)
    starts = jnp.concatenate(
        [jnp.ones_like(sorted_ids[:, :1], bool), sorted_ids[:, 1:] != sorted_ids[:, :-1]], axis=-1
    )
    # The sorted position where each run of equal ids starts, carried along the run.
    position = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), ids.shape)
    run_start = lax.cummax(jnp.where(starts, position, 0), axis=1)
    first_sorted = jnp.take_along_axis(order, run_start, axis=-1).astype(jnp.int32)
    # Scatter back from sorted order to the original positions.
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros(ids.shape, jnp.int32).at[rows, order].set(first_sorted)


def lengths_valid(lengths: Array | None, length: int) -> Array | None:
    """int ``[B]`` lengths -> bool ``[B, length]``, True before the length (None stays None)."""
    if lengths is None:
        return None
    return jnp.arange(length, dtype=jnp.int32)[None, :] < lengths[:, None]


def zero_invalid_rows(out: Array, lse: Array | None, valid: Array | None):
    """Clears the rows where ``valid [B, T]`` is False, as jattn's own paths give them.

    The output ``[B, T, H, Dv]`` gets zeros there and the lse ``[B, H, T]``
    :func:`jattn.large_negative` (the dense and blockwise paths' log-sum-exp of a row that
    attends nothing). A ``where`` (not a multiply) so that the rows' cotangents are exactly
    zero whatever the kernel computed there.
    """
    if valid is None:
        return out, lse
    out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    if lse is not None:
        lse = jnp.where(valid[:, None, :], lse, masks.large_negative(lse.dtype))
    return out, lse
