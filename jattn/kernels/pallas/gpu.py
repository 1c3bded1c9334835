"""The Triton lowering of jattn's Pallas kernels (NVIDIA GPUs).

:mod:`jattn.kernels.pallas._flash` holds the kernels; on a GPU they run with Triton's
compiler parameters (which also select the Triton lowering over Mosaic GPU, Pallas's
default there). Tiles are powers of two, at least 16 (Triton's dot), and the head sizes
are padded to powers of two by the adapter.
"""

from __future__ import annotations

from jax.experimental.pallas import triton as pltriton

__all__ = ["compiler_params"]


def compiler_params(head_dim: int):
    """``kernel -> pltriton.CompilerParams`` for the 'fwd', 'dkv' and 'dq' kernels.

    Warps as jax's own Triton flash attention picks them (4 up to head_dim 64, else 8),
    two pipeline stages for the forward pass's key/value loads.
    """
    warps = 4 if head_dim <= 64 else 8

    def params(kernel: str):
        stages = 2 if kernel == "fwd" else 1
        return pltriton.CompilerParams(num_warps=warps, num_stages=stages)

    return params
