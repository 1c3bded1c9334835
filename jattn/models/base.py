"""What the three models share: token checks, the dropout mode, and the KV cache.

Every model holds its config (a frozen dataclass, see :mod:`jattn.models.configs`) as
``cfg`` and its transformer blocks as ``trf_blocks`` (an ``nnx.List``), each with a
:class:`jattn.nnx.MultiHeadAttention` as ``att``. Decoding goes through the attention
modules' own caches (:mod:`jattn.kvcache`): :meth:`LanguageModel.init_cache` creates one
per block, and a call with ``decode=True`` appends the chunk to every one of them.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn import _checks, _util, packing, rope

__all__ = ["LanguageModel"]

Array = jax.Array
RngsArg = nnx.Rngs | nnx.RngStream | jax.Array | None


def _check_runs(name: str, segment_ids: Array) -> Array | None:
    """Concrete ids: a ValueError where a row comes back to a document's id after another
    document. Attention joins equal ids wherever they stand, while the default positions
    restart at each run (:func:`jattn.positions_from_segment_ids`): the two would disagree.
    Traced ids (a jitted training step): the check in the program, as a factor for the
    embeddings (:func:`jattn._checks.nan_unless`: 1, or NaN when a row comes back)."""
    if isinstance(segment_ids, jax.core.Tracer):
        # no id comes back when each row has as many runs of equal ids as distinct ids
        runs = jnp.sum(segment_ids[..., 1:] != segment_ids[..., :-1], axis=-1)
        ids = jnp.sort(segment_ids, axis=-1)
        return _checks.nan_unless(jnp.all(runs == jnp.sum(ids[..., 1:] != ids[..., :-1], -1)))
    ids = np.asarray(segment_ids).reshape(-1, segment_ids.shape[-1])
    for r, row in enumerate(ids):
        starts = np.concatenate([[0], np.flatnonzero(row[1:] != row[:-1]) + 1])
        _, first = np.unique(row[starts], return_index=True)
        if first.size < starts.size:  # an id begins two runs: the second one's start
            again = starts[np.setdiff1d(np.arange(starts.size), first)[0]]
            raise ValueError(
                f"{name}: segment_ids row {r} comes back to document {row[again]} at token "
                f"{again} after another document; attention joins equal ids wherever they "
                "stand, while the default positions restart at each run. Give each document "
                "its own id (jattn.pack does), or pass positions= explicitly."
            )
    return None


class LanguageModel(nnx.Module):
    """Base class of :class:`GPTModel`, :class:`Llama3Model` and :class:`Qwen3Model`."""

    cfg: Any
    dtype: Any  # of the activations and the KV cache
    trf_blocks: nnx.List
    # Whether positions end at cfg.context_length (a learned position embedding, GPT-2);
    # RoPE models can decode past it through rolling KV caches.
    positions_limited: bool = False

    @staticmethod
    def check_rngs(rngs, name: str) -> None:
        """Constructors take an ``nnx.Rngs`` (a TypeError naming the model otherwise)."""
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"{name}: rngs must be an nnx.Rngs (e.g. rngs=nnx.Rngs(0)), got "
                f"{type(rngs).__name__}."
            )

    @staticmethod
    def dropout_rngs(rngs: nnx.Rngs) -> nnx.Rngs | None:
        """``rngs`` for an ``nnx.Dropout`` where it has a ``dropout`` (or ``default``)
        stream, else None: built from ``nnx.Rngs(params=0)`` the model then needs
        ``rngs=`` at a training call, as the attention modules do (no stream to keep)."""
        return rngs if "dropout" in rngs or "default" in rngs else None

    @staticmethod
    def embed(table: nnx.Embed, ids: Array) -> Array:
        """``table(ids)``: the rows of ``ids`` ``[batch..., T]``. On a mesh with explicit
        axes, ids sharded in their type (the batch over devices) state the rows' sharding
        (theirs, the features whole), which flax's gather cannot resolve alone."""
        spec = _util.axis_specs(ids)
        if all(entry is None for entry in spec):
            return table(ids)
        return table(ids, out_sharding=jax.typeof(ids).sharding.update(spec=jax.P(*spec, None)))

    def check_token_ids(self, token_ids) -> Array:
        """Validates ``token_ids`` int ``[batch..., T]`` and returns them as an array.

        Raises:
          TypeError: non-integer ids.
          ValueError: no token axis or no tokens, more than ``context_length`` tokens, and
            (when the ids are concrete, i.e. not under ``jax.jit``) ids outside
            ``[0, vocab_size)``.
        """
        name, cfg = type(self).__name__, self.cfg
        token_ids = jnp.asarray(token_ids)
        if not jnp.issubdtype(token_ids.dtype, jnp.integer):
            raise TypeError(
                f"{name}: token_ids must be integer token ids [batch..., num_tokens], got dtype "
                f"{token_ids.dtype}."
            )
        if token_ids.ndim < 1 or token_ids.shape[-1] < 1:
            raise ValueError(
                f"{name}: token_ids must have shape [batch..., num_tokens] with num_tokens >= 1, "
                f"got {token_ids.shape}."
            )
        if token_ids.shape[-1] > cfg.context_length:
            raise ValueError(
                f"{name}: token_ids holds {token_ids.shape[-1]} tokens (last axis of "
                f"{token_ids.shape}) but cfg['context_length'] is {cfg.context_length}. Keep the "
                f"last {cfg.context_length} tokens (the book's idx[:, -context_size:])."
            )
        if not isinstance(token_ids, jax.core.Tracer) and token_ids.size:
            # numpy: under jit a concrete (closed-over) array's jnp.min would be traced
            ids = np.asarray(token_ids)
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= cfg.vocab_size:
                raise ValueError(
                    f"{name}: token_ids must be in [0, {cfg.vocab_size}) (cfg['vocab_size']), got "
                    f"values from {lo} to {hi}."
                )
        return token_ids

    def packed_layout(self, token_ids: Array, segment_ids, positions, decode: bool):
        """Validates a call's ``segment_ids`` and ``positions``; returns them as arrays.

        ``positions`` default: with ``segment_ids``, each token's position in its document
        (:func:`jattn.positions_from_segment_ids`), else ``0 ... T-1``; in decode mode
        neither may be given (positions follow the cache). Both come back broadcast to
        ``token_ids.shape`` (``segment_ids`` None when not given), with ``factor``: None,
        or for traced ``segment_ids`` without ``positions`` (a jitted training step, where
        the ids cannot be read) the float32 scalar to multiply the embeddings by
        (``jattn._checks.with_factor``): 1, or NaN when a row comes back to a document's
        id (the logits and the gradients NaN then, where an eager call raises).

        Raises:
          TypeError: non-integer ids or positions.
          ValueError: shapes that do not broadcast to ``token_ids``; with decode; (when
            concrete) negative positions, GPT-2 positions past ``context_length - 1``, or
            without ``positions`` a document id that comes back after another document
            (attention would join the two runs while their positions restart).
        """
        name, shape = type(self).__name__, token_ids.shape
        if decode:
            if segment_ids is not None or positions is not None:
                raise ValueError(
                    f"{name}: segment_ids and positions are for full-sequence calls (training, "
                    "scoring packed rows); with decode=True positions follow each row's KV "
                    "cache and a row holds one sequence."
                )
            return None, None, None
        checked = []
        for arg, value in (("segment_ids", segment_ids), ("positions", positions)):
            if value is None:
                checked.append(None)
                continue
            value = jnp.asarray(value)
            if not jnp.issubdtype(value.dtype, jnp.integer):
                raise TypeError(f"{name}: {arg} must hold integers, got dtype {value.dtype}.")
            try:
                ok = value.ndim >= 1 and value.shape[-1] == shape[-1]  # one per token
                ok = ok and jnp.broadcast_shapes(value.shape, shape) == shape
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"{name}: {arg} must be int [batch..., T] broadcastable to token_ids' shape "
                    f"{shape} (one per token, e.g. from jattn.pack), got shape {value.shape}."
                )
            checked.append(jnp.broadcast_to(value, shape).astype(jnp.int32))
        segment_ids, positions = checked
        factor = None
        if positions is None and segment_ids is not None:
            factor = _check_runs(name, segment_ids)
        if positions is None:
            positions = (
                jnp.broadcast_to(jnp.arange(shape[-1], dtype=jnp.int32), shape)
                if segment_ids is None
                else packing.positions_from_segment_ids(segment_ids)
            )
        elif not isinstance(positions, jax.core.Tracer):
            values = np.asarray(positions)  # numpy, as for token_ids
            lo, hi = int(values.min()), int(values.max())
            top = self.cfg.context_length - 1 if self.positions_limited else None
            if lo < 0 or (top is not None and hi > top):
                raise ValueError(
                    f"{name}: positions must be in [0, {top if top is not None else 'inf'}]"
                    + (" (the rows of pos_emb)" if top is not None else "")
                    + f", got values from {lo} to {hi}."
                )
        return segment_ids, positions, factor

    def logits(self, x: Array, token_ids: Array, logits_at) -> Array:
        """The output head: ``final_norm`` then ``out_head`` of ``x [batch..., T, emb_dim]``,
        at every position (``logits_at`` None: ``[batch..., T, vocab_size]``) or at one
        position per row (int ``[batch...]``: ``[batch..., vocab_size]``, the other
        positions' head never computed: it is most of a prefill chunk's work on a large
        vocabulary).

        Raises:
          TypeError: non-integer ``logits_at``.
          ValueError: a shape other than ``token_ids``' batch dims ``[batch...]``; (when
            concrete) positions outside ``[0, T)``.
        """
        if logits_at is None:
            return self.out_head(self.final_norm(x))
        name, batch, t = type(self).__name__, token_ids.shape[:-1], token_ids.shape[-1]
        logits_at = jnp.asarray(logits_at)
        if not jnp.issubdtype(logits_at.dtype, jnp.integer):
            raise TypeError(
                f"{name}: logits_at must hold integer positions, got dtype {logits_at.dtype}."
            )
        if logits_at.shape != batch:
            raise ValueError(
                f"{name}: logits_at must be int [batch...] = {batch} (one position per row of "
                f"token_ids {token_ids.shape}), got shape {logits_at.shape}."
            )
        if not isinstance(logits_at, jax.core.Tracer) and logits_at.size:
            values = np.asarray(logits_at)  # numpy, as for token_ids
            lo, hi = int(values.min()), int(values.max())
            if lo < 0 or hi >= t:
                raise ValueError(
                    f"{name}: logits_at must be in [0, {t}) (positions of the {t} tokens), got "
                    f"values from {lo} to {hi}."
                )
        index = logits_at.astype(jnp.int32)[..., None, None]  # [batch..., 1, 1]
        x = jnp.take_along_axis(x, index, axis=-2)[..., 0, :]  # [batch..., emb_dim]
        return self.out_head(self.final_norm(x))

    def dropout_mode(self, deterministic: bool | None, rngs: RngsArg, rate: float):
        """``(deterministic, rngs)`` for this call.

        ``deterministic``: the call argument, else the attribute (``.train()`` /
        ``.eval()``); with ``rate == 0`` neither is needed. A raw key becomes an
        ``nnx.Rngs(dropout=key)``, so each dropout layer draws its own key from it.
        """
        name = type(self).__name__
        if deterministic is None:
            deterministic = self.deterministic
        if deterministic is None:
            if rate > 0.0:
                raise ValueError(
                    f"{name} has drop_rate={rate} but no `deterministic` was given: pass "
                    "deterministic=True (inference) or False (training) to the call or the "
                    "constructor, or use model.eval() / model.train()."
                )
            deterministic = True
        if isinstance(rngs, jax.Array):
            rngs = nnx.Rngs(dropout=rngs)
        return bool(deterministic), rngs

    def set_view(self, deterministic: bool | None = None):
        """Used by ``nnx.view``: sets ``deterministic`` when given."""
        if deterministic is not None:
            self.deterministic = deterministic

    # ------------------------------------------------------------------------------------
    # KV cache
    # ------------------------------------------------------------------------------------

    def init_cache(
        self,
        batch_shape: int | tuple[int, ...] = 1,
        capacity: int | None = None,
        dtype=None,
        *,
        rolling: bool = False,
    ) -> None:
        """Creates an empty KV cache in every attention layer (and resets a filled one).

        Args:
          batch_shape: the batch dims of the token ids to decode (an int for one axis).
          capacity: positions per row (prompt plus generated tokens), at most
            ``context_length`` (the default). Each decoding step works over the whole
            cache, so size it to what the run needs.
          dtype: dtype of the cached keys and values; default the model's ``dtype``.
          rolling: rolling caches (:class:`jattn.kvcache.RollingKVCache`) of the last
            ``capacity`` tokens: decoding attends over a sliding window (each token sees
            itself and the ``capacity`` tokens before it), and rows may run past
            ``context_length`` (Llama 3 / Qwen3 only: RoPE has no position limit, GPT-2's
            position embedding has ``context_length`` rows).
        """
        if isinstance(batch_shape, numbers.Integral):
            batch_shape = (batch_shape,)
        batch_shape = tuple(batch_shape)
        capacity = self.cfg.context_length if capacity is None else capacity
        if (
            isinstance(capacity, bool)
            or not isinstance(capacity, numbers.Integral)
            or not 1 <= capacity <= self.cfg.context_length
        ):
            raise ValueError(
                f"{type(self).__name__}: capacity must be an int in [1, "
                f"{self.cfg.context_length}] (cfg['context_length']), got {capacity!r}."
            )
        capacity = int(capacity)
        dtype = self.dtype if dtype is None else dtype
        for block in self.trf_blocks:
            block.att.init_cache((*batch_shape, capacity, self.cfg.emb_dim), dtype, rolling=rolling)

    def cache_lengths(self) -> Array:
        """Int ``[batch...]``: tokens already in the KV cache of each row."""
        cache = getattr(self.trf_blocks[0].att, "cache", None)
        if cache is None:
            raise ValueError(
                f"{type(self).__name__}: decode=True needs a KV cache; call "
                "model.init_cache(batch_shape, capacity) first."
            )
        return cache.get_value().lengths

    def decode_positions(self, num_tokens: int) -> Array:
        """Int ``[batch..., T]``: where a chunk of ``T`` tokens sits, row by row.

        Token ``t`` of row ``b`` is at ``cache_lengths()[b] + t``. A position past
        ``context_length - 1`` has no row in GPT-2's position embedding: with concrete
        lengths it raises (a rolling cache would otherwise run on past the context); under
        jit it is capped there (a plain cache holds at most ``context_length`` positions,
        so such a token is dropped and its output is not used).

        Raises:
          ValueError: concrete lengths whose chunk runs past ``context_length``.
        """
        lengths = self.cache_lengths()
        context = self.cfg.context_length
        if not isinstance(lengths, jax.core.Tracer) and lengths.size:
            end = int(np.asarray(lengths).max()) + num_tokens  # numpy, as for token_ids
            if end > context:
                raise ValueError(
                    f"{type(self).__name__}: a chunk of {num_tokens} tokens after rows holding "
                    f"{np.asarray(lengths).tolist()} reaches position {end - 1}, past "
                    f"cfg['context_length'] - 1 = {context - 1}: the position embedding has "
                    f"{context} rows (a plain cache holds no more, and a rolling one cannot "
                    "take GPT-2 past its context)."
                )
        positions = rope.positions_from_lengths(lengths, num_tokens)
        return jnp.minimum(positions, context - 1)
