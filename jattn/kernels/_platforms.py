"""Which platforms a jattn call is routed for: the host's, or those set by
:func:`lowering_platforms` (re-exported by :mod:`jattn.kernels`)."""

from __future__ import annotations

import contextlib

__all__ = ["lowering_platforms", "route_platforms"]

# The platforms the automatic rule routes for (one route each, traced at once, one
# jax.lax.platform_dependent branch each); None: the default (the host's route traced,
# the other platforms' deferred to lowering time); (): the host's route only.
_ROUTE_PLATFORMS: list[tuple[str, ...] | None] = [None]


def route_platforms() -> tuple[str, ...] | None:
    """The platforms set by :func:`lowering_platforms` (None: not set)."""
    return _ROUTE_PLATFORMS[-1]


@contextlib.contextmanager
def lowering_platforms(*platforms: str):
    """Routes jattn calls traced while active for each of ``platforms`` ('cpu', 'cuda',
    'rocm', 'tpu'), each route traced at once: one program carries each platform's route
    (``jax.lax.platform_dependent``). Without it a traced call already carries every
    platform's route, the others' deferred to lowering time (:mod:`jattn._routing`); use
    it to restrict the set, to route a named implementation for another platform than
    the host's (``implementation='pallas'`` lowered for 'cuda' from a CPU host), or, with
    no platform, to trace the host's route only (no deferred branches)."""
    for p in platforms:
        if p not in ("cpu", "cuda", "rocm", "tpu"):
            raise ValueError(f"lowering_platforms takes 'cpu', 'cuda', 'rocm' or 'tpu', got {p!r}.")
    _ROUTE_PLATFORMS.append(tuple(platforms))
    try:
        yield
    finally:
        _ROUTE_PLATFORMS.pop()
