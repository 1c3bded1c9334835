"""The book's Qwen3 (``llms_from_scratch.qwen3.Qwen3Model``, dense models) in Flax NNX.

The architecture of :class:`jattn.models.decoder.RopeDecoder` with Qwen3's settings:
``head_dim`` independent of ``emb_dim // n_heads`` (0.6B: 16 heads of 128 on a 1024-wide
model), QK-norm (an RMSNorm with eps 1e-6 on every query and key head before RoPE) when
``qk_norm``, RoPE without frequency scaling, the book's own ``RMSNorm`` with eps 1e-6
(parameter ``scale``, statistics in float32).
"""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from jattn.models.configs import Qwen3Config
from jattn.models.decoder import RopeDecoder

__all__ = ["Qwen3Model"]

# qwen3.RMSNorm(emb_dim, eps=1e-6) in the book's Qwen3 blocks and final norm.
NORM_EPS = 1e-6


class Qwen3Model(RopeDecoder):
    """The book's ``Qwen3Model``.

    Args:
      cfg: the book's config dict (``QWEN_CONFIG_06_B`` keys: ``vocab_size,
        context_length, emb_dim, n_heads, n_layers, hidden_dim, head_dim, qk_norm,
        n_kv_groups, rope_base, dtype``) or a :class:`Qwen3Config`.
      attention_implementation: the attention core's ``implementation`` (None: automatic).
      rngs: ``nnx.Rngs`` for the initialization.

    Call ``model(token_ids)`` with int ``[batch..., T]`` for logits ``[batch..., T, vocab]``.
    """

    def __init__(
        self,
        cfg: Mapping | Qwen3Config,
        *,
        attention_implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        cfg = Qwen3Config.from_book(cfg)
        super().__init__(
            cfg,
            head_dim=cfg.head_dim,
            qk_norm=cfg.qk_norm,
            norm_eps=NORM_EPS,
            rotary=cfg.rope,
            attention_implementation=attention_implementation,
            rngs=rngs,
        )
