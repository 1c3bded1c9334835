"""Greedy autoregressive generation for the toy model (no KV cache).

Each new token reruns the model on the whole fixed-size window, the way chapter 4 of the
book generates; positions not generated yet hold ``pad_id``. A causal model never looks
at them; a leaky model does, which is exactly why it fails here. This function is the
one place the demo generates, so a KV-cache version can replace it.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["generation_accuracy", "greedy_generate"]


@partial(jax.jit, static_argnames=("model", "num_new_tokens", "pad_id"))
def greedy_generate(
    model: nn.Module, variables, prompt, *, num_new_tokens: int, pad_id: int = 0
) -> jax.Array:
    """Extends ``prompt [B, P]`` by ``num_new_tokens`` tokens, each the argmax of the logits.

    Args:
      model: a module mapping ``tokens [B, T]`` to ``logits [B, T, V]`` that accepts
        ``deterministic=True`` (dropout off), e.g. :class:`jattn.toy.TinyGPT`.
      variables: its variables (``{'params': ...}``).
      prompt: int ``[B, P]``.
      num_new_tokens: how many tokens to append (>= 1); ``P + num_new_tokens - 1`` must not
        exceed the model's context length (the last new token is never read back).
      pad_id: token placed in the positions not generated yet.

    Returns:
      int ``[B, P + num_new_tokens]``: the prompt followed by the generated tokens.
    """
    batch, prompt_len = prompt.shape
    total = prompt_len + num_new_tokens
    # [B, total]: the prompt, then placeholders that are overwritten one by one.
    buffer = jnp.full((batch, total), pad_id, dtype=prompt.dtype).at[:, :prompt_len].set(prompt)

    def write_next(i, buffer):
        # [B, total - 1, V]: one fixed-shape call per new token, so this compiles once.
        logits = model.apply(variables, buffer[:, : total - 1], deterministic=True)
        pos = prompt_len + i
        next_token = jnp.argmax(logits[:, pos - 1, :], axis=-1).astype(buffer.dtype)  # [B]
        return buffer.at[:, pos].set(next_token)

    return jax.lax.fori_loop(0, num_new_tokens, write_next, buffer)


def generation_accuracy(
    model: nn.Module, variables, windows, prompt_len: int, *, pad_id: int = 0
) -> tuple[float, jax.Array]:
    """How many tokens greedy generation gets right after each window's prompt.

    Args:
      model, variables: as in :func:`greedy_generate`.
      windows: int ``[N, P + M]`` held-out windows; the first ``prompt_len`` tokens are
        the prompt and the remaining ``M`` are the reference continuation.
      prompt_len: ``P``.
      pad_id: as in :func:`greedy_generate`.

    Returns:
      ``(accuracy, generated)``: the share of the ``N * M`` continuation tokens generated
      correctly, and the generated continuations ``[N, M]``.
    """
    num_new = windows.shape[1] - prompt_len
    generated = greedy_generate(
        model, variables, windows[:, :prompt_len], num_new_tokens=num_new, pad_id=pad_id
    )[:, prompt_len:]
    # [N, M] token-wise agreement with the reference continuation
    return float(jnp.mean(generated == windows[:, prompt_len:])), generated
