"""Builds jattn's fused CPU attention kernel (everything else is in pyproject.toml).

The kernel (``jattn/kernels/cpu/csrc``) is a plain shared library that jattn loads with
ctypes and registers with ``jax.ffi``; it is not a Python extension module (no Python
headers, no PyInit). It is *optional*: without a C++ compiler the build prints why and
jattn installs without it, on its XLA paths (``jattn.kernels.cpu.status()`` says why).
The XLA FFI headers are vendored (``csrc/vendor``, from jaxlib), so the build needs
neither jax nor Python headers.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = "jattn/kernels/cpu/csrc"
SOURCES = [f"{CSRC}/{name}.cc" for name in ("ffi", "attention_avx512", "attention_avx2",
                                            "attention_generic", "paged_avx512", "paged_avx2",
                                            "paged_generic", "argmax")]  # fmt: skip
HEADERS = [f"{CSRC}/{name}" for name in ("attention.h", "attention_impl.h", "simd.h", "paged.h",
                                         "paged_impl.h", "argmax_impl.h", "isa_target.h")]  # fmt: skip


class BuildKernel(build_ext):
    """Compiler flags per toolchain; the per-ISA sources set their own target pragmas."""

    def build_extension(self, ext):
        if self.compiler.compiler_type == "msvc":
            ext.extra_compile_args = ["/O2", "/std:c++17"]
        else:
            ext.extra_compile_args = ["-O3", "-std=c++17", "-ffp-contract=fast", "-fPIC"]
            ext.extra_link_args = ["-pthread"]
        super().build_extension(ext)

    def get_export_symbols(self, ext):
        return []  # a ctypes library: no PyInit_ symbol to export


setup(
    ext_modules=[
        Extension(
            "jattn.kernels.cpu._jattn_cpu",
            sources=SOURCES,
            include_dirs=[CSRC, f"{CSRC}/vendor"],
            depends=HEADERS,
            language="c++",
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildKernel},
)
