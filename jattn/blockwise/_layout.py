"""The blockwise path's entry: a validated call laid out in tiles, run, and laid back.

:func:`attention` takes a call checked by :func:`jattn.dot_product_attention` (its
:class:`jattn._call.Operands` and :class:`jattn._call.Settings`), reshapes
``[batch..., T, H, D]`` into the tile layout ``[N, K, G, T_pad, D]`` (``N`` the flattened
batch, ``K`` key/value heads, ``G`` query heads per key/value head), turns masks, lengths,
segment ids, dropout and the modifiers into the passes' operands, runs
:func:`jattn.blockwise._passes.core` on each split of the heads and lays the result back.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn import _prng
from jattn._call import Operands, Settings
from jattn._util import axis_specs, expand_rank, sharded_axes, softmax_dtype
from jattn.blockwise._config import Aux, Config, ModOperands, ModSpec, make_config
from jattn.blockwise._mods import hoist_modifier, peel_band
from jattn.blockwise._passes import core
from jattn.blockwise._schedule import block_states, causal_fast, schedule

__all__ = ["attention", "explicit_closure", "head_splits", "tile_flags", "tile_layout"]

Array = jax.Array


def attention(query, key, value, ops: Operands, settings: Settings, *, block_q=None, block_k=None):
    """Blockwise attention of a validated call (see :mod:`jattn._call`).

    On operands sharded in their types (a mesh's explicit axes) the loops run with those
    axes made automatic (:func:`_on_auto_axes`) and over all heads at once (no
    :func:`head_splits`: the devices share the work, and a split would slice the sharded
    head axis across them), so each device computes its own rows or heads.

    Returns:
      ``(out, lse)``: out ``[batch..., q_len, H, Dv]`` in the inputs' dtype; with
      ``settings.return_residual`` the log-sum-exp ``[batch..., q_len, H]`` (float32+,
      :func:`jattn.large_negative` for rows that see no key, differentiable), else None.
    """
    if not sharded_axes(query, key, value, ops):
        return _attention(query, key, value, ops, settings, block_q, block_k, split_heads=True)

    def attend(q, k, v, o, score_mod, mask_mod):
        local = dataclasses.replace(settings, score_mod=score_mod, mask_mod=mask_mod)
        return _attention(q, k, v, o, local, block_q, block_k, split_heads=False)

    operands = (query, key, value, ops, settings.score_mod, settings.mask_mod)
    return _on_auto_axes(attend, settings.return_residual, *operands)


def _on_auto_axes(attend, residual: bool, query, *operands):
    """``attend(query, *operands) -> (out, lse or None)`` with the mesh's explicit axes made
    automatic inside (``jax.sharding.auto_axes``): XLA partitions the loops as it does on an
    automatic mesh (jax's explicit types refused their carries and head slices), and the
    results come back typed as the query's leading axes. The arrays of ``operands``' pytrees
    pass in as arguments, typed for the automatic axes: among them the arrays of
    :mod:`jattn.mods`' modifiers (pytrees), which a closure could not carry in (an array
    typed on explicit axes, read in the automatic context, makes jax raise)."""
    leaves, tree = jax.tree.flatten((query, *operands))
    where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    def inner(*arrays):  # the arrays replaced; Python numbers (the scale) stay static
        full = list(leaves)
        for i, x in zip(where, arrays, strict=True):
            full[i] = x
        return attend(*jax.tree.unflatten(tree, full))

    sharding = jax.typeof(query).sharding
    lead = axis_specs(query)[:-1]
    out_sharding = (
        sharding.update(spec=jax.P(*lead, None)),
        sharding.update(spec=jax.P(*lead)) if residual else None,
    )
    return jax.sharding.auto_axes(inner, out_sharding=out_sharding)(*(leaves[i] for i in where))


def explicit_closure(settings: Settings) -> str | None:
    """Why the call's modifiers cannot run on operands sharded in their types (None: they
    can): one closes over an array typed on a mesh's explicit axes, which
    :func:`_on_auto_axes` cannot pass in (jax raises when the automatic context reads it).
    The arrays of :mod:`jattn.mods`' modifiers are their pytree leaves and pass."""
    for fn, kind in ((settings.score_mod, "score_mod"), (settings.mask_mod, "mask_mod")):
        if fn is None:
            continue
        _, consts = hoist_modifier(fn, kind[:-4], jnp.float32)
        leaves = {id(x) for x in jax.tree.leaves(fn)}
        if any(id(c) not in leaves and _explicitly_typed(c) for c in consts):
            return (
                f"a {kind} closes over an array placed on a mesh of explicit axes, which the "
                "blockwise path's loops (on the mesh's axes made automatic) cannot read: "
                "pass it through a jattn.mods modifier (jattn.mods.alibi, relative_bias, ...) "
                "or as segment ids, lengths or a bias, or close over an unplaced copy"
            )
    return None


def _explicitly_typed(x) -> bool:
    """Whether array ``x``'s type names a mesh with explicit axes."""
    if not isinstance(x, jax.Array):
        return False
    mesh = jax.typeof(x).sharding.mesh
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _attention(query, key, value, ops, settings, block_q, block_k, *, split_heads: bool):
    """:func:`attention`'s computation; ``split_heads``: over :func:`head_splits`' splits
    of the heads, else all at once."""
    *batch, q_len, num_heads, _ = query.shape
    dv = value.shape[-1]
    cfg, q, k, v, aux, mops = _prepare(query, key, value, ops, settings, block_q, block_k)
    try:
        splits = head_splits(cfg) if split_heads else 1
        out, lse = _by_head_splits(cfg, q, k, v, aux, mops, splits)
    except TypeError as e:
        if "forward-mode" not in str(e):
            raise
        raise TypeError(
            "jattn's blockwise attention path has a custom VJP (FlashAttention's backward), "
            "which forward-mode autodiff applied to the call (jax.jvp, jax.jacfwd) cannot go "
            "through. "
            "Pass implementation='dense' to jattn.dot_product_attention (modules: "
            "attention_implementation='dense'); the automatic rule picks blockwise on CPU "
            "from jattn._routing.AUTO_MIN_LEN tokens."
        ) from e
    # [N, K, G, Tq_pad, Dv] -> [batch..., q_len, H, Dv]
    out = out[:, :, :, :q_len].transpose(0, 3, 1, 2, 4).reshape(*batch, q_len, num_heads, dv)
    if not settings.return_residual:
        return out, None
    # [N, K, G, Tq_pad] -> [batch..., q_len, H]
    lse = lse[..., :q_len].transpose(0, 3, 1, 2).reshape(*batch, q_len, num_heads)
    return out, lse


def tile_flags(query, key, value, ops: Operands, settings: Settings, *, block_q=None,
               block_k=None):  # fmt: skip
    """The forward pass's schedule of a validated call: ``(needed, full, fast)`` with
    ``needed``/``full`` bool numpy ``[num_q_tiles, num_kv_tiles]`` (computed at all;
    computed without an elementwise mask) and ``fast`` whether the causal fast path runs.

    For inspection and tests (how many tiles a mask skips); eager calls only.
    """
    cfg, _, _, _, aux, _ = _prepare(query, key, value, ops, settings, block_q, block_k)
    plan = schedule(cfg, aux)
    fast = causal_fast(cfg, aux, cfg.block_q, cfg.block_k)
    return np.asarray(plan.needed), np.asarray(plan.full), fast


def _prepare(query, key, value, ops: Operands, settings: Settings, block_q, block_k):
    """``(cfg, q, k, v, aux, mops)``: the call in tile layout (see :func:`attention`)."""
    *batch, q_len, num_heads, d = query.shape
    kv_len, k_heads, dv = value.shape[-3:]
    n = math.prod(batch)
    groups = num_heads // k_heads
    # A ready-made causal mask_mod is the causal band: the same schedule (and fast path)
    causal, mask_rest = peel_band(settings.mask_mod)
    cfg = make_config(
        q_len=q_len,
        kv_len=kv_len,
        num_heads=num_heads,
        kv_heads=k_heads,
        batch_size=n,
        scale=ops.scale,
        is_causal=settings.is_causal or causal,
        window=settings.window,
        dropout=ops.dropout_rng is not None,
        dropout_shared=settings.dropout_shared,
        precision=settings.precision,
        block_q=block_q,
        block_k=block_k,
    )
    # [batch..., T, H, D] -> [N, K, G, Tq_pad, D]; keys/values -> [N, K, Tk_pad, D]
    q = query.reshape(n, q_len, k_heads, groups, d).transpose(0, 2, 3, 1, 4)
    q = _pad_len(q, 3, cfg.padded_q)
    k = _pad_len(key.reshape(n, kv_len, k_heads, d).transpose(0, 2, 1, 3), 2, cfg.padded_kv)
    v = _pad_len(value.reshape(n, kv_len, k_heads, dv).transpose(0, 2, 1, 3), 2, cfg.padded_kv)
    aux = _aux(cfg, ops, tuple(batch), query.dtype)
    cfg, aux, mops = _modifiers(cfg, aux, ops, settings, (causal, mask_rest), tuple(batch),
                                query.dtype)  # fmt: skip
    return cfg, q, k, v, aux, mops


def head_splits(cfg: Config) -> int:
    """How many independent computations :func:`attention` splits the heads into.

    On a CPU, each tile product is too small to keep more than one core busy, but XLA
    runs independent loops concurrently: splitting the key/value heads in two loops keeps
    two cores busy (measured on 2 cores: benchmarks/results.md). One split elsewhere, and
    when the heads do not split evenly. (Not to be confused with ``G``, the query heads per
    key/value head: a split keeps whole groups.)
    """
    if jax.default_backend() != "cpu" or _SPLIT_CORES < 2:
        return 1
    return math.gcd(cfg.kv_heads, min(_SPLIT_CORES, 2))


_SPLIT_CORES = (
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)


def _modifiers(cfg: Config, aux: Aux, ops: Operands, settings: Settings, peeled, batch, dtype):
    """The call's score_mod, mask_mod, block mask, sinks and bias in the tile loops' terms:
    ``(cfg with its ModSpec, aux with mask consts and tile states, ModOperands)``.

    ``peeled = (causal, mask_rest)``: whether the call's mask_mod has a causal part (now the
    band) and the rest of it. The tile states come from the block mask when the path's
    tiles (forward and backward) are multiples of its tiles; otherwise (or without a block
    mask) the hoisted mask_mod is evaluated once per call at tiles dividing both passes'
    (:func:`jattn.blockwise._schedule.block_states`).
    """
    causal, mask_rest = peeled
    f32 = softmax_dtype(dtype)
    spec, mops = ModSpec(), ModOperands()
    if settings.score_mod is not None:
        fn, consts = hoist_modifier(settings.score_mod, "score", f32)
        floats = tuple(bool(jnp.issubdtype(jnp.result_type(c), jnp.floating)) for c in consts)
        spec = dataclasses.replace(spec, score=fn, score_float=floats)
        mops = mops._replace(score_consts=tuple(consts))
    if mask_rest is not None:
        fn, consts = hoist_modifier(mask_rest, "mask", f32)
        spec = dataclasses.replace(spec, mask=fn)
        aux = aux._replace(mask_consts=tuple(consts))
    if mask_rest is not None or ops.block_mask is not None:
        tiles = ((cfg.block_q, cfg.block_k), (cfg.bwd_block_q, cfg.bwd_block_k))
        bm = ops.block_mask
        if bm is not None and all(t[0] % bm.block_q == 0 and t[1] % bm.block_k == 0 for t in tiles):
            block = (bm.block_q, bm.block_k)
        else:
            block = (math.gcd(cfg.block_q, cfg.bwd_block_q), math.gcd(cfg.block_k, cfg.bwd_block_k))
        states = block_states(
            spec.mask, aux.mask_consts, causal=causal, block_mask=bm, n=cfg.batch_size,
            num_heads=cfg.num_heads, q_len=cfg.q_len, kv_len=cfg.kv_len, block=block,
        )  # fmt: skip
        spec = dataclasses.replace(spec, states_block=block)
        aux = aux._replace(tile_states=states)
    if ops.sinks is not None:
        sinks = ops.sinks.astype(f32).reshape(cfg.kv_heads, cfg.num_heads // cfg.kv_heads)
        mops = mops._replace(sinks=sinks)
    if ops.bias is not None:
        bias = tile_layout(
            ops.bias.astype(f32), batch, cfg.num_heads, cfg.kv_heads, cfg.padded_q, cfg.padded_kv
        )
        spec = dataclasses.replace(spec, has_bias=True)
        mops = mops._replace(bias=bias)
    return dataclasses.replace(cfg, mods=spec), aux, mops


def _by_head_splits(cfg: Config, q, k, v, aux: Aux, mops: ModOperands, splits: int):
    """:func:`core` over ``splits`` splits of the key/value heads, joined."""
    if splits == 1:
        return core(cfg, q, k, v, aux, mops)
    width = cfg.kv_heads // splits
    outs, lses = [], []
    for part_index in range(splits):
        part = slice(part_index * width, (part_index + 1) * width)
        sub = dataclasses.replace(
            cfg, kv_heads=width, num_heads=cfg.num_heads // splits, head_offset=part.start
        )
        sub_aux = aux._replace(mask=_head_part(aux.mask, part, axis=1))
        sub_mops = mops._replace(
            sinks=_head_part(mops.sinks, part, axis=0), bias=_head_part(mops.bias, part, axis=1)
        )
        out, lse = core(sub, q[:, part], k[:, part], v[:, part], sub_aux, sub_mops)
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def _head_part(x: Array | None, part: slice, axis: int) -> Array | None:
    """``x``'s key/value heads ``part`` along ``axis`` (None and size-1 axes pass through)."""
    if x is None or x.shape[axis] == 1:
        return x
    return lax.slice_in_dim(x, part.start, part.stop, axis=axis)


def _pad_len(x, axis, size):
    """``x`` padded to ``size`` along ``axis`` (ints repeat their last value, floats get 0)."""
    extra = size - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, mode="edge" if jnp.issubdtype(x.dtype, jnp.integer) else "constant")


def _aux(cfg: Config, ops: Operands, batch: tuple[int, ...], dtype) -> Aux:
    """The call's masks and dropout operands in tile layout."""
    n = cfg.batch_size
    aux = Aux()
    if ops.q_lengths is not None:
        aux = aux._replace(q_lengths=jnp.asarray(ops.q_lengths, jnp.int32).reshape(n))
    if ops.kv_lengths is not None:
        aux = aux._replace(kv_lengths=jnp.asarray(ops.kv_lengths, jnp.int32).reshape(n))
    if ops.q_segments is not None:
        q_ids = jnp.asarray(ops.q_segments, jnp.int32).reshape(n, cfg.q_len)
        k_ids = jnp.asarray(ops.kv_segments, jnp.int32).reshape(n, cfg.kv_len)
        aux = aux._replace(
            q_segments=_pad_len(q_ids, 1, cfg.padded_q),
            kv_segments=_pad_len(k_ids, 1, cfg.padded_kv),
        )
    if ops.mask is not None:
        mask = tile_layout(
            ops.mask, batch, cfg.num_heads, cfg.kv_heads, cfg.padded_q, cfg.padded_kv
        )
        aux = aux._replace(mask=mask)
    if cfg.dropout:
        keep_prob = 1.0 - ops.dropout_rate
        aux = aux._replace(
            dropout_words=_prng.key_words(ops.dropout_rng),
            dropout_threshold=_prng.keep_threshold(keep_prob),
            keep_prob=jnp.asarray(keep_prob, softmax_dtype(dtype)),
        )
    return aux


def tile_layout(x: Array, batch, num_heads, k_heads, padded_q, padded_kv) -> Array:
    """A mask or bias broadcastable to ``[batch..., H, Tq, Tk]`` as ``[N|1, K|1, G|1, Lq, Lk]``:
    size-1 axes stay size 1 (nothing is materialised along them); full query / key axes are
    padded with zeros (False) to the tiled lengths."""
    x = expand_rank(x, len(batch) + 3)
    if all(s == 1 for s in x.shape[: len(batch)]):
        x = x.reshape(1, *x.shape[len(batch) :])
    else:
        x = jnp.broadcast_to(x, (*batch, *x.shape[len(batch) :]))
        x = x.reshape(math.prod(batch), *x.shape[len(batch) :])
    _, h, lq, lk = x.shape
    groups = num_heads // k_heads  # query heads per key/value head
    x = x.reshape(x.shape[0], k_heads, groups, lq, lk) if h > 1 else x[:, :, None]
    pad_q = padded_q - lq if lq > 1 else 0
    pad_k = padded_kv - lk if lk > 1 else 0
    if pad_q or pad_k:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad_q), (0, pad_k)))
    return x
