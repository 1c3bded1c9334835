"""Attention read through a page table: the fused CPU kernel for paged KV caches.

:func:`paged_attention` attends a chunk of queries per row over the keys and values a
page pool holds for that row (the layout of :class:`jattn.paged.PagedKVCache`), reading
the pages in place through the page table: no gathered copy of the keys, and only the
pages below each row's length are touched, so the cost follows the tokens held, not the
table's width. On CPU with the kernel built it is one ``jax.ffi.ffi_call``
(``jattn_cpu_paged_attention``): an online softmax per (row, kv head) over blocks of
keys, and for a long row with few queries (decoding) fixed key splits merged in order
(split-KV, as flash-decoding), so the result does not depend on the thread count
(``JATTN_CPU_THREADS``). A decoding step over several rows takes each row's kv heads
together, block by block, so it reads the pages' token records whole rather than one
head's slice of each at a time. A call with little work (a few pages a row) runs on the
calling thread alone: waking a pool thread would cost more than it saves. Elsewhere (another
platform's lowering, or no kernel) it is the XLA formulation: gather the pages, mask,
softmax. Its derivatives are that formulation's (a ``jax.custom_jvp``), so ``jax.grad``,
``jax.jvp`` and ``jax.hessian`` work on every platform, jitted or not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn.kernels.cpu import _library, _ops, adapter

__all__ = ["paged_attention"]

Array = jax.Array
_FLOATS = ("float32", "bfloat16", "float16")


def paged_attention(
    query,
    k_pages,
    v_pages,
    page_table,
    starts,
    num_real,
    lengths,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    k_scales=None,
    v_scales=None,
) -> Array:
    """Each row's chunk of queries attending over the row's pages.

    Args:
      query: ``[R, T, H, D]`` float (float32, bfloat16 or float16; computed in float32).
      k_pages: ``[N, S, K, D]``: the key pool: float32, bfloat16 or float16 (read in
        place as float32, exactly: no float32 copy of the pool), or int8 with
        ``k_scales``.
      v_pages: ``[N, S, K, Dv]``: the value pool.
      page_table: int32 ``[R, P]``: position ``p`` of row ``r`` is at offset ``p % S`` of
        page ``page_table[r, p // S]``; an entry outside ``[0, N)`` is unallocated: never
        read, its positions count as zero keys and values.
      starts: int32 ``[R]``: tokens each row held before the chunk (query ``t`` is at
        position ``starts + t``).
      num_real: int32 ``[R]``: real queries of each row's chunk (capped at
        ``P * S - starts``); the others are padding and get zeros.
      lengths: int32 ``[R]``: tokens each row holds after the chunk: keys ``p < lengths``.
      is_causal: query ``t`` also sees only ``p <= starts + t``.
      scale: the logit multiplier, a Python number; default ``D ** -0.5``.
      k_scales, v_scales: float32 ``[N, S, K]`` for int8 pools (``key = k_pages * k_scales``).

    Returns:
      float32 ``[R, T, H, Dv]``; queries that see no key (padding, rows of length 0) give
      zeros. Query head ``h`` reads kv head ``h // (H // K)`` (grouped-query attention).
    """
    query, k_pages, v_pages, k_scales, v_scales = _check_arrays(
        query, k_pages, v_pages, k_scales, v_scales
    )
    ints = [jnp.asarray(x).astype(jnp.int32) for x in (page_table, starts, num_real, lengths)]
    rows = query.shape[0]
    if ints[0].shape != (rows, ints[0].shape[-1]) or any(x.shape != (rows,) for x in ints[1:]):
        raise ValueError(
            f"page_table must be [{rows}, P] and starts, num_real, lengths [{rows}], got "
            f"{[tuple(x.shape) for x in ints]}."
        )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}.")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return _paged(query, k_pages, v_pages, k_scales, v_scales, *ints, is_causal, scale)


def _check_arrays(query, k_pages, v_pages, k_scales, v_scales):
    """The operands: the query as float32; float32, bfloat16 or float16 pools as they are
    (the kernel reads them as float32, exactly; pools of two float types as float32), int8
    pools with scales."""
    query, k_pages, v_pages = (jnp.asarray(x) for x in (query, k_pages, v_pages))
    if query.ndim != 4 or k_pages.ndim != 4 or v_pages.ndim != 4:
        raise ValueError(
            f"query must be [R, T, H, D] and the pools [N, S, K, D], got {query.shape}, "
            f"{k_pages.shape} and {v_pages.shape}."
        )
    h, d, kh = query.shape[-2], query.shape[-1], k_pages.shape[-2]
    if k_pages.shape[-1] != d or k_pages.shape[:3] != v_pages.shape[:3] or h % kh:
        raise ValueError(
            f"query {query.shape}, k_pages {k_pages.shape} and v_pages {v_pages.shape} do not "
            "match (head_dim, pools' first three dims, heads a multiple of kv heads)."
        )
    if jnp.dtype(query.dtype).name not in _FLOATS:
        raise TypeError(f"query must be float32, bfloat16 or float16, got {query.dtype}.")
    int8 = k_pages.dtype == jnp.int8
    if (
        int8 != (v_pages.dtype == jnp.int8)
        or int8 != (k_scales is not None)
        or ((k_scales is None) != (v_scales is None))
    ):
        raise ValueError("int8 pools come with k_scales and v_scales; float pools without.")
    if int8:
        k_scales, v_scales = (jnp.asarray(x, jnp.float32) for x in (k_scales, v_scales))
        if k_scales.shape != k_pages.shape[:3] or v_scales.shape != v_pages.shape[:3]:
            raise ValueError(f"k_scales and v_scales must be {k_pages.shape[:3]}.")
    else:
        for x in (k_pages, v_pages):
            if jnp.dtype(x.dtype).name not in _FLOATS:
                raise TypeError(f"pools must be float32, bfloat16, float16 or int8, got {x.dtype}.")
        if k_pages.dtype != v_pages.dtype:  # the kernel reads one element type for both
            k_pages, v_pages = k_pages.astype(jnp.float32), v_pages.astype(jnp.float32)
    return query.astype(jnp.float32), k_pages, v_pages, k_scales, v_scales


@functools.partial(jax.custom_jvp, nondiff_argnums=(9, 10))
def _paged(
    q, k_pages, v_pages, k_scales, v_scales, table, starts, num_real, lengths, causal, scale
):
    operands = (q, k_pages, v_pages, k_scales, v_scales, table, starts, num_real, lengths)
    xla = functools.partial(_xla, causal=causal, scale=scale)
    if _library.library() is None:
        return xla(*operands)
    fused = functools.partial(_fused, causal=causal, scale=scale)
    return jax.lax.platform_dependent(*operands, cpu=fused, default=xla)


@_paged.defjvp
def _paged_jvp(causal, scale, primals, tangents):
    """The XLA formulation's derivative beside the call's value: forward mode
    (``jax.jvp``, ``jax.hessian``) and, through it, reverse mode (the tangent is linear,
    so JAX transposes it; ``jax.grad`` recomputes that formulation's weights)."""
    xla = functools.partial(_xla, causal=causal, scale=scale)
    return _paged(*primals, causal, scale), jax.jvp(xla, primals, tangents)[1]


def _fused(q, k_pages, v_pages, k_scales, v_scales, table, starts, num_real, lengths, *, causal,
           scale):  # fmt: skip
    """The kernel's ``ffi_call`` (float32 out)."""
    rows, t, h, _ = q.shape
    out_type = jax.ShapeDtypeStruct((rows, t, h, v_pages.shape[-1]), jnp.float32)
    call = jax.ffi.ffi_call(_library.PAGED_TARGET, out_type, vmap_method="sequential")
    if k_scales is None:  # placeholders, never read
        k_scales = v_scales = jnp.zeros((1,), jnp.float32)
    operands = (q, k_pages, v_pages, k_scales, v_scales, table, starts, num_real, lengths)
    out = call(
        *operands, scale=np.float32(scale), causal=np.int64(causal),
        max_threads=np.int64(adapter.max_threads()),
    )  # fmt: skip
    # inside shard_map: vary over the operands' manual axes, as the XLA formulation does
    return _ops.vary(out, _ops.varying_axes(*operands))


def _xla(q, k_pages, v_pages, k_scales, v_scales, table, starts, num_real, lengths, *, causal,
         scale):  # fmt: skip
    """The XLA formulation: the pages gathered (unallocated ones as zeros), masked, softmax."""
    num_pages, size, kh, d = k_pages.shape
    rows, width = table.shape
    t, h, cap = q.shape[1], q.shape[2], width * size
    idx = jnp.where((table >= 0) & (table < num_pages), table, num_pages).reshape(-1)

    def read(pool):  # [R, P * S, ...]
        pages = jnp.take(pool, idx, axis=0, mode="fill", fill_value=0)
        return pages.reshape(rows, cap, *pool.shape[2:])

    keys, values = read(k_pages).astype(jnp.float32), read(v_pages).astype(jnp.float32)
    if k_scales is not None:
        keys, values = keys * read(k_scales)[..., None], values * read(v_scales)[..., None]
    start = jnp.clip(starts, 0, cap)
    real = jnp.clip(jnp.minimum(num_real, cap - start), 0, t)
    tq = jnp.arange(t, dtype=jnp.int32)[None, :, None]  # [1, T, 1]
    pos = jnp.arange(cap, dtype=jnp.int32)[None, None, :]  # [1, 1, cap]
    mask = (tq < real[:, None, None]) & (pos < jnp.clip(lengths, 0, cap)[:, None, None])
    if causal:
        mask = mask & (pos <= start[:, None, None] + tq)
    qg = q.reshape(rows, t, kh, h // kh, d)
    logits = jnp.einsum("rtkgd,rpkd->rkgtp", qg, keys) * np.float32(scale)
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("rkgtp,rpkd->rtkgd", weights / jnp.where(total > 0, total, 1.0), values)
    return out.reshape(rows, t, h, values.shape[-1])
