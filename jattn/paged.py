"""A paged KV cache: one page pool per layer, a page table and a length per sequence.

The contiguous :class:`jattn.kvcache.KVCache` holds ``batch x capacity`` positions whatever
each row uses. A :class:`PagedKVCache` holds a pool of fixed-size pages instead, shared by
every sequence, and a *page table* per sequence saying which pages hold its tokens (the
vLLM / FlashAttention ``page_table`` convention): position ``p`` of row ``b`` lives in page
``page_table[b, p // page_size]`` at offset ``p % page_size``. Pages are handed out as
tokens arrive and taken back when a sequence ends, so the memory in use follows the tokens
held; two sequences with one prompt can point at the same pages (prefix sharing).

* :class:`PagedKVCache` ``(k_pages, v_pages, page_table, lengths)``, a NamedTuple (a
  pytree, as :class:`jattn.kvcache.KVCache`).
* :func:`init_paged_cache` makes an empty one; :func:`append` writes a chunk at each row's
  end; :func:`gather` reads the pages back as a contiguous :class:`jattn.kvcache.KVCache`;
  :func:`update_and_attend` appends and attends, and is what the attention modules call
  when their cache is a paged one (:func:`jattn.kvcache.update_and_attend` dispatches here);
  :func:`fused` says whether a call runs the fused CPU paged kernel.

**Who owns the pages.** The arrays are pure data: which page a row gets is decided by the
caller (the host), which writes page ids into ``page_table`` before a step. An entry
outside ``[0, num_pages)`` (the default, ``num_pages``) is *unallocated*: a token that
would land there is not written, and reading it gives zeros. Rows that share a page must
not write to it (share only full pages). :func:`jattn.models.generate_many` is the
allocator: a free list, reference counts for shared prefixes, a slot per request.

**Cost follows the tokens held.** On CPU, with jattn's fused kernel built, a plain call
(causal or full attention; ``scale``, ``dtype``, ``implementation`` None or
``'cpu_fused'``; float32, bfloat16, float16 or int8 pages) of up to
:data:`FUSED_MAX_QUERIES` tokens per row (decoding, prefill chunks) attends through
:func:`jattn.kernels.cpu.paged_attention`, which reads each row's pages in place through
its page table (no gathered copy) and only up to the row's length: its cost follows the
tokens held, whatever the table's width or a ``blocks`` work list (ignored then);
:func:`fused` says whether a call takes it. Otherwise (another platform,
``implementation='xla'`` and the others, no kernel, longer chunks, whose arithmetic
outweighs the gather) a step attends over the
``page_table``'s width in pages, not over the pool: the caller passes
``page_table[:, :n]`` with ``n`` pages enough for the longest row (a few widths, e.g.
powers of two, so that a jitted step compiles a bounded number of times), and the step
gathers and attends ``n * page_size`` keys per row. With rows of very different lengths
that still makes every row pay for the longest: a work list (``cache.blocks``, from
:func:`block_list`) of ``(row, block)`` pairs makes the step gather and attend only the
blocks of :func:`block_size` positions each row holds, one batch entry per block, and
merge a row's blocks by their log-sum-exps (split-KV, as flash-decoding); its cost follows
the blocks listed. Calls with a mask, modifiers, sinks, a window, dropout or weights take
the page-table path instead.

**Attention** through the fused kernel is the softmax in float32 of the queries against
the row's written keys (causal per row, padding queries attend nothing, grouped-query
heads without repeating K/V), cast to the computation dtype (``dtype``, or the promoted
dtype of the query and the pages); its gradient is the XLA formulation's. Elsewhere,
attention over the gathered pages is :func:`jattn.kvcache.attend` on a contiguous
cache whose slot ``j`` holds position ``j``: the same mask, ``local_window_size``,
``score_mod``/``mask_mod`` at absolute positions, ``sinks`` and the other
:func:`jattn.dot_product_attention` keywords, so a paged step equals a contiguous one.
There is no rolling (modulo-capacity) mode: a paged cache frees memory by pages instead,
and a sliding window is ``local_window_size=(W, 0)``: once a row holds ``n`` tokens, the
table entries ``[0, (n - W) // page_size)`` are behind every later query's window and
may be freed (marked unallocated, their pages given to other rows).

**int8 pages** (``init_paged_cache(..., quantized=True)``): keys and values are stored
as int8 with one float32 scale per token and head (``max |x| / 127`` over ``head_dim``,
rounded to nearest), a quarter of float32's memory; reading dequantizes them to float32.
The attention error this adds is measured in ``tests/test_paged.py`` and
``benchmarks/bench_serving.py`` (the logits against float32 pages).

**Capacity.** A row holds ``page_table.shape[-1] * page_size`` positions. As with
:class:`jattn.kvcache.KVCache`, an eager call whose chunk does not fit raises a ValueError,
and so does one whose real tokens would land on an unallocated page. Under ``jax.jit``
tokens past the table are not written, ``lengths`` stops at the table's capacity, and
their queries attend nothing; tokens on unallocated pages are not written either, but
count in ``lengths`` and read back as zeros on every path.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _fused_cache, functional, kvcache

__all__ = [
    "FUSED_MAX_QUERIES",
    "PagedKVCache",
    "append",
    "block_list",
    "block_size",
    "capacity",
    "fused",
    "gather",
    "init_paged_cache",
    "page_size",
    "pages_needed",
    "update_and_attend",
]

Array = jax.Array


class PagedKVCache(NamedTuple):
    """A page pool and, per sequence, its page table and filled length.

    Attributes:
      k_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``: the key pool.
      v_pages: ``[num_pages, page_size, num_kv_heads, v_head_dim]``: the value pool.
      page_table: int32 ``[batch..., pages_per_seq]``: ``page_table[b, i]`` is the page
        holding positions ``i * page_size ... (i + 1) * page_size - 1`` of row ``b``; a
        value outside ``[0, num_pages)`` marks a page not allocated. Rows may share the
        pages they only read (a common prompt prefix); a chunk must not write a slot that
        another position holds (an eager call checks; under jit such writes race).
      lengths: int32 ``[batch...]``: positions filled in each row.
      k_scales: int8 pages only: float32 ``[num_pages, page_size, num_kv_heads]``, the
        scale of each stored key (``key = k_pages * k_scales``); None for float pages.
      v_scales: the same for the values.
      blocks: optional int32 ``[num_blocks, 2]``, a work list (split-KV attention, as
        flash-decoding): entry ``(row, j)`` stands for positions ``j * S ... (j + 1) * S - 1``
        of flattened row ``row``, ``S = block_size(page_size)``; a ``row`` outside
        ``[0, rows)`` is padding. With it, a step attends each listed block and merges the
        blocks of a row by their log-sum-exps, so its cost follows the blocks listed, not
        ``rows x pages_per_seq``; the list must hold every block of a row below its length
        after the chunk (:func:`block_list`; an eager call checks), and a row it leaves out
        entirely attends nothing. It describes one step: the cache a call returns has
        None. None: attend the whole page table.
    """

    k_pages: Array
    v_pages: Array
    page_table: Array
    lengths: Array
    k_scales: Array | None = None
    v_scales: Array | None = None
    blocks: Array | None = None


def page_size(cache: PagedKVCache) -> int:
    """Positions per page (a static int)."""
    return cache.k_pages.shape[1]


def capacity(cache: PagedKVCache) -> int:
    """Positions a row can hold through its page table: ``pages_per_seq * page_size``."""
    return cache.page_table.shape[-1] * page_size(cache)


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` positions: ``ceil(num_tokens / page_size)``."""
    return -(-num_tokens // page_size)


# Keys per block of a work list (PagedKVCache.blocks): whole pages, about 128 keys, enough
# for a block's attention to take the fused CPU kernel (which pays from 128 keys on) and
# few enough that a row's last block wastes little.
_BLOCK_KEYS = 128


def block_size(page_size: int) -> int:
    """Positions per block of a :attr:`PagedKVCache.blocks` work list (whole pages)."""
    return page_size * max(1, _BLOCK_KEYS // page_size)


def block_list(lengths, page_size: int, num_blocks=None) -> np.ndarray:
    """The work list that covers each row's first ``lengths[row]`` positions (host side).

    Args:
      lengths: int ``[rows]`` (numpy): positions each row attends over after the chunk (its
        length before it plus its real tokens); 0 lists no block for the row.
      page_size: positions per page.
      num_blocks: pad the list to this many entries (padding rows are ``rows``, outside
        the batch), or to the smallest of a sorted sequence of counts that holds it (a
        jitted step's few shapes); default the blocks needed.

    Returns:
      int32 ``[num_blocks, 2]``: ``(row, block)`` pairs, rows in order.
    """
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    counts = -(-lengths // block_size(page_size))
    total = int(counts.sum())
    rows = np.repeat(np.arange(lengths.size), counts)
    blocks = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    pairs = np.stack([rows, blocks], axis=1).astype(np.int32)
    if num_blocks is None:
        return pairs
    if not isinstance(num_blocks, numbers.Integral):
        num_blocks = next((n for n in num_blocks if n >= total), num_blocks[-1])
    if num_blocks < total:
        raise ValueError(f"lengths {lengths.tolist()} need {total} blocks, more than {num_blocks}.")
    padding = np.tile(np.array([[lengths.size, 0]], np.int32), (num_blocks - total, 1))
    return np.concatenate([pairs, padding])


def init_paged_cache(
    batch_shape: int | tuple[int, ...],
    num_pages: int,
    page_size: int,
    pages_per_seq: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    v_head_dim: int | None = None,
    dtype: Any = jnp.float32,
    quantized: bool = False,
) -> PagedKVCache:
    """An empty paged cache: zero pools, every page table entry unallocated, zero lengths.

    Args:
      batch_shape: the batch dims (sequences decoded together; an int for one axis).
      num_pages: pages in the pool (shared by all rows).
      page_size: positions per page.
      pages_per_seq: width of each row's page table (a row holds up to
        ``pages_per_seq * page_size`` positions).
      num_kv_heads: key/value heads.
      head_dim: width of each key head.
      v_head_dim: width of each value head; default ``head_dim``.
      dtype: dtype of the pools (appended chunks are cast to it); ignored with
        ``quantized``.
      quantized: int8 pools with a float32 scale per token and head (see the module
        docstring); they read back as float32.

    Returns:
      ``PagedKVCache(k_pages [num_pages, page_size, num_kv_heads, head_dim], v_pages,
      page_table int32 [*batch_shape, pages_per_seq] filled with num_pages, lengths int32
      [*batch_shape])``.
    """
    batch_shape = _checks.batch_shape(batch_shape)
    num_pages = _checks.size(num_pages, "num_pages")
    size = _checks.size(page_size, "page_size")
    pages_per_seq = _checks.size(pages_per_seq, "pages_per_seq")
    num_kv_heads = _checks.size(num_kv_heads, "num_kv_heads")
    head_dim = _checks.size(head_dim, "head_dim")
    v_head_dim = head_dim if v_head_dim is None else _checks.size(v_head_dim, "v_head_dim")
    dtype = _checks.float_dtype(dtype, "dtype")
    _checks.flag(quantized, "quantized")
    dtype = jnp.int8 if quantized else dtype

    def scales():  # two buffers (one shared buffer could not be donated as both)
        return jnp.zeros((num_pages, size, num_kv_heads), jnp.float32) if quantized else None

    return PagedKVCache(
        k_pages=jnp.zeros((num_pages, size, num_kv_heads, head_dim), dtype),
        v_pages=jnp.zeros((num_pages, size, num_kv_heads, v_head_dim), dtype),
        page_table=jnp.full((*batch_shape, pages_per_seq), num_pages, jnp.int32),
        lengths=jnp.zeros(batch_shape, jnp.int32),
        k_scales=scales(),
        v_scales=scales(),
    )


# ----------------------------------------------------------------------------------------
# Checks (once, at the public entries)
# ----------------------------------------------------------------------------------------


def _check_cache(cache) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(
            f"cache must be a jattn.kvcache.PagedKVCache (from init_paged_cache), got "
            f"{type(cache).__name__}."
        )
    k, v, table, lengths, k_scales, v_scales, blocks = cache
    if blocks is not None and (
        blocks.ndim != 2 or blocks.shape[-1] != 2 or not jnp.issubdtype(blocks.dtype, jnp.integer)
    ):
        raise ValueError(
            f"cache.blocks must be int [num_blocks, 2] (row, block) pairs, got {blocks.dtype} "
            f"{blocks.shape}."
        )
    if (k_scales is None) != (v_scales is None) or (k_scales is not None) != (k.dtype == jnp.int8):
        raise ValueError(
            "a paged cache has int8 pages and both k_scales and v_scales, or float pages and "
            "neither; build it with init_paged_cache(..., quantized=True/False)."
        )
    if k_scales is not None and (k_scales.shape != k.shape[:3] or v_scales.shape != v.shape[:3]):
        raise ValueError(
            f"k_scales and v_scales must be [num_pages, page_size, num_kv_heads] = {k.shape[:3]}, "
            f"got {k_scales.shape} and {v_scales.shape}."
        )
    if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "k_pages and v_pages must be [num_pages, page_size, num_kv_heads, dim] with the same "
            f"first three dims, got {k.shape} and {v.shape}."
        )
    if table.ndim < 1 or table.shape[:-1] != lengths.shape:
        raise ValueError(
            f"page_table must be [batch..., pages_per_seq] and lengths [batch...], got "
            f"{table.shape} and {lengths.shape}."
        )
    for name, x in (("page_table", table), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"cache.{name} must hold integers, got dtype {x.dtype}.")
    return cache


def _check_chunk(cache: PagedKVCache, key, value, num_new) -> tuple[Array, Array, Array]:
    key = _checks.float_array(key, "key", tokens=True)
    value = _checks.float_array(value, "value", tokens=True)
    batch = cache.lengths.shape
    for name, x, pool in (("key", key, cache.k_pages), ("value", value, cache.v_pages)):
        if x.ndim != len(batch) + 3 or x.shape[:-3] != batch or x.shape[-2:] != pool.shape[-2:]:
            raise ValueError(
                f"{name} must have shape [*{batch}, T, {pool.shape[-2]}, {pool.shape[-1]}] to "
                f"match the paged cache, got {x.shape}."
            )
    chunk_len = key.shape[-3]
    if chunk_len < 1 or value.shape[-3] != chunk_len:
        raise ValueError(
            f"key and value must hold the same chunk of T >= 1 tokens, got {key.shape} and "
            f"{value.shape}."
        )
    if num_new is None:
        num_new = jnp.full(batch, chunk_len, jnp.int32)
    num_new = jnp.asarray(num_new)
    if not jnp.issubdtype(num_new.dtype, jnp.integer):
        raise TypeError(f"num_new must hold integers, got dtype {num_new.dtype}.")
    try:
        num_new = jnp.broadcast_to(num_new, batch).astype(jnp.int32)
    except ValueError:
        raise ValueError(
            f"num_new must have the batch shape {batch} (real tokens per row) or be a scalar, "
            f"got shape {num_new.shape}."
        ) from None
    if _checks.is_host_value(num_new) and _checks.is_host_value(cache.lengths):
        n, lengths = np.asarray(num_new), np.asarray(cache.lengths)
        if n.size and (n.min() < 0 or n.max() > chunk_len):
            raise ValueError(f"num_new must be in [0, {chunk_len}], got {n.tolist()}.")
        if lengths.size and lengths.min() < 0:
            raise ValueError(f"cache.lengths must be >= 0 (tokens held), got {lengths.tolist()}.")
        if n.size and (lengths + n).max() > capacity(cache):
            raise ValueError(
                f"paged KV cache overflow: rows with lengths {lengths.tolist()} cannot take "
                f"{n.tolist()} more tokens; the page table holds {cache.page_table.shape[-1]} "
                f"pages of {page_size(cache)} positions. Pass a wider page_table."
            )
        if _checks.is_host_value(cache.page_table):
            lengths, n = lengths.reshape(-1), n.reshape(-1)
            table = np.asarray(cache.page_table).reshape(lengths.size, -1)  # [rows, P]
            _check_allocated(cache, table, lengths, n)
            _check_overwrites(cache, table, lengths, n)
    return key, value, num_new


def _check_allocated(
    cache: PagedKVCache, table: np.ndarray, lengths: np.ndarray, num_new: np.ndarray
) -> None:
    """A ValueError where a chunk's real token would land on an unallocated page (eager:
    under jit such a token is dropped, and its row's length still counts it)."""
    size, num_pages = page_size(cache), cache.k_pages.shape[0]
    for row, (start, n) in enumerate(zip(lengths, num_new, strict=True)):
        index = np.arange(start // size, pages_needed(start + n, size)) if n else []
        missing = [int(i) for i in index if not 0 <= table[row, i] < num_pages]
        if missing:
            raise ValueError(
                f"row {row} writes positions {start}..{start + n - 1}, but page_table[{row}, "
                f"{missing[0]}] = {table[row, missing[0]]} is not an allocated page (ids are in "
                f"[0, {num_pages})). Write a page id into the table before the chunk "
                "(jattn.models.generate_many allocates pages for you)."
            )


def _check_overwrites(
    cache: PagedKVCache, table: np.ndarray, lengths: np.ndarray, num_new: np.ndarray
) -> None:
    """A ValueError where a chunk's token would land on a slot of the pool that another
    position holds after the chunk, its own row's or another's (eager: under jit the
    writes race, and rows read each other's tokens). Pages shared between rows are
    read-only; only the pages this chunk writes are looked at."""
    size, table = page_size(cache), table.astype(np.int64)
    end = lengths.astype(np.int64) + num_new  # positions each row holds after the chunk
    first, last = lengths // size, -(-end // size)  # written pages' table columns: [first, last)
    column = np.arange(table.shape[1])
    writes = (column >= first[:, None]) & (column < last[:, None]) & (num_new[:, None] > 0)
    written = np.unique(table[writes])
    held = (column < last[:, None]) & np.isin(table, written)  # entries naming a written page
    rows, cols = np.nonzero(held)
    pos = (cols[:, None] * size + np.arange(size)).ravel()  # [entries * size] positions
    rows = np.repeat(rows, size)
    keep = pos < end[rows]
    rows, pos = rows[keep], pos[keep]
    slot = table[rows, pos // size] * size + pos % size
    _, inverse, counts = np.unique(slot, return_inverse=True, return_counts=True)
    clash = np.nonzero((counts[inverse] > 1) & (pos >= lengths[rows]))[0]
    if clash.size:
        i = clash[0]
        j = next(j for j in np.nonzero(slot == slot[i])[0] if j != i)
        raise ValueError(
            f"row {rows[i]} writes position {pos[i]} into page {slot[i] // size}, slot "
            f"{slot[i] % size}, which row {rows[j]} holds as its position {pos[j]} "
            f"(page_table[{rows[i]}, {pos[i] // size}] and page_table[{rows[j]}, "
            f"{pos[j] // size}]). A page holds one row's positions: pages shared by rows (a "
            "common prefix) are read-only, so give each row its own page for the positions "
            "it writes (jattn.models.generate_many does this for you)."
        )


def _check_query(query, key: Array) -> Array:
    query = jnp.asarray(query)
    if query.ndim != key.ndim or query.shape[:-2] != key.shape[:-2]:
        raise ValueError(
            f"query must have shape [*{key.shape[:-3]}, {key.shape[-3]}, num_heads, head_dim] to "
            f"match the chunk's keys, got {query.shape}."
        )
    return query


# ----------------------------------------------------------------------------------------
# Writing and reading pages
# ----------------------------------------------------------------------------------------


def append(cache: PagedKVCache, key, value, *, num_new=None) -> PagedKVCache:
    """Writes a chunk's keys and values after each row's last token.

    Args:
      cache: a :class:`PagedKVCache` whose page table has pages for the new positions.
      key: ``[batch..., T, num_kv_heads, head_dim]``.
      value: ``[batch..., T, num_kv_heads, v_head_dim]``.
      num_new: int ``[batch...]``: real tokens per row (the rest is right padding, never
        written); default ``T``.

    Returns:
      The cache with the pools written and ``lengths + num_new`` (capped at the table's
      capacity); tokens on unallocated pages or past the table are dropped.
    """
    cache = _check_cache(cache)
    key, value, num_new = _check_chunk(cache, key, value, num_new)
    return _append(cache, key, value, num_new)._replace(blocks=None)


def _append(cache: PagedKVCache, key: Array, value: Array, num_new: Array) -> PagedKVCache:
    """:func:`append` of validated arguments."""
    num_pages, size = cache.k_pages.shape[:2]
    table = cache.page_table.reshape(-1, cache.page_table.shape[-1])  # [N, P]
    n, width = table.shape
    chunk_len = key.shape[-3]
    t = jnp.arange(chunk_len, dtype=jnp.int32)[None, :]  # [1, T]
    pos = cache.lengths.reshape(n, 1) + t  # [N, T]: each token's position
    # [N, T]: the page of each position (out-of-table positions read an unallocated entry)
    page = jnp.take_along_axis(table, jnp.minimum(pos // size, width - 1), axis=1)
    real = (t < num_new.reshape(n, 1)) & (pos >= 0) & (pos < width * size)
    real = real & (page >= 0) & (page < num_pages)
    # [N, T]: the flat slot of the pool; padding, overflow and unallocated pages get
    # num_pages * page_size, which mode="drop" discards (never clamped onto a real entry).
    dest = jnp.where(real, page * size + pos % size, num_pages * size)

    def write(pool: Array, x: Array) -> Array:
        flat = pool.reshape(num_pages * size, *pool.shape[2:])
        rows = x.reshape(n, chunk_len, *pool.shape[2:]).astype(pool.dtype)
        return flat.at[dest].set(rows, mode="drop").reshape(pool.shape)

    k_scales = v_scales = None
    if cache.k_scales is not None:
        (key, k_scales), (value, v_scales) = (
            _quantize(x, pool, scales, write)
            for x, pool, scales in ((key, cache.k_pages, cache.k_scales), (value, cache.v_pages, cache.v_scales))
        )  # fmt: skip
    return PagedKVCache(
        k_pages=write(cache.k_pages, key),
        v_pages=write(cache.v_pages, value),
        page_table=cache.page_table,
        lengths=jnp.minimum(cache.lengths + num_new, width * size).astype(jnp.int32),
        k_scales=k_scales,
        v_scales=v_scales,
        blocks=cache.blocks,
    )


def _quantize(x: Array, pool: Array, scales: Array, write) -> tuple[Array, Array]:
    """``x [..., D]`` as int8 and its per-token, per-head scales written into ``scales``."""
    x = x.astype(jnp.float32)
    # [..., K]: max |x| / 127 over head_dim; an all-zero vector gets scale 1 (stored as 0s)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, write(scales, scale)


def gather(cache: PagedKVCache) -> kvcache.KVCache:
    """The pages of each row in order, as a contiguous cache (slot ``j`` = position ``j``).

    Returns:
      ``KVCache(keys [batch..., pages_per_seq * page_size, num_kv_heads, head_dim],
      values [...], lengths)``; unallocated pages read as zeros.
    """
    return _gather(_check_cache(cache))


def _gather(cache: PagedKVCache) -> kvcache.KVCache:
    """:func:`gather` of a checked cache."""
    width, size = cache.page_table.shape[-1], page_size(cache)
    num_pages = cache.k_pages.shape[0]
    table = cache.page_table.reshape(-1)
    # every unallocated entry as num_pages, which mode="fill" reads as zeros (a negative
    # entry would otherwise count from the end of the pool, as numpy's indices do)
    table = jnp.where((table >= 0) & (table < num_pages), table, num_pages)

    def read(pool: Array) -> Array:
        # each page as one row: XLA's CPU gather copies whole rows of a 2-D operand faster
        # (about 1.7x) than [page_size, K, D] slices of the 4-D pool
        rows = pool.reshape(pool.shape[0], -1)  # [num_pages, page_size * K * D]
        pages = jnp.take(rows, table, axis=0, mode="fill", fill_value=0)
        # [batch..., P * page_size, K, D]
        return pages.reshape(*cache.page_table.shape[:-1], width * size, *pool.shape[2:])

    keys, values = read(cache.k_pages), read(cache.v_pages)
    if cache.k_scales is not None:  # int8 pages: dequantized to float32
        keys = keys.astype(jnp.float32) * read(cache.k_scales)[..., None]
        values = values.astype(jnp.float32) * read(cache.v_scales)[..., None]
    return kvcache.KVCache(keys, values, cache.lengths)


# ----------------------------------------------------------------------------------------
# Attention over pages
# ----------------------------------------------------------------------------------------


def update_and_attend(cache: PagedKVCache, query, key, value, *, num_new=None, **attend_kwargs):
    """Appends a chunk to the pages, then attends its queries over each row's pages.

    Args:
      cache: a :class:`PagedKVCache` whose page table covers the new positions.
      query: ``[batch..., T, num_heads, head_dim]``.
      key: ``[batch..., T, num_kv_heads, head_dim]``.
      value: ``[batch..., T, num_kv_heads, v_head_dim]``.
      num_new: int ``[batch...]``: real tokens per row of the chunk; default ``T``.
      **attend_kwargs: the keywords of :func:`jattn.kvcache.attend` (``mask``,
        ``is_causal``, ``local_window_size``, ``score_mod``, ``mask_mod`` at absolute
        positions, ``sinks``, ``dtype``, ...); their key axis is the page table's
        ``pages_per_seq * page_size`` positions.

    Returns:
      ``(output, cache)``: ``[batch..., T, num_heads, v_head_dim]`` as
      :func:`jattn.kvcache.attend` gives over a contiguous cache with the same tokens, and
      the updated paged cache.
    """
    cache = _check_cache(cache)
    _check_keywords(attend_kwargs)
    key, value, num_new = _check_chunk(cache, key, value, num_new)
    query = _check_query(query, key)
    updated = _append(cache, key, value, num_new)
    if fused(cache, query, attend_kwargs):
        out = _attend_fused(updated, query, cache.lengths, num_new, attend_kwargs)
    elif cache.blocks is not None and _fused_cache.plain(attend_kwargs):
        _check_blocks(cache, num_new)
        out = _attend_blocks(updated, query, cache.lengths, num_new, attend_kwargs)
    else:
        out = kvcache.attend(
            _gather(updated), query, starts=cache.lengths, num_new=num_new, **attend_kwargs
        )
    # a work list describes this step's lengths alone: the next step needs its own
    return out, updated._replace(blocks=None)


def _parameters(fn, *leave_out: str) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters) - set(leave_out)


# What update_and_attend's **attend_kwargs may hold: kvcache.attend's keywords and the
# dot_product_attention ones it passes on.
_ATTEND_KEYWORDS = _parameters(
    kvcache.attend, "cache", "query", "starts", "num_new", "attention_kwargs"
) | _parameters(functional.dot_product_attention, "query", "key", "value")


def _check_keywords(kwargs: dict) -> None:
    """A TypeError for a keyword :func:`jattn.kvcache.attend` does not take: the fused
    kernel reads a few of them and would otherwise ignore a misspelt one."""
    unknown = sorted(set(kwargs) - _ATTEND_KEYWORDS)
    if "rolling" in unknown:
        raise TypeError(
            "a paged cache has no rolling mode: it frees memory by pages (generate_many "
            "does); for a sliding window pass local_window_size=."
        )
    if unknown:
        raise TypeError(
            f"update_and_attend() got unexpected keyword arguments {unknown}: it takes those "
            "of jattn.kvcache.attend (mask, is_causal, local_window_size, score_mod, "
            "mask_mod, sinks, dtype, implementation, ...)."
        )


def _check_blocks(cache: PagedKVCache, num_new: Array) -> None:
    """Eager: a ValueError when the work list names a row but misses one of the blocks it
    holds after the chunk (their keys would silently drop out of its softmax); a row the
    list leaves out entirely attends nothing, as documented."""
    if not all(_checks.is_host_value(x) for x in (cache.blocks, cache.lengths, num_new)):
        return
    lengths = np.asarray(cache.lengths).reshape(-1)
    ends = np.minimum(lengths + np.asarray(num_new).reshape(-1), capacity(cache))
    need = pages_needed(ends, block_size(page_size(cache)))  # blocks held, rounded up
    pairs = np.asarray(cache.blocks).astype(np.int64)
    have = np.zeros((lengths.size, max(int(need.max(initial=0)), 1)), bool)
    ok = (pairs[:, 0] >= 0) & (pairs[:, 0] < lengths.size) & (pairs[:, 1] >= 0)
    ok &= pairs[:, 1] < have.shape[1]
    have[pairs[ok, 0], pairs[ok, 1]] = True
    for row in range(lengths.size):
        if have[row].any() and not have[row, : need[row]].all():
            raise ValueError(
                f"cache.blocks misses blocks of row {row}, which holds {ends[row]} positions "
                f"after the chunk: pass blocks=paged.block_list(lengths + num_new, page_size) "
                f"for this step ({ends.tolist()} here), or blocks=None."
            )


# The most queries per row (chunk length) the fused paged kernel takes.
FUSED_MAX_QUERIES = _fused_cache.MAX_QUERIES


def fused(cache: PagedKVCache, query=None, attend_kwargs=None) -> bool:
    """Whether :func:`update_and_attend` attends through the fused CPU paged kernel
    (:func:`jattn.kernels.cpu.paged_attention`): on a CPU host with the kernel built, for a
    plain causal or full call (the keywords ``is_causal``, a Python ``scale``, ``dtype`` and
    ``implementation`` None or ``'cpu_fused'``), float32, bfloat16, float16 or int8 pages,
    queries of the first three and chunks of up to :data:`FUSED_MAX_QUERIES` tokens
    (decoding steps, prefill chunks). ``query``/``attend_kwargs`` None: the cache alone."""
    kwargs = {} if attend_kwargs is None else attend_kwargs
    return _fused_cache.takes((cache.k_pages, cache.v_pages), query, kwargs)


def _attend_fused(cache: PagedKVCache, query: Array, starts: Array, num_new: Array, kwargs):
    """Attention through the fused CPU paged kernel (reads the pages in place)."""
    return _fused_cache.attend(
        query, cache.k_pages, cache.v_pages, cache.page_table, starts, num_new, cache.lengths,
        kwargs, (cache.k_scales, cache.v_scales),
    )  # fmt: skip


def _attend_blocks(cache: PagedKVCache, query: Array, starts: Array, num_new: Array, kwargs):
    """Attention over the blocks of ``cache.blocks`` (split-KV), merged per row.

    Each listed block attends its row's queries over its positions (one batch entry per
    block), giving an output and a log-sum-exp per query; a row's output is its blocks'
    outputs weighted by ``exp(lse - max lse)``, normalized: the softmax over all of them.
    """
    size, width = page_size(cache), cache.page_table.shape[-1]
    per, span = block_size(size) // size, block_size(size)
    table = cache.page_table.reshape(-1, width)  # [R, P]
    rows, chunk_len = table.shape[0], query.shape[-3]
    row, block = cache.blocks[:, 0], cache.blocks[:, 1]  # [N]
    listed = (row >= 0) & (row < rows)
    r = jnp.where(listed, row, 0)
    # [N, per]: the block's pages; entries past the table read as unallocated
    idx = block[:, None] * per + jnp.arange(per, dtype=jnp.int32)[None, :]
    pages = jnp.where(
        idx < width, table[r[:, None], jnp.minimum(idx, width - 1)], cache.k_pages.shape[0]
    )
    keys = _gather(cache._replace(page_table=pages))  # [N, S, K, D], values
    # [N, 1, T, S]: written keys, causal per row, real stored queries (as kvcache.attend)
    t = jnp.arange(chunk_len, dtype=jnp.int32)[None, :, None]  # [1, T, 1]
    pos_k = (block[:, None] * span + jnp.arange(span, dtype=jnp.int32)[None, :])[:, None, :]
    starts_r, lengths_r = starts.reshape(rows)[r], cache.lengths.reshape(rows)[r]
    real = jnp.minimum(num_new.reshape(rows)[r], jnp.maximum(width * size - starts_r, 0))
    mask = listed[:, None, None] & (t < real[:, None, None]) & (pos_k < lengths_r[:, None, None])
    if kwargs.get("is_causal", True):
        mask = mask & (pos_k <= starts_r[:, None, None] + t)
    passed = {k: v for k, v in kwargs.items() if k in _fused_cache.PASSED and k != "is_causal"}
    q = query.reshape(rows, *query.shape[-3:])[r]  # [N, T, H, D]
    out, lse = functional.dot_product_attention(
        q, keys.keys, keys.values, mask=mask[:, None], return_residual=True, **passed
    )
    return _merge(out, lse, jnp.where(listed, row, rows), rows).reshape(
        *query.shape[:-1], out.shape[-1]
    )


def _merge(out: Array, lse: Array, segment: Array, rows: int) -> Array:
    """``[rows, T, H, Dv]``: the blocks' outputs ``[N, T, H, Dv]`` merged per row (segment
    ``rows`` is padding) by their log-sum-exps ``[N, T, H]``; rows with no block get zeros."""
    lse = lse.astype(jnp.float32)
    top = jax.ops.segment_max(lse, segment, num_segments=rows + 1)  # [R + 1, T, H]
    weight = jnp.exp(lse - top[segment])  # [N, T, H]; 1 for each row's largest
    total = jax.ops.segment_sum(weight, segment, num_segments=rows + 1)[:rows]
    merged = jax.ops.segment_sum(
        out.astype(jnp.float32) * weight[..., None], segment, num_segments=rows + 1
    )[:rows]
    safe = jnp.where(total > 0, total, 1.0)[..., None]
    return jnp.where(total[..., None] > 0, merged / safe, 0.0).astype(out.dtype)


kvcache.register_cache(PagedKVCache, update_and_attend)
