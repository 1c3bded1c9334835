"""The blockwise passes: one tile, the forward pass, the backward pass, the custom VJP.

The forward pass streams the softmax over key blocks with a running max ``m`` and sum
``l`` (Rabe & Staats 2021; Dao et al. 2022), so the ``[q_len, kv_len]`` score matrix never
exists; only one ``[block_q, block_k]`` tile per (batch, head) does, and only the tiles of
the schedule (:mod:`jattn.blockwise._schedule`) are computed.

The backward pass is FlashAttention-2's: it keeps only the output and the per-row
log-sum-exp ``lse = m + log(l)`` from the forward pass and recomputes each tile's
probabilities ``exp(s - lse)``, so forward+backward memory is O(T) too. Its outer loop
runs over key blocks, the inner over the query blocks that see them; dK, dV accumulate in
the carry, dQ in a full-length buffer. Tiles are key-major, ``[bk, G, bq]``, and every
product is a plain (row-major) one: q and dO are also kept transposed, and dQ is
accumulated transposed (dQ^T += K^T dS^T), so XLA makes no transposed copy of a tile (it
would for dS otherwise, on every tile).

Dropout is applied inside the tiles with bits that depend only on the key and the
element's global (batch, head, query, key) position (:mod:`jattn._prng`), so the mask is
the dense path's mask, whatever the tile sizes. Plain causal self-attention takes a fast
path (:func:`jattn.blockwise._schedule.causal_fast`): diagonal blocks as static sub-tiles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn import _prng
from jattn import masks as masks_lib
from jattn._util import expand_rank, softmax_dtype
from jattn.blockwise._config import Aux, Config, ModOperands
from jattn.blockwise._mods import (
    add_extra,
    backward_score,
    extra_zeros,
    forward_score,
    mask_tile,
    mod_grads,
    tile_extra_zeros,
    tile_index,
)
from jattn.blockwise._schedule import causal_fast, diag_tile, schedule

__all__ = ["backward", "core", "forward"]

Array = jax.Array


def _tile_mask(cfg: Config, aux: Aux, i, j) -> Array | None:
    """Visible (query, key) pairs of tile ``(i, j)``, broadcastable to ``[N, K, G, bq, bk]``."""
    bq, bk = cfg.block_q, cfg.block_k
    # [1, 1, 1, bq, 1] and [1, 1, 1, 1, bk] global positions
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (1, 1, 1, bq, 1), 3)
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (1, 1, 1, 1, bk), 4)
    parts = []
    if cfg.band_hi is not None:
        parts.append(k_pos - q_pos <= cfg.band_hi)
    if cfg.band_lo is not None:
        parts.append(k_pos - q_pos >= cfg.band_lo)
    if cfg.padded_kv > cfg.kv_len:
        parts.append(k_pos < cfg.kv_len)
    if aux.q_lengths is not None:
        # [N, 1, 1, bq, 1]
        parts.append(q_pos < aux.q_lengths[:, None, None, None, None])
    if aux.kv_lengths is not None:
        # [N, 1, 1, 1, bk]
        parts.append(k_pos < aux.kv_lengths[:, None, None, None, None])
    if aux.q_segments is not None:
        q_ids = lax.dynamic_slice_in_dim(aux.q_segments, i * bq, bq, axis=1)
        k_ids = lax.dynamic_slice_in_dim(aux.kv_segments, j * bk, bk, axis=1)
        # [N, 1, 1, bq, bk]
        parts.append((q_ids[:, :, None] == k_ids[:, None, :])[:, None, None])
    if aux.mask is not None:
        mask = aux.mask  # [Nm, Km, Gm, Lq, Lk]
        if mask.shape[-2] > 1:
            mask = lax.dynamic_slice_in_dim(mask, i * bq, bq, axis=3)
        if mask.shape[-1] > 1:
            mask = lax.dynamic_slice_in_dim(mask, j * bk, bk, axis=4)
        parts.append(mask)
    if cfg.mods is not None and cfg.mods.mask is not None:
        index = tile_index(cfg, i * bq, bq, j * bk, bk, key_major=False)
        parts.append(mask_tile(cfg.mods, aux.mask_consts, index))  # [N|1, K|1, G|1, bq, bk]
    visible = masks_lib.combine_masks(*parts)
    # rank 5 explicitly (rank promotion 'raise'): [N|1, K|1, G|1, bq|1, bk|1]
    return None if visible is None else expand_rank(visible, 5)


def _dropout_row_keys(cfg: Config, aux: Aux) -> tuple[Array, Array]:
    """Dropout row keys of every query row, ``[N|1, K|1, G|1, Tq_pad]`` (one Philox call each).

    Rows are numbered as in the dense dropout mask ``[batch..., heads, q_len, kv_len]``
    (row-major over all but the key axis; shared axes count as size 1), as
    :func:`jattn._prng.keep_mask` numbers them, so both paths draw the same mask.
    """
    n, k_heads, groups = cfg.batch_size, cfg.kv_heads, cfg.num_heads // cfg.kv_heads
    u32 = jnp.uint32
    row = lax.broadcasted_iota(u32, (1, 1, 1, cfg.padded_q), 3)
    if cfg.dropout_rows_heads:
        # head h = k * G + g, as the dense path's reshape lays them out
        k_index = lax.broadcasted_iota(u32, (1, k_heads, groups, 1), 1) + np.uint32(cfg.head_offset)
        head = k_index * np.uint32(groups) + lax.broadcasted_iota(u32, (1, k_heads, groups, 1), 2)
        row = row + head * np.uint32(cfg.q_len)
    if cfg.dropout_rows_batch:
        heads = cfg.all_heads if cfg.dropout_rows_heads else 1
        row = row + lax.broadcasted_iota(u32, (n, 1, 1, 1), 0) * np.uint32(
            (heads * cfg.q_len) % 2**32
        )
    return _prng.row_keys(aux.dropout_words, row)


class _Dropout(NamedTuple):
    row_keys: tuple[Array, Array]  # _dropout_row_keys
    threshold: Array
    scale: Array  # 1 / keep probability

    def keep(self, row0, rows: int, col0, cols: int, key_major: bool = False) -> Array:
        """Keep decisions of queries ``[row0, row0 + rows)`` x keys ``[col0, col0 + cols)``:
        ``[N|1, K|1, G|1, rows, cols]`` (``key_major``: ``[N|1, K|1, cols, G|1, rows]``)."""
        keys = [lax.dynamic_slice_in_dim(x, row0, rows, axis=3)[..., None] for x in self.row_keys]
        col = (col0 + lax.broadcasted_iota(jnp.int32, (1, 1, 1, 1, cols), 4)).astype(jnp.uint32)
        if key_major:
            keys, col = [_to_key_major(x) for x in keys], _to_key_major(col)
        return _prng.keep_from_counters(tuple(keys), self.threshold, col)


def _dropout(cfg: Config, aux: Aux) -> _Dropout | None:
    if not cfg.dropout:
        return None
    return _Dropout(_dropout_row_keys(cfg, aux), aux.dropout_threshold, 1.0 / aux.keep_prob)


def _to_key_major(x: Array | None) -> Array | None:
    """``[.., G, bq, bk]``-broadcastable (rank <= 5) -> ``[.., bk, G, bq]``-broadcastable."""
    if x is None:
        return None
    x = expand_rank(x, 5)
    return jnp.transpose(x, (0, 1, 4, 2, 3))


def _scaled(cfg: Config, q: Array) -> Array:
    """``q * scale``: the scale is paid once, not on every logit tile.

    In q's dtype where that dtype has float32's range (bfloat16, float32, float64); a
    float16 q stays scaled in float32, since ``q * scale`` may pass float16's 65504 (inf,
    then NaN) where the float32 logits would not (its tile products then run in float32).
    """
    f32 = softmax_dtype(q.dtype)
    scaled = q.astype(f32) * jnp.asarray(cfg.scale, f32)
    has_range = jnp.finfo(q.dtype).max >= jnp.finfo(jnp.float32).max
    return scaled.astype(q.dtype) if has_range else scaled


def _softmax_step(
    cfg: Config, carry, q_rows, kt_c, v_c, visible=None, keep=None, drop=None, score=None
):
    """One key tile of the online softmax: queries ``q_rows [N, K, G, r, D]`` (scaled) against
    keys ``kt_c [N, K, D, c]`` (transposed) and values ``v_c [N, K, c, Dv]``; ``carry`` is
    the running max, sum and output accumulator of the ``r`` rows. ``score``: the call's
    ``score_mod`` and bias on the tile (:func:`forward_score`), or None."""
    m, row_sum, acc = carry
    f32 = m.dtype
    s = jnp.einsum(
        "nkgqd,nkdc->nkgqc", q_rows, kt_c, precision=cfg.precision, preferred_element_type=f32
    )
    if score is not None:
        s = score(s)
    if visible is not None:
        # -inf, not a finite stand-in: visible logits below jattn.large_negative (a
        # finfo.min bias) still outweigh hidden keys
        s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    # the shift: 0 while a row has seen no finite logit (no -inf - (-inf) anywhere)
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - shift[..., None])  # exactly zero for hidden keys
    alpha = jnp.exp(m - shift)
    row_sum = alpha * row_sum + p.sum(axis=-1)
    if keep is not None:
        p = jnp.where(keep, p * drop.scale, 0.0)
    # [N, K, G, r, c] x [N, K, c, Dv] -> [N, K, G, r, Dv]
    pv = jnp.einsum(
        "nkgqc,nkcd->nkgqd",
        p.astype(v_c.dtype),
        v_c,
        precision=cfg.precision,
        preferred_element_type=f32,
    )
    return m_new, row_sum, alpha[..., None] * acc + pv


def _softmax_init(q_rows: Array, dv: int, sinks: Array | None = None):
    """The running max, sum and accumulator before any key. With ``sinks [K, G]`` each row
    starts from its head's sink logit (max = sink, sum = exp(0) = 1, no value): the sink
    is one more logit of its softmax, and the finished lse includes it."""
    n, k_heads, groups, rows, _ = q_rows.shape
    f32 = softmax_dtype(q_rows.dtype)
    shape = (n, k_heads, groups, rows)
    if sinks is None:
        m, row_sum = jnp.full(shape, -jnp.inf, f32), jnp.zeros(shape, f32)
    else:
        m = jnp.broadcast_to(sinks.astype(f32)[None, :, :, None], shape)
        row_sum = jnp.ones(shape, f32)
    return m, row_sum, jnp.zeros((*shape, dv), f32)


def _softmax_finish(carry, dtype):
    """``(out, lse)`` of finished rows; a row that saw no key gets zero output and a large
    finite negative lse (an empty sum), which the backward pass only meets in masked tiles,
    where its probabilities are zeroed."""
    m, row_sum, acc = carry
    has_key = row_sum > 0
    safe_sum = jnp.where(has_key, row_sum, 1.0)
    out = acc / safe_sum[..., None]  # acc == 0 in a row that saw no key
    lse = jnp.where(has_key, m + jnp.log(safe_sum), masks_lib.large_negative(m.dtype))
    return out.astype(dtype), lse


def _from_blocks(x: Array, axis: int) -> Array:
    """Per-block results stacked by ``lax.scan``, ``[nb, ...]`` with each block's tile axis
    at ``axis`` (of ``...``), joined along it: ``[..., nb * b, ...]``."""
    x = jnp.moveaxis(x, 0, axis)  # [..., nb, b, ...]
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


def forward(cfg: Config, q, k, v, aux: Aux, mops: ModOperands | None = None):
    """``(out, lse)`` of one call: ``q [N, K, G, Tq_pad, D]``, ``k, v [N, K, Tk_pad, D]`` in,
    out ``[N, K, G, Tq_pad, Dv]`` in q's dtype and lse ``[N, K, G, Tq_pad]`` (large negative
    for rows that see no key) out. ``mops``: the differentiable operands of the call's
    modifiers (score_mod's arrays, sinks, bias), or None."""
    q, kt = _scaled(cfg, q), jnp.swapaxes(k, -1, -2)  # [N, K, D, Tk]: plain tile products
    sinks = None if mops is None else mops.sinks
    if causal_fast(cfg, aux, cfg.block_q, cfg.block_k):
        return _forward_causal(cfg, q, kt, v, aux, sinks)
    bq, bk = cfg.block_q, cfg.block_k
    plan = schedule(cfg, aux)
    drop = _dropout(cfg, aux)

    def q_block(_, i):
        q_i = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)  # [N, K, G, bq, D]

        def update(j, carry, masked: bool):
            kt_j = lax.dynamic_slice_in_dim(kt, j * bk, bk, axis=3)
            v_j = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            visible = _tile_mask(cfg, aux, i, j) if masked else None
            keep = None if drop is None else drop.keep(i * bq, bq, j * bk, bk)
            score = forward_score(cfg, mops, i * bq, bq, j * bk, bk)
            return _softmax_step(cfg, carry, q_i, kt_j, v_j, visible, keep, drop, score)

        def tile(j, carry, masked: bool, state=None):
            if state is None:
                return update(j, carry, masked)
            # Only the running statistics pass through the branches (small: no [T, D] buffer).
            branches = [
                lambda c: c,  # skipped
                functools.partial(update, j, masked=True),
                functools.partial(update, j, masked=False),  # every pair visible
            ]
            return lax.switch(state, branches, carry)

        carry = plan.visit(i, tile, _softmax_init(q_i, v.shape[-1], sinks))
        return None, _softmax_finish(carry, v.dtype)  # the inputs' dtype

    _, (out, lse) = lax.scan(q_block, None, jnp.arange(cfg.padded_q // bq))
    return _from_blocks(out, 3), _from_blocks(lse, 3)


def _forward_causal(cfg: Config, q, kt, v, aux: Aux, sinks=None):
    """The causal forward pass, exact: each query block attends to the key tiles left of
    its diagonal block unmasked, then to the diagonal block as ``block_q / diag`` static
    sub-tiles, each trimmed to the rows that see it (rows ``[c*d, bq)`` x keys
    ``[c*d, (c+1)*d)``): the masked waste is one ``d``-triangle per sub-tile instead of
    half a ``bq x bq`` block."""
    bq, bk = cfg.block_q, cfg.block_k
    bd = diag_tile(cfg, bk)
    drop = _dropout(cfg, aux)
    tri = lax.broadcasted_iota(jnp.int32, (bq, bd), 1) <= lax.broadcasted_iota(
        jnp.int32, (bq, bd), 0
    )  # [row, key] of a diagonal sub-tile, both counted from its first key: key <= row

    def q_block(_, i):
        q0 = i * bq
        q_i = lax.dynamic_slice_in_dim(q, q0, bq, axis=3)

        def full_tile(j, carry):
            kt_j = lax.dynamic_slice_in_dim(kt, j * bk, bk, axis=3)
            v_j = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            keep = None if drop is None else drop.keep(q0, bq, j * bk, bk)
            return _softmax_step(cfg, carry, q_i, kt_j, v_j, keep=keep, drop=drop)

        init = _softmax_init(q_i, v.shape[-1], sinks)
        carry = lax.fori_loop(0, i * (bq // bk), full_tile, init)
        for c in range(bq // bd):
            lo = c * bd  # rows [lo, bq) of the block see keys [q0 + lo, q0 + lo + bd)
            kt_c = lax.dynamic_slice_in_dim(kt, q0 + lo, bd, axis=3)
            v_c = lax.dynamic_slice_in_dim(v, q0 + lo, bd, axis=2)
            keep = None if drop is None else drop.keep(q0 + lo, bq - lo, q0 + lo, bd)
            rows = tuple(x[..., lo:] if x.ndim == 4 else x[..., lo:, :] for x in carry)
            rows = _softmax_step(cfg, rows, q_i[..., lo:, :], kt_c, v_c, tri[: bq - lo], keep, drop)
            carry = tuple(
                jnp.concatenate([x[..., :lo], r], -1)
                if x.ndim == 4
                else jnp.concatenate([x[..., :lo, :], r], -2)
                for x, r in zip(carry, rows, strict=True)
            )
        return None, _softmax_finish(carry, v.dtype)  # the inputs' dtype

    _, (out, lse) = lax.scan(q_block, None, jnp.arange(cfg.padded_q // bq))
    return _from_blocks(out, 3), _from_blocks(lse, 3)


class _Rows(NamedTuple):
    """The query side of the backward pass, full length (sliced per tile by :meth:`cols`)."""

    qt: Array  # [N, K, D, G, Tq_pad]: scaled q, transposed
    d_out_t: Array  # [N, K, Dv, G, Tq_pad]: dO, transposed
    q: Array  # [N, K, G, Tq_pad, D]: scaled q
    d_out: Array  # [N, K, G, Tq_pad, Dv]
    lse: Array  # [N, K, 1, G, Tq_pad]
    delta: Array  # [N, K, 1, G, Tq_pad]

    def cols(self, start, width: int) -> _Rows:
        axes = (4, 4, 3, 3, 4, 4)
        return _Rows(
            *(
                lax.dynamic_slice_in_dim(x, start, width, axis=a)
                for x, a in zip(self, axes, strict=True)
            )
        )


def _rows(cfg: Config, q, out, lse, d_out, d_lse) -> _Rows:
    f32 = softmax_dtype(q.dtype)
    # rowsum(dO * O) = sum_j P_ij dP_ij, the softmax backward's row term; a cotangent of
    # lse = log sum_j exp(s_ij) adds P_ij * d_lse_i to dS_ij.
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)
    if d_lse is not None:
        delta = delta - d_lse.astype(f32)
    q = _scaled(cfg, q)
    return _Rows(
        qt=jnp.moveaxis(q, -1, 2),
        d_out_t=jnp.moveaxis(d_out, -1, 2),
        q=q,
        d_out=d_out,
        lse=lse[:, :, None],
        delta=delta[:, :, None],
    )


def _tile_grads(cfg: Config, kv, rows: _Rows, visible=None, keep=None, drop=None, score=None):
    """One key-major tile's ``(dQ^T, dK, dV, extra)`` contributions: ``kv = (k, v, k^T)`` of
    ``c`` keys (``[N, K, c, D]``, ``[N, K, c, Dv]``, ``[N, K, D, c]``), ``rows`` of ``r``
    queries. ``score`` (:func:`backward_score`) recomputes the call's modified scores and
    gives ``extra = (d_float_consts, dS)`` for the modifiers' gradients (None without)."""
    k_c, v_c, kt_c = kv
    f32 = rows.lse.dtype
    mm = k_c.dtype  # tile products run in the inputs' dtype, accumulated in f32

    def product(spec, a, b):
        return jnp.einsum(spec, a, b, precision=cfg.precision, preferred_element_type=f32)

    s = product("nkcd,nkdgq->nkcgq", k_c, rows.qt)  # [N, K, c, G, r]
    score_vjp = extra = None
    if score is not None:
        s, score_vjp = score(s)
    dp = product("nkcd,nkdgq->nkcgq", v_c, rows.d_out_t)
    p = jnp.exp(s - rows.lse)
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    p_used = p
    if keep is not None:
        p_used = jnp.where(keep, p * drop.scale, 0.0)
        dp = jnp.where(keep, dp * drop.scale, 0.0)
    dv = product("nkcgq,nkgqd->nkcd", p_used.astype(mm), rows.d_out)
    ds = p * (dp - rows.delta)
    if score_vjp is not None:  # dS of the modified scores -> of the raw ones (and the mods')
        ds, extra = score_vjp(ds)
    ds = ds.astype(mm)
    dk = product("nkcgq,nkgqd->nkcd", ds, rows.q)
    dqt = product("nkdc,nkcgq->nkdgq", kt_c, ds)  # dQ^T = K^T dS^T
    return dqt, dk, dv, extra


def _add_cols(dqt: Array, start, x: Array) -> Array:
    width = x.shape[-1]
    return lax.dynamic_update_slice_in_dim(
        dqt, lax.dynamic_slice_in_dim(dqt, start, width, axis=4) + x, start, axis=4
    )


def _key_block(x: Array, start, width: int, axis: int = 2) -> Array:
    return lax.dynamic_slice_in_dim(x, start, width, axis=axis)


def backward(cfg: Config, q, k, v, aux: Aux, out, lse, d_out, d_lse=None, mops=None):
    """``(dq, dk, dv)`` of one call, given the forward's ``out`` and ``lse`` and the
    cotangents ``d_out [N, K, G, Tq_pad, Dv]`` and ``d_lse [N, K, G, Tq_pad]`` (or None).
    The pass runs on ``cfg``'s backward tiles. With the modifiers' operands ``mops``
    (:class:`jattn.blockwise._config.ModOperands`), ``(dq, dk, dv, d_mops)``."""
    cfg = cfg.backward_tiles()
    rows = _rows(cfg, q, out, lse, d_out, d_lse)
    kt = jnp.swapaxes(k, -1, -2)
    d_extra = None
    if causal_fast(cfg, aux, cfg.block_k, cfg.block_q):
        dqt, dk, dv = _backward_causal(cfg, k, v, kt, aux, rows)
    else:
        dqt, dk, dv, d_extra = _backward_general(cfg, k, v, kt, aux, rows, mops)
    dq = jnp.moveaxis(dqt, 2, -1) * jnp.asarray(cfg.scale, dqt.dtype)
    # dk needs no scale: the tiles' q was scaled already.
    grads = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    if mops is None:
        return grads
    return (*grads, mod_grads(cfg, mops, rows, d_extra))


def _backward_general(cfg: Config, k, v, kt, aux: Aux, rows: _Rows, mops=None):
    """Every mask, by the schedule: ``(dQ^T, dK, dV)`` in float32, and the modifiers'
    gradient accumulators (:func:`extra_zeros`; None without modifiers)."""
    n, k_heads, d, groups, _ = rows.qt.shape
    bq, bk = cfg.block_q, cfg.block_k
    f32 = rows.lse.dtype
    plan = schedule(cfg, aux).transposed()
    drop = _dropout(cfg, aux)

    def k_block(scan_carry, j):
        dqt, d_extra = scan_carry
        kv = (_key_block(k, j * bk, bk), _key_block(v, j * bk, bk), _key_block(kt, j * bk, bk, 3))

        def grads(i, masked: bool):
            visible = _to_key_major(_tile_mask(cfg, aux, i, j)) if masked else None
            keep = None if drop is None else drop.keep(i * bq, bq, j * bk, bk, key_major=True)
            score = backward_score(cfg, mops, i * bq, bq, j * bk, bk)
            return _tile_grads(cfg, kv, rows.cols(i * bq, bq), visible, keep, drop, score)

        def tile(i, carry, masked: bool, state=None):
            dqt, dk, dv, d_extra = carry
            if state is None:
                g = grads(i, masked)
            else:
                # The branches return only this tile's small contributions; dQ^T (a [T, D]
                # buffer) is updated outside them, so it stays in place.
                zeros = (
                    jnp.zeros((n, k_heads, d, groups, bq), f32),
                    jnp.zeros(dk.shape, f32),
                    jnp.zeros(dv.shape, f32),
                    tile_extra_zeros(cfg, mops, (n, k_heads, bk, groups, bq), f32),
                )
                g = lax.switch(
                    state, [lambda: zeros, lambda: grads(i, True), lambda: grads(i, False)]
                )
            d_extra = add_extra(cfg, d_extra, g[3], i, j)
            return _add_cols(dqt, i * bq, g[0]), dk + g[1], dv + g[2], d_extra

        init = (dqt, jnp.zeros((n, k_heads, bk, d), f32), jnp.zeros(kv[1].shape, f32), d_extra)
        dqt, dk, dv, d_extra = plan.visit(j, tile, init)
        return (dqt, d_extra), (dk, dv)

    init = (jnp.zeros(rows.qt.shape, f32), extra_zeros(cfg, mops, f32))
    (dqt, d_extra), (dk, dv) = lax.scan(k_block, init, jnp.arange(cfg.padded_kv // bk))
    return dqt, _from_blocks(dk, 2), _from_blocks(dv, 2), d_extra


def _backward_causal(cfg: Config, k, v, kt, aux: Aux, rows: _Rows):
    """The causal backward pass, exact: key block ``j`` meets the query blocks below its
    diagonal square unmasked, and the square as ``block_k / diag`` static sub-tiles (keys
    ``[0, (c+1)*d)`` x queries ``[c*d, (c+1)*d)`` of the square)."""
    n, k_heads, d, _, t = rows.qt.shape
    bq, bk = cfg.block_q, cfg.block_k
    bd = diag_tile(cfg, bq)
    f32 = rows.lse.dtype
    drop = _dropout(cfg, aux)

    def k_block(dqt, j):
        k0 = j * bk
        k_j, v_j, kt_j = _key_block(k, k0, bk), _key_block(v, k0, bk), _key_block(kt, k0, bk, 3)
        dk = jnp.zeros((n, k_heads, bk, d), f32)
        dv = jnp.zeros(v_j.shape, f32)
        for c in range(bk // bd):  # (no modifier reaches this fast path: causal_fast)
            r = (c + 1) * bd  # keys [k0, k0 + r) are seen by queries [k0 + c*bd, k0 + r)
            seen = lax.broadcasted_iota(jnp.int32, (r, 1, bd), 0) <= (
                c * bd + lax.broadcasted_iota(jnp.int32, (r, 1, bd), 2)
            )
            keep = None if drop is None else drop.keep(k0 + c * bd, bd, k0, r, key_major=True)
            kv = (k_j[:, :, :r], v_j[:, :, :r], kt_j[..., :r])
            g = _tile_grads(cfg, kv, rows.cols(k0 + c * bd, bd), seen, keep, drop)
            dqt = _add_cols(dqt, k0 + c * bd, g[0])
            dk, dv = dk.at[:, :, :r].add(g[1]), dv.at[:, :, :r].add(g[2])

        def full_tile(i, carry):
            dqt, dk, dv = carry
            keep = None if drop is None else drop.keep(i * bq, bq, k0, bk, key_major=True)
            g = _tile_grads(cfg, (k_j, v_j, kt_j), rows.cols(i * bq, bq), keep=keep, drop=drop)
            return _add_cols(dqt, i * bq, g[0]), dk + g[1], dv + g[2]

        dqt, dk, dv = lax.fori_loop((j + 1) * (bk // bq), t // bq, full_tile, (dqt, dk, dv))
        return dqt, (dk, dv)

    dqt, (dk, dv) = lax.scan(k_block, jnp.zeros(rows.qt.shape, f32), jnp.arange(t // bk))
    return dqt, _from_blocks(dk, 2), _from_blocks(dv, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def core(cfg: Config, q, k, v, aux: Aux, mops: ModOperands):
    return forward(cfg, q, k, v, aux, mops)


def _core_fwd(cfg, q, k, v, aux, mops):
    out, lse = forward(cfg, q, k, v, aux, mops)
    return (out, lse), (q, k, v, aux, mops, out, lse)


def _core_bwd(cfg, residuals, cotangents):
    q, k, v, aux, mops, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv, d_mops = backward(cfg, q, k, v, aux, out, lse, d_out, d_lse, mops)
    return dq, dk, dv, jax.tree.map(lambda _: None, aux), d_mops


core.defvjp(_core_fwd, _core_bwd)
