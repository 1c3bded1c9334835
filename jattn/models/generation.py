"""Text generation with the models' KV caches, compiled once.

:func:`generate` is the book's ``generate`` (chapter 5: greedy at temperature 0, else
temperature and top-k sampling) run through :func:`jattn.generate.generate`: one jitted
program that feeds the prompt once (prefill) and then a ``lax.scan`` of one-token steps,
each reading and extending the attention layers' caches. ``use_cache=False`` runs
:func:`jattn.generate.generate_recompute` instead (a full forward pass per new token, the
book's ``generate_text_simple``): the same tokens, for checking and timing.

Stop tokens: ``eos_id=`` (one id or several) ends a row when its next token is one of
them, as the book's chapter-5 ``generate(..., eos_id=)`` (the stop token is not part of
the continuation); the output keeps its fixed shape ``[batch, max_new_tokens]``, with
``pad_id`` (default the stop token) from each row's end on, and ``return_lengths=True``
gives each row's length. :func:`generate_stream` yields the tokens step by step as the
book's ``generate_text_simple_stream``.

The model is passed to the jitted program as a pure function of its state:
:class:`NNXDecodeFn` / :class:`NNXForwardFn` hold only the model's ``nnx.GraphDef``, so
they compare equal for models of the same structure and a second call with the same
shapes reuses the compiled program. The model itself is never modified.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jattn import generate as jgen
from jattn.models.base import LanguageModel

__all__ = ["NNXDecodeFn", "NNXForwardFn", "generate", "generate_stream"]

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class NNXDecodeFn:
    """``decode_fn(state, tokens, cache, num_new) -> (logits, cache)`` of a jattn model.

    ``state`` is everything but the ``nnx.Cache`` variables, ``cache`` those; see
    :func:`jattn.generate.generate`. With ``last_only`` the logits are each row's last real
    token's, ``[B, 1, V]`` (the model's ``logits_at=num_new - 1``), else ``[B, T, V]``.
    """

    graphdef: Any
    # True: the logits of each row's last real token only, [B, 1, V] (the output head skips
    # a prompt's other positions); False: every position's, [B, T, V].
    last_only: bool = False

    def __call__(self, state, tokens, cache, num_new):
        model = nnx.merge(self.graphdef, cache, state)
        at = jnp.maximum(num_new - 1, 0) if self.last_only else None
        logits = model(tokens, deterministic=True, decode=True, num_new=num_new, logits_at=at)
        return (logits if at is None else logits[:, None]), nnx.state(model, nnx.Cache)


@dataclasses.dataclass(frozen=True)
class NNXForwardFn:
    """``forward_fn(state, tokens) -> logits`` of a jattn model (no cache, no dropout)."""

    graphdef: Any

    def __call__(self, state, tokens):
        return nnx.merge(self.graphdef, state)(tokens, deterministic=True)


def _check_window(model: LanguageModel, window, use_cache: bool) -> None:
    """``window``: None or an int in ``[1, context_length]``, with the KV cache only."""
    if window is None:
        return
    context = model.cfg.context_length
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= context:
        raise ValueError(
            f"window must be None or an int in [1, {context}] (cfg['context_length']): the "
            f"tokens each new token sees before itself; got {window!r}."
        )
    if not use_cache:
        raise ValueError("window= decodes through rolling KV caches; it needs use_cache=True.")


def _check_room(model: LanguageModel, prompt_len: int, max_new_tokens, window=None) -> int:
    """Positions the run needs (prompt + new tokens - 1); a ValueError past the context
    (unless a rolling cache of ``window`` positions serves a model without a position limit)."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, numbers.Integral)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    max_new_tokens = int(max_new_tokens)
    # The last new token is sampled but never fed back, so it takes no position.
    needed = prompt_len + max_new_tokens - 1
    context = model.cfg.context_length
    if window is not None and not model.positions_limited:
        return needed
    if needed > context:
        raise ValueError(
            f"a prompt of {prompt_len} tokens and max_new_tokens={max_new_tokens} need "
            f"{needed} positions, more than cfg['context_length'] = {context}. The book's "
            "generate_text_simple crops the prompt instead: pass at most the last "
            f"{max(context - max_new_tokens + 1, 1)} prompt tokens, or ask for fewer new "
            "tokens"
            + (
                "; GPT-2's position embedding ends at the context, so window= cannot extend it."
                if model.positions_limited
                else ", or pass window= (a rolling KV cache, sliding-window attention)."
            )
        )
    return needed


def _check_model_and_prompt(model, token_ids) -> Array:
    if not isinstance(model, LanguageModel):
        raise TypeError(
            f"model must be a jattn.models model (GPTModel, Llama3Model, Qwen3Model), got "
            f"{type(model).__name__}."
        )
    token_ids = model.check_token_ids(token_ids)
    if token_ids.ndim != 2:
        raise ValueError(
            f"token_ids must have shape [batch, prompt_len] (the book's idx), got "
            f"{token_ids.shape}; add a batch axis with token_ids[None]."
        )
    return token_ids


def generate(
    model: LanguageModel,
    token_ids,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    key: Array | None = None,
    prompt_lengths=None,
    use_cache: bool = True,
    window: int | None = None,
    eos_id=None,
    pad_id: int | None = None,
    return_lengths: bool = False,
):
    """Generates up to ``max_new_tokens`` tokens after each prompt, with the KV cache.

    Args:
      model: a :class:`GPTModel`, :class:`Llama3Model` or :class:`Qwen3Model` (not
        modified; dropout is off).
      token_ids: int ``[batch, prompt_len]``, ids in ``[0, vocab_size)``; rows shorter than
        ``prompt_len`` are right-padded (see ``prompt_lengths``).
      max_new_tokens: tokens to generate per row (>= 1); ``prompt_len + max_new_tokens - 1``
        must fit ``context_length``.
      temperature: 0 (default): greedy, as the book's ``generate_text_simple``; otherwise
        the book's chapter-5 sampling at this temperature.
      top_k: sample only among the ``top_k`` largest logits (None: all).
      key: ``jax.random`` key, required when ``temperature > 0`` (step ``i`` uses
        ``fold_in(key, i)``).
      prompt_lengths: int ``[batch]``, real tokens of each row; default ``prompt_len``.
      use_cache: False reruns the whole sequence for every token (for comparison).
      window: decode through rolling KV caches of ``window`` positions
        (:class:`jattn.kvcache.RollingKVCache`): every token attends to itself and the
        ``window`` tokens before it (sliding-window attention, also over the prompt), and
        Llama 3 / Qwen3 may then generate past ``context_length`` (RoPE has no position
        limit; the prompt itself must still fit). Equal to the plain cache while prompt +
        new tokens stay within ``window + 1``.
      eos_id: a stop token id or several (None: none), as the book's ``generate(...,
        eos_id=)``: a row ends when its next token is a stop token, which is not part of
        its continuation. The compiled loop stops once every row has ended.
      pad_id: the id written from a row's end on; default the (first) ``eos_id``.
      return_lengths: also return each row's continuation length.

    Returns:
      int32 ``[batch, max_new_tokens]``: the continuation only (the book returns the prompt
      and the continuation: ``jnp.concatenate([token_ids, out], axis=1)``), ``pad_id``
      from each row's end on. With ``return_lengths``, ``(tokens, lengths int32 [batch])``:
      row ``b``'s continuation is ``tokens[b, :lengths[b]]``; for one row that is what the
      book's ``generate(model, idx, ..., eos_id=)`` appends to ``idx``.

    Raises:
      TypeError: a model that is not a jattn model, non-integer token ids.
      ValueError: ids outside the vocabulary, a prompt that is not ``[batch, prompt_len]``,
        a run longer than the context, bad sampling arguments.
    """
    token_ids = _check_model_and_prompt(model, token_ids)
    _check_window(model, window, use_cache)
    capacity = _check_room(model, token_ids.shape[1], max_new_tokens, window)
    jgen.check_stop(eos_id, pad_id, model.cfg.vocab_size)
    sampling = dict(max_new_tokens=max_new_tokens, key=key, temperature=temperature, top_k=top_k)
    stop = dict(eos_id=eos_id, pad_id=pad_id, return_lengths=return_lengths)
    if not use_cache:
        graphdef, state = nnx.split(model)
        return jgen.generate_recompute(
            NNXForwardFn(graphdef), state, token_ids, prompt_lengths, **sampling, **stop
        )
    decode_fn, state, cache = _decoder(model, token_ids.shape[0], capacity, window)
    return jgen.generate(
        decode_fn, state, cache, token_ids.astype(jnp.int32), prompt_lengths, **sampling, **stop
    )


def _decoder(model: LanguageModel, batch: int, capacity: int, window):
    """``(decode_fn, state, cache)``: a copy of the model (sharing its arrays) with a fresh
    cache sized to the run (a rolling one of ``window`` positions when given)."""
    graphdef, state = nnx.split(model)
    decoder = nnx.merge(graphdef, state)
    if window is None:
        decoder.init_cache(batch, capacity)
    else:
        decoder.init_cache(batch, window, rolling=True)
    graphdef, cache, state = nnx.split(decoder, nnx.Cache, ...)
    return NNXDecodeFn(graphdef, last_only=True), state, cache


def generate_stream(
    model: LanguageModel,
    token_ids,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    key: Array | None = None,
    prompt_lengths=None,
    window: int | None = None,
    eos_id=None,
    pad_id: int | None = None,
):
    """Yields new tokens as they are produced: the book's ``generate_text_simple_stream``.

    The same tokens, step for step, as :func:`generate` with the same arguments (greedy or
    sampled with the same key), through the KV cache: one compiled prefill and one
    compiled step, each compiled once per shape.

    Every argument is as in :func:`generate` (``model``, ``token_ids``,
    ``max_new_tokens``, ``temperature``, ``top_k``, ``key``, ``prompt_lengths``,
    ``window``, ``eos_id``, ``pad_id``).

    Yields:
      int32 ``[batch]`` per step: every row's next token, ``pad_id`` for rows that have
      ended. The stream ends after ``max_new_tokens`` steps or when every row has ended:
      for one row, right before its stop token, as the book's
      ``generate_text_simple_stream(..., eos_token_id=)`` (which yields ``[batch, 1]``).

    Raises:
      ValueError: as :func:`generate`, at the call (before the first token).
    """
    token_ids = _check_model_and_prompt(model, token_ids)
    _check_window(model, window, True)
    capacity = _check_room(model, token_ids.shape[1], max_new_tokens, window)
    jgen.check_stop(eos_id, pad_id, model.cfg.vocab_size)
    decode_fn, state, cache = _decoder(model, token_ids.shape[0], capacity, window)
    return jgen.generate_stream(
        decode_fn,
        state,
        cache,
        token_ids.astype(jnp.int32),
        prompt_lengths,
        max_new_tokens=max_new_tokens,
        key=key,
        temperature=temperature,
        top_k=top_k,
        eos_id=eos_id,
        pad_id=pad_id,
    )
