"""Blockwise (FlashAttention-style) attention: O(T) memory, skipped masked tiles, custom VJP.

The XLA path that :func:`jattn.dot_product_attention` routes long sequences to
(``implementation='blockwise'``; the automatic rule's threshold is
``jattn._routing.AUTO_MIN_LEN``). The guide is ``docs/guides/fast_path.md``. Its rooms,
each importing only those above it:

* :mod:`~jattn.blockwise._config`: the tile rule, :class:`Config` (static), :class:`Aux`
  (per-call arrays), the modifiers' static spec and operands;
* :mod:`~jattn.blockwise._closure`, :mod:`~jattn.blockwise._mods`: modifiers hoisted out
  of their closures and applied per tile (score_mod, mask_mod, bias, sinks);
* :mod:`~jattn.blockwise._schedule`: which tiles run, and which need a mask;
* :mod:`~jattn.blockwise._passes`: one tile, the forward and backward passes, the custom VJP;
* :mod:`~jattn.blockwise._layout`: the entry: a validated call in tile layout.

The names below are the internal API that jattn's other paths build on (ring attention:
:func:`make_config`, :func:`forward`, :func:`backward`; routing: :func:`attention`; the
Pallas kernels: :func:`hoist`, :func:`tile_layout`, :func:`coarsen`); they
take validated, cast inputs and may change.
"""

from jattn.blockwise._closure import hoist
from jattn.blockwise._config import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    Aux,
    Config,
    Tiles,
    cpu_kind,
    default_tiles,
    make_config,
)
from jattn.blockwise._layout import (
    attention,
    explicit_closure,
    head_splits,
    tile_flags,
    tile_layout,
)
from jattn.blockwise._passes import backward, forward
from jattn.blockwise._schedule import coarsen

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "Aux",
    "Config",
    "Tiles",
    "attention",
    "backward",
    "coarsen",
    "cpu_kind",
    "default_tiles",
    "explicit_closure",
    "forward",
    "head_splits",
    "hoist",
    "make_config",
    "tile_flags",
    "tile_layout",
]
