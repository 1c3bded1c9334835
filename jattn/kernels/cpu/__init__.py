"""jattn's fused CPU attention kernel: C++ (``csrc/``) behind XLA's FFI.

* :mod:`jattn.kernels.cpu.adapter`: the adapter contract (``implementation='cpu_fused'``);
* ``_library``: loads the compiled library and registers its FFI targets;
* ``_ops``: the ``jax.ffi.ffi_call`` forward and backward inside a ``jax.custom_vjp``.

:func:`status` says whether the kernel is on (and with which instruction set) or why not.
"""

from jattn.kernels.cpu._library import status

__all__ = ["status"]
