"""Attention deferred to lowering time: a route that is traced only when a program is
lowered for its platform.

The routing carries one ``jax.lax.platform_dependent`` branch per platform. The host's
branch is traced as usual; every other platform's branch is :func:`attend`, one primitive
(``jattn_deferred_attention``) whose abstract evaluation gives the host branch's output
avals (every route returns the same) and whose lowering rule traces that platform's
route (``build(platform)``) when, and only when, the branch is lowered for it. A
program lowered for the host alone (``jax.jit`` as usual) never traces the other routes:
``platform_dependent`` prunes their branches, so the deferred branches cost one equation
each on the host.

Transformations:

* reverse-mode autodiff: :func:`attend` is a ``jax.custom_vjp`` (residuals: the operands
  and the outputs) whose backward pass is a second deferred primitive
  (``jattn_deferred_attention_grad``) computing, when lowered, the VJP of the platform's
  route: from the forward's outputs where the route offers that (``given``: jattn's
  Pallas kernel runs its backward kernels alone), else ``jax.vjp`` of the route, its
  forward pass recomputed (correct, one forward more). Integer, boolean and key
  operands get no cotangent.
* ``jax.vmap``: both primitives batch by deferring ``jax.vmap`` of the function they
  lower (:class:`_Vmapped`); the abstract output gains the batch axis in front.
* forward-mode autodiff (``jax.jvp`` of a jitted call, ``jax.hessian``): the routes'
  custom VJPs have none, so both primitives differentiate the ``fallback`` (the dense
  path) there, traced at that point.
* ``jax.checkpoint``, ``shard_map``: plain primitives, nothing to do.

This module knows nothing of routing: ``build`` is the routing's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

__all__ = ["PLATFORMS", "attend"]

# The platforms with a lowering rule of their own; any other platform gets the branch
# lowered with platform=None (see _lower).
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


class Builder:
    """``build(platform) -> fn(*operands) -> list of arrays``; optionally ``given(platform)
    -> ((operands, outs) -> None | fn)``: the same function with its forward pass given
    (its outputs ``outs``), whose VJP then needs no recomputed forward (None: the route has
    none); and ``fallback() -> fn``: the function on a route that runs on every platform
    and has forward-mode derivatives (the routing's dense path), for ``jax.jvp``. Hashed
    by identity (a primitive's parameters must be hashable; two calls never share one)."""

    def __init__(self, build: Callable, given: Callable | None, fallback: Callable):
        self._build, self._given, self._fallback = build, given, fallback

    def build(self, platform: str | None) -> Callable:
        return self._build(platform)

    def given(self, platform: str | None) -> Callable | None:
        return None if self._given is None else self._given(platform)

    def fallback(self) -> Callable:
        return self._fallback


class _Vmapped(Builder):
    """``inner`` under ``jax.vmap(in_axes=in_axes, out_axes=0, axis_size=size)``."""

    def __init__(self, inner: Builder, in_axes: tuple, size: int, axis_name):
        self._inner, self._in_axes, self._size, self._axis_name = inner, in_axes, size, axis_name

    def _vmap(self, fn):
        return jax.vmap(
            lambda *xs: list(fn(*xs)), in_axes=self._in_axes, out_axes=0,
            axis_size=self._size, axis_name=self._axis_name,
        )  # fmt: skip

    def build(self, platform):
        return self._vmap(self._inner.build(platform))

    def fallback(self):
        return self._vmap(self._inner.fallback())


class _Gradient(Builder):
    """The VJP of ``inner``'s function: ``(*operands, *outs, *cotangents) -> cotangents``
    of the operands marked ``differentiable``. Through ``inner.given`` where the route
    offers it (its backward pass from the forward's outputs), else ``jax.vjp`` of the
    route itself: its forward pass recomputed (correct; ``outs`` unused)."""

    def __init__(self, inner: Builder, differentiable: tuple[bool, ...], num_outs: int):
        self._inner, self._diff, self._num_outs = inner, differentiable, num_outs

    def _gradient(self, fn, given):
        n, m = len(self._diff), self._num_outs

        def gradient(*args):
            operands, outs, cotangents = list(args[:n]), args[n : n + m], list(args[n + m :])
            forward = None if given is None else given(operands, outs)
            forward = fn if forward is None else forward
            floats = [x for x, d in zip(operands, self._diff, strict=True) if d]

            def of_floats(*xs):
                it = iter(xs)
                full = [next(it) if d else x for x, d in zip(operands, self._diff, strict=True)]
                return list(forward(*full))

            _, vjp = jax.vjp(of_floats, *floats)
            return list(vjp(cotangents))

        return gradient

    def build(self, platform):
        return self._gradient(self._inner.build(platform), self._inner.given(platform))

    def fallback(self):
        return self._gradient(self._inner.fallback(), None)


# ----------------------------------------------------------------------------------------
# The primitives
# ----------------------------------------------------------------------------------------

_forward_p = jax.extend.core.Primitive("jattn_deferred_attention")
_forward_p.multiple_results = True
_backward_p = jax.extend.core.Primitive("jattn_deferred_attention_grad")
_backward_p.multiple_results = True


@_forward_p.def_abstract_eval
def _forward_aval(*avals, builder, platform, out_avals):
    return list(out_avals)


@_backward_p.def_abstract_eval
def _backward_aval(*avals, builder, platform, out_avals):
    return list(out_avals)


def _bind_jitted(prim, *args, **params):
    # Outside jit a branch of platform_dependent runs only on the host, which holds no
    # deferred branch; a direct call (tests) compiles the primitive for the host.
    return jax.jit(lambda *xs: prim.bind(*xs, **params))(*args)


for _prim in (_forward_p, _backward_p):
    _prim.def_impl(functools.partial(_bind_jitted, _prim))


def _batch(prim, axis_data, args, dims, *, builder, platform, out_avals):
    size = axis_data.size
    args = [
        x if d is None or d == 0 else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True)
    ]
    in_axes = tuple(None if d is None else 0 for d in dims)
    vmapped = _Vmapped(builder, in_axes, size, axis_data.name)
    avals = tuple(jax.extend.core.unmapped_aval(size, 0, a) for a in out_avals)
    outs = prim.bind(*args, builder=vmapped, platform=platform, out_avals=avals)
    return outs, [0] * len(outs)


for _prim in (_forward_p, _backward_p):
    batching.fancy_primitive_batchers[_prim] = functools.partial(_batch, _prim)


def _jvp(primals, tangents, *, builder, platform, out_avals):
    # Forward-mode autodiff of a deferred call (jax.hessian of a jitted function, say):
    # the routes' custom VJPs have no forward mode, so the call takes the fallback (the
    # dense path, on every platform), as the automatic rule does when it sees jax.jvp.
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    fn = builder.fallback()
    out, tangent_out = jax.jvp(lambda *xs: list(fn(*xs)), list(primals), tangents)
    return out, tangent_out


for _prim in (_forward_p, _backward_p):
    ad.primitive_jvps[_prim] = _jvp


def _lower(ctx, *args, builder, platform, out_avals, rule_platform):
    """The route of ``platform`` where the branch is lowered for it; elsewhere (a program
    lowered for several platforms lowers every branch for each) zeros, never executed."""
    if rule_platform == platform:
        fn = builder.build(platform)
    elif len(ctx.module_context.platforms) == 1:  # the branch would run here: a bug
        raise AssertionError(f"the deferred branch of {platform} lowered for {rule_platform}")
    else:

        def fn(*_):
            return [jnp.zeros(a.shape, a.dtype) for a in ctx.avals_out]

    return mlir.lower_fun(lambda *xs: list(fn(*xs)), multiple_results=True)(ctx, *args)


for _prim in (_forward_p, _backward_p):
    for _p in PLATFORMS:
        mlir.register_lowering(_prim, functools.partial(_lower, rule_platform=_p), platform=_p)
    mlir.register_lowering(_prim, functools.partial(_lower, rule_platform=None))


# ----------------------------------------------------------------------------------------
# The differentiable call
# ----------------------------------------------------------------------------------------


def _differentiable(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attend(builder: Builder, platform, out_avals, *operands):
    return _forward_p.bind(*operands, builder=builder, platform=platform, out_avals=out_avals)


def _attend_fwd(builder, platform, out_avals, *operands):
    outs = _forward_p.bind(*operands, builder=builder, platform=platform, out_avals=out_avals)
    return outs, (operands, outs)


def _attend_bwd(builder, platform, out_avals, residuals, cotangents):
    operands, outs = residuals
    diff = tuple(_differentiable(x) for x in operands)
    grad_avals = tuple(jax.typeof(x) for x, d in zip(operands, diff, strict=True) if d)
    grads = iter(
        _backward_p.bind(
            *operands,
            *outs,
            *cotangents,
            builder=_Gradient(builder, diff, len(outs)),
            platform=platform,
            out_avals=grad_avals,
        )
    )
    return tuple(next(grads) if d else None for d in diff)


_attend.defvjp(_attend_fwd, _attend_bwd)


def attend(
    build: Callable[[str | None], Callable], platform: str | None, operands: Sequence,
    out_avals: Sequence, given: Callable | None, fallback: Callable,
) -> list:  # fmt: skip
    """The outputs of ``build(platform)(*operands)``, traced when lowered for ``platform``.

    Args:
      build: ``build(platform) -> fn``; ``fn(*operands)`` returns a list of arrays with
        ``out_avals`` (the route of ``platform``, chosen and traced at lowering time).
      given: ``given(platform) -> ((operands, outs) -> None | fn)``: ``fn`` with its
        forward pass given as ``outs`` (a backward pass without a recomputed forward;
        None where the route has none), or None.
      fallback: ``fn`` on a route that runs on every platform and has forward-mode
        derivatives: what forward-mode autodiff of the call runs (``jax.jvp``).
      platform: the lowering platform this branch serves (one of :data:`PLATFORMS`), or
        None for the branch of any other platform.
      operands: the arrays the route reads (tracers included; no Python scalars).
      out_avals: the outputs' abstract values (``jax.typeof`` of the host's outputs).

    Returns:
      The list of outputs, differentiable (reverse mode) in the inexact operands.
    """
    builder = Builder(build, given, fallback)
    return list(_attend(builder, platform, tuple(out_avals), *operands))
