"""Thin adapters from jattn's attention call to the fused kernels that jax itself ships.

One module per kernel family, each with the same three functions:

* ``obstacle(*, backend, interpret, q_shape, kv_shape, dtype, is_causal, window, has_mask,
  has_bias, has_lengths, has_segments, dropout, return_weights, softcap, ...)``: ``None``
  when the kernel honours the call on ``backend``, else a short reason naming the option
  it lacks. Static: shapes, dtypes and flags only.
* ``attention(q, k, v, *, scale, is_causal, window, q_lengths, kv_lengths, q_segments,
  kv_segments, softcap, interpret) -> (out, lse)``: inputs validated and cast by the public
  entry; ``q [batch..., Tq, H, D]``, ``k, v [batch..., Tk, K, D]``; returns
  ``out [batch..., Tq, H, Dv]`` in q's dtype with jattn's semantics (fully masked query rows
  give zero output and zero gradients) and ``lse [batch..., H, Tq]`` float32 or ``None``
  (:func:`jattn.large_negative` on rows that attend nothing, as jattn's own paths).
* ``available(backend) -> bool``: the kernel can run natively there.
* ``RETURNS_LSE``: whether ``attention`` returns the lse (``return_residual=`` needs it).

:mod:`jattn._routing` routes ``implementation=`` names and the automatic rule to these
adapters.

The kernels:

* :mod:`jattn.kernels.cudnn`: ``jax.nn.dot_product_attention(implementation='cudnn')``
  (NVIDIA GPUs);
* :mod:`jattn.kernels.pallas_triton`: the Pallas GPU (Triton) flash attention,
  ``jax.experimental.pallas.ops.gpu.attention.mha`` (GPUs; CPU in interpret mode);
* :mod:`jattn.kernels.splash`: Pallas splash attention,
  ``jax.experimental.pallas.ops.tpu.splash_attention`` (TPUs; CPU in interpret mode).

No module here imports a kernel at import time: jax's kernel modules load on first use
(the Pallas GPU module warns of its deprecation on import from jax 0.12 on).
"""

from __future__ import annotations

import os

__all__ = ["INTERPRET_ENV", "KERNELS", "adapter", "interpret_requested"]

# The implementation names the adapters serve, as `implementation=` spells them.
KERNELS = ("cudnn", "pallas_triton", "splash")

# Set to 1 to run the Pallas kernels ('splash', 'pallas_triton') in interpret mode on CPU.
INTERPRET_ENV = "JATTN_PALLAS_INTERPRET"


def interpret_requested() -> bool:
    """True when ``JATTN_PALLAS_INTERPRET`` asks for the Pallas kernels in interpret mode.

    Accepts ``1``, ``true`` or ``yes`` (any case); anything else, or unset, is False.
    Interpret mode runs a Pallas kernel as ordinary XLA operations on any backend: slow,
    but the kernel's own code and its own VJP, so CPU tests check what a TPU or GPU runs.
    """
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes")


def adapter(name: str):
    """The adapter module for ``name`` (one of :data:`KERNELS`), imported on first use."""
    if name == "cudnn":
        from jattn.kernels import cudnn as module
    elif name == "pallas_triton":
        from jattn.kernels import pallas_triton as module
    elif name == "splash":
        from jattn.kernels import splash as module
    else:
        raise ValueError(f"no kernel adapter named {name!r}; expected one of {KERNELS}.")
    return module
