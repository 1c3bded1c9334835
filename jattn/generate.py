"""Autoregressive generation: greedy, temperature and top-k sampling, with or without a KV cache.

Two generators, the same sampling, the same keys, so they give the same tokens:

* :func:`generate` runs the prompt once through the model (prefill), then feeds one
  token per step, each step reading and extending the model's KV cache
  (:mod:`jattn.kvcache`). One ``lax.scan``, one compilation per shape.
* :func:`generate_recompute` reruns the model on the whole sequence for every new token,
  the way chapter 4 of the book generates. It needs no cache, costs a full forward pass
  per token, and is the reference the cached generator is tested and benchmarked against.

Both are model-agnostic. The model comes in as a pure function of its parameters:

* ``decode_fn(params, tokens [B, T], cache, num_new [B]) -> (logits [B, T, V], cache)``
  runs a chunk of ``T`` tokens (the right-padded prompt, then ``T = 1``) with ``num_new[b]``
  real tokens in row ``b``, and returns the logits and the extended cache (any pytree;
  :class:`jattn.kvcache.KVCache` leaves in it get an eager capacity check). The logits
  may instead be ``[B, 1, V]``, each row's last real position only (all the generators
  read): a prompt's other positions then skip the output head;
* ``forward_fn(params, tokens [B, S]) -> logits [B, S, V]``: a plain causal forward pass.

Define these functions once (at module level or once per model): they are static jit
arguments, hashed by identity, so a fresh lambda per call recompiles. For a Linen model,
:class:`LinenDecodeFn` and :class:`LinenForwardFn` are ready-made (they compare equal
for equal models, so they never recompile needlessly).

**Stop tokens and streaming.** ``eos_id=`` (one id or several) ends a row when its next
token is one of them, as the book's chapter-5 ``generate(..., eos_id=)``: the stop token is
not part of the continuation, the row's later positions hold ``pad_id`` (default the stop
token), ``return_lengths=True`` gives each row's length, and the compiled loop (a
``lax.while_loop``) stops once every row has ended. :func:`generate_stream` yields the
same tokens one step at a time, as the book's ``generate_text_simple_stream``.

Randomness is explicit: step ``i`` samples with ``jax.random.fold_in(key, i)``, so a key
fixes the whole continuation, and ``temperature=0`` (greedy) needs no key.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, kvcache
from jattn import masks as masks_lib
from jattn._util import axis_specs
from jattn.kernels import cpu as cpu_kernels

__all__ = [
    "LinenDecodeFn",
    "LinenForwardFn",
    "check_sampling",
    "check_stop",
    "generate",
    "generate_recompute",
    "generate_stream",
    "sample_next",
    "stop_at_eos",
]

Array = jax.Array
DecodeFn = Callable[[Any, Array, Any, Array], tuple[Array, Any]]
ForwardFn = Callable[[Any, Array], Array]


# ----------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------


def check_sampling(temperature, top_k, key) -> tuple[float, int | None]:
    """``(temperature, top_k)`` of a call's sampling arguments, checked: ``temperature`` a
    finite float >= 0 (0 = greedy), ``top_k`` None or an int >= 1, and with
    ``temperature > 0`` one ``jax.random`` key.

    Raises:
      TypeError, ValueError: naming the argument and the fix.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float >= 0, got {temperature!r}.")
    temperature = float(temperature)
    if not 0.0 <= temperature < float("inf"):  # also rejects NaN
        raise ValueError(
            f"temperature must be >= 0 and finite (0 = greedy), got {temperature}. It divides "
            "the logits before sampling: below 1 sharpens, above 1 flattens the distribution."
        )
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}.")
        top_k = int(top_k)
    if temperature > 0.0 and key is None:
        raise ValueError(
            f"sampling with temperature={temperature} needs a random key: pass "
            "key=jax.random.key(seed), or temperature=0.0 for greedy decoding."
        )
    if temperature > 0.0:
        _checks.rng(key, "key")
    return temperature, top_k


def sample_next(logits, key: Array | None = None, *, temperature: float = 0.0, top_k=None):
    """Picks one token per row from next-token logits.

    ``temperature == 0``: the argmax (greedy; ``key`` and ``top_k`` are not used).
    Otherwise, as the book's chapter 5: keep the ``top_k`` largest logits (all of them when
    None; ties with the k-th are kept), divide by ``temperature``, sample from the softmax.

    Args:
      logits: ``[batch..., vocab]`` float.
      key: ``jax.random`` key; required when ``temperature > 0``.
      temperature: float >= 0 (static).
      top_k: int >= 1 or None (static).

    Returns:
      int32 ``[batch...]`` token ids.
    """
    temperature, top_k = check_sampling(temperature, top_k, key)
    logits = jnp.asarray(logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(
            f"logits must be a float array [batch..., vocab], got dtype {logits.dtype}."
        )
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"logits must have shape [batch..., vocab] with vocab >= 1, got {logits.shape}."
        )
    # [batch..., V] in float32: sampling should not depend on a bfloat16 rounding.
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if temperature == 0.0:
        return cpu_kernels.argmax(logits)  # one kernel call on CPU, else two reductions
    if top_k is not None and top_k < logits.shape[-1]:
        # [batch..., 1]: the k-th largest logit; everything below it is hidden.
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(
            logits < kth, masks_lib.large_negative(logits.dtype), logits / temperature
        )
    else:
        logits = logits / temperature
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------
# Argument checks shared by both generators
# ----------------------------------------------------------------------------------------


def _check_model_fn(fn, name: str) -> None:
    if not callable(fn):
        raise TypeError(
            f"{name} must be a function of (params, tokens, ...) (see jattn.generate), got "
            f"{type(fn).__name__}. For a Linen model use jattn.generate.Linen"
            f"{'DecodeFn' if name == 'decode_fn' else 'ForwardFn'}(model)."
        )


def _check_prompt(prompt, prompt_lengths, max_new_tokens) -> tuple[Array, Array]:
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(
            f"prompt must be int token ids [batch, prompt_len], got {prompt.dtype} {prompt.shape}."
            " Add a batch axis with prompt[None] for a single sequence."
        )
    if prompt.shape[1] < 1:
        raise ValueError("prompt must hold at least one token per row (prompt_len >= 1).")
    smallest = None if isinstance(prompt, jax.core.Tracer) else np.asarray(prompt).min(initial=0)
    if smallest is not None and smallest < 0:
        raise ValueError(
            f"prompt holds negative token ids (smallest {int(smallest)}); token ids are in "
            "[0, vocab_size)."
        )
    _checks.size(max_new_tokens, "max_new_tokens")
    batch, prompt_len = prompt.shape
    if prompt_lengths is None:
        lengths = jnp.full((batch,), prompt_len, jnp.int32)
    else:
        lengths = jnp.asarray(prompt_lengths)
        if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(
                f"prompt_lengths must be int [batch] = ({batch},) (real tokens of each "
                f"right-padded prompt row), got {lengths.dtype} {lengths.shape}."
            )
        lengths = lengths.astype(jnp.int32)
        if not isinstance(lengths, jax.core.Tracer):
            n = np.asarray(lengths)
            if n.min() < 1 or n.max() > prompt_len:
                raise ValueError(
                    f"prompt_lengths must be in [1, {prompt_len}] (prompt_len), got {n.tolist()}."
                )
    rows = _rows_of(prompt)
    if rows.spec[0] is not None:  # rows sharded in their type: the lengths go with them
        if isinstance(prompt, jax.core.Tracer):
            lengths = jax.sharding.reshard(lengths, rows)
        else:  # placed on the prompt's devices (no jax.set_mesh needed)
            lengths = jax.device_put(lengths, prompt.sharding.update(spec=rows.spec))
    return prompt.astype(jnp.int32), lengths


def _rows_of(prompt: Array):
    """The sharding of an array of ``prompt``'s rows: its batch axis's on a mesh whose axes
    are explicit (in the types), none otherwise."""
    return jax.typeof(prompt).sharding.update(spec=jax.P(axis_specs(prompt)[0]))


def _check_cache_room(cache, lengths: Array, max_new_tokens: int) -> None:
    """Eager check: every KVCache in ``cache`` can take the prompt and the new tokens.

    Runs where the lengths can be read without a device-to-host copy (``_checks.
    is_host_value``: CPU arrays, numpy); elsewhere the cache's defined overflow behaviour
    applies (see :mod:`jattn.kvcache`), and ``kvcache.fits`` answers under jit.
    """
    caches = [
        c
        for c in jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, kvcache.KVCache))
        if isinstance(c, kvcache.KVCache)
    ]
    if not _checks.is_host_value(lengths):
        return
    # The last new token is sampled but never fed back, so it takes no cache slot.
    need = np.asarray(lengths) + max_new_tokens - 1
    for c in caches:
        if not _checks.is_host_value(c.lengths):
            continue
        total = np.asarray(c.lengths).reshape(-1) + need.reshape(-1)
        if total.max() > kvcache.capacity(c):
            raise ValueError(
                f"the KV cache holds {kvcache.capacity(c)} positions per row, but a row needs "
                f"{int(total.max())} (already filled + prompt + max_new_tokens - 1). Build the "
                "cache with a larger capacity or ask for fewer tokens."
            )


def check_stop(eos_id, pad_id, vocab_size: int | None = None) -> tuple[Array, int]:
    """``(eos_ids int32 [E], pad_id)`` of a call's stop tokens (``E = 0``: no stop token).

    Args:
      eos_id: None, one token id, or a sequence of them (any of which ends a row).
      pad_id: the id written after a row stops; None: the first of ``eos_id`` (0 without).
      vocab_size: when known, ids must be below it.

    Raises:
      ValueError: ids that are not ints >= 0 (below ``vocab_size``), an empty sequence.
    """
    hint = f" in [0, {vocab_size})" if vocab_size is not None else " >= 0"
    if hasattr(eos_id, "dtype") and hasattr(eos_id, "ndim"):  # a numpy or jax array
        if not jnp.issubdtype(eos_id.dtype, jnp.integer) or eos_id.ndim > 1:
            raise ValueError(
                f"eos_id must be None, a token id or a sequence of token ids, got an array of "
                f"{eos_id.dtype} {eos_id.shape}."
            )
        eos_id = np.asarray(eos_id).tolist()  # an int (0-d) or a list of ints

    def token_id(value, name):
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0
        if not ok or (vocab_size is not None and value >= vocab_size):
            raise ValueError(f"{name} must be a token id (an int{hint}), got {value!r}.")
        return int(value)

    if eos_id is None:
        ids = []
    elif isinstance(eos_id, numbers.Integral) and not isinstance(eos_id, bool):
        ids = [token_id(eos_id, "eos_id")]
    else:
        try:
            ids = [token_id(x, "eos_id") for x in eos_id]
        except TypeError:
            raise ValueError(
                f"eos_id must be None, a token id or a sequence of token ids, got {eos_id!r}."
            ) from None
        if not ids:
            raise ValueError("eos_id is an empty sequence: pass None for no stop token.")
    if pad_id is None:
        pad_id = ids[0] if ids else 0
    elif not (isinstance(pad_id, numbers.Integral) and not isinstance(pad_id, bool)):
        raise ValueError(f"pad_id must be an int (the id after a row stops), got {pad_id!r}.")
    # device_put: jnp.asarray would compile a conversion per shape of ids
    return jax.device_put(np.asarray(ids, np.int32).reshape(-1)), int(pad_id)


def _is_stop(tokens: Array, eos_ids: Array) -> Array:
    """Bool ``tokens.shape``: True where a token is one of ``eos_ids [E]`` (never if ``E = 0``)."""
    return jnp.any(tokens[..., None] == eos_ids.reshape((1,) * tokens.ndim + (-1,)), axis=-1)


def stop_at_eos(tokens: Array, eos_ids: Array, pad_id: int) -> tuple[Array, Array]:
    """Ends each row at its first stop token, as the book's ``generate(..., eos_id=)``.

    Args:
      tokens: int ``[B, N]`` generated tokens.
      eos_ids: int ``[E]`` stop tokens.
      pad_id: written at the first stop token and after it.

    Returns:
      ``(tokens [B, N], lengths int32 [B])``: row ``b``'s continuation is
      ``tokens[b, :lengths[b]]`` (the stop token itself excluded); the rest is ``pad_id``.
    """
    stopped = jnp.cumsum(_is_stop(tokens, eos_ids), axis=1) > 0  # [B, N]
    lengths = jnp.sum(~stopped, axis=1, dtype=jnp.int32)
    return jnp.where(stopped, jnp.int32(pad_id), tokens), lengths


# ----------------------------------------------------------------------------------------
# Generators
# ----------------------------------------------------------------------------------------


def _prefill(decode_fn, params, cache, prompt, lengths, key, *, temperature, top_k):
    """The prompt through the model once: ``(first new token [B], cache)``."""
    # [B, P, V] (or [B, 1, V]: the last real positions only); row b's next token comes
    # from its last real position.
    logits, cache = decode_fn(params, prompt, cache, lengths)
    at = lengths - 1 if logits.shape[1] == prompt.shape[1] else jnp.zeros_like(lengths)
    last = jnp.take_along_axis(logits, at[:, None, None], axis=1)[:, 0]  # [B, V]
    first = sample_next(last, jax.random.fold_in(key, 0), temperature=temperature, top_k=top_k)
    return first, cache


def _step(decode_fn, params, cache, token, i, key, *, temperature, top_k):
    """One token per row through the model: ``(token i [B], cache)``."""
    # [B, 1] -> [B, 1, V]
    logits, cache = decode_fn(params, token[:, None], cache, jnp.ones_like(token))
    token = sample_next(
        logits[:, -1], jax.random.fold_in(key, i), temperature=temperature, top_k=top_k
    )
    return token, cache


@partial(jax.jit, static_argnames=("decode_fn", "max_new_tokens", "temperature", "top_k", "pad_id"))
def _generate(
    decode_fn, params, cache, prompt, lengths, key, eos_ids, *, max_new_tokens, temperature,
    top_k, pad_id,
):  # fmt: skip
    sampling = dict(temperature=temperature, top_k=top_k)
    first, cache = _prefill(decode_fn, params, cache, prompt, lengths, key, **sampling)
    # [B, N]: the tokens so far; steps after every row has stopped are never run.
    shape = (prompt.shape[0], max_new_tokens)
    out = jax.lax.full(shape, pad_id, jnp.int32, sharding=_rows_of(prompt)).at[:, 0].set(first)

    def running(carry):
        i, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def step(carry):
        i, token, cache, done, out = carry
        # A stopped row keeps decoding its own (valid) token; its output is padding.
        token, cache = _step(decode_fn, params, cache, token, i, key, **sampling)
        return i + 1, token, cache, done | _is_stop(token, eos_ids), out.at[:, i].set(token)

    carry = (jnp.int32(1), first, cache, _is_stop(first, eos_ids), out)
    out = jax.lax.while_loop(running, step, carry)[-1]
    return stop_at_eos(out, eos_ids, pad_id)


def generate(
    decode_fn: DecodeFn,
    params,
    cache,
    prompt,
    prompt_lengths=None,
    *,
    max_new_tokens: int,
    key: Array | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id=None,
    pad_id: int | None = None,
    return_lengths: bool = False,
):
    """Generates up to ``max_new_tokens`` tokens per row with a KV cache, in one jitted loop.

    Args:
      decode_fn: ``(params, tokens [B, T], cache, num_new [B]) -> (logits [B, T, V], cache)``
        (or ``[B, 1, V]`` logits: see the module docstring); a static argument.
      params: the model parameters (any pytree; traced, not baked into the program).
      cache: the model's empty (or partly filled) cache pytree, e.g. a Linen model's
        ``'cache'`` collection; it must hold ``prompt_lengths + max_new_tokens - 1`` more
        positions per row (checked eagerly for :class:`jattn.kvcache.KVCache` leaves).
      prompt: int ``[B, P]``, each row right-padded after its real tokens.
      prompt_lengths: int ``[B]``: real tokens per row, in ``[1, P]``; default ``P``.
      max_new_tokens: tokens to generate per row (>= 1).
      key: ``jax.random`` key; required when ``temperature > 0``.
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_k: sample among the ``top_k`` most likely tokens only (None: all).
      eos_id: a stop token id, or several (None: none). A row ends when its next token
        is one of them, which is not part of its continuation (the book's ``generate(...,
        eos_id=)``); once every row has ended, no further step runs.
      pad_id: the id after a row's end; default the (first) ``eos_id``.
      return_lengths: also return each row's continuation length.

    Returns:
      int32 ``[B, max_new_tokens]``: the continuation of each row's real prompt, ``pad_id``
      from its end on; with ``return_lengths``, ``(tokens, lengths int32 [B])`` where row
      ``b``'s continuation is ``tokens[b, :lengths[b]]``.
    """
    _check_model_fn(decode_fn, "decode_fn")
    temperature, top_k = check_sampling(temperature, top_k, key)
    prompt, lengths = _check_prompt(prompt, prompt_lengths, max_new_tokens)
    eos_ids, pad_id = check_stop(eos_id, pad_id)
    _checks.flag(return_lengths, "return_lengths")
    _check_cache_room(cache, lengths, max_new_tokens)
    tokens, ends = _generate(
        decode_fn,
        params,
        cache,
        prompt,
        lengths,
        jax.random.key(0) if key is None else key,  # unused when greedy
        eos_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        pad_id=pad_id,
    )
    return (tokens, ends) if return_lengths else tokens


_prefill_jit = jax.jit(_prefill, static_argnames=("decode_fn", "temperature", "top_k"))
_step_jit = jax.jit(_step, static_argnames=("decode_fn", "temperature", "top_k"))


def generate_stream(
    decode_fn: DecodeFn,
    params,
    cache,
    prompt,
    prompt_lengths=None,
    *,
    max_new_tokens: int,
    key: Array | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id=None,
    pad_id: int | None = None,
):
    """Yields the new tokens one step at a time, as they are produced (the book's
    ``generate_text_simple_stream``).

    The same tokens as :func:`generate` with the same arguments (the same keys per step),
    from two compiled programs (the prefill and one step), each compiled once per shape.

    Every argument is as in :func:`generate` (``decode_fn``, ``params``, ``cache``,
    ``prompt``, ``prompt_lengths``, ``max_new_tokens``, ``key``, ``temperature``, ``top_k``,
    ``eos_id``, ``pad_id``).

    Yields:
      int32 ``[B]`` per step: each row's next token, ``pad_id`` for a row that has ended.
      The stream stops after ``max_new_tokens`` steps, or as soon as every row has ended
      (so with one row it stops before yielding its stop token, as the book's).
    """
    _check_model_fn(decode_fn, "decode_fn")
    temperature, top_k = check_sampling(temperature, top_k, key)
    prompt, lengths = _check_prompt(prompt, prompt_lengths, max_new_tokens)
    eos_ids, pad_id = check_stop(eos_id, pad_id)
    _check_cache_room(cache, lengths, max_new_tokens)
    key = jax.random.key(0) if key is None else key
    sampling = dict(temperature=temperature, top_k=top_k)
    return _stream(
        decode_fn, params, cache, prompt, lengths, key, eos_ids, pad_id, max_new_tokens, sampling
    )


def _stream(decode_fn, params, cache, prompt, lengths, key, eos_ids, pad_id, steps, sampling):
    """The generator behind :func:`generate_stream` (its arguments checked before the first
    ``next``)."""
    token, cache = _prefill_jit(decode_fn, params, cache, prompt, lengths, key, **sampling)
    done = jnp.zeros(token.shape, bool)
    for i in range(steps):
        done = done | _is_stop(token, eos_ids)
        if bool(jnp.all(done)):
            return
        yield jnp.where(done, jnp.int32(pad_id), token)
        if i + 1 < steps:
            token, cache = _step_jit(
                decode_fn, params, cache, token, jnp.int32(i + 1), key, **sampling
            )


@partial(jax.jit, static_argnames=("forward_fn", "max_new_tokens", "temperature", "top_k"))
def _generate_recompute(
    forward_fn, params, prompt, lengths, key, *, max_new_tokens, temperature, top_k
):
    batch, prompt_len = prompt.shape
    # The last new token is never read back, so the window stops one short of the end.
    window = prompt_len + max_new_tokens - 1
    # [B, P + N]: the prompt (its padding is overwritten as tokens come in), then room.
    rows = _rows_of(prompt)
    room = jax.lax.full((batch, max_new_tokens), 0, jnp.int32, sharding=rows)
    buffer = jnp.concatenate([prompt, room], axis=1)
    column = jax.lax.broadcasted_iota(jnp.int32, buffer.shape, 1, out_sharding=rows)

    def step(i, buffer):
        # [B, window, V]: the whole sequence again, for one new token per row.
        logits = forward_fn(params, buffer[:, :window])
        pos = lengths + i  # [B]: where the new token goes; its logits sit one before
        last = jnp.take_along_axis(logits, (pos - 1)[:, None, None], axis=1)[:, 0]
        token = sample_next(last, jax.random.fold_in(key, i), temperature=temperature, top_k=top_k)
        return jnp.where(column == pos[:, None], token[:, None], buffer)

    buffer = jax.lax.fori_loop(0, max_new_tokens, step, buffer)
    # [B, N]: each row's continuation, starting right after its real prompt.
    cols = lengths[:, None] + jnp.arange(max_new_tokens)[None, :]
    return jnp.take_along_axis(buffer, cols, axis=1)


def generate_recompute(
    forward_fn: ForwardFn,
    params,
    prompt,
    prompt_lengths=None,
    *,
    max_new_tokens: int,
    key: Array | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id=None,
    pad_id: int | None = None,
    return_lengths: bool = False,
):
    """The reference generator: a full forward pass over the sequence for every new token.

    As chapter 4 of the book, but with a fixed-size window so one compilation serves every
    step: the model reads ``P + max_new_tokens - 1`` tokens each time, positions not
    generated yet hold stale tokens, and a causal model never looks at them.

    Args:
      forward_fn: ``(params, tokens [B, S]) -> logits [B, S, V]``, causal; a static argument.
      others: ``params``, ``prompt``, ``prompt_lengths``, ``max_new_tokens``, ``key``,
        ``temperature``, ``top_k``, ``eos_id``, ``pad_id``, ``return_lengths`` as in
        :func:`generate`; ``P + max_new_tokens - 1`` must fit the model's context.

    Returns:
      as :func:`generate`: the same tokens it gives for a model whose cached and uncached
      logits agree.
    """
    _check_model_fn(forward_fn, "forward_fn")
    temperature, top_k = check_sampling(temperature, top_k, key)
    prompt, lengths = _check_prompt(prompt, prompt_lengths, max_new_tokens)
    eos_ids, pad_id = check_stop(eos_id, pad_id)
    _checks.flag(return_lengths, "return_lengths")
    tokens = _generate_recompute(
        forward_fn,
        params,
        prompt,
        lengths,
        jax.random.key(0) if key is None else key,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
    )
    tokens, ends = stop_at_eos(tokens, eos_ids, pad_id)
    return (tokens, ends) if return_lengths else tokens


# ----------------------------------------------------------------------------------------
# Adapters for Linen language models
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinenDecodeFn:
    """``decode_fn`` of a Linen language model whose attention keeps a ``'cache'`` collection.

    Calls ``model.apply({'params': params, 'cache': cache}, tokens, num_new=num_new,
    mutable=['cache'], **kwargs)``, so the model must take ``num_new`` (real tokens per row
    of the chunk) and pass it to its :class:`jattn.linen.MultiHeadAttention` layers built
    with ``decode=True``, as :class:`jattn.toy.TinyGPT` does. Its empty cache is
    ``model.init(key, jnp.zeros((batch, capacity), jnp.int32))['cache']``.

    Attributes:
      model: the module, built in decode mode.
      kwargs: extra call arguments as ``(name, value)`` pairs (hashable), e.g.
        ``(("deterministic", True),)``.
    """

    model: Any
    kwargs: tuple = ()

    def __call__(self, params, tokens, cache, num_new):
        logits, updated = self.model.apply(
            {"params": params, "cache": cache},
            tokens,
            num_new=num_new,
            mutable=["cache"],
            **dict(self.kwargs),
        )
        return logits, updated["cache"]


@dataclasses.dataclass(frozen=True)
class LinenForwardFn:
    """``forward_fn`` of a Linen language model: ``model.apply({'params': params}, tokens)``.

    Attributes:
      model: the module (not in decode mode).
      kwargs: extra call arguments as ``(name, value)`` pairs.
    """

    model: Any
    kwargs: tuple = ()

    def __call__(self, params, tokens):
        return self.model.apply({"params": params}, tokens, **dict(self.kwargs))
