"""Chapter 4's GPT model in Flax NNX, on jattn's MultiHeadAttention.

The book's ``GPTModel`` (``llms_from_scratch.ch04``), layer for layer and name for name::

    tok_emb, pos_emb           nnx.Embed [vocab_size, emb_dim], [context_length, emb_dim]
    drop_emb                   nnx.Dropout(drop_rate)
    trf_blocks/{i}             TransformerBlock:
      norm1, norm2               LayerNorm (scale, shift; eps 1e-5)
      att                        jattn.nnx.MultiHeadAttention(emb_dim, emb_dim, context_length,
                                   drop_rate, n_heads, qkv_bias): W_query, W_key, W_value, out_proj
      ff/layers/{0,2}            Linear(emb, 4 emb), GELU (tanh), Linear(4 emb, emb)
      drop_resid                 nnx.Dropout(drop_rate) after attention and after ff
    final_norm                 LayerNorm
    out_head                   Linear(emb_dim, vocab_size), no bias

Beyond the book: KV-cache decoding (``init_cache``, then ``decode=True``; positions
follow each row's cache length, so ragged batches work), and any number of batch dims.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jattn import _checks
from jattn import nnx as jnnx
from jattn.models.base import LanguageModel, RngsArg
from jattn.models.configs import GPTConfig, parse_dtype
from jattn.models.layers import FeedForward, LayerNorm

__all__ = ["GPTModel", "TransformerBlock"]

Array = jax.Array


class TransformerBlock(nnx.Module):
    """Chapter 4's ``TransformerBlock``: pre-LayerNorm attention and feed-forward, each with
    dropout and a shortcut connection."""

    def __init__(
        self, cfg: GPTConfig, *, dtype, param_dtype, attention_implementation, rngs: nnx.Rngs
    ):
        e = cfg.emb_dim
        self.att = jnnx.MultiHeadAttention(
            d_in=e,
            d_out=e,
            context_length=cfg.context_length,
            dropout=cfg.drop_rate,
            num_heads=cfg.n_heads,
            qkv_bias=cfg.qkv_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            attention_implementation=attention_implementation,
            rngs=rngs,
        )
        self.ff = FeedForward(e, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm1 = LayerNorm(e, dtype=dtype, param_dtype=param_dtype)
        self.norm2 = LayerNorm(e, dtype=dtype, param_dtype=param_dtype)
        self.drop_resid = nnx.Dropout(
            cfg.drop_rate, deterministic=None, rngs=LanguageModel.dropout_rngs(rngs)
        )

    def __call__(
        self,
        x: Array,
        *,
        deterministic: bool,
        rngs: RngsArg,
        decode: bool,
        num_new,
        segment_ids=None,
    ) -> Array:
        """``x [batch..., T, emb_dim]`` -> ``[batch..., T, emb_dim]``."""
        shortcut = x
        x = self.att(
            self.norm1(x),
            deterministic=deterministic,
            rngs=rngs,
            decode=decode,
            num_new=num_new,
            segment_ids=segment_ids,
        )
        x = self.drop_resid(x, deterministic=deterministic, rngs=rngs) + shortcut
        shortcut = x
        x = self.ff(self.norm2(x))
        return self.drop_resid(x, deterministic=deterministic, rngs=rngs) + shortcut


class GPTModel(LanguageModel):
    """Chapter 4's ``GPTModel`` (GPT-2 architecture) built from jattn's attention module.

    Args:
      cfg: the book's config dict (``GPT_CONFIG_124M`` keys: ``vocab_size,
        context_length, emb_dim, n_heads, n_layers, drop_rate, qkv_bias``) or a
        :class:`GPTConfig`.
      deterministic: True: no dropout; None: decided per call (or ``.train()`` /
        ``.eval()``; with ``drop_rate == 0`` never needed).
      dtype: computation dtype (None: ``param_dtype``; the book's GPT-2 is float32).
      param_dtype: parameter dtype.
      attention_implementation: the attention core's ``implementation`` (None: automatic).
      rngs: ``nnx.Rngs`` for the initialization and the dropout streams.

    Call ``model(token_ids)`` with int ``[batch..., T]`` for logits ``[batch..., T, vocab]``.
    """

    positions_limited = True  # pos_emb has context_length rows

    def __init__(
        self,
        cfg: Mapping | GPTConfig,
        *,
        deterministic: bool | None = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        attention_implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        self.check_rngs(rngs, "GPTModel")
        cfg = GPTConfig.from_book(cfg)
        self.cfg = cfg
        self.deterministic = deterministic
        for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
            if value is not None:
                parse_dtype(value, name)  # a clear error for anything but a float dtype
        self.dtype = jnp.dtype(dtype or param_dtype)
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.tok_emb = nnx.Embed(cfg.vocab_size, cfg.emb_dim, **kw, rngs=rngs)
        self.pos_emb = nnx.Embed(cfg.context_length, cfg.emb_dim, **kw, rngs=rngs)
        self.drop_emb = nnx.Dropout(cfg.drop_rate, deterministic=None, rngs=self.dropout_rngs(rngs))
        self.trf_blocks = nnx.List(
            TransformerBlock(
                cfg, **kw, attention_implementation=attention_implementation, rngs=rngs
            )
            for _ in range(cfg.n_layers)
        )
        self.final_norm = LayerNorm(cfg.emb_dim, **kw)
        self.out_head = nnx.Linear(cfg.emb_dim, cfg.vocab_size, use_bias=False, **kw, rngs=rngs)

    def __call__(
        self,
        token_ids,
        *,
        deterministic: bool | None = None,
        rngs: RngsArg = None,
        decode: bool = False,
        num_new=None,
        segment_ids=None,
        positions=None,
        logits_at=None,
    ) -> Array:
        """Logits of every position (or of one per row: ``logits_at``).

        Args:
          token_ids: int ``[batch..., T]``, ``T <= context_length``, ids in ``[0, vocab_size)``.
          segment_ids: int ``[batch..., T]`` (broadcastable) for packed rows
            (:func:`jattn.pack`): the document of each token; a token attends only tokens
            of its own document. Not with ``decode``.
          positions: int ``[batch..., T]`` (broadcastable), the rows of ``pos_emb`` each
            token reads, in ``[0, context_length)``; default ``0 ... T-1``, with
            ``segment_ids`` each token's position in its document (so positions restart
            per document). Not with ``decode``.
          deterministic: True for inference (no dropout); overrides the attribute.
          rngs: dropout keys for this call (an ``nnx.Rngs``, a stream or a key); default the
            streams kept at construction.
          decode: run through the KV cache made by :meth:`init_cache`: the tokens continue
            each row after what the cache holds (positions ``lengths[b] + t``).
          num_new: decode mode only: int ``[batch...]``, real tokens of each row (the rest
            is right padding, never written to the cache); default all ``T``.
          logits_at: int ``[batch...]``: compute the logits at this position of each row
            only (e.g. its last real token, ``num_new - 1``, when prefilling); default every
            position.

        Returns:
          float ``[batch..., T, vocab_size]``; with ``logits_at``, ``[batch..., vocab_size]``.
        """
        token_ids = self.check_token_ids(token_ids)
        deterministic, rngs = self.dropout_mode(deterministic, rngs, self.cfg.drop_rate)
        segment_ids, positions, factor = self.packed_layout(
            token_ids, segment_ids, positions, decode
        )
        if decode:
            positions = self.decode_positions(token_ids.shape[-1])  # [batch..., T]
        # [batch..., T, emb_dim]
        x = _checks.with_factor(
            self.embed(self.tok_emb, token_ids) + self.embed(self.pos_emb, positions), factor
        )
        x = self.drop_emb(x, deterministic=deterministic, rngs=rngs)
        for block in self.trf_blocks:
            x = block(
                x,
                deterministic=deterministic,
                rngs=rngs,
                decode=decode,
                num_new=num_new,
                segment_ids=segment_ids,
            )
        # [batch..., T, vocab_size], or [batch..., vocab_size] at logits_at
        return self.logits(x, token_ids, logits_at)
