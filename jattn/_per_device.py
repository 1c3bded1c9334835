"""A kernel on explicitly sharded operands, run on each device's rows and heads.

jattn's kernels (the fused CPU kernel, the Pallas kernels) are custom calls on whole
arrays, with no partitioning rule. On a mesh whose axes are explicit (``jax.make_mesh``'s
default) the operands' sharding is in their types, so a call whose queries are sharded
over batch or head axes can run the kernel inside ``jax.shard_map``: each device attends
its own rows and heads, as the unsharded call does for them, and nothing moves between
devices. Dropout's mask is keyed by the global batch and head indices, so each device
is given its rows' numbers in the whole call (``Operands.dropout_rows``); the arrays of
jattn.mods' modifiers that run over rows or heads (ALiBi's slopes, a relative bias
table, segment ids, prefix lengths) and a block mask's tiles are split with the queries,
so a device's own batch and head indices read its own share. :func:`obstacle` says when
a device's share is not the same call: a modifier of the user's that reads its batch or
head index (a device would see its own, from 0) or closes over arrays, rows of the
flattened batch split past its first axis, a query sharded along its tokens or features,
grouped heads split across a group. The router then takes a path that partitions itself
(blockwise, dense) or names the reason.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jattn import _prng, blockwise, mods
from jattn._call import Operands, Settings
from jattn._util import axis_specs, sharded_axes

Array = jax.Array

# The operands laid out as [batch..., H, Tq, Tk] (broadcastable), [batch...] or
# [batch..., T]: each gets the query's batch (and head) sharding where its axis is full.
_SCORES = ("bias", "mask")
_ROWS = ("q_lengths", "kv_lengths")
_TOKENS = ("q_segments", "kv_segments")


def _devices(entry, mesh) -> int:
    """The devices a spec entry splits an axis of ``mesh`` over."""
    if entry is None:
        return 1
    return math.prod(mesh.shape[a] for a in (entry if isinstance(entry, tuple) else (entry,)))


def _mesh(query: Array):
    """The (abstract) mesh of the query's type: the call needs no ``jax.set_mesh``."""
    return jax.typeof(query).sharding.mesh


def obstacle(query, key, value, ops: Operands, settings: Settings) -> str | None:
    """Why a kernel cannot run on each device's share of this call (None: it can, or
    nothing is sharded)."""
    if not sharded_axes(query, key, value, ops):
        return None
    spec = axis_specs(query)
    if any(entry is not None for entry in (spec[-3], spec[-1])):
        return "the queries are sharded along their tokens or features"
    if key.shape[:-3] != query.shape[:-3] or value.shape[:-3] != query.shape[:-3]:
        return "the keys' batch axes differ from the queries'"
    devices, kv_heads = _devices(spec[-2], _mesh(query)), key.shape[-2]
    if kv_heads % devices and kv_heads != 1:
        return f"{kv_heads} key/value heads cannot follow the query heads over {devices} devices"
    return _modifier_obstacle(ops, settings, spec[:-3])


def _modifier_obstacle(ops: Operands, settings: Settings, batch: tuple) -> str | None:
    """Why a modifier would differ on a device's share: it reads the batch or head index
    (but through the arrays of jattn.mods' modifiers, which are split with the rows and
    heads), or rows of the flattened batch (a block mask's tiles, jattn.mods' row arrays)
    would split past its first batch axis."""
    for fn, kind in ((settings.score_mod, "score_mod"), (settings.mask_mod, "mask_mod")):
        reason = None if fn is None else _mod_reason(fn, kind, batch)
        if reason is not None:
            if ops.block_mask is not None and fn is ops.block_mask.mask_mod:
                reason += " (the mask_mod the block_mask was built from)"
            return reason
    if ops.block_mask is not None and ops.block_mask.state.shape[0] > 1 and _past_first(batch):
        return "the block mask's tiles per row (flattened batch) would split across batch axes past the first"
    return None


def _past_first(batch: tuple) -> bool:
    """Whether batch axes past the first are sharded: arrays over the flattened batch rows
    (a block mask's tiles, jattn.mods' row arrays) then split into no contiguous blocks."""
    return any(e is not None for e in batch[1:])


# The arrays of jattn.mods' modifiers that run over the (flattened) batch rows, axis 0, or
# the heads, last axis: split with the queries, a device's own b or h then reads its own.
_ROW_FIELDS = {mods.Document: ("q_segments", "kv_segments"), mods.PrefixLM: ("prefix_lengths",)}
_HEAD_FIELDS = {mods.Alibi: ("slopes",), mods.RelativeBias: ("table",)}
_COMBINED = (mods.Compose, mods.MaskAnd, mods.MaskOr)
_MOD_FIELDS = ("score_mod", "mask_mod")  # the Settings fields holding the modifiers


def _mod_reason(fn, kind: str, batch: tuple) -> str | None:
    """:func:`_modifier_reason` for ``fn`` and, when it combines modifiers, each of its parts;
    jattn.mods' modifiers whose arrays are split with the rows or heads pass."""
    if isinstance(fn, _COMBINED):
        return next((r for part in fn.mods if (r := _mod_reason(part, kind, batch))), None)
    if type(fn) in _HEAD_FIELDS:
        return None
    if type(fn) in _ROW_FIELDS:
        rows = max(getattr(fn, f).shape[0] for f in _ROW_FIELDS[type(fn)])
        if rows > 1 and _past_first(batch):
            return f"a {kind}'s rows (flattened batch) would split across batch axes past the first"
        return None
    return _modifier_reason(fn, kind)


def _mod_specs(fn, batch: tuple, heads) -> list:
    """Per leaf of modifier ``fn`` (``jax.tree.leaves`` order): how an array of jattn.mods'
    follows the queries (:data:`_ROW_FIELDS`, :data:`_HEAD_FIELDS`; a shared row, one of
    size 1, on every device), None for the other leaves (functions, numbers: kept)."""

    def specs(part):
        fields = {}
        for f in _ROW_FIELDS.get(type(part), ()):
            x = getattr(part, f)
            rows = batch[0] if batch and x.shape[0] > 1 else None
            fields[f] = _Spec((rows,) + (None,) * (x.ndim - 1))
        for f in _HEAD_FIELDS.get(type(part), ()):
            x = getattr(part, f)
            fields[f] = _Spec((None,) * (x.ndim - 1) + (heads,))
        return dataclasses.replace(part, **fields) if fields else part

    known = (*_ROW_FIELDS, *_HEAD_FIELDS)
    tree = jax.tree.map(specs, fn, is_leaf=lambda x: type(x) in known)
    return [box.spec if isinstance(box, _Spec) else None for box in jax.tree.leaves(tree)]


@dataclasses.dataclass(frozen=True)
class _Spec:
    """A partition spec standing in for an array of a modifier (a pytree leaf)."""

    spec: tuple


def _modifier_reason(fn, kind: str) -> str | None:
    """Why modifier ``fn`` would differ on a device's share or cannot go there (traced once,
    at one element): it reads its batch or head index, or closes over arrays (traced ones,
    or ones placed on the mesh: jax.shard_map cannot close over either)."""
    one = jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.int32)
    scores = [jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32)] if kind == "score_mod" else []
    hoisted, consts = blockwise.hoist(fn, *scores, one, one, one, one)
    if hoisted.uses(len(scores)) or hoisted.uses(len(scores) + 1):
        return f"a {kind} that reads its batch or head index would see a device's own"
    if consts:
        return f"a {kind} closes over arrays (pass them as segment ids, lengths or a bias)"
    return None


def run(run_kernel, query, key, value, ops: Operands, settings: Settings, extras):
    """``run_kernel(query, key, value, ops, settings, extras) -> (out, None, residual)`` on
    each device's rows and heads (:func:`obstacle` is None); unsharded calls run directly."""
    if not sharded_axes(query, key, value, ops):
        return run_kernel(query, key, value, ops, settings, extras)
    spec, mesh = axis_specs(query), _mesh(query)
    batch, heads = spec[:-3], spec[-2]
    mod_specs = {f: _mod_specs(getattr(settings, f), batch, heads) for f in _MOD_FIELDS}
    arrays, specs = _shares(query, key, value, ops, settings, batch, heads, mesh, mod_specs)
    names = list(arrays)
    in_specs = tuple(_partition(specs[n]) for n in names)  # a modifier's: a list, one per array
    placed = jax.tree.map(
        lambda x, p: jax.sharding.reshard(x, NamedSharding(mesh, p)),
        [arrays[n] for n in names],
        list(in_specs),
    )

    def local(*shards):
        given = dict(zip(names, shards, strict=True))
        q, k, v = (given.pop(n) for n in ("query", "key", "value"))
        own = _own_mods(settings, given, mod_specs)
        if "block_state" in given:  # this device's tiles, its mask_mod for the partial ones
            given["block_mask"] = dataclasses.replace(
                ops.block_mask, state=given.pop("block_state"), mask_mod=own.mask_mod
            )
        if "q_segments" in given and "kv_segments" not in given:
            given["kv_segments"] = given["q_segments"]  # one id array for both
        return run_kernel(q, k, v, ops._replace(**given), own, extras)

    out_specs = (jax.P(*specs["query"]), None, jax.P(*batch, None, heads))
    if not settings.return_residual:
        out_specs = (*out_specs[:2], None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(sharded_axes(query, key, value, ops)),
        # The kernels' custom calls do not type how their results vary over the devices;
        # the transpose then sums a replicated operand's cotangent over them (bias, sinks).
        check_vma=False,
    )(*placed)


def _own_mods(settings: Settings, given: dict, mod_specs: dict) -> Settings:
    """``settings`` with its modifiers reading this device's shares of their arrays, popped
    from ``given`` (:func:`_shares`' ``score_mod`` and ``mask_mod`` lists; ``mod_specs``:
    :func:`_mod_specs` of each)."""
    own = {}
    for field in _MOD_FIELDS:
        if field in given:
            fn, mine = getattr(settings, field), iter(given.pop(field))
            leaves, tree = jax.tree.flatten(fn)
            pairs = zip(leaves, mod_specs[field], strict=True)
            own[field] = jax.tree.unflatten(
                tree, [x if s is None else next(mine) for x, s in pairs]
            )
    return dataclasses.replace(settings, **own)


def _shares(
    query, key, value, ops, settings, batch: tuple, heads, mesh, mod_specs: dict
) -> tuple[dict, dict]:
    """``(arrays, specs)``: every array the kernel reads, by :class:`Operands` field name
    (and query, key, value, the block mask's ``block_state``; the arrays of the modifiers
    as lists under ``score_mod`` and ``mask_mod``), and how each is split over the devices:
    jax.shard_map cannot close over them."""
    kv_heads = heads if key.shape[-2] % _devices(heads, mesh) == 0 else None
    specs = {
        "query": (*batch, None, heads, None),
        "key": (*batch, None, kv_heads, None),
        "value": (*batch, None, kv_heads, None),
    }
    arrays = {"query": query, "key": key, "value": value}
    for name in (*_SCORES, *_ROWS, *_TOKENS, "sinks"):
        x = getattr(ops, name)
        if x is not None and not (name == "kv_segments" and x is ops.q_segments):
            arrays[name] = x
            specs[name] = _operand_spec(name, x, query, batch, heads)
    if ops.dropout_rng is not None:  # the whole call's mask rows, the key and rate as given
        *lead, tq, h, _ = query.shape
        n = math.prod(lead)
        starts = _prng.row_starts(n, h, tq, settings.dropout_shared)
        arrays["dropout_rows"] = jnp.broadcast_to(starts, (n, h)).reshape(*lead, h)
        specs["dropout_rows"] = (*batch, heads)
        arrays["dropout_rng"], specs["dropout_rng"] = ops.dropout_rng, ()
        if isinstance(ops.dropout_rate, jax.Array):
            arrays["dropout_rate"], specs["dropout_rate"] = ops.dropout_rate, ()
    for field in _MOD_FIELDS:  # as lists, one entry per array
        fn = getattr(settings, field)
        pairs = zip(jax.tree.leaves(fn), mod_specs[field], strict=True)
        split = [(x, s) for x, s in pairs if s is not None]
        if split:
            arrays[field], specs[field] = [x for x, _ in split], [s for _, s in split]
    if ops.block_mask is not None:  # [B|1, H|1, ...]: the tiles of the device's rows, heads
        state = ops.block_mask.state
        rows = batch[0] if batch and state.shape[0] > 1 else None
        arrays["block_state"] = state
        specs["block_state"] = (rows, heads if state.shape[1] > 1 else None, None, None)
    return arrays, specs


def _partition(spec):
    """A :class:`jax.P` of a spec tuple, or a list of them of a list of spec tuples."""
    return [jax.P(*x) for x in spec] if isinstance(spec, list) else jax.P(*spec)


def _operand_spec(name: str, x: Array, query: Array, batch: tuple, heads) -> tuple:
    """The spec of operand ``name``: the query's batch (and, for the score-shaped ones and
    sinks, head) entries on axes as long as the query's, nothing on broadcast or token axes."""
    if name == "sinks":
        return (heads,)
    lead = query.ndim - 3
    if name in _SCORES:  # right-aligned to [batch..., H, Tq, Tk]
        axes = [*zip(query.shape[:lead], batch, strict=True), (query.shape[-2], heads)]
        axes = axes[len(axes) - (x.ndim - 2) :] if x.ndim - 2 < len(axes) else axes
        full = [e if size == n else None for (n, e), size in zip(axes, x.shape[:-2], strict=True)]
        return (*full, None, None)
    own = x.ndim - (1 if name in _TOKENS else 0)  # the operand's batch axes, right-aligned
    pairs = list(zip(query.shape[:lead], batch, strict=True))[lead - own :] if own else []
    full = [e if size == n else None for (n, e), size in zip(pairs, x.shape[:own], strict=True)]
    return (*full, *((None,) if name in _TOKENS else ()))
