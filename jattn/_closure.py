"""Closure conversion for functions that cross a ``jax.custom_vjp`` boundary.

A ``score_mod`` such as ``lambda s, b, h, q, k: s + slopes[h] * (k - q)`` closes over
``slopes``. Inside a ``custom_vjp`` the function is a static (non-differentiable)
argument, so the slopes would get no gradient, and a traced array in its closure would
leak out of the trace. :func:`hoist` turns the function into one that takes every array
it closes over as explicit arguments, which the ``custom_vjp`` then carries as ordinary
(differentiable) operands; the backward pass gets their cotangents from ``jax.vjp`` of
the converted function.

``jax.closure_convert`` does the same for the constants it deems "maybe perturbed" only
(float tracers); integer arrays traced by an enclosing ``jax.jit`` (segment ids, prefix
lengths) stay in the closure, and ``jax.grad(jax.jit(f))`` then fails with "No constant
handler for type DynamicJaxprTracer". :func:`hoist` therefore hoists every constant.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

__all__ = ["hoist"]


def hoist(fn: Callable, *example_args) -> tuple[Callable, list]:
    """``fn`` with every array it closes over hoisted into explicit trailing arguments.

    Args:
      fn: a pure function of ``example_args``' structure (pytrees of arrays).
      *example_args: arrays or ``jax.ShapeDtypeStruct``\\ s of the shapes ``fn`` will be
        called with (the converted function is specialised to them).

    Returns:
      ``(converted, consts)``: ``converted(*args, *consts) == fn(*args)`` for ``args``
      shaped like ``example_args``; ``consts`` is the list of arrays (concrete or traced)
      that ``fn`` reads from its closure.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example_args)
    in_tree = jax.tree.structure(example_args)
    out_tree = jax.tree.structure(out_shape)
    jaxpr, num_consts = closed.jaxpr, len(closed.consts)

    def converted(*args_and_consts):
        split = len(args_and_consts) - num_consts
        args, consts = args_and_consts[:split], args_and_consts[split:]
        leaves, tree = jax.tree.flatten(tuple(args))
        if tree != in_tree:
            raise TypeError(
                f"the hoisted function was specialised to arguments {in_tree}, got {tree}."
            )
        out = jaxpr_as_fun(ClosedJaxpr(jaxpr, list(consts)))(*leaves)
        return jax.tree.unflatten(out_tree, out)

    return converted, list(closed.consts)
