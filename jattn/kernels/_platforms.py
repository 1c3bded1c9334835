"""Which platforms a jattn call is routed for: the host's, or those set by
:func:`lowering_platforms` (re-exported by :mod:`jattn.kernels`)."""

from __future__ import annotations

import contextlib

__all__ = ["lowering_platforms", "route_platforms"]

# The platforms the automatic rule routes for (one route each, chosen at lowering time by
# jax.lax.platform_dependent); None: the host's default backend only.
_ROUTE_PLATFORMS: list[tuple[str, ...] | None] = [None]


def route_platforms() -> tuple[str, ...] | None:
    """The platforms set by :func:`lowering_platforms` (None: the default backend only)."""
    return _ROUTE_PLATFORMS[-1]


@contextlib.contextmanager
def lowering_platforms(*platforms: str):
    """Routes jattn calls traced while active for each of ``platforms`` ('cpu', 'cuda',
    'tpu'): one program carries each platform's route (``jax.lax.platform_dependent``),
    e.g. around ``jax.export(f, platforms=['cpu', 'cuda', 'tpu'])`` or
    ``jax.jit(f).trace(...).lower(lowering_platforms=('cuda',))`` from a CPU host."""
    for p in platforms:
        if p not in ("cpu", "cuda", "rocm", "tpu"):
            raise ValueError(f"lowering_platforms takes 'cpu', 'cuda', 'rocm' or 'tpu', got {p!r}.")
    _ROUTE_PLATFORMS.append(tuple(platforms))
    try:
        yield
    finally:
        _ROUTE_PLATFORMS.pop()
