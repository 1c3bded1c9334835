"""A KV cache's attention through the fused CPU paged kernel: which calls take it, the call.

:func:`jattn.kernels.cpu.paged_attention` reads each row's keys and values in place, and
only up to the row's length. Both caches attend through it: a
:class:`jattn.paged.PagedKVCache` through its page table, and a contiguous
:class:`jattn.kvcache.KVCache` as a pool of one page per row (``capacity`` positions;
page ``r`` is row ``r``, a reshape, no copy). So a decoding step's cost follows the tokens
held in either, and one rule (:func:`takes`) says which calls the kernel computes.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _util
from jattn.kernels import cpu as cpu_kernels

Array = jax.Array

# The keywords a plain call may set; with any other one set (a mask, a modifier, sinks,
# a window, dropout, weights) a call takes the general path, which honours them all.
PASSED = ("is_causal", "dtype", "precision", "implementation", "scale")
_DROPOUT = ("dropout_rate", "dropout_rng", "deterministic", "broadcast_dropout")

# The most queries per row (chunk length) the kernel takes: past it the attention's
# arithmetic outweighs the reading, and XLA's gather plus the tiled kernel is as fast
# (measured on the AVX-512 EPYC, one thread: the paged kernel 1.7-3x faster up to 64
# queries against 1000 keys, 1.1x at 256, even at 1024).
MAX_QUERIES = 256
_DTYPES = ("float32", "bfloat16", "float16")


def plain(kwargs: dict) -> bool:
    """Whether a call's attention keywords ask for plain causal (or full) attention: only
    :data:`PASSED` set, dropout off."""
    dropout_off = not kwargs.get("dropout_rate") or kwargs.get("deterministic") is True
    if not isinstance(kwargs.get("is_causal", True), bool):
        return False  # the general path names the error
    rest = (v for k, v in kwargs.items() if k not in PASSED and k not in _DROPOUT)
    return dropout_off and all(v is None or v is False for v in rest)


def takes(pools, query, kwargs: dict) -> bool:
    """Whether the fused kernel computes a cache's call: on a CPU host with the kernel
    built, a :func:`plain` call with ``implementation`` None or ``'cpu_fused'``, a Python
    ``scale``, no ``precision``, float32, bfloat16 or float16 (or int8) keys and values
    (``pools``: the cache's key and value arrays), queries and ``dtype``, chunks of up to
    :data:`MAX_QUERIES` tokens, and none of them sharded in its type over a mesh (the
    kernel has no partitioning rule: the general path keeps each device's rows). ``query``
    None: the cache alone."""
    if not plain(kwargs) or kwargs.get("implementation") not in (None, "cpu_fused"):
        return False
    if _util.sharded_axes(query, pools):
        return False
    if query is not None and jnp.ndim(query) >= 3 and jnp.shape(query)[-3] > MAX_QUERIES:
        return False
    scale = kwargs.get("scale")
    static_scale = scale is None or (
        isinstance(scale, (numbers.Real, np.number)) and not isinstance(scale, bool)
    )
    if kwargs.get("precision") is not None or not static_scale:
        return False
    dtypes = [x.dtype for x in pools if x.dtype != jnp.int8]
    dtypes += [] if query is None else [jnp.asarray(query).dtype]
    dtypes += [] if kwargs.get("dtype") is None else [kwargs["dtype"]]
    if any(jnp.dtype(d).name not in _DTYPES for d in dtypes):
        return False
    return jax.default_backend() == "cpu" and cpu_kernels.available()


def attend(query, k_pages, v_pages, table, starts, num_new, lengths, kwargs, scales=(None, None)):
    """The kernel's attention of ``query [batch..., T, H, D]`` over the pools through
    ``table [batch..., P]`` (``starts``, ``num_new``, ``lengths`` ``[batch...]``), in the
    computation dtype the general path gives: ``dtype``, or the promoted one."""
    rows = int(np.prod(lengths.shape, dtype=np.int64))
    kv = [jnp.float32 if x.dtype == jnp.int8 else x.dtype for x in (k_pages, v_pages)]
    dtype = kwargs.get("dtype") or jnp.result_type(query.dtype, *kv)
    out = cpu_kernels.paged_attention(
        query.reshape(rows, *query.shape[-3:]), k_pages, v_pages,
        table.reshape(rows, table.shape[-1]), starts.reshape(rows), num_new.reshape(rows),
        lengths.reshape(rows), is_causal=kwargs.get("is_causal", True),
        scale=kwargs.get("scale"), k_scales=scales[0], v_scales=scales[1],
    )  # fmt: skip
    return out.reshape(*query.shape[:-1], out.shape[-1]).astype(dtype)
