"""The book's non-attention layers in Flax NNX: LayerNorm, GELU, the two feed-forward nets.

Parameter names follow the book so that a PyTorch key maps to an NNX path by replacing
``.`` with ``/`` (and ``weight`` with ``kernel``, transposed, for ``nn.Linear``):
``norm1.scale``, ``ff.layers.0.weight``, ``ff.fc1.weight``. RMSNorm is flax's
``nnx.RMSNorm`` (parameter ``scale``; statistics in float32), the same computation as the
book's Qwen3 ``RMSNorm`` and ``torch.nn.RMSNorm``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["FeedForward", "GatedFeedForward", "LayerNorm", "gelu"]

Array = jax.Array


def _features(param: Array, ndim: int) -> Array:
    """``[features]`` -> ``[1..., features]`` with ``ndim`` axes (no implicit rank promotion)."""
    return param.reshape((1,) * (ndim - 1) + param.shape)


class LayerNorm(nnx.Module):
    """Chapter 4's ``LayerNorm``: ``scale * (x - mean) / sqrt(var + eps) + shift``.

    The variance is the biased one (``unbiased=False``), ``eps = 1e-5``, parameters
    ``scale`` (ones) and ``shift`` (zeros) as in the book. Statistics are computed in
    float32 (float64 stays float64); the output has x's dtype, or ``dtype``.

    Args:
      emb_dim: features (the last axis).
      eps: added to the variance.
      dtype: output dtype; None: x's.
      param_dtype: dtype of ``scale`` and ``shift``.
    """

    def __init__(
        self, emb_dim: int, *, eps: float = 1e-5, dtype: Any = None, param_dtype: Any = jnp.float32
    ):
        self.eps = eps
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((emb_dim,), param_dtype))
        self.shift = nnx.Param(jnp.zeros((emb_dim,), param_dtype))

    def __call__(self, x: Array) -> Array:
        """``x [..., emb_dim]`` -> normalized ``[..., emb_dim]``."""
        compute = jnp.promote_types(x.dtype, jnp.float32)
        xc = x.astype(compute)
        mean = xc.mean(axis=-1, keepdims=True)  # [..., 1]
        var = jnp.square(xc - mean).mean(axis=-1, keepdims=True)  # biased, as the book
        norm = (xc - mean) / jnp.sqrt(var + self.eps)
        scale = _features(self.scale[...].astype(compute), x.ndim)
        shift = _features(self.shift[...].astype(compute), x.ndim)
        return (scale * norm + shift).astype(self.dtype or x.dtype)


_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_CUBIC = _SQRT_2_OVER_PI * 0.044715


def gelu(x: Array) -> Array:
    """Chapter 4's ``GELU``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    The formula of ``jax.nn.gelu(x, approximate=True)``, in ``x``'s dtype, arranged as
    ``h + h tanh(x (c + c' x^2))`` with ``h = x / 2``: equal to float rounding, with two
    fewer operations an element. XLA's CPU compiler splits an elementwise op over threads
    when it counts more arithmetic than bytes moved; ``jax.nn.gelu``'s arrangement after
    the bias add crosses that line, and on a decoding step's small ``[rows, 4 emb]`` the
    hand-off between threads costs more than the op (``benchmarks/ab_gelu.py``).
    """
    half = 0.5 * x
    return half + half * jnp.tanh(x * (_SQRT_2_OVER_PI + _CUBIC * (x * x)))


class FeedForward(nnx.Module):
    """Chapter 4's ``FeedForward``: Linear(emb, 4 emb) -> GELU -> Linear(4 emb, emb).

    ``layers`` is an ``nnx.List`` as the book's ``nn.Sequential``: parameters
    ``layers/0/{kernel,bias}`` and ``layers/2/{kernel,bias}`` (the book's
    ``layers.0.weight``, ``layers.2.weight``; the GELU at index 1 has none).
    """

    def __init__(
        self, emb_dim: int, *, dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs
    ):
        def linear(d_in, d_out):
            return nnx.Linear(d_in, d_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.layers = nnx.List([linear(emb_dim, 4 * emb_dim), gelu, linear(4 * emb_dim, emb_dim)])

    def __call__(self, x: Array) -> Array:
        """``[..., emb_dim]`` -> ``[..., emb_dim]``."""
        for layer in self.layers:
            x = layer(x)
        return x


class GatedFeedForward(nnx.Module):
    """Llama 3 / Qwen3's ``FeedForward`` (SwiGLU): ``fc3(silu(fc1(x)) * fc2(x))``, no biases.

    Args:
      emb_dim: input and output width.
      hidden_dim: the inner width (the book's ``cfg['hidden_dim']``).
      dtype, param_dtype: as ``nnx.Linear``.
      rngs: for the initialization.
    """

    def __init__(
        self,
        emb_dim: int,
        hidden_dim: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        def linear(d_in, d_out):
            return nnx.Linear(
                d_in, d_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )

        self.fc1 = linear(emb_dim, hidden_dim)
        self.fc2 = linear(emb_dim, hidden_dim)
        self.fc3 = linear(hidden_dim, emb_dim)

    def __call__(self, x: Array) -> Array:
        """``[..., emb_dim]`` -> ``[..., emb_dim]``."""
        # [..., hidden_dim]: the gate (fc1, through SiLU) times the up projection (fc2)
        return self.fc3(jax.nn.silu(self.fc1(x)) * self.fc2(x))
