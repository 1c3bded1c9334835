"""Loading the compiled kernel library and registering its FFI targets with jax.

The library (``_jattn_cpu*.so``, built by ``pip install`` from ``csrc/``, see ``setup.py``)
is loaded with :mod:`ctypes` on first use and its four handlers are registered with
``jax.ffi.register_ffi_target(..., platform="cpu")``. When it is missing (jattn was
installed where no C++ compiler was found) or fails to load, :func:`status` says why and
jattn keeps its XLA paths.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax

FORWARD_TARGET = "jattn_cpu_attention_forward"
BACKWARD_TARGET = "jattn_cpu_attention_backward"
PAGED_TARGET = "jattn_cpu_paged_attention"
ARGMAX_TARGET = "jattn_cpu_argmax"
_HERE = pathlib.Path(__file__).resolve().parent


class Library:
    """The loaded kernel: its path and the instruction set it dispatched to."""

    def __init__(self, path: pathlib.Path, lib: ctypes.CDLL):
        self.path = path
        lib.jattn_cpu_isa.restype = ctypes.c_char_p
        lib.jattn_cpu_ffi_api_version.restype = ctypes.c_int
        self.isa = lib.jattn_cpu_isa().decode()
        version = lib.jattn_cpu_ffi_api_version()
        self.ffi_api_version = (version // 1000, version % 1000)
        for name, symbol in (
            (FORWARD_TARGET, lib.JattnCpuAttentionForward),
            (BACKWARD_TARGET, lib.JattnCpuAttentionBackward),
            (PAGED_TARGET, lib.JattnCpuPagedAttention),
            (ARGMAX_TARGET, lib.JattnCpuArgmax),
        ):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
        self._lib = lib  # keeps the handlers alive


@functools.cache
def _load() -> tuple[Library | None, str | None]:
    found = sorted(p for p in _HERE.glob("_jattn_cpu*") if p.suffix in (".so", ".pyd", ".dylib"))
    if not found:
        return None, (
            "the fused CPU kernel was not built when jattn was installed (no C++ compiler "
            "found?); install a C++17 compiler and reinstall jattn to build it"
        )
    try:
        return Library(found[0], ctypes.CDLL(str(found[0]))), None
    except (OSError, AttributeError) as error:
        return None, f"the fused CPU kernel at {found[0]} did not load: {error}"


def library() -> Library | None:
    """The loaded, registered kernel library, or None (then :func:`status` says why)."""
    return _load()[0]


def status() -> str:
    """One line: which instruction set the kernel runs with, or why it is off."""
    lib, reason = _load()
    if lib is None:
        return f"off: {reason}"
    major, minor = lib.ffi_api_version
    return f"on: {lib.isa} kernels from {lib.path.name} (XLA FFI API {major}.{minor})"
