"""Small pieces every path shares (one copy each): dtypes, sizes, ranks, implementation names.

The bottom floor of the house: it imports nothing of jattn, and every module may import it.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

__all__ = [
    "ALIASES",
    "IMPLEMENTATIONS",
    "KERNELS",
    "OWN_PATHS",
    "Implementation",
    "axis_specs",
    "expand_rank",
    "round_up",
    "sharded_axes",
    "softmax_dtype",
    "tile_cap",
]

Array = jax.Array

# The one list of `implementation=` names: jattn._checks validates against it, the public
# entry's type is it, jattn._routing routes each (``'xla'`` is an alias of ``'dense'``).
Implementation = Literal[
    "dense", "blockwise", "xla", "cudnn", "pallas_triton", "splash", "pallas", "cpu_fused"
]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
ALIASES = {"xla": "dense"}  # jax.nn's names
OWN_PATHS = ("dense", "blockwise")  # jattn's XLA paths; every other name is a kernel adapter
KERNELS = tuple(n for n in IMPLEMENTATIONS if n not in OWN_PATHS and n not in ALIASES)


def softmax_dtype(dtype):
    """Softmax runs in at least float32, whatever the input dtype (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n``."""
    return -(-n // multiple) * multiple


def tile_cap(length: int, block: int) -> int:
    """``block`` capped at ``length`` rounded up to 8: a sequence shorter than a tile is one
    short tile, not a padded one."""
    return min(block, round_up(length, 8))


def expand_rank(x: Array, ndim: int) -> Array:
    """Leading singleton axes up to rank ``ndim`` (explicit, for rank promotion 'raise')."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


def axis_specs(x: Array) -> tuple:
    """``x``'s partition spec in its type, one entry per axis (None: not sharded)."""
    spec = jax.typeof(x).sharding.spec
    return (*spec, *(None,) * (x.ndim - len(spec)))


def sharded_axes(*trees) -> tuple[str, ...]:
    """The mesh axes of more than one device that an array in ``trees`` is sharded over in
    its type (explicit sharding; an automatic mesh's sharding is not in the type, and inside
    ``jax.shard_map`` the arrays are each device's own)."""
    axes: list[str] = []
    for x in jax.tree.leaves(trees):
        if not isinstance(x, jax.Array):
            continue
        sharding = jax.typeof(x).sharding
        for entry in sharding.spec:
            for name in entry if isinstance(entry, tuple) else (entry,):
                if name is not None and sharding.mesh.shape[name] > 1 and name not in axes:
                    axes.append(name)
    return tuple(axes)
