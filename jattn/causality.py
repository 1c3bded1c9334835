"""Probes that measure whether a sequence function's outputs depend on future inputs.

``dependence_matrix(fn, x)[i, j]`` is the largest effect of input position ``j`` on
output position ``i``, measured either

* by gradient: ``max |d fn(x)[..., i, :] / d x[..., j, :]|`` over every other axis
  (an exact zero means no dependence at all, not merely a small one), or
* by perturbation: change input position ``j`` only (Gaussian noise for float inputs,
  another token for integer inputs) and take ``max |fn(x') - fn(x)|`` at output ``i``.

A causal function has ``D[i, j] == 0`` for every ``j > i``; :func:`future_leak` is the
largest of those entries. The tests and ``train_toy.py`` use these probes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["dependence_matrix", "future_leak", "is_causal"]


def _reduce_to(arr: jnp.ndarray, keep: tuple[int, int]) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Max of |arr| over every axis except the two in ``keep`` (kept in that order), and
    where that max saw a NaN: XLA's CPU max reduction can drop NaNs, so they are looked for
    apart (a NaN must not read as "no dependence")."""
    arr = jnp.moveaxis(jnp.abs(arr), keep, (0, 1))
    flat = arr.reshape(arr.shape[0], arr.shape[1], -1)
    return flat.max(axis=-1), jnp.isnan(flat).any(axis=-1)


def _checked(reduced, what: str) -> np.ndarray:
    """``[T_out, T_in]`` from :func:`_reduce_to`'s ``[T_in, T_out]`` pair, or a ValueError
    naming the first (output, input) pair whose effect is NaN."""
    dep, nan = (np.asarray(a).T for a in reduced)
    if nan.any():
        i, j = np.argwhere(nan)[0]
        raise ValueError(
            f"{what} is NaN for output position {i} and input position {j}, so whether that "
            "output depends on that input cannot be told (NaN would read as no dependence). "
            "Make fn finite at x (jax.debug_nans finds where a NaN starts), or pass another x."
        )
    return dep


def _default_perturb(x, j, key, vocab_size):
    """Input ``x`` (positions on axis 0) with position ``j`` changed."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        if vocab_size is None:
            raise ValueError(
                "integer (token) inputs need vocab_size= to draw replacement tokens, or a "
                "custom perturb=(x, j) -> x' function."
            )
        # A shift in [1, vocab_size) guarantees a *different* token at every element.
        shift = jax.random.randint(key, x.shape[1:], 1, vocab_size, dtype=x.dtype)
        return x.at[j].set((x[j] + shift) % vocab_size)
    noise = jax.random.normal(key, x.shape[1:], x.dtype)
    return x.at[j].add(noise)


def dependence_matrix(
    fn: Callable[[jax.Array], jax.Array],
    x,
    *,
    method: Literal["gradient", "perturbation"] = "gradient",
    in_axis: int = -2,
    out_axis: int = -2,
    key: jax.Array | None = None,
    vocab_size: int | None = None,
    perturb: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> np.ndarray:
    """Measures how much each output position depends on each input position.

    Args:
      fn: a JAX function of one array, e.g. ``lambda x: module.apply(params, x)``.
      x: its input; the sequence runs along ``in_axis`` (``[batch..., T, d]`` by default;
        use ``in_axis=-1`` for token ids ``[batch..., T]``).
      method: ``'gradient'`` (float inputs only) or ``'perturbation'``.
      in_axis: the sequence axis of ``x``.
      out_axis: the sequence axis of ``fn(x)``.
      key: random key for the perturbations; default ``jax.random.key(0)``.
      vocab_size: for integer inputs with the default perturbation: tokens are in
        ``[0, vocab_size)``.
      perturb: optional ``perturb(x_moved, j) -> x_moved'`` changing position ``j`` of an
        input whose sequence axis has been moved to the front.

    Returns:
      numpy ``[T_out, T_in]``: ``D[i, j]`` is the effect of input ``j`` on output ``i``.

    Raises:
      ValueError: an effect is NaN (``fn`` gives a NaN output or gradient at ``x``): the
        dependence cannot be told, so no matrix is returned.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a function of one array, got {type(fn).__name__}.")
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have a sequence axis, got a scalar.")
    if not -x.ndim <= in_axis < x.ndim:
        raise ValueError(f"in_axis={in_axis} is not an axis of x (shape {x.shape}).")
    y_ndim = jax.eval_shape(fn, x).ndim
    if not -y_ndim <= out_axis < max(y_ndim, 1):
        raise ValueError(
            f"out_axis={out_axis} is not an axis of fn(x) (rank {y_ndim}); fn must return a "
            "sequence of outputs, e.g. [batch..., T, features]."
        )
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2
    ):
        raise ValueError(
            f"vocab_size must be an int >= 2 (a replacement token must differ from the "
            f"original), got {vocab_size!r}."
        )
    if method == "gradient":
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"method='gradient' needs a float input, got {x.dtype}; use "
                "method='perturbation' (with vocab_size=) for token ids."
            )
        jac = jax.jit(jax.jacrev(fn))(x)  # y.shape + x.shape; one compilation, not one per op
        out_ax = out_axis % y_ndim
        in_ax = y_ndim + (in_axis % x.ndim)
        return _checked(_reduce_to(jac, (in_ax, out_ax)), "The gradient of fn(x)")
    if method != "perturbation":
        raise ValueError(f"method must be 'gradient' or 'perturbation', got {method!r}.")

    key = jax.random.key(0) if key is None else key
    xs = jnp.moveaxis(x, in_axis, 0)  # [T_in, ...]
    t_in = xs.shape[0]
    change = perturb or (
        lambda xm, j: _default_perturb(xm, j, jax.random.fold_in(key, j), vocab_size)
    )

    def output(j):
        # j = -1 is the unperturbed input. It goes through the same compiled body as the
        # perturbed ones, so numerically identical outputs really compare equal.
        changed = change(xs, jnp.maximum(j, 0))
        return fn(jnp.moveaxis(jnp.where(j < 0, xs, changed), 0, in_axis))

    def columns():
        ys = jax.lax.map(output, jnp.arange(-1, t_in))  # [1 + T_in, *y.shape]
        # an output that did not change has no effect, equal infinities included
        diff = jnp.where(ys[1:] == ys[:1], 0, ys[1:] - ys[:1])
        return _reduce_to(diff, (0, 1 + (out_axis % (diff.ndim - 1))))  # [T_in, T_out]

    return _checked(jax.jit(columns)(), "The change of fn(x)")


def future_leak(fn, x, **kwargs) -> float:
    """Largest effect of a *future* input on an output: ``max_{j > i} D[i, j]``.

    Exactly ``0.0`` for a causal function. Takes :func:`dependence_matrix`'s arguments.
    """
    dep = dependence_matrix(fn, x, **kwargs)
    upper = np.triu(np.ones(dep.shape, dtype=bool), k=1)
    return float(dep[upper].max()) if upper.any() else 0.0


def is_causal(fn, x, *, atol: float = 0.0, **kwargs) -> bool:
    """True when no output depends on a future input (``future_leak <= atol``)."""
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol}.")
    return future_leak(fn, x, **kwargs) <= atol
