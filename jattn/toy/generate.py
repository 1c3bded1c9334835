"""Greedy autoregressive generation for the toy model, two ways.

* Fixed window (``cached=False``, what the demo's ``generation_accuracy`` reports): every
  new token reruns the model on the whole window it was trained on
  (:func:`jattn.generate.generate_recompute`, compiled once); positions not generated yet
  hold placeholder tokens (zeros).
* KV cache (``cached=True``): the prompt goes through the model once (prefill), then each
  new token costs one cached step (:func:`jattn.generate.generate`, :mod:`jattn.kvcache`).

A causal model never reads a later position, so both give the same tokens (checked in
``tests/test_toy.py``). A leaky model (``causal=False``) learned to read the token it must
predict from the next position: in the fixed window that position holds a placeholder, not
the answer, so it fails, which is what the demo shows. Through the cache nothing after the
current token exists at all, and keys and values are frozen as they were computed, so the
cached generator is not the leaky model's forward pass (it computes a different function);
the demo reports it as ``cached_generation_accuracy`` for contrast.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn import generate as gen

__all__ = ["generation_accuracy", "greedy_generate"]


@functools.lru_cache(maxsize=16)
def _cache_shapes(decoder: nn.Module, batch: int, capacity: int):
    # Shapes of the 'cache' collection from an abstract init: no forward pass runs.
    tokens = jax.ShapeDtypeStruct((batch, capacity), jnp.int32)
    return jax.eval_shape(decoder.init, jax.random.key(0), tokens)["cache"]


def greedy_generate(
    model: nn.Module, variables, prompt, *, num_new_tokens: int, cached: bool = False
) -> jax.Array:
    """Extends ``prompt [B, P]`` by ``num_new_tokens`` tokens, each the argmax of the logits.

    Args:
      model: a :class:`jattn.toy.TinyGPT` (any Linen language model taking
        ``deterministic=``; with ``cached=True`` also a ``decode`` attribute and a
        ``num_new`` call argument, see :class:`jattn.generate.LinenDecodeFn`).
      variables: its variables (``{'params': ...}``).
      prompt: int ``[B, P]``.
      num_new_tokens: how many tokens to append (>= 1); ``P + num_new_tokens - 1`` must not
        exceed the model's context length (the last new token is never read back); it is
        the window (or the cache size).
      cached: generate through the KV cache instead of rerunning the fixed window.

    Returns:
      int ``[B, P + num_new_tokens]``: the prompt followed by the generated tokens.
    """
    params, inference = variables["params"], (("deterministic", True),)
    if cached:
        decoder = model.clone(decode=True)
        batch, prompt_len = prompt.shape
        # An empty cache is all zeros (zero filled lengths), sized to this generation.
        shapes = _cache_shapes(decoder, batch, prompt_len + num_new_tokens - 1)
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        decode = gen.LinenDecodeFn(decoder, inference)
        new = gen.generate(decode, params, cache, prompt, max_new_tokens=num_new_tokens)
    else:
        forward = gen.LinenForwardFn(model, inference)
        new = gen.generate_recompute(forward, params, prompt, max_new_tokens=num_new_tokens)
    return jnp.concatenate([prompt, new.astype(prompt.dtype)], axis=1)


def generation_accuracy(
    model: nn.Module, variables, windows, prompt_len: int, *, cached: bool = False
) -> tuple[float, jax.Array]:
    """How many tokens greedy generation gets right after each window's prompt.

    Args:
      model, variables, cached: as in :func:`greedy_generate`.
      windows: int ``[N, P + M]`` held-out windows; the first ``prompt_len`` tokens are
        the prompt and the remaining ``M`` are the reference continuation.
      prompt_len: ``P``.

    Returns:
      ``(accuracy, generated)``: the share of the ``N * M`` continuation tokens generated
      correctly, and the generated continuations ``[N, M]``.
    """
    num_new = windows.shape[1] - prompt_len
    generated = greedy_generate(
        model, variables, windows[:, :prompt_len], num_new_tokens=num_new, cached=cached
    )[:, prompt_len:]
    # [N, M] token-wise agreement with the reference continuation
    return float(jnp.mean(generated == windows[:, prompt_len:])), generated
