"""jattn's FlashAttention-2 kernels in Pallas: a forward pass and two backward passes.

* forward, grid ``(q tiles, N, H)``: one query tile against its visible key tiles with an
  online softmax (running max and sum per row, starting from the head's sink when the
  call has sinks); writes the output and the per-row log-sum-exp;
* dK/dV, grid ``(key tiles, N, K)``: one key tile against the visible query tiles of each
  of the ``G`` query heads sharing its key/value head (grouped-query attention reads K and
  V once, never repeated), with the bias, ALiBi-slope and score_mod-constant gradients;
* dQ, grid ``(q tiles, N, H)``: one query tile against its visible key tiles.

Tiles are skipped by the loop bounds (causal band, window, real and per-row lengths) and,
where visibility is data-dependent (segment ids, block-mask tile states), by a
``lax.cond`` per tile; tiles wholly inside the band and the lengths skip the elementwise
mask. Operands travel in the layout a :class:`Layout` gives them (``[N, T, H, D]`` on
GPUs); the in-tile arithmetic is :mod:`jattn.kernels.pallas._common`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.interpreters import mlir

from jattn import block_masks
from jattn.kernels.pallas import _common as C

Array = jax.Array


class Layout(NamedTuple):
    """How one platform's kernels receive their operands.

    Attributes:
      compiler_params: ``(kernel) -> compiler_params`` for ``pl.pallas_call`` ('fwd',
        'dkv', 'dq'), or None (interpret mode).
      interpret: run in interpret mode.
      only_on: in a program lowered for several platforms, the platform whose
        ``platform_dependent`` branch holds the kernels: their lowering for the others
        (a branch never taken there) is a placeholder of zeros.
    """

    compiler_params: Callable[[str], Any] | None
    interpret: bool
    only_on: str | None = None  # lower the kernels for this platform only (see _only_on)


class Inputs(NamedTuple):
    """The kernels' operands (None where the call has none), in kernel layout.

    q ``[N, Tq, H, D]``, k ``[N, Tk, K, D]``, v ``[N, Tk, K, Dv]`` (padded); q_len / kv_len
    int32 ``[N, 1, 1]``; q_seg int32 ``[N, Tq, 1]``, kv_seg ``[N, 1, Tk]``; bias
    ``[Nb, Hb, Lq, Lk]``; slopes / sinks float32 ``[H, 1, 1]``; key0 / key1 uint32
    ``[Nr, Hr, Tq, 1]`` (dropout row keys), threshold uint32 ``[1, 1, 1]``, inv_keep
    float32 ``[1, 1, 1]``; score_consts / mask_consts: the hoisted modifiers' arrays;
    fwd_states / bwd_states int32 ``[nq, nk]`` block-mask tile states.
    """

    q: Array
    k: Array
    v: Array
    q_len: Array | None = None
    kv_len: Array | None = None
    q_seg: Array | None = None
    kv_seg: Array | None = None
    bias: Array | None = None
    slopes: Array | None = None
    sinks: Array | None = None
    key0: Array | None = None
    key1: Array | None = None
    threshold: Array | None = None
    inv_keep: Array | None = None
    score_consts: tuple = ()
    mask_consts: tuple = ()
    fwd_states: Array | None = None
    bwd_states: Array | None = None
    do: Array | None = None  # the backward passes' operands: d out [N, Tq, H, Dv],
    lse: Array | None = None  # lse and delta = rowsum(d_out * out) - d_lse [N, H, Tq, 1]
    delta: Array | None = None


# ----------------------------------------------------------------------------------------
# A kernel lowered for one platform only (multi-platform export)
# ----------------------------------------------------------------------------------------

# jax lowers every branch of a platform_dependent for every platform of the program, and
# a Pallas kernel cannot lower for another platform: this primitive holds the kernel call,
# lowered as it is for its platform and as zeros (never executed) for the others.
_only_on_p = jax.extend.core.Primitive("jattn_platform_only")
_only_on_p.multiple_results = True
_only_on_p.def_abstract_eval(lambda *avals, jaxpr, platform: jaxpr.out_avals)


def _lower_only_on(ctx, *args, jaxpr, platform):
    return mlir.lower_fun(jax.extend.core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)


def _lower_elsewhere(ctx, *args, jaxpr, platform):
    def zeros(*_):
        return [jnp.zeros(a.shape, a.dtype) for a in jaxpr.out_avals]

    return mlir.lower_fun(zeros, multiple_results=True)(ctx, *args)


for _p in ("cuda", "rocm", "tpu"):
    mlir.register_lowering(_only_on_p, _lower_only_on, platform=_p)
mlir.register_lowering(_only_on_p, _lower_elsewhere)


def _call(layout: Layout, kernel, *arrays):
    if layout.only_on is None:
        return kernel(*arrays)
    closed = jax.make_jaxpr(kernel)(*arrays)
    flat = jax.tree.leaves(arrays)
    out_tree = jax.tree.structure(jax.eval_shape(kernel, *arrays))
    return jax.tree.unflatten(
        out_tree, _only_on_p.bind(*flat, jaxpr=closed, platform=layout.only_on)
    )


# ----------------------------------------------------------------------------------------
# Block specs: which block of each operand a program reads
# ----------------------------------------------------------------------------------------


def _full(x: Array) -> pl.BlockSpec:
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _seq(spec: C.Spec, block: int, width: int, head, pos):
    """A block of ``block`` positions of one head (``head``/``pos``: block indices) in the
    sequence-major GPU layout ``[N, T, H, D]`` or the head-major TPU one ``[N, H, T, D]``;
    ``head`` None: the ``G`` heads of a key/value head (``pos`` then spans all rows)."""
    if spec.mosaic:
        shape = (None, spec.groups if head is None else None, block, width)
        return shape, (lambda b, hh, p: (b, hh, p, 0))
    shape = (None, block, spec.groups if head is None else None, width)
    return shape, (lambda b, hh, p: (b, p, hh, 0))


def _rows_spec(spec: C.Spec, block: int, width: int, grid):
    """A one-head block of ``block`` positions; ``grid(*program ids) -> (b, h, p)``."""
    shape, order = _seq(spec, block, width, True, None)
    return pl.BlockSpec(shape, lambda *ids: order(*grid(*ids)))


def _scalars(spec: C.Spec, per_batch, whole) -> dict[str, pl.BlockSpec]:
    """Scalar operands: in SMEM, whole, on TPUs; one ``[1, 1]`` block each on GPUs."""
    names = ("q_len", "kv_len", "threshold", "inv_keep")
    if spec.mosaic:
        from jax.experimental.pallas import tpu as pltpu

        smem = {n: pl.BlockSpec(memory_space=pltpu.SMEM) for n in names}
        smem.update(fwd_states=smem["q_len"], bwd_states=smem["q_len"])
        return smem
    return {
        "q_len": pl.BlockSpec((None, 1, 1), per_batch),
        "kv_len": pl.BlockSpec((None, 1, 1), per_batch),
        "threshold": pl.BlockSpec((None, 1, 1), whole),
        "inv_keep": pl.BlockSpec((None, 1, 1), whole),
    }


def _row_specs(spec: C.Spec, ins: Inputs, bq: int, bk: int) -> dict[str, pl.BlockSpec]:
    """Specs for a query-tile program ``(i, b, h)``: forward and dQ."""
    g = spec.groups
    d, dv = spec.head_dim, spec.v_dim

    def rows(width):
        shape, order = _seq(spec, bq, width, True, None)
        return pl.BlockSpec(shape, lambda i, b, h: order(b, h, i))

    def keys(width):
        shape, order = _seq(spec, spec.padded_kv, width, True, None)
        return pl.BlockSpec(shape, lambda i, b, h: order(b, lax.div(h, g), 0))

    specs = {
        "q": rows(d),
        "k": keys(d),
        "v": keys(dv),
        **_scalars(spec, lambda i, b, h: (b, 0, 0), lambda *_: (0, 0, 0)),
        "q_seg": pl.BlockSpec((None, bq, 1), lambda i, b, h: (b, i, 0)),
        "kv_seg": pl.BlockSpec((None, 1, spec.padded_kv), lambda i, b, h: (b, 0, 0)),
        "slopes": pl.BlockSpec((None, 1, 1), lambda i, b, h: (h, 0, 0)),
        "sinks": pl.BlockSpec((None, 1, 1), lambda i, b, h: (h, 0, 0)),
        "do": rows(dv),
        "lse": pl.BlockSpec((None, None, bq, 1), lambda i, b, h: (b, h, i, 0)),
        "delta": pl.BlockSpec((None, None, bq, 1), lambda i, b, h: (b, h, i, 0)),
    }
    if ins.bias is not None:
        nb, hb, lq, lk = ins.bias.shape
        specs["bias"] = pl.BlockSpec(
            (None, None, bq if lq > 1 else 1, lk),
            lambda i, b, h: (b if nb > 1 else 0, h if hb > 1 else 0, i if lq > 1 else 0, 0),
        )
    if ins.key0 is not None:
        nr, hr = ins.key0.shape[:2]
        row_key = pl.BlockSpec(
            (None, None, bq, 1), lambda i, b, h: (b if nr > 1 else 0, h if hr > 1 else 0, i, 0)
        )
        specs["key0"] = specs["key1"] = row_key
    return specs


def _col_specs(spec: C.Spec, ins: Inputs, bq: int, bk: int) -> dict[str, pl.BlockSpec]:
    """Specs for a key-tile program ``(j, b, kh)`` (dK/dV): all rows of the group's heads."""
    g = spec.groups
    d, dv, tq = spec.head_dim, spec.v_dim, spec.padded_q

    def group_rows(width):
        shape, order = _seq(spec, tq, width, None, None)
        return pl.BlockSpec(shape, lambda j, b, kh: order(b, kh, 0))

    def keys(width):
        shape, order = _seq(spec, bk, width, True, None)
        return pl.BlockSpec(shape, lambda j, b, kh: order(b, kh, j))

    specs = {
        "q": group_rows(d),
        "k": keys(d),
        "v": keys(dv),
        **_scalars(spec, lambda j, b, kh: (b, 0, 0), lambda *_: (0, 0, 0)),
        "q_seg": pl.BlockSpec((None, tq, 1), lambda j, b, kh: (b, 0, 0)),
        "kv_seg": pl.BlockSpec((None, 1, bk), lambda j, b, kh: (b, 0, j)),
        "slopes": pl.BlockSpec((g, 1, 1), lambda j, b, kh: (kh, 0, 0)),
        "do": group_rows(dv),
        "lse": pl.BlockSpec((None, g, tq, 1), lambda j, b, kh: (b, kh, 0, 0)),
        "delta": pl.BlockSpec((None, g, tq, 1), lambda j, b, kh: (b, kh, 0, 0)),
    }
    if ins.bias is not None:
        nb, hb, lq, lk = ins.bias.shape
        specs["bias"] = pl.BlockSpec(
            (None, g if hb > 1 else 1, lq, bk if lk > 1 else 1),
            lambda j, b, kh: (b if nb > 1 else 0, kh if hb > 1 else 0, 0, j if lk > 1 else 0),
        )
    if ins.key0 is not None:
        nr, hr = ins.key0.shape[:2]
        row_key = pl.BlockSpec(
            (None, g if hr > 1 else 1, tq, 1),
            lambda j, b, kh: (b if nr > 1 else 0, kh if hr > 1 else 0, 0, 0),
        )
        specs["key0"] = specs["key1"] = row_key
    return specs


def _flatten(ins: Inputs, specs: dict, skip: tuple[str, ...]) -> tuple[list, list, list]:
    """``(names, arrays, block specs)`` of the operands present (not in ``skip``), in
    :class:`Inputs` order; an operand without an entry in ``specs`` is read whole."""
    names, arrays, blocks = [], [], []
    for name, x in ins._asdict().items():
        if name in skip:
            continue
        items = (
            [(f"{name}{c}", c_x) for c, c_x in enumerate(x)]
            if isinstance(x, tuple)
            else [(name, x)]
        )
        for item, value in items:
            if value is not None:
                names.append(item)
                arrays.append(value)
                blocks.append(specs.get(item) or _full(value))
    return names, arrays, blocks


class _Refs:
    """The kernel's input refs by name (None for absent operands)."""

    def __init__(self, names, refs):
        self._refs = dict(zip(names, refs, strict=True))

    def __getattr__(self, name):
        return self._refs.get(name)

    def consts(self, kind: str, n: int) -> list:
        return [self._refs[f"{kind}{c}"][...] for c in range(n)]


def _scalar(spec: C.Spec, ref, b=None):
    """A scalar operand: ``ref[b]`` of the whole ``[N, 1, 1]`` array in SMEM (TPU), the
    program's ``[1, 1]`` block (GPU); ``b`` None: a call-wide scalar."""
    if ref is None:
        return None
    if spec.mosaic:
        return ref[0 if b is None else b, 0, 0]
    return ref[0, 0]


def _group_rows(spec: C.Spec, ref, g, rows):
    """Rows ``rows`` of the ``g``-th head of a group block (either layout)."""
    return ref[g, rows, :] if spec.mosaic else ref[rows, g, :]


# ----------------------------------------------------------------------------------------
# Tile ranges and the masked / plain choice
# ----------------------------------------------------------------------------------------


def _key_range(spec: C.Spec, row0, bq: int, bk: int, q_len, kv_len):
    """``[lo, hi)`` key tiles a query tile at ``row0`` visits (int32 scalars)."""
    lo_band, hi_band = spec.band
    lo_key = jnp.maximum(row0 + lo_band, 0) if lo_band is not None else jnp.int32(0)
    end = jnp.int32(spec.kv_len)
    if hi_band is not None:
        end = jnp.minimum(end, row0 + bq + hi_band)
    if kv_len is not None:
        end = jnp.minimum(end, kv_len)
    lo, hi = lax.div(lo_key, bk), lax.div(end + bk - 1, bk)  # non-negative: lax.div floors
    if q_len is not None:
        hi = jnp.where(row0 < q_len, hi, lo)
    return lo, jnp.maximum(hi, lo)


def _query_range(spec: C.Spec, col0, bq: int, bk: int, q_len, kv_len):
    """``[lo, hi)`` query tiles a key tile at ``col0`` is visited by (int32 scalars)."""
    lo_band, hi_band = spec.band
    lo_row = jnp.maximum(col0 - hi_band, 0) if hi_band is not None else jnp.int32(0)
    end = jnp.int32(spec.q_len)
    if lo_band is not None:
        end = jnp.minimum(end, col0 + bk - lo_band)
    if q_len is not None:
        end = jnp.minimum(end, q_len)
    lo, hi = lax.div(lo_row, bq), lax.div(end + bq - 1, bq)
    if kv_len is not None:
        hi = jnp.where(col0 < kv_len, hi, lo)
    return lo, jnp.maximum(hi, lo)


def _interior(spec: C.Spec, row0, bq: int, col0, bk: int, q_len, kv_len):
    """Whether a tile lies wholly inside the band and the lengths (no position mask):
    a traced bool, or Python True when nothing can hide a position."""
    lo_band, hi_band = spec.band
    parts = []
    if lo_band is not None:
        parts.append(col0 - (row0 + bq - 1) >= lo_band)
    if hi_band is not None:
        parts.append(col0 + bk - 1 - row0 <= hi_band)
    if spec.padded_kv != spec.kv_len:
        parts.append(col0 + bk <= spec.kv_len)
    if q_len is not None:
        parts.append(row0 + bq <= q_len)
    if kv_len is not None:
        parts.append(col0 + bk <= kv_len)
    if not parts:
        return True
    inside = parts[0]
    for p in parts[1:]:
        inside = inside & p
    return inside


def _visit(spec: C.Spec, step, carry, interior, state):
    """Runs ``step(carry, masked, mod_mask) -> carry`` on a tile: skipped when its block-mask
    state is EMPTY, without the position mask inside the band, without ``mask_mod`` on
    FULL tiles."""
    if state is None:
        if spec.elementwise_mask:
            return step(carry, True, True)
        if interior is True:
            return step(carry, False, False)
        return lax.cond(
            interior, lambda c: step(c, False, False), lambda c: step(c, True, True), carry
        )

    def masked(c):
        full = state == block_masks.FULL
        return lax.cond(full, lambda c2: step(c2, True, False), lambda c2: step(c2, True, True), c)

    def visible(c):
        if spec.segments:
            return masked(c)
        plain = state == block_masks.FULL
        if interior is not True:
            plain = plain & interior
        return lax.cond(plain, lambda c2: step(c2, False, False), masked, c)

    return lax.cond(state != block_masks.EMPTY, visible, lambda c: c, carry)


def _any(mask) -> Array:
    return jnp.max(mask.astype(jnp.int32)) > 0


# ----------------------------------------------------------------------------------------
# Scores of one tile
# ----------------------------------------------------------------------------------------


def _tile_scores(spec: C.Spec, r: _Refs, t: C.Tile, q, k, slope, score_consts, bias, grad: bool):
    """Final scores of a tile ``[bq, bk]`` (modifiers, then the bias) and, with ``grad``, the
    modifiers' VJP (None without modifiers)."""
    s = C.raw_scores(spec, q, k)
    vjp = None
    modified = spec.softcap is not None or spec.alibi is not None or spec.score_mod
    if modified and grad:
        s, vjp = C.modify_vjp(spec, s, t, slope, score_consts)
    elif modified:
        s = C.modify(spec, s, t, slope, score_consts)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    return s, vjp


def _mask(
    spec: C.Spec, t: C.Tile, masked: bool, mod_mask: bool, q_len, kv_len, q_seg, kv_seg, mconsts
):
    if not masked:
        return None
    sub = spec if mod_mask else _without_mask_mod(spec)
    return C.tile_mask(sub, t, q_len, kv_len, q_seg, kv_seg, mconsts)


@functools.cache
def _spec_without_mask_mod(spec: C.Spec) -> C.Spec:
    return dataclasses.replace(spec, mask_mods=None, num_mask_consts=0)


def _without_mask_mod(spec: C.Spec) -> C.Spec:
    return spec if not spec.mask_mod else _spec_without_mask_mod(spec)


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------


def _forward_kernel(spec: C.Spec, names, *refs):
    r = _Refs(names, refs[: len(names)])
    o_ref, lse_ref = refs[len(names) :]
    bq, bk = spec.fwd_block
    i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row0 = i * bq
    q = r.q[...]
    q_len, kv_len = _scalar(spec, r.q_len, b), _scalar(spec, r.kv_len, b)
    q_seg = None if r.q_seg is None else r.q_seg[...]
    slope = None if r.slopes is None else r.slopes[...].astype(jnp.float32)
    sconsts = r.consts("score_consts", spec.num_score_consts)
    mconsts = r.consts("mask_consts", spec.num_mask_consts)
    keys = None if r.key0 is None else (r.key0[...], r.key1[...])
    threshold = _scalar(spec, r.threshold)
    inv_keep = _scalar(spec, r.inv_keep)
    if r.sinks is not None:
        m0 = jnp.broadcast_to(r.sinks[...].astype(jnp.float32), (bq, 1))
        l0 = jnp.ones((bq, 1), jnp.float32)
    else:
        m0 = jnp.full((bq, 1), -jnp.inf, jnp.float32)
        l0 = jnp.zeros((bq, 1), jnp.float32)
    acc0 = jnp.zeros((bq, spec.v_dim), jnp.float32)

    def body(j, carry):
        col0 = j * bk
        t = C.Tile(b, h, row0, bq, col0, bk)
        cols = pl.ds(pl.multiple_of(col0, bk), bk)
        kv_seg = None if r.kv_seg is None else r.kv_seg[:, cols]

        def step(c, masked: bool, mod_mask: bool):
            m, total, acc = c
            k = r.k[cols, :]
            v = r.v[cols, :]
            bias = _bias_rows(r, spec, cols)
            s, _ = _tile_scores(spec, r, t, q, k, slope, sconsts, bias, grad=False)
            mask = _mask(spec, t, masked, mod_mask, q_len, kv_len, q_seg, kv_seg, mconsts)
            if mask is not None:  # -inf: visible logits below C.NEG still outweigh hidden keys
                s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            # the shift: 0 while a row has seen no finite logit (no -inf - (-inf))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift)  # exactly zero for hidden keys
            alpha = jnp.exp(m - shift)
            total = total * alpha + jnp.sum(p, axis=1, keepdims=True)
            if keys is not None:
                p = jnp.where(C.keep(t, *keys, threshold), p * inv_keep, 0.0)
            acc = acc * alpha + C.dot(p.astype(v.dtype), v, (1, 0))
            return m_new, total, acc

        interior = _interior(spec, row0, bq, col0, bk, q_len, kv_len)
        state = None if r.fwd_states is None else r.fwd_states[i, j]
        return _visit_tile(spec, step, carry, interior, state, q_seg, kv_seg)

    lo, hi = _key_range(spec, row0, bq, bk, q_len, kv_len)
    m, total, acc = lax.fori_loop(lo, hi, body, (m0, l0, acc0))
    seen = total > 0.0
    safe_l = jnp.where(seen, total, 1.0)
    o_ref[...] = jnp.where(seen, acc / safe_l, 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe_l), C.NEG)


def _bias_rows(r: _Refs, spec: C.Spec, cols):
    """The forward / dQ program's bias tile (rows of its block, the tile's keys)."""
    if r.bias is None:
        return None
    return r.bias[:, cols] if r.bias.shape[-1] > 1 else r.bias[...]


def forward(spec: C.Spec, layout: Layout, ins: Inputs):
    """``(out [N, Tq, H, Dv], lse [N, H, Tq, 1] float32)`` of the padded operands."""
    bq, bk = spec.fwd_block
    specs = _row_specs(spec, ins, bq, bk)
    names, arrays, blocks = _flatten(ins, specs, ("bwd_states",))
    n, h = spec.batch, spec.num_heads
    out_layout = (n, h, spec.padded_q) if spec.mosaic else (n, spec.padded_q, h)
    out_shape = [
        jax.ShapeDtypeStruct((*out_layout, spec.v_dim), ins.q.dtype),
        jax.ShapeDtypeStruct((n, h, spec.padded_q, 1), jnp.float32),
    ]
    out_specs = [
        _rows_spec(spec, bq, spec.v_dim, lambda i, b, hh: (b, hh, i)),
        pl.BlockSpec((None, None, bq, 1), lambda i, b, hh: (b, hh, i, 0)),
    ]
    call = pl.pallas_call(
        functools.partial(_forward_kernel, spec, tuple(names)),
        grid=(spec.padded_q // bq, n, h),
        in_specs=blocks,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=layout.interpret,
        compiler_params=None if layout.compiler_params is None else layout.compiler_params("fwd"),
        name="jattn_flash_fwd",
    )
    return tuple(_call(layout, call, *arrays))


# ----------------------------------------------------------------------------------------
# Backward: dK / dV (and the bias, slope and score-constant gradients), then dQ
# ----------------------------------------------------------------------------------------


def _probs(spec: C.Spec, s, mask, lse):
    p = jnp.exp(s - lse)
    return p if mask is None else jnp.where(mask, p, 0.0)


def _drop(spec: C.Spec, t: C.Tile, keys, threshold, inv_keep, p, dp):
    """``(p, dp)`` through dropout: kept elements scaled by ``1 / keep``, dropped ones 0."""
    if keys is None:
        return p, dp
    kept = C.keep(t, *keys, threshold)
    return jnp.where(kept, p * inv_keep, 0.0), jnp.where(kept, dp * inv_keep, 0.0)


def _dkv_kernel(spec: C.Spec, names, out_names, *refs):
    r = _Refs(names, refs[: len(names)])
    out = dict(zip(out_names, refs[len(names) :], strict=True))
    bq, bk = spec.bwd_block
    kt = _key_tile(spec, r)
    bias_q, bias_k = _bias_axes(r)
    if bias_q:  # tiles never visited keep a zero gradient
        _clear_dbias(spec, out["dbias"], bk if bias_k else 1)
    f32 = jnp.float32
    floats = [c for c, fl in zip(kt.sconsts, spec.score_float, strict=True) if fl]
    lo, hi = _query_range(spec, kt.col0, bq, bk, kt.q_len, kt.kv_len)
    carry0 = (
        jnp.zeros((bk, spec.head_dim), f32),
        jnp.zeros((bk, spec.v_dim), f32),
        tuple(jnp.zeros(c.shape, f32) for c in floats),
    )
    head = functools.partial(_dkv_head, spec, r, out, kt, lo, hi)
    dk, dv, d_consts = lax.fori_loop(0, spec.groups, head, carry0)
    out["dk"][...] = dk.astype(out["dk"].dtype)
    out["dv"][...] = dv.astype(out["dv"].dtype)
    for c, d in enumerate(d_consts):
        out[f"dconst{c}"][...] = d.astype(out[f"dconst{c}"].dtype)


class _KeyTile(NamedTuple):
    """A dK/dV program's key tile and the operands all its query tiles share."""

    b: Array  # the program's batch row
    kh: Array  # its key/value head
    j: Array  # its key tile
    col0: Array  # the tile's first key
    k: Array
    v: Array
    q_len: Array | None
    kv_len: Array | None
    kv_seg: Array | None
    sconsts: list
    mconsts: list
    threshold: Array | None
    inv_keep: Array | None


def _key_tile(spec: C.Spec, r: _Refs) -> _KeyTile:
    """The dK/dV program's :class:`_KeyTile`, read from its program ids and refs."""
    j, b, kh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    return _KeyTile(
        b=b, kh=kh, j=j, col0=j * spec.bwd_block[1], k=r.k[...], v=r.v[...],
        q_len=_scalar(spec, r.q_len, b), kv_len=_scalar(spec, r.kv_len, b),
        kv_seg=None if r.kv_seg is None else r.kv_seg[...],
        sconsts=r.consts("score_consts", spec.num_score_consts),
        mconsts=r.consts("mask_consts", spec.num_mask_consts),
        threshold=_scalar(spec, r.threshold), inv_keep=_scalar(spec, r.inv_keep),
    )  # fmt: skip


def _bias_axes(r: _Refs) -> tuple[bool, bool]:
    """Whether the dK/dV program's bias varies along queries, and along keys."""
    return (
        r.bias is not None and r.bias.shape[1] > 1,
        r.bias is not None and r.bias.shape[2] > 1,
    )


def _clear_dbias(spec: C.Spec, dbias_ref, width: int):
    """Zeros every query tile of a bias-gradient block ``[G, Lq, width]``."""
    bq = spec.bwd_block[0]
    nq = spec.padded_q // bq
    zeros = jnp.zeros((bq, width), jnp.float32)

    def clear_head(g, _):
        def clear(i, _):
            dbias_ref[g, pl.ds(pl.multiple_of(i * bq, bq), bq), :] = zeros
            return 0

        return lax.fori_loop(0, nq, clear, 0)

    lax.fori_loop(0, dbias_ref.shape[0], clear_head, 0)


class _QueryHead(NamedTuple):
    """One query head of a dK/dV program's group."""

    g: Array  # its index in the group
    h: Array  # its head
    slope: Array | None  # its ALiBi slope (float32)
    gb: Any  # its index in the bias block (0 where the heads share the bias)
    gr: Any  # its index in the dropout keys (0 where the heads share the dropout mask)


def _dkv_head(spec: C.Spec, r: _Refs, out: dict, kt: _KeyTile, lo, hi, g, carry):
    """``carry`` plus head ``g``'s query tiles ``[lo, hi)``; writes its summed dbias, dslope."""
    dk, dv, d_consts = carry
    bias_q, bias_k = _bias_axes(r)
    f32 = jnp.float32
    qh = _QueryHead(
        g=g,
        h=kt.kh * spec.groups + g,
        slope=None if r.slopes is None else r.slopes[g].astype(f32),
        gb=g if r.bias is not None and r.bias.shape[0] > 1 else 0,
        gr=g if r.key0 is not None and r.key0.shape[0] > 1 else 0,
    )
    bias_acc0 = jnp.zeros((1, spec.bwd_block[1] if bias_k else 1), f32)
    slope_acc0 = jnp.zeros((1, 1), f32)
    row_tile = functools.partial(_dkv_query_tile, spec, r, out, kt, qh)
    dk, dv, d_consts, bias_acc, slope_acc = lax.fori_loop(
        lo, hi, row_tile, (dk, dv, d_consts, bias_acc0, slope_acc0)
    )
    if r.bias is not None and not bias_q:
        out["dbias"][g] = bias_acc
    if "dslope" in out:
        out["dslope"][g] = slope_acc
    return dk, dv, d_consts


def _dkv_query_tile(spec: C.Spec, r: _Refs, out: dict, kt: _KeyTile, qh: _QueryHead, i, c):
    """``c`` plus query tile ``i``'s gradients: skipped, plain or masked as it is visible."""
    bq, bk = spec.bwd_block
    row0 = i * bq
    rows = pl.ds(pl.multiple_of(row0, bq), bq)
    t = C.Tile(kt.b, qh.h, row0, bq, kt.col0, bk)
    q_seg = None if r.q_seg is None else r.q_seg[rows, :]
    step = functools.partial(_dkv_tile, spec, r, out, kt, qh, t, rows, q_seg)
    interior = _interior(spec, row0, bq, kt.col0, bk, kt.q_len, kt.kv_len)
    state = None if r.bwd_states is None else r.bwd_states[i, kt.j]
    return _visit_tile(spec, step, c, interior, state, q_seg, kt.kv_seg)


def _visit_tile(spec: C.Spec, step, carry, interior, state, q_seg, kv_seg):
    """:func:`_visit`, first skipping (where no tile states do) a tile whose segments never meet."""
    if spec.segments and state is None:
        seen = _any(q_seg == kv_seg)
        return lax.cond(
            seen, lambda c2: _visit(spec, step, c2, interior, None), lambda c2: c2, carry
        )
    return _visit(spec, step, carry, interior, state)


def _dkv_tile(
    spec: C.Spec, r: _Refs, out: dict, kt: _KeyTile, qh: _QueryHead, t: C.Tile, rows, q_seg,
    c, masked: bool, mod_mask: bool,
):  # fmt: skip
    """``c`` plus one visible tile's dK, dV, bias, slope and score-constant gradients."""
    dk, dv, d_consts, bias_acc, slope_acc = c
    q, do = _group_rows(spec, r.q, qh.g, rows), _group_rows(spec, r.do, qh.g, rows)
    lse, delta = r.lse[qh.g, rows, :], r.delta[qh.g, rows, :]
    bias = _dkv_bias(r, qh.gb, rows)
    s, vjp = _tile_scores(spec, r, t, q, kt.k, qh.slope, kt.sconsts, bias, grad=True)
    mask = _mask(spec, t, masked, mod_mask, kt.q_len, kt.kv_len, q_seg, kt.kv_seg, kt.mconsts)
    p = _probs(spec, s, mask, lse)
    keys = None if r.key0 is None else (r.key0[qh.gr, rows, :], r.key1[qh.gr, rows, :])
    pd, dp = _drop(spec, t, keys, kt.threshold, kt.inv_keep, p, C.dot(do, kt.v, (1, 1)))
    dv = dv + C.dot(pd.astype(do.dtype), do, (0, 0))
    ds = p * (dp - delta)
    if r.bias is not None:
        bias_acc = _add_dbias(r, out, qh.g, rows, ds, bias_acc)
    if vjp is not None:
        ds, slope_acc, d_consts = _modifier_grads(spec, vjp, ds, slope_acc, d_consts)
    dk = dk + C.dot(ds.astype(q.dtype), q, (0, 0)) * spec.scale
    return dk, dv, d_consts, bias_acc, slope_acc


def _dkv_bias(r: _Refs, gb, rows):
    """The dK/dV program's bias tile (head ``gb`` of its block, the tile's queries)."""
    if r.bias is None:
        return None
    return r.bias[gb, rows, :] if _bias_axes(r)[0] else r.bias[gb]


def _add_dbias(r: _Refs, out: dict, g, rows, ds, bias_acc):
    """Head ``g``'s bias gradient of a tile: written where it varies along queries, else summed."""
    bias_q, bias_k = _bias_axes(r)
    tile_db = ds if bias_k else jnp.sum(ds, axis=1, keepdims=True)
    if bias_q:
        out["dbias"][g, rows, :] = tile_db
        return bias_acc
    return bias_acc + jnp.sum(tile_db, axis=0, keepdims=True)


def _modifier_grads(spec: C.Spec, vjp, ds, slope_acc, d_consts):
    """``ds`` through the score modifiers' VJP, and the slope and float-constant gradient sums."""
    ds, d_slope, dc = vjp(ds)
    if d_slope is not None:
        slope_acc = slope_acc + d_slope
    d_floats = [x for x, fl in zip(dc, spec.score_float, strict=True) if fl]
    d_consts = tuple(a + x for a, x in zip(d_consts, d_floats, strict=True))
    return ds, slope_acc, d_consts


def _dq_kernel(spec: C.Spec, names, *refs):
    r = _Refs(names, refs[: len(names)])
    (dq_ref,) = refs[len(names) :]
    bq, bk = spec.bwd_block
    i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row0 = i * bq
    q, do = r.q[...], r.do[...]
    lse, delta = r.lse[...], r.delta[...]
    q_len, kv_len = _scalar(spec, r.q_len, b), _scalar(spec, r.kv_len, b)
    q_seg = None if r.q_seg is None else r.q_seg[...]
    slope = None if r.slopes is None else r.slopes[...].astype(jnp.float32)
    sconsts = r.consts("score_consts", spec.num_score_consts)
    mconsts = r.consts("mask_consts", spec.num_mask_consts)
    keys = None if r.key0 is None else (r.key0[...], r.key1[...])
    threshold, inv_keep = _scalar(spec, r.threshold), _scalar(spec, r.inv_keep)

    def body(j, dq):
        col0 = j * bk
        t = C.Tile(b, h, row0, bq, col0, bk)
        cols = pl.ds(pl.multiple_of(col0, bk), bk)
        kv_seg = None if r.kv_seg is None else r.kv_seg[:, cols]

        def step(dq, masked: bool, mod_mask: bool):
            k, v = r.k[cols, :], r.v[cols, :]
            s, vjp = _tile_scores(
                spec, r, t, q, k, slope, sconsts, _bias_rows(r, spec, cols), grad=True
            )
            mask = _mask(spec, t, masked, mod_mask, q_len, kv_len, q_seg, kv_seg, mconsts)
            p = _probs(spec, s, mask, lse)
            _, dp = _drop(spec, t, keys, threshold, inv_keep, p, C.dot(do, v, (1, 1)))
            ds = p * (dp - delta)
            if vjp is not None:
                ds = vjp(ds)[0]
            return dq + C.dot(ds.astype(k.dtype), k, (1, 0)) * spec.scale

        interior = _interior(spec, row0, bq, col0, bk, q_len, kv_len)
        state = None if r.bwd_states is None else r.bwd_states[i, j]
        return _visit_tile(spec, step, dq, interior, state, q_seg, kv_seg)

    lo, hi = _key_range(spec, row0, bq, bk, q_len, kv_len)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, spec.head_dim), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def backward(spec: C.Spec, layout: Layout, ins: Inputs):
    """The dK/dV and dQ kernels on ``ins`` (with ``do``, ``lse``, ``delta``): a dict of
    ``dq, dk, dv`` and, where the call has them, ``dbias`` ``[N, H, Lq', Lk']`` (per
    batch row and head; ``Lk'`` = key tiles when the bias is constant along keys),
    ``dslope`` ``[nk, N, H, 1, 1]``, ``dconst{c}`` ``[nk, N, K, *shape]`` (partial sums)."""
    bq, bk = spec.bwd_block
    n, h, kvh, g = spec.batch, spec.num_heads, spec.kv_heads, spec.groups
    nq, nk = spec.padded_q // bq, spec.padded_kv // bk
    params = layout.compiler_params
    skip = ("fwd_states", "sinks")

    names, arrays, blocks = _flatten(ins, _col_specs(spec, ins, bq, bk), skip)
    outs = {
        "dk": (jax.ShapeDtypeStruct(ins.k.shape, ins.k.dtype),
               _rows_spec(spec, bk, spec.head_dim, lambda j, b, kh: (b, kh, j))),
        "dv": (jax.ShapeDtypeStruct(ins.v.shape, ins.v.dtype),
               _rows_spec(spec, bk, spec.v_dim, lambda j, b, kh: (b, kh, j))),
    }  # fmt: skip
    if ins.bias is not None:
        lq, lk = ins.bias.shape[2:]
        shape = (n, h, lq, lk if lk > 1 else nk)
        outs["dbias"] = (
            jax.ShapeDtypeStruct(shape, jnp.float32),
            pl.BlockSpec((None, g, lq, bk if lk > 1 else 1), lambda j, b, kh: (b, kh, 0, j)),
        )
    if ins.slopes is not None:
        outs["dslope"] = (
            jax.ShapeDtypeStruct((nk, n, h, 1, 1), jnp.float32),
            pl.BlockSpec((None, None, g, 1, 1), lambda j, b, kh: (j, b, kh, 0, 0)),
        )
    floats = [c for c, fl in zip(ins.score_consts, spec.score_float, strict=True) if fl]
    for c, x in enumerate(floats):
        rank = x.ndim
        outs[f"dconst{c}"] = (
            jax.ShapeDtypeStruct((nk, n, kvh, *x.shape), jnp.float32),
            pl.BlockSpec(
                (None, None, None, *x.shape), lambda j, b, kh, rank=rank: (j, b, kh) + (0,) * rank
            ),
        )
    out_names = tuple(outs)
    call = pl.pallas_call(
        functools.partial(_dkv_kernel, spec, tuple(names), out_names),
        grid=(nk, n, kvh),
        in_specs=blocks,
        out_specs=[o[1] for o in outs.values()],
        out_shape=[o[0] for o in outs.values()],
        interpret=layout.interpret,
        compiler_params=None if params is None else params("dkv"),
        name="jattn_flash_dkv",
    )
    results = _call(layout, call, *arrays)
    grads = dict(zip(out_names, results, strict=True))

    names, arrays, blocks = _flatten(ins, _row_specs(spec, ins, bq, bk), skip)
    call = pl.pallas_call(
        functools.partial(_dq_kernel, spec, tuple(names)),
        grid=(nq, n, h),
        in_specs=blocks,
        out_specs=_rows_spec(spec, bq, spec.head_dim, lambda i, b, hh: (b, hh, i)),
        out_shape=jax.ShapeDtypeStruct(ins.q.shape, ins.q.dtype),
        interpret=layout.interpret,
        compiler_params=None if params is None else params("dq"),
        name="jattn_flash_dq",
    )
    grads["dq"] = _call(layout, call, *arrays)
    return grads


# ----------------------------------------------------------------------------------------
# The differentiable kernel call
# ----------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def flash(spec: C.Spec, layout: Layout, ins: Inputs):
    """``(out [N, Tq, H, Dv], lse [N, H, Tq, 1])``, differentiable in both (kernel VJPs)."""
    return forward(spec, layout, ins)


def _flash_fwd(spec, layout, ins):
    out, lse = forward(spec, layout, ins)
    return (out, lse), (ins, out, lse)


def _flash_bwd(spec: C.Spec, layout: Layout, residuals, cotangents):
    ins, out, lse = residuals
    d_out, d_lse = cotangents
    f32 = jnp.float32
    # delta_i = sum_j p_ij dp_ij = d_out_i . out_i; the lse cotangent enters as -d_lse.
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)  # [N, Tq, H] | [N, H, Tq]
    delta = (delta if spec.mosaic else jnp.swapaxes(delta, 1, 2))[..., None] - d_lse
    grads = backward(spec, layout, ins._replace(do=d_out.astype(ins.q.dtype), lse=lse, delta=delta))
    d = {name: None for name in Inputs._fields}
    d.update(q=grads["dq"], k=grads["dk"], v=grads["dv"], score_consts=(), mask_consts=())
    if ins.bias is not None:
        nb, hb, _, lk = ins.bias.shape
        db = grads["dbias"]
        db = db.sum(
            axis=tuple(a for a, full in ((0, nb > 1), (1, hb > 1), (3, lk > 1)) if not full),
            keepdims=True,
        )
        d["bias"] = db.astype(ins.bias.dtype)
    if ins.slopes is not None:
        d["slopes"] = grads["dslope"].sum(axis=(0, 1)).astype(ins.slopes.dtype)  # [H, 1, 1]
    if ins.sinks is not None:
        # The sink's probability in row i is exp(sink - lse_i); d out_i / d sink = -p out_i.
        p_sink = jnp.exp(ins.sinks[None, :, :, 0].astype(f32) - lse[..., 0])  # [N, H, Tq]
        d["sinks"] = (-jnp.sum(p_sink * delta[..., 0], axis=(0, 2))).reshape(ins.sinks.shape)
        d["sinks"] = d["sinks"].astype(ins.sinks.dtype)
    consts, c_float = [], 0
    for x, fl in zip(ins.score_consts, spec.score_float, strict=True):
        if fl:
            consts.append(grads[f"dconst{c_float}"].sum(axis=(0, 1, 2)).astype(x.dtype))
            c_float += 1
        else:
            consts.append(None)
    d["score_consts"] = tuple(consts)
    d["mask_consts"] = tuple(None for _ in ins.mask_consts)
    return (Inputs(**d),)


flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def given(spec: C.Spec, layout: Layout, ins: Inputs, out: Array, lse: Array):
    """:func:`flash` with its forward pass given (``out``, ``lse`` as :func:`flash`
    returned them for ``ins``): returns them, and its VJP is the backward kernels'."""
    return out, lse


def _given_fwd(spec, layout, ins, out, lse):
    return (out, lse), (ins, out, lse)


def _given_bwd(spec, layout, residuals, cotangents):
    (d_ins,) = _flash_bwd(spec, layout, residuals, cotangents)
    _, out, lse = residuals
    return d_ins, jnp.zeros_like(out), jnp.zeros_like(lse)


given.defvjp(_given_fwd, _given_bwd)
