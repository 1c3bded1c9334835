"""The book's Llama 3 (``llms_from_scratch.llama3.Llama3Model``) in Flax NNX.

Llama 3, 3.1 and 3.2 share one architecture (:class:`jattn.models.decoder.RopeDecoder`):
grouped-query attention with ``n_kv_groups`` key/value heads of ``emb_dim // n_heads``
features, RoPE with base ``rope_base`` and, for 3.1 / 3.2, the frequency scaling of
``rope_freq``; ``torch.nn.RMSNorm`` with eps 1e-5 (here ``nnx.RMSNorm``, parameter
``scale`` for the book's ``weight``); SwiGLU feed-forward of width ``hidden_dim``;
everything in ``dtype`` (the book's ``torch.bfloat16`` configs become ``jnp.bfloat16``).
"""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from jattn.models.configs import Llama3Config
from jattn.models.decoder import RopeDecoder

__all__ = ["Llama3Model"]

# torch.nn.RMSNorm(emb_dim, eps=1e-5) in the book's Llama 3 blocks and final norm.
NORM_EPS = 1e-5


class Llama3Model(RopeDecoder):
    """The book's ``Llama3Model``.

    Args:
      cfg: the book's config dict (``LLAMA32_CONFIG_1B`` keys: ``vocab_size,
        context_length, emb_dim, n_heads, n_layers, hidden_dim, n_kv_groups, rope_base,
        dtype, rope_freq``) or a :class:`Llama3Config`.
      attention_implementation: the attention core's ``implementation`` (None: automatic).
      rngs: ``nnx.Rngs`` for the initialization.

    Call ``model(token_ids)`` with int ``[batch..., T]`` for logits ``[batch..., T, vocab]``.
    """

    def __init__(
        self,
        cfg: Mapping | Llama3Config,
        *,
        attention_implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        cfg = Llama3Config.from_book(cfg)
        super().__init__(
            cfg,
            head_dim=cfg.head_dim,
            qk_norm=False,
            norm_eps=NORM_EPS,
            rotary=cfg.rope,
            attention_implementation=attention_implementation,
            rngs=rngs,
        )
