"""Block masks: which tiles of the score matrix a ``mask_mod`` hides, shows or cuts through.

A :class:`BlockMask` is FlexAttention's ``BlockMask`` for jattn: ``mask_mod`` evaluated
once over every ``[block_q, block_k]`` tile and reduced to one state per tile,

* ``EMPTY`` (0): every (query, key) pair of the tile is hidden: the tile is skipped;
* ``PARTIAL`` (1): some pairs are visible: the tile is computed with the elementwise mask;
* ``FULL`` (2): every pair is visible: the tile is computed without a mask,

stored densely as int8 ``state [B, H, num_q_blocks, num_kv_blocks]``, where ``B`` is the
flattened batch size or 1 (the mask does not vary over ``b``) and ``H`` the number of
query heads or 1. Only real positions count: the last tile of a length that is not a
multiple of the block size is judged on its real rows and keys (padding is the
consumer's to mask). Build one with :func:`block_mask` and pass it to
:func:`jattn.dot_product_attention` (``block_mask=``) as often as you like; it is a
pytree (``state`` and the arrays of a ready-made ``mask_mod`` are its leaves), so it
goes through ``jax.jit`` as an argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jattn import _checks, mods
from jattn._util import expand_rank, round_up, tile_cap

__all__ = ["DEFAULT_BLOCK", "EMPTY", "FULL", "PARTIAL", "BlockMask", "block_mask"]

Array = jax.Array

EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_BLOCK = 128  # FlexAttention's default; a short sequence gets one tile (see _tile)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """Per-tile states of a ``mask_mod`` (see the module docstring).

    Attributes:
      state: int8 ``[B|1, H|1, num_q_blocks, num_kv_blocks]``: EMPTY, PARTIAL or FULL.
      mask_mod: the ``mask_mod`` it was built from (the elementwise mask of partial tiles).
      q_len: query positions it covers.
      kv_len: key positions it covers.
      block_q: query tile length.
      block_k: key tile length.
    """

    state: Array
    mask_mod: Callable
    q_len: int
    kv_len: int
    block_q: int
    block_k: int

    def __post_init__(self):
        # Checked where it is built (the builder, or a user): every consumer trusts it. A
        # pytree round trip (_unflatten) rebuilds it unchecked, with any leaves.
        for name in ("q_len", "kv_len", "block_q", "block_k"):
            _checks.size(getattr(self, name), f"BlockMask {name}")
        if not callable(self.mask_mod):
            raise TypeError(
                f"BlockMask mask_mod must be the mask_mod it was built from, got "
                f"{type(self.mask_mod).__name__}."
            )
        state = self.state
        tiles = (round_up(self.q_len, self.block_q) // self.block_q,
                 round_up(self.kv_len, self.block_k) // self.block_k)  # fmt: skip
        if getattr(state, "ndim", None) != 4 or tuple(state.shape[2:]) != tiles:
            raise ValueError(
                f"BlockMask state must be [B|1, H|1, {tiles[0]}, {tiles[1]}] (one state per "
                f"[{self.block_q}, {self.block_k}] tile of q_len={self.q_len}, "
                f"kv_len={self.kv_len}), got shape {tuple(getattr(state, 'shape', ()))}. Build "
                "one with jattn.block_mask."
            )
        if jnp.dtype(state.dtype) != jnp.int8:
            raise TypeError(
                f"BlockMask state must be int8 (EMPTY/PARTIAL/FULL), got {state.dtype}."
            )

    @property
    def num_blocks(self) -> tuple[int, int]:
        """``(num_q_blocks, num_kv_blocks)``."""
        return self.state.shape[-2], self.state.shape[-1]

    @property
    def needed(self) -> Array:
        """bool, the shape of ``state``: the tile has a visible pair (not EMPTY)."""
        return self.state != EMPTY

    @property
    def full(self) -> Array:
        """bool, the shape of ``state``: every pair of the tile is visible (FULL)."""
        return self.state == FULL

    def tile_flags(self) -> tuple[Array, Array]:
        """``(needed, full)`` bool ``[num_q_blocks, num_kv_blocks]`` over the whole batch
        and every head: needed for some (batch, head), full for all (for a path whose tile
        loop is shared by the batch and heads)."""
        return self.needed.any(axis=(0, 1)), self.full.all(axis=(0, 1))

    def density(self) -> Array:
        """The fraction of tiles that are not EMPTY (1 - FlexAttention's "sparsity")."""
        return jnp.mean(self.needed.astype(jnp.float32))

    def __repr__(self) -> str:
        return (
            f"BlockMask(state {tuple(self.state.shape)}, q_len={self.q_len}, "
            f"kv_len={self.kv_len}, block=({self.block_q}, {self.block_k}), "
            f"mask_mod={type(self.mask_mod).__name__})"
        )


def _flatten(bm: BlockMask):
    # A ready-made mask_mod is a pytree child (its arrays trace); any other callable is
    # static, like a function passed to jax.jit.
    dynamic = mods.is_modifier(bm.mask_mod)
    children = (bm.state, bm.mask_mod if dynamic else None)
    aux = (bm.q_len, bm.kv_len, bm.block_q, bm.block_k, None if dynamic else bm.mask_mod)
    return children, aux


def _unflatten(aux, children):
    q_len, kv_len, block_q, block_k, static_mod = aux
    state, dynamic_mod = children
    mask_mod = static_mod if static_mod is not None else dynamic_mod
    # Unchecked: jax rebuilds pytrees with placeholder leaves (None, tracers, shapes).
    bm = object.__new__(BlockMask)
    fields = dict(state=state, mask_mod=mask_mod, q_len=q_len, kv_len=kv_len, block_q=block_q,
                  block_k=block_k)  # fmt: skip
    for name, value in fields.items():
        object.__setattr__(bm, name, value)
    return bm


jax.tree_util.register_pytree_node(BlockMask, _flatten, _unflatten)


def _tile(length: int, block: int | None, name: str) -> int:
    """The tile length: ``block``, capped at ``length`` rounded up to 8 (one short tile)."""
    return tile_cap(length, DEFAULT_BLOCK if block is None else _checks.size(block, name))


def _varies(mask_mod, axis: int, q_len: int, kv_len: int) -> bool:
    """Whether ``mask_mod``'s output varies along batch (``axis`` 0) or head (1) indices.

    Probed abstractly with two batch rows / heads: an elementwise mask that ignores the
    index keeps that axis of size 1.
    """
    sizes = [1, 1]
    sizes[axis] = 2
    structs = [
        jax.ShapeDtypeStruct(x.shape, jnp.int32)
        for x in jax.eval_shape(lambda: mods.indices(*sizes, q_len, kv_len))
    ]
    out = jax.eval_shape(mask_mod, *structs)
    return len(out.shape) >= 4 - axis and out.shape[axis - 4] == 2


def _states(mask_mod, n: int, heads: int, q_len, kv_len, bq, bk) -> Array:
    """int8 ``[n, heads, nq, nk]``: one row of query tiles at a time (memory
    ``n * heads * bq * kv_len`` booleans per step)."""
    nq, nk = round_up(q_len, bq) // bq, round_up(kv_len, bk) // bk
    kv_pos = jnp.arange(nk * bk, dtype=jnp.int32)
    kv_valid = kv_pos < kv_len
    # Positions past the end are clamped (a mask_mod may index arrays with them); those
    # pairs are excluded from the reduction below.
    b, h, _, kv = mods.indices(n, heads, 1, nk * bk)
    kv = jnp.minimum(kv, kv_len - 1)

    def row(i):
        q_pos = i * bq + jnp.arange(bq, dtype=jnp.int32)
        q = jnp.minimum(q_pos, q_len - 1).reshape(1, 1, bq, 1)
        mask = jnp.asarray(mask_mod(b, h, q, kv))
        mask = jnp.broadcast_to(expand_rank(mask, 4), (n, heads, bq, nk * bk))
        valid = ((q_pos < q_len)[:, None] & kv_valid[None, :])[None, None]  # [1, 1, bq, Tk_pad]
        # [n, heads, bq, nk, bk] reduced over the tile's rows and keys -> [n, heads, nk]
        shown = (mask & valid).reshape(n, heads, bq, nk, bk).any(axis=(2, 4))
        all_shown = (mask | ~valid).reshape(n, heads, bq, nk, bk).all(axis=(2, 4))
        return jnp.where(all_shown, FULL, jnp.where(shown, PARTIAL, EMPTY)).astype(jnp.int8)

    states = lax.map(row, jnp.arange(nq, dtype=jnp.int32))  # [nq, n, heads, nk]
    return jnp.moveaxis(states, 0, 2)


def block_mask(
    mask_mod: Callable,
    *,
    q_len: int,
    kv_len: int | None = None,
    batch_shape: tuple[int, ...] | int | None = None,
    num_heads: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> BlockMask:
    """Evaluates ``mask_mod`` once per tile and returns the tiles' states (a :class:`BlockMask`).

    Pass the result to :func:`jattn.dot_product_attention` as ``block_mask=`` (instead of,
    or with the same, ``mask_mod``): the blockwise path skips EMPTY tiles and computes
    FULL tiles without an elementwise mask; the dense path applies ``mask_mod``. Works
    under ``jax.jit`` (``mask_mod`` may close over traced arrays, e.g. segment ids); the
    cost is one evaluation of ``mask_mod`` over every (query, key) pair, one row of tiles
    at a time.

    Args:
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (see :mod:`jattn.mods`).
      q_len: number of queries of the calls it will serve.
      kv_len: number of keys (default ``q_len``).
      batch_shape: the calls' batch dims (``[batch...]``, or their product), needed when
        ``mask_mod`` varies over ``b``; None (default) when it does not.
      num_heads: the calls' query heads, needed when ``mask_mod`` varies over ``h``.
      block_q: query tile length (default 128, capped at ``q_len`` rounded up to 8).
      block_k: key tile length (default 128, capped at ``kv_len`` rounded up to 8).

    Returns:
      A :class:`BlockMask` whose state has batch size 1 unless ``mask_mod`` varies over
      ``b`` (then the flattened ``batch_shape``), and 1 head unless it varies over ``h``.

    Raises:
      TypeError: ``mask_mod`` is not a function of ``(b, h, q_idx, kv_idx)`` returning bool.
      ValueError: bad sizes; ``mask_mod`` varies over ``b`` (``h``) but ``batch_shape``
        (``num_heads``) is not given.
    """
    q_len = _checks.size(q_len, "q_len")
    kv_len = q_len if kv_len is None else _checks.size(kv_len, "kv_len")
    if batch_shape is None:
        n = None
    else:
        dims = (batch_shape,) if isinstance(batch_shape, int) else tuple(batch_shape)
        n = math.prod(_checks.size(d, "batch_shape") for d in dims)
    heads = None if num_heads is None else _checks.size(num_heads, "num_heads")
    shape = (n or 1, heads or 1, q_len, kv_len)
    _checks.mask_mod(mask_mod, shape)
    for axis, given, name in ((0, n, "batch_shape"), (1, heads, "num_heads")):
        varies = _varies(mask_mod, axis, min(q_len, 8), min(kv_len, 8))
        if varies and given is None:
            index = "batch index b" if axis == 0 else "head index h"
            raise ValueError(
                f"mask_mod varies over the {index}: pass {name}= to jattn.block_mask (the "
                "calls' " + ("batch dims" if axis == 0 else "number of query heads") + ")."
            )
        if not varies:
            shape = (*shape[:axis], 1, *shape[axis + 1 :])
    _checks.modifier_sizes(mask_mod, n or 1, heads or 1, q_len, kv_len)
    bq = _tile(q_len, block_q, "block_q")
    bk = _tile(kv_len, block_k, "block_k")
    state = _states(mask_mod, shape[0], shape[1], q_len, kv_len, bq, bk)
    return BlockMask(state, mask_mod, q_len, kv_len, bq, bk)
