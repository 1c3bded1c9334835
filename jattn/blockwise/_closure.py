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

__all__ = ["Hoisted", "hoist"]


def hoist(fn: Callable, *example_args) -> tuple[Hoisted, list]:
    """``fn`` with every array it closes over hoisted into explicit trailing arguments.

    Args:
      fn: a pure function of ``example_args``' structure (pytrees of arrays).
      *example_args: arrays or ``jax.ShapeDtypeStruct``\\ s of the shapes ``fn`` will be
        called with (the converted function is specialised to them).

    Returns:
      ``(converted, consts)``: ``converted(*args, *consts) == fn(*args)`` for ``args``
      shaped like ``example_args``; ``consts`` is the list of arrays (concrete or traced)
      that ``fn`` reads from its closure. ``fn`` is traced once, here; ``converted``
      evaluates the traced program and never calls ``fn`` again.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example_args)
    converted = Hoisted(
        closed.jaxpr, jax.tree.structure(example_args), jax.tree.structure(out_shape)
    )
    return converted, list(closed.consts)


class Hoisted:
    """A function hoisted by :func:`hoist`: ``converted(*args, *consts)``."""

    def __init__(self, jaxpr, in_tree, out_tree):
        self._jaxpr = jaxpr
        self._in_tree = in_tree
        self._out_tree = out_tree
        self._num_consts = len(jaxpr.constvars)

    def __call__(self, *args_and_consts):
        split = len(args_and_consts) - self._num_consts
        args, consts = args_and_consts[:split], args_and_consts[split:]
        leaves, tree = jax.tree.flatten(tuple(args))
        if tree != self._in_tree:
            raise TypeError(
                f"the hoisted function was specialised to arguments {self._in_tree}, got {tree}."
            )
        out = jaxpr_as_fun(ClosedJaxpr(self._jaxpr, list(consts)))(*leaves)
        return jax.tree.unflatten(self._out_tree, out)

    def uses(self, index: int) -> bool:
        """Whether the result depends on flat argument ``index`` at all (it is read by some
        operation or returned): e.g. whether a ``mask_mod`` looks at its batch index."""
        var = self._jaxpr.invars[index]
        read = (v for eqn in self._jaxpr.eqns for v in eqn.invars)
        return any(v is var for v in read) or any(v is var for v in self._jaxpr.outvars)
