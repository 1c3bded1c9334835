"""Packed variable-length sequences: rows of documents with segment ids, and a varlen entry.

Training on documents of different lengths wastes the padding of a ``[batch, max_len]``
batch. Packing puts several documents into one row and tells attention where each one
starts and ends, so none attends across a boundary:

* :func:`pack` ``(sequences, row_length)`` -> a :class:`Packed` of token rows, segment
  ids (``1, 2, ...`` per document within a row, ``0`` for the padding at a row's end) and
  per-document positions (each document starts at 0, so RoPE and GPT-2's learned
  positions restart per document); :func:`unpack` takes the rows (or anything computed
  per token from them, such as logits) back to one array per sequence.
* :func:`positions_from_segment_ids` gives those positions for segment ids from
  elsewhere (a new document wherever the id changes).
* :func:`varlen_attention` is FlashAttention's ``flash_attn_varlen_func`` convention:
  the sequences concatenated on one token axis ``[total_tokens, heads, head_dim]`` and
  described by their cumulative lengths ``cu_seqlens = [0, n_0, n_0 + n_1, ...]``. It
  runs :func:`jattn.dot_product_attention` with segment ids made from ``cu_seqlens``, so
  the blockwise path skips every tile that lies across two sequences.

``pack`` and ``unpack`` run on the host (numpy), where a data pipeline builds batches;
the arrays they return feed a jitted step as they are, and with ``num_rows=`` every batch
has the same shape (one compilation).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _util, functional, mods

__all__ = ["Packed", "pack", "positions_from_segment_ids", "unpack", "varlen_attention"]

Array = jax.Array


class Packed(NamedTuple):
    """Documents packed into rows (from :func:`pack`); numpy arrays.

    Attributes:
      tokens: int32 ``[num_rows, row_length]``: the documents back to back, then ``pad_id``.
      segment_ids: int32 ``[num_rows, row_length]``: ``1, 2, ...`` for the documents of a
        row in order, ``0`` for its padding (``segment_ids > 0`` marks the real tokens).
      positions: int32 ``[num_rows, row_length]``: each token's position in its own
        document (``0 ... n-1``); ``0`` for padding.
      rows: int32 ``[num_sequences]``: the row each input sequence went to.
      starts: int32 ``[num_sequences]``: where it starts in that row.
      lengths: int32 ``[num_sequences]``: its length.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    rows: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


_INT32 = np.iinfo(np.int32)


def _check_size(value, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
    return int(value)


def _as_sequences(sequences) -> list[np.ndarray]:
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
        raise TypeError(
            "sequences must be a list of 1-D integer token arrays (or lists of ints), got "
            f"{type(sequences).__name__}."
        )
    out = []
    for i, seq in enumerate(sequences):
        arr = np.asarray(seq)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"sequences[{i}] must be a non-empty 1-D array of integer token ids, got "
                f"dtype {arr.dtype}, shape {arr.shape}."
            )
        if not _INT32.min <= arr.min() <= arr.max() <= _INT32.max:  # no silent wrap-around
            raise ValueError(
                f"sequences[{i}] holds ids from {arr.min()} to {arr.max()}; packed rows are "
                "int32, so ids must fit in it."
            )
        out.append(arr)
    if not out:
        raise ValueError("sequences is empty: pack needs at least one sequence.")
    return out


def pack(sequences, row_length: int, *, num_rows: int | None = None, pad_id: int = 0) -> Packed:
    """Packs token sequences into rows of ``row_length`` tokens (first fit, in input order).

    Each sequence goes whole into the first row with room for it (a new row if none has),
    so documents are never split and the order within a row is the input order.

    Args:
      sequences: a list of 1-D integer token arrays (or lists), each 1 to ``row_length``
        tokens long.
      row_length: tokens per row.
      num_rows: pad the result to exactly this many rows (fixed shapes: one compilation
        for every batch); default as many rows as the sequences need.
      pad_id: the token id at the end of rows (its segment id is 0).

    Returns:
      a :class:`Packed`.

    Raises:
      TypeError: ``sequences`` not a list of sequences.
      ValueError: an empty or non-integer sequence, one longer than ``row_length``, bad
        sizes, or more rows needed than ``num_rows``.
    """
    seqs = _as_sequences(sequences)
    row_length = _check_size(row_length, "row_length")
    if (
        isinstance(pad_id, bool)
        or not isinstance(pad_id, numbers.Integral)
        or not _INT32.min <= pad_id <= _INT32.max
    ):
        raise ValueError(f"pad_id must be an int token id (int32), got {pad_id!r}.")
    for i, seq in enumerate(seqs):
        if seq.size > row_length:
            raise ValueError(
                f"sequences[{i}] has {seq.size} tokens, more than row_length={row_length}; "
                "split long documents into chunks of at most row_length tokens first."
            )
    fill: list[int] = []  # tokens used per row so far
    rows, starts = [], []
    for seq in seqs:
        row = next((r for r, used in enumerate(fill) if used + seq.size <= row_length), None)
        if row is None:
            row = len(fill)
            fill.append(0)
        rows.append(row)
        starts.append(fill[row])
        fill[row] += seq.size
    total_rows = len(fill)
    if num_rows is not None:
        num_rows = _check_size(num_rows, "num_rows")
        if total_rows > num_rows:
            raise ValueError(
                f"the sequences need {total_rows} rows of {row_length} tokens but num_rows="
                f"{num_rows}; pass fewer sequences per batch or a larger num_rows."
            )
        total_rows = num_rows
    tokens = np.full((total_rows, row_length), pad_id, np.int32)
    segment_ids = np.zeros((total_rows, row_length), np.int32)
    positions = np.zeros((total_rows, row_length), np.int32)
    next_segment = np.ones(total_rows, np.int32)
    for seq, row, start in zip(seqs, rows, starts, strict=True):
        span = slice(start, start + seq.size)
        tokens[row, span] = seq
        segment_ids[row, span] = next_segment[row]
        positions[row, span] = np.arange(seq.size)
        next_segment[row] += 1
    lengths = np.array([s.size for s in seqs], np.int32)
    rows, starts = np.array(rows, np.int32), np.array(starts, np.int32)
    return Packed(tokens, segment_ids, positions, rows, starts, lengths)


def unpack(packed: Packed, values=None) -> list:
    """One array per packed sequence, in the order given to :func:`pack`.

    Args:
      packed: the :class:`Packed` the rows came from.
      values: ``[num_rows, row_length, ...]`` per-token values of the packed rows (e.g.
        a model's logits ``[num_rows, row_length, vocab]``); default ``packed.tokens``.

    Returns:
      a list with ``values[rows[i], starts[i] : starts[i] + lengths[i]]`` for sequence
      ``i`` (``[lengths[i], ...]``), the sequences themselves for the default.

    Raises:
      TypeError: ``packed`` not a :class:`Packed`.
      ValueError: ``values`` whose first two axes are not ``[num_rows, row_length]``.
    """
    if not isinstance(packed, Packed):
        raise TypeError(f"packed must be a jattn.Packed from jattn.pack, got {type(packed)}.")
    values = packed.tokens if values is None else values
    if not hasattr(values, "shape"):  # a nested list
        values = np.asarray(values)
    if tuple(values.shape[:2]) != packed.tokens.shape:
        raise ValueError(
            f"values must have shape [num_rows, row_length, ...] = "
            f"{(*packed.tokens.shape, '...')}, got {tuple(values.shape)}."
        )
    spans = zip(packed.rows.tolist(), packed.starts.tolist(), packed.lengths.tolist(), strict=True)
    return [values[r, s : s + n] for r, s, n in spans]


def positions_from_segment_ids(segment_ids) -> Array:
    """Each token's position in its document: 0 where the segment id changes, then counting.

    Args:
      segment_ids: int ``[batch..., T]``; a document is a run of equal ids (an id that
        comes back after another starts a new run at 0, while attention joins equal ids:
        the models refuse such rows unless given ``positions=``).

    Returns:
      int32 ``[batch..., T]``; for :func:`pack`'s segment ids, its ``positions`` (and
      ``0, 1, ...`` over a row's padding).
    """
    ids = _checks.int_array(segment_ids, "segment_ids")
    if ids.ndim < 1:
        raise ValueError(f"segment_ids must have shape [batch..., T], got {ids.shape}.")
    t = jnp.broadcast_to(jnp.arange(ids.shape[-1], dtype=jnp.int32), ids.shape)
    # [batch..., T]: True where a new document starts (always at t = 0)
    first = jnp.concatenate(
        [jnp.ones_like(ids[..., :1], bool), ids[..., 1:] != ids[..., :-1]], axis=-1
    )
    starts = jax.lax.cummax(jnp.where(first, t, 0), axis=ids.ndim - 1)
    return t - starts


# ----------------------------------------------------------------------------------------
# FlashAttention's varlen convention
# ----------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class _BottomRightCausal(mods.MaskMod):
    """Causal per sequence, aligned bottom-right when a sequence has more keys than queries:
    query ``i`` of a sequence with ``n_q`` queries and ``n_k`` keys sees keys
    ``j <= i + n_k - n_q`` (FlashAttention's varlen ``causal=True``)."""

    q_pos: Array  # int32 [total_q]: i + n_k - n_q of each query
    kv_pos: Array  # int32 [total_k]: j of each key

    def __call__(self, b, h, q_idx, kv_idx):
        del b, h
        return self.kv_pos[kv_idx] <= self.q_pos[q_idx]


def _check_cu_seqlens(cu, name: str, total: int) -> Array:
    cu = _checks.int_array(cu, name)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(
            f"{name} must be int [num_sequences + 1] = [0, n_0, n_0 + n_1, ...] (at least two "
            f"entries), got shape {cu.shape}."
        )
    if _checks.is_host_value(cu):
        c = np.asarray(cu)
        if c[0] != 0 or np.any(np.diff(c) < 0) or c[-1] > total:
            raise ValueError(
                f"{name} must start at 0, never decrease and end at most at the token count "
                f"({total}), got {c.tolist()}."
            )
    return cu.astype(jnp.int32)


def _cu_ok(cu: Array, total: int) -> Array:
    """The traced form of :func:`_check_cu_seqlens`' value check: a bool scalar."""
    return (cu[0] == 0) & jnp.all(cu[1:] >= cu[:-1]) & (cu[-1] <= total)


def _same_values(a: Array, b: Array) -> bool:
    """Whether two ``cu_seqlens`` are one array or equal concrete ones (False when
    either is traced)."""
    if a is b:
        return True
    hosts = _checks.is_host_value(a) and _checks.is_host_value(b)
    return hosts and bool(np.array_equal(np.asarray(a), np.asarray(b)))


def _segments(cu: Array, total: int, padding_id: int) -> tuple[Array, Array]:
    """``(segment ids [total], local positions [total])`` of the tokens described by ``cu``;
    tokens past ``cu[-1]`` get ``padding_id``."""
    t = jnp.arange(total, dtype=jnp.int32)
    seg = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    seg_c = jnp.minimum(seg, cu.shape[0] - 2)
    return jnp.where(t < cu[-1], seg, padding_id), t - cu[seg_c]


def _check_varlen(
    query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, local_window_size, implementation
) -> tuple[Array, Array, bool]:
    """:func:`varlen_attention`'s own checks: ``(cu_q, cu_k, self_attention)``."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if jnp.ndim(x) != 3:
            raise ValueError(
                f"varlen_attention: {name} must be [total_tokens, heads, head_dim] (the "
                f"sequences concatenated, FlashAttention's varlen layout), got shape "
                f"{jnp.shape(x)}. For batched [batch, T, heads, head_dim] inputs use "
                "jattn.dot_product_attention with query_segment_ids."
            )
    total_q, total_k = jnp.shape(query)[0], jnp.shape(key)[0]
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q)
    self_attention = cu_seqlens_k is None
    cu_k = cu_q if self_attention else _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k)
    if cu_k.shape != cu_q.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"shapes {cu_q.shape} and {cu_k.shape}."
        )
    if not self_attention and total_q == total_k and _same_values(cu_seqlens_q, cu_seqlens_k):
        self_attention = True  # FlashAttention's habit: cu_seqlens_q passed for both
    if self_attention and total_q != total_k:
        raise ValueError(
            f"query has {total_q} tokens and key {total_k}: pass cu_seqlens_k for the keys "
            "(cu_seqlens_q stands for both only when they are the same tokens)."
        )
    if local_window_size is not None and not self_attention:
        raise ValueError(
            "local_window_size needs self-attention (cu_seqlens_k not given, or equal to "
            "cu_seqlens_q): a window over "
            "the concatenated tokens is a window per sequence only when queries and keys are "
            "the same tokens."
        )
    _checks.flag(is_causal, "is_causal")
    if is_causal and not self_attention and implementation in _util.KERNELS:
        raise ValueError(
            f"varlen_attention: implementation={implementation!r} cannot run causal attention "
            "with cu_seqlens_k (aligned bottom-right per sequence, a mask function the kernel "
            "cannot take). Use implementation=None, 'blockwise' or 'dense'; for "
            "self-attention leave cu_seqlens_k out."
        )
    return cu_q, cu_k, self_attention


def _traced_check(given_q, cu_q: Array, given_k, cu_k: Array, total_q: int, total_k: int):
    """The value checks :func:`_check_cu_seqlens` could not run, in the program: a scalar
    to multiply the inputs and output by (1, or NaN for wrong cu_seqlens); None when
    every value was checked on the host."""
    ok = None
    for given, cu, total in ((given_q, cu_q, total_q), (given_k, cu_k, total_k)):
        if given is not None and not _checks.is_host_value(given):
            ok = _cu_ok(cu, total) if ok is None else ok & _cu_ok(cu, total)
    return None if ok is None else _checks.nan_unless(ok)


def varlen_attention(
    query,
    key,
    value,
    *,
    cu_seqlens_q,
    cu_seqlens_k=None,
    is_causal: bool = False,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    implementation=None,
):
    """Attention over sequences concatenated on one token axis (FlashAttention's varlen API).

    Sequence ``b`` holds queries ``cu_seqlens_q[b] ... cu_seqlens_q[b+1] - 1`` and keys
    ``cu_seqlens_k[b] ... cu_seqlens_k[b+1] - 1``; it attends only within itself. This is
    :func:`jattn.dot_product_attention` on a batch of one with segment ids made from the
    cumulative lengths, so every implementation's segment support applies (the blockwise
    path skips the tiles between sequences). Tokens past ``cu_seqlens[-1]`` (padding to a
    fixed total, for one compilation) attend nothing and get zero output.

    Args:
      query: ``[total_q, num_heads, head_dim]``.
      key: ``[total_k, num_kv_heads, head_dim]`` (``num_heads`` a multiple of
        ``num_kv_heads``).
      value: ``[total_k, num_kv_heads, v_head_dim]``.
      cu_seqlens_q: int ``[num_sequences + 1]``, ``[0, n_0, n_0 + n_1, ...]``: where each
        sequence's queries start (FlashAttention's ``cu_seqlens_q``).
      cu_seqlens_k: int ``[num_sequences + 1]`` for the keys; default ``cu_seqlens_q``
        (self-attention; ``cu_seqlens_q`` itself, or equal concrete values, count as it).
      is_causal: query ``i`` of a sequence sees its keys ``j <= i + n_k - n_q`` (top-left
        when ``n_q == n_k``; bottom-right otherwise, as FlashAttention >= 2.1).
      scale: multiplier of the logits; default ``1 / sqrt(head_dim)``.
      local_window_size: ``int`` or ``(left, right)`` as :func:`jattn.dot_product_attention`;
        self-attention only (``cu_seqlens_k`` not given, or equal to ``cu_seqlens_q``).
      dropout_rate, dropout_rng, deterministic, dtype, precision, implementation: as
        :func:`jattn.dot_product_attention`.

    Returns:
      ``[total_q, num_heads, v_head_dim]``.

    Raises:
      ValueError: inputs that are not ``[total, heads, head_dim]``, ``cu_seqlens`` that are
        not 1-D, do not start at 0, decrease, end past the token count or differ in the
        number of sequences; a window with ``cu_seqlens_k``; anything
        :func:`jattn.dot_product_attention` rejects. ``cu_seqlens`` whose values cannot be
        read (traced under ``jax.jit``, or on an accelerator) are checked in the program:
        wrong ones make the whole output NaN, and its gradients; an eager call with the
        same values names the mistake.
      TypeError: non-integer ``cu_seqlens``, non-float inputs.
    """
    cu_q, cu_k, self_attention = _check_varlen(
        query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, local_window_size,
        implementation,
    )  # fmt: skip
    total_q, total_k = jnp.shape(query)[0], jnp.shape(key)[0]
    factor = _traced_check(cu_seqlens_q, cu_q, cu_seqlens_k, cu_k, total_q, total_k)
    query, key, value = (_checks.with_factor(x, factor) for x in (query, key, value))
    q_seg, q_local = _segments(cu_q, total_q, -1)
    kv_seg, kv_local = _segments(cu_k, total_k, -2)  # padding queries and keys never meet
    mask_mod = None
    if is_causal and not self_attention:
        lengths = jnp.diff(cu_k) - jnp.diff(cu_q)  # [num_sequences]: n_k - n_q
        shift = lengths[jnp.clip(q_seg, 0, cu_q.shape[0] - 2)]
        mask_mod = _BottomRightCausal(q_local + shift, kv_local)
    out = functional.dot_product_attention(
        query[None],
        key[None],
        value[None],
        is_causal=bool(is_causal) and self_attention,
        scale=scale,
        local_window_size=local_window_size,
        query_segment_ids=q_seg[None],
        key_value_segment_ids=kv_seg[None],
        mask_mod=mask_mod,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        deterministic=deterministic,
        dtype=dtype,
        precision=precision,
        implementation=implementation,
    )
    return _checks.with_factor(out[0], factor)
