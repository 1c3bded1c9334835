"""jattn's fused CPU attention kernel: C++ (``csrc/``) behind XLA's FFI.

* :mod:`jattn.kernels.cpu.adapter`: the adapter contract (``implementation='cpu_fused'``);
* ``_library``: loads the compiled library and registers its FFI targets;
* ``_ops``: the ``jax.ffi.ffi_call`` forward and backward inside a ``jax.custom_vjp``;
* :mod:`jattn.kernels.cpu.paged`: :func:`paged_attention`, attention read through a page
  table (the fused step of :mod:`jattn.paged`);
* :mod:`jattn.kernels.cpu.greedy`: :func:`argmax`, decoding's greedy pick
  (:func:`jattn.generate.sample_next`).

:func:`status` says whether the kernel is on (and with which instruction set) or why not.
"""

from jattn.kernels.cpu._library import library, status
from jattn.kernels.cpu.greedy import argmax
from jattn.kernels.cpu.paged import paged_attention

__all__ = ["argmax", "available", "paged_attention", "status"]


def available() -> bool:
    """Whether the kernel library was built and loads (:func:`status` says why not)."""
    return library() is not None
