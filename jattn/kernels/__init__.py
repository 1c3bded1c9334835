"""Thin adapters from jattn's attention call to the fused kernels that jax itself ships.

Every adapter module keeps one contract, :class:`Kernel` (module-level ``NAME``,
``RETURNS_LSE``, ``LSE_HAS_GRADIENT``, ``available(platform)``, ``obstacle(query)``,
``attention(q, k, v, ops, settings, *, interpret)``), and reads the call through one typed
description, :class:`KernelQuery`, which :func:`jattn._routing.kernel_query` builds once per
call. :mod:`jattn._routing` routes ``implementation=`` names and the automatic rule to the
adapters.

The kernels:

* :mod:`jattn.kernels.cudnn`: ``jax.nn.dot_product_attention(implementation='cudnn')``
  (NVIDIA GPUs);
* :mod:`jattn.kernels.pallas_triton`: the Pallas GPU (Triton) flash attention,
  ``jax.experimental.pallas.ops.gpu.attention.mha`` (GPUs; CPU in interpret mode);
* :mod:`jattn.kernels.splash`: Pallas splash attention,
  ``jax.experimental.pallas.ops.tpu.splash_attention`` (TPUs; CPU in interpret mode);
* :mod:`jattn.kernels.pallas`: jattn's own Pallas flash attention (``'pallas'``: Triton
  on GPUs, Mosaic on TPUs, CPU in interpret mode), the first adapter on the
  :class:`KernelQuery` contract, with jattn's whole call (dropout, modifiers, block
  masks, sinks, bias);
* :mod:`jattn.kernels.cpu.adapter`: jattn's own fused CPU kernel (C++ through XLA's FFI,
  ``implementation='cpu_fused'``); ``jattn.kernels.cpu.status()`` says whether it was
  built and loads, or why not.

A traced call carries one route per platform, the host's traced at once and the others
deferred to lowering time (:mod:`jattn.kernels._deferred`), so programs lowered or
exported for other platforms than the host's hold those platforms' kernels;
:func:`lowering_platforms` sets the platforms routed for explicitly.

No module here imports a kernel at import time: jax's kernel modules load on first use
(the Pallas GPU module warns of its deprecation on import from jax 0.12 on).
"""

from __future__ import annotations

import os

from jattn import _util
from jattn.kernels._contract import Kernel, KernelQuery
from jattn.kernels._platforms import lowering_platforms, route_platforms

__all__ = [
    "INTERPRET_ENV",
    "KERNELS",
    "Kernel",
    "KernelQuery",
    "adapter",
    "interpret_requested",
    "lowering_platforms",
    "route_platforms",
]


# The implementation names the adapters serve, as `implementation=` spells them.
KERNELS = _util.KERNELS

# Set to 1 to run the Pallas kernels ('splash', 'pallas_triton') in interpret mode on CPU.
INTERPRET_ENV = "JATTN_PALLAS_INTERPRET"


def interpret_requested() -> bool:
    """True when ``JATTN_PALLAS_INTERPRET`` asks for the Pallas kernels in interpret mode.

    Accepts ``1``, ``true`` or ``yes`` (any case); anything else, or unset, is False.
    Interpret mode runs a Pallas kernel as ordinary XLA operations on any backend: slow,
    but the kernel's own code and its own VJP, so CPU tests check what a TPU or GPU runs.
    """
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes")


def adapter(name: str) -> Kernel:
    """The adapter module for ``name`` (one of :data:`KERNELS`), imported on first use."""
    if name == "cudnn":
        from jattn.kernels import cudnn as module
    elif name == "pallas_triton":
        from jattn.kernels import pallas_triton as module
    elif name == "splash":
        from jattn.kernels import splash as module
    elif name == "pallas":
        from jattn.kernels import pallas as module
    elif name == "cpu_fused":
        from jattn.kernels.cpu import adapter as module
    else:
        raise ValueError(f"no kernel adapter named {name!r}; expected one of {KERNELS}.")
    return module
