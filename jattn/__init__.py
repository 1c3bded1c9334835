"""jattn: causal and multi-head attention for JAX, as pure functions and Flax modules.

The pure core lives at the top level (masks and functional attention); the Flax
modules are the submodules ``jattn.linen`` and ``jattn.nnx``.
"""

import importlib

from jattn import book, causality, masks, mods
from jattn.block_masks import BlockMask, block_mask
from jattn.functional import (
    CausalAlignmentWarning,
    dot_product_attention,
    dot_product_attention_weights,
    dropout,
    simplified_self_attention,
    simplified_self_attention_loop,
)
from jattn.masks import (
    causal_mask,
    combine_masks,
    large_negative,
    lengths_to_valid,
    mask_to_bias,
    padding_mask,
    padding_mask_from_lengths,
    segment_mask,
    sliding_window_mask,
)
from jattn.packing import Packed, pack, positions_from_segment_ids, unpack, varlen_attention

__version__ = "0.1.0"

# Submodules that import flax (or matplotlib) load on first use: `jattn.linen.MultiHeadAttention`
# works after a plain `import jattn`, and `import jattn` stays light.
_LAZY_SUBMODULES = (
    "convert", "generate", "kvcache", "linen", "models", "nnx", "paged", "ring", "rope", "toy",
    "viz",
)  # fmt: skip


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"jattn.{name}")
    raise AttributeError(f"module 'jattn' has no attribute {name!r}")


__all__ = [
    "BlockMask",
    "CausalAlignmentWarning",
    "Packed",
    "block_mask",
    "book",
    "causal_mask",
    "causality",
    "combine_masks",
    "dot_product_attention",
    "dot_product_attention_weights",
    "dropout",
    "large_negative",
    "lengths_to_valid",
    "mask_to_bias",
    "masks",
    "mods",
    "pack",
    "padding_mask",
    "padding_mask_from_lengths",
    "positions_from_segment_ids",
    "segment_mask",
    "simplified_self_attention",
    "simplified_self_attention_loop",
    "sliding_window_mask",
    "unpack",
    "varlen_attention",
]
