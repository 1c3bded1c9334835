"""Independent float64 numpy references for attention (loops where clarity beats speed).

Import from tests as ``from reference import np_attention`` (tests/ is on sys.path via rootdir
conftest). Nothing here imports jattn.
"""

from __future__ import annotations

import math

import numpy as np


def np_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def np_attention(q, k, v, *, mask=None, bias=None, scale=None, return_weights=False):
    """float64 attention on [batch..., T, H, D] / [batch..., S, K, D] inputs.

    ``mask`` is boolean (True = attend), broadcastable to [batch..., H, T, S]. Fully masked
    rows give zero weights and zero output (PyTorch SDPA semantics).
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    *batch, t, h, d = q.shape
    s, kh = k.shape[-3], k.shape[-2]
    groups = h // kh
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    # Repeat K/V heads so that query head i uses kv head i // groups (jax.nn's GQA layout).
    k_full = np.repeat(k, groups, axis=-2)
    v_full = np.repeat(v, groups, axis=-2)
    logits = np.einsum("...thd,...shd->...hts", q, k_full) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, dtype=np.float64)
    if mask is None:
        mask = np.ones(logits.shape, dtype=bool)
    mask = np.broadcast_to(np.asarray(mask, dtype=bool), logits.shape)
    weights = np.zeros_like(logits)
    flat_logits = logits.reshape(-1, s)
    flat_mask = mask.reshape(-1, s)
    flat_w = weights.reshape(-1, s)
    for r in range(flat_logits.shape[0]):
        m = flat_mask[r]
        if m.any():
            row = np.where(m, flat_logits[r], -np.inf)
            flat_w[r] = np_softmax(row)
    weights = flat_w.reshape(logits.shape)
    out = np.einsum("...hts,...shd->...thd", weights, v_full)
    assert out.shape == (*batch, t, h, v.shape[-1])
    return (out, weights) if return_weights else out


def np_flex_attention(q, k, v, *, score=None, mask=None, sinks=None, scale=None):
    """float64 FlexAttention-style attention: ``score(s, b, h, qi, ki)`` on the scaled logits,
    a boolean ``mask`` (True = attend, broadcastable to ``[N, H, T, S]``), per-head ``sinks``.

    Inputs are ``[N, T, H, D]`` / ``[N, S, K, D]`` (one flattened batch axis). ``score`` gets
    numpy arrays ``s [N, H, T, S]`` and index arrays ``b [N,1,1,1]``, ``h [1,H,1,1]``,
    ``qi [1,1,T,1]``, ``ki [1,1,1,S]``. A sink is one more logit in each row's softmax with
    no value. Returns ``(out [N, T, H, Dv], weights [N, H, T, S], lse [N, H, T])``; a row with
    no visible key has zero weights and an lse of its sink (``-inf`` without sinks).
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    n, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    k_full = np.repeat(k, h // kh, axis=2)
    v_full = np.repeat(v, h // kh, axis=2)
    logits = np.einsum("nthd,nshd->nhts", q, k_full) * scale
    if score is not None:
        idx = np.ix_(range(n), range(h), range(t), range(s))
        logits = np.broadcast_to(score(logits, *idx), logits.shape).astype(np.float64)
    mask = np.ones(logits.shape, bool) if mask is None else np.broadcast_to(mask, logits.shape)
    weights = np.zeros(logits.shape)
    lse = np.full(logits.shape[:-1], -np.inf)
    for bi, hi, ti in np.ndindex(n, h, t):
        row = logits[bi, hi, ti][mask[bi, hi, ti]]
        sink = [float(sinks[hi])] if sinks is not None else []
        terms = list(row) + [x for x in sink if x > -np.inf]  # a -inf sink: no sink
        if not terms:
            continue
        top = max(terms)
        total = sum(np.exp(x - top) for x in terms)
        lse[bi, hi, ti] = top + np.log(total)
        weights[bi, hi, ti][mask[bi, hi, ti]] = np.exp(row - lse[bi, hi, ti])
    out = np.einsum("nhts,nshd->nthd", weights, v_full)
    return out, weights, lse


def np_t5_bucket(
    rel: int, num_buckets: int, bidirectional: bool = True, max_distance: int = 32
) -> int:
    """T5's _relative_position_bucket for one relative position ``rel = key - query``."""
    bucket, n = 0, num_buckets
    if bidirectional:
        n //= 2
        bucket += n if rel > 0 else 0
        rel = abs(rel)
    else:
        rel = max(-rel, 0)
    exact = n // 2
    if rel < exact:
        return bucket + rel
    large = exact + int(math.log(rel / exact) / math.log(max_distance / exact) * (n - exact))
    return bucket + min(large, n - 1)
