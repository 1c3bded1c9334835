"""The decoder Llama 3 and Qwen3 share: RMSNorm, grouped-query attention with RoPE, SwiGLU.

The book's two models differ only in settings (see :mod:`jattn.models.llama3` and
:mod:`jattn.models.qwen3`)::

    tok_emb                    nnx.Embed [vocab_size, emb_dim]
    trf_blocks/{i}             DecoderBlock:
      norm1, norm2               nnx.RMSNorm(emb_dim) (scale; eps 1e-5 Llama 3, 1e-6 Qwen3)
      att                        jattn.nnx.MultiHeadAttention: n_heads query heads of head_dim,
                                   n_kv_groups key/value heads, no biases, RoPE on queries
                                   and keys (Qwen3: after QK-norm), out_proj without bias
      ff                         GatedFeedForward: fc1, fc2, fc3 (SwiGLU), no biases
    final_norm                 nnx.RMSNorm(emb_dim)
    out_head                   Linear(emb_dim, vocab_size), no bias (untied, as the book)

The book computes RoPE tables for ``context_length`` positions and passes them to every
block; here each attention layer rotates its queries and keys at the tokens' positions
(``0 ... T-1``, or each row's cache length onward when decoding), which is the same.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jattn import _checks, rope
from jattn import nnx as jnnx
from jattn.models.base import LanguageModel, RngsArg
from jattn.models.layers import GatedFeedForward

__all__ = ["DecoderBlock", "RopeDecoder"]

Array = jax.Array

# Qwen3's q_norm / k_norm use eps 1e-6 (the book's RMSNorm default).
QK_NORM_EPS = 1e-6


class DecoderBlock(nnx.Module):
    """Llama 3 / Qwen3's ``TransformerBlock``: pre-RMSNorm attention and SwiGLU feed-forward,
    each with a shortcut connection (no dropout)."""

    def __init__(
        self,
        cfg,
        *,
        head_dim: int,
        qk_norm: bool,
        norm_eps: float,
        rotary: rope.RoPE,
        attention_implementation: str | None,
        rngs: nnx.Rngs,
    ):
        dtype = cfg.dtype
        self.att = jnnx.MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            context_length=cfg.context_length,
            dropout=0.0,
            num_heads=cfg.n_heads,
            qkv_bias=False,
            num_kv_heads=cfg.n_kv_groups,
            head_dim=head_dim,
            out_bias=False,
            rope=rotary,
            qk_norm=qk_norm,
            qk_norm_eps=QK_NORM_EPS,
            dtype=dtype,
            param_dtype=dtype,
            attention_implementation=attention_implementation,
            rngs=rngs,
        )
        self.ff = GatedFeedForward(
            cfg.emb_dim, cfg.hidden_dim, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        norm = dict(epsilon=norm_eps, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.norm1 = nnx.RMSNorm(cfg.emb_dim, **norm)
        self.norm2 = nnx.RMSNorm(cfg.emb_dim, **norm)

    def __call__(
        self, x: Array, *, decode: bool, num_new, segment_ids=None, positions=None
    ) -> Array:
        """``x [batch..., T, emb_dim]`` -> ``[batch..., T, emb_dim]``."""
        h = self.att(
            self.norm1(x),
            decode=decode,
            num_new=num_new,
            segment_ids=segment_ids,
            positions=positions,
        )
        x = h + x
        return self.ff(self.norm2(x)) + x


class RopeDecoder(LanguageModel):
    """The shared body of :class:`Llama3Model` and :class:`Qwen3Model`.

    Args:
      cfg: the parsed config (``Llama3Config`` or ``Qwen3Config``).
      head_dim: features per attention head.
      qk_norm: RMSNorm on every query and key head before RoPE (Qwen3).
      norm_eps: epsilon of the block and final RMSNorms.
      rotary: the RoPE settings (``rope_base``, Llama 3's ``rope_freq``).
      attention_implementation: the attention core's ``implementation`` (None: automatic).
      rngs: ``nnx.Rngs`` for the initialization.
    """

    deterministic = True  # no dropout anywhere in these models

    def __init__(
        self,
        cfg: Any,
        *,
        head_dim: int,
        qk_norm: bool,
        norm_eps: float,
        rotary: rope.RoPE,
        attention_implementation: str | None,
        rngs: nnx.Rngs,
    ):
        self.check_rngs(rngs, type(self).__name__)
        self.cfg = cfg
        self.dtype = dtype = cfg.dtype
        self.tok_emb = nnx.Embed(
            cfg.vocab_size, cfg.emb_dim, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.trf_blocks = nnx.List(
            DecoderBlock(
                cfg,
                head_dim=head_dim,
                qk_norm=qk_norm,
                norm_eps=norm_eps,
                rotary=rotary,
                attention_implementation=attention_implementation,
                rngs=rngs,
            )
            for _ in range(cfg.n_layers)
        )
        self.final_norm = nnx.RMSNorm(
            cfg.emb_dim, epsilon=norm_eps, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.out_head = nnx.Linear(
            cfg.emb_dim, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
        )

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
          positions: int ``[batch..., T]`` (broadcastable) RoPE positions, >= 0; default
            ``0 ... T-1``, with ``segment_ids`` each token's position in its document (RoPE
            restarts per document). Not with ``decode``.
          deterministic, rngs: accepted so that every jattn model takes the same call; these
            models have no dropout.
          decode: run through the KV cache made by :meth:`init_cache` (positions continue
            each row's cache length).
          num_new: decode mode only: int ``[batch...]``, real tokens of each row (the rest is
            right padding); default all ``T``.
          logits_at: int ``[batch...]``: compute the logits at this position of each row
            only (e.g. its last real token, ``num_new - 1``, when prefilling); default every
            position.

        Returns:
          ``[batch..., T, vocab_size]`` in the config's dtype; with ``logits_at``,
          ``[batch..., vocab_size]``.
        """
        del deterministic, rngs  # no dropout in Llama 3 / Qwen3
        token_ids = self.check_token_ids(token_ids)
        segment_ids, positions, factor = self.packed_layout(
            token_ids, segment_ids, positions, decode
        )
        if decode:
            self.cache_lengths()  # a clear error when there is no cache
        # [batch..., T, emb_dim]
        x = _checks.with_factor(self.embed(self.tok_emb, token_ids), factor)
        for block in self.trf_blocks:
            x = block(
                x, decode=decode, num_new=num_new, segment_ids=segment_ids, positions=positions
            )
        # [batch..., T, vocab_size], or [batch..., vocab_size] at logits_at
        return self.logits(x, token_ids, logits_at)
