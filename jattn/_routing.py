"""Which implementation runs an attention call: the one routing table.

Each implementation has a *route*: a function saying why it cannot honour a call (None
when it can) and a function running it. An explicit ``implementation=`` that cannot
honour the call raises a ValueError with that reason; the automatic rule (``None``)
picks, per backend, the fastest route that can.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax

from jattn import _checks, blockwise, dense
from jattn._call import DenseExtras, Operands, Settings

Array = jax.Array

# The automatic rule's thresholds. On CPU the blockwise path is used when q_len and kv_len
# are both at least AUTO_MIN_LEN: from there on it measured faster, below it dense was as
# fast or faster (benchmarks/results.md), and one-query decoding stays dense. Elsewhere
# dense is kept unless its [q_len, kv_len] logits per (batch, head) reach
# AUTO_DENSE_MAX_SCORES elements.
AUTO_MIN_LEN = 256
AUTO_DENSE_MAX_SCORES = 4096 * 4096


class Route(NamedTuple):
    """How to refuse and how to run one implementation."""

    obstacle: Callable[..., str | None]  # (q, k, ops, settings, extras) -> reason or None
    run: Callable[..., tuple]  # (q, k, v, ops, settings, extras) -> (out, weights, residual)


def _dense_run(query, key, value, ops, settings, extras):
    return dense.attention(query, key, value, ops, settings, extras)


def _blockwise_obstacle(query, key, ops: Operands, settings: Settings, extras: DenseExtras):
    needed = extras.needed()
    if needed is not None:
        return needed
    if ops.bias is not None:
        return "a bias array is added densely (it is [q_len, kv_len] already)"
    if not isinstance(ops.scale, numbers.Real):
        return f"scale must be a Python number for it, got {type(ops.scale).__name__}"
    modifiers = _modifiers_given(ops, settings)
    if modifiers:
        return f"it does not take {modifiers} yet (the dense path does)"
    return None


def _modifiers_given(ops: Operands, settings: Settings) -> str:
    """The FlexAttention-style options of the call, named for a refusal ('' if none)."""
    given = [
        name
        for name, value in (
            ("score_mod", settings.score_mod),
            ("mask_mod", None if ops.block_mask is not None else settings.mask_mod),
            ("sinks", ops.sinks),
            ("block_mask", ops.block_mask),
        )
        if value is not None
    ]
    return ", ".join(given)


def _blockwise_run(query, key, value, ops, settings, extras):
    out, lse = blockwise.attention(query, key, value, ops, settings)
    return out, None, lse


def _cudnn_obstacle(query, key, ops, settings, extras):
    backend = jax.default_backend()
    if backend != "gpu":
        return f"jax's cuDNN kernel runs on NVIDIA GPUs only (the backend here is {backend!r})"
    return "the cuDNN route is not available in this version of jattn"


ROUTES: dict[str, Route] = {
    "dense": Route(lambda *args: None, _dense_run),
    "blockwise": Route(_blockwise_obstacle, _blockwise_run),
    "cudnn": Route(_cudnn_obstacle, None),
}
ALIASES = {"xla": "dense"}  # jax.nn's names


def choose(implementation, query, key, ops, settings, extras) -> str:
    """The implementation that runs the call (raises if an explicit one cannot honour it)."""
    _checks.implementation(implementation)
    if implementation is not None:
        name = ALIASES.get(implementation, implementation)
        route = ROUTES.get(name)
        reason = (
            f"{name!r} is not available in this version of jattn"
            if route is None
            else route.obstacle(query, key, ops, settings, extras)
        )
        if reason is not None:
            raise ValueError(
                f"implementation={implementation!r} cannot be used here: {reason}. Use "
                "implementation='dense' or None (automatic)."
            )
        return name
    if ROUTES["blockwise"].obstacle(query, key, ops, settings, extras) is not None:
        return "dense"
    q_len, kv_len = query.shape[-3], key.shape[-3]
    if jax.default_backend() == "cpu":
        return "blockwise" if min(q_len, kv_len) >= AUTO_MIN_LEN else "dense"
    return "blockwise" if q_len * kv_len >= AUTO_DENSE_MAX_SCORES else "dense"


def run(implementation, query, key, value, ops: Operands, settings: Settings, extras):
    """Runs the call on the chosen implementation: ``(out, weights, residual)``."""
    name = choose(implementation, query, key, ops, settings, extras)
    return ROUTES[name].run(query, key, value, ops, settings, extras)
