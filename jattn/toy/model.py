"""A tiny GPT built from jattn's Linen ``MultiHeadAttention``, the way a user would build one.

token + position embeddings -> ``num_layers`` pre-LayerNorm blocks
(``x + MHA(LN(x))``, ``x + MLP(LN(x))``) -> final LayerNorm -> vocabulary head.

The only difference between the demo's "causal" and "leaky" models is
``TinyGPTConfig.causal``, passed straight to ``MultiHeadAttention(is_causal=...)``: both have the
same parameter tree, so the same seed gives them the same initial weights.

Tensor parallelism is annotated, not coded: ``MultiHeadAttention(model_axis='model')``
splits the heads (Q/K/V by columns, ``out_proj`` by rows) and the MLP is split alike
(``mlp_in`` by columns, ``mlp_out`` by rows), so each device of a ``model`` group holds
whole heads and a slice of the hidden units (Megatron-LM's layout). Everything else is
replicated. The annotations only name mesh axes (``nn.with_partitioning``): they change no
value, and :func:`init_variables` returns plain arrays; :mod:`jattn.toy.train` reads them
with ``nn.get_partition_spec`` to place the parameters on a mesh.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jattn.linen import MultiHeadAttention
from jattn.toy.parallel import MODEL_AXIS

__all__ = ["TinyGPT", "TinyGPTConfig", "init_variables"]

# Flax's Dense defaults, annotated as jattn's attention projections are (Megatron-style):
# the hidden units split over the 'model' mesh axis, mlp_in by columns, mlp_out by rows.
# kernel [d_in, d_out] and bias [d_out]
_mlp_in_init = (
    nn.with_partitioning(nn.initializers.lecun_normal(), (None, MODEL_AXIS)),
    nn.with_partitioning(nn.initializers.zeros_init(), (MODEL_AXIS,)),
)
_mlp_out_init = (
    nn.with_partitioning(nn.initializers.lecun_normal(), (MODEL_AXIS, None)),
    nn.with_partitioning(nn.initializers.zeros_init(), (None,)),
)


@dataclasses.dataclass(frozen=True)
class TinyGPTConfig:
    """Sizes of the tiny GPT (frozen, so it can be a static jit argument).

    Attributes:
      vocab_size: number of token ids.
      context_length: the most tokens the model reads (size of the position table).
      d_model: width of the residual stream (a multiple of ``num_heads``).
      num_layers: number of transformer blocks.
      num_heads: attention heads per block.
      mlp_ratio: hidden width of the MLP is ``mlp_ratio * d_model`` (4, as GPT-2).
      dropout: rate of attention-weight dropout and of residual/embedding dropout.
      causal: False removes the causal mask in every block (the "leaky" model).
    """

    vocab_size: int
    context_length: int
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.1
    causal: bool = True

    def __post_init__(self):
        for name in (
            "vocab_size",
            "context_length",
            "d_model",
            "num_layers",
            "num_heads",
            "mlp_ratio",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be a multiple of num_heads ({self.num_heads})."
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise TypeError(f"dropout must be a float in [0, 1), got {self.dropout!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}.")


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention then MLP, each added to the residual."""

    config: TinyGPTConfig
    decode: bool = False

    @nn.compact
    def __call__(self, x_BxTxD, *, deterministic: bool, sow_attention: bool = False, num_new=None):
        cfg = self.config
        # [B, T, D] -> [B, T, D]; dropout on the attention weights happens inside.
        h_BxTxD = MultiHeadAttention(
            cfg.d_model,
            cfg.context_length,
            cfg.dropout,
            cfg.num_heads,
            is_causal=cfg.causal,
            decode=self.decode,
            model_axis=MODEL_AXIS,
            name="attn",
        )(
            nn.LayerNorm(name="ln_attn")(x_BxTxD),
            deterministic=deterministic,
            sow_weights=sow_attention,
            num_new=num_new,
        )
        x_BxTxD = x_BxTxD + nn.Dropout(cfg.dropout)(h_BxTxD, deterministic=deterministic)
        # [B, T, D] -> [B, T, mlp_ratio * D] -> [B, T, D]
        h_BxTxF = nn.Dense(
            cfg.mlp_ratio * cfg.d_model,
            kernel_init=_mlp_in_init[0],
            bias_init=_mlp_in_init[1],
            name="mlp_in",
        )(nn.LayerNorm(name="ln_mlp")(x_BxTxD))
        h_BxTxD = nn.Dense(
            cfg.d_model, kernel_init=_mlp_out_init[0], bias_init=_mlp_out_init[1], name="mlp_out"
        )(nn.gelu(h_BxTxF))
        return x_BxTxD + nn.Dropout(cfg.dropout)(h_BxTxD, deterministic=deterministic)


class TinyGPT(nn.Module):
    """Next-token model: ``tokens [batch..., T]`` (int) -> ``logits [batch..., T, vocab_size]``.

    Call with ``deterministic=False`` and ``rngs={'dropout': key}`` for training;
    ``deterministic=True`` (the default) for evaluation and generation. With
    ``sow_attention=True`` and ``mutable=['intermediates']`` every block's attention
    weights ``[batch..., num_heads, T, T]`` are sown under
    ``intermediates/blocks_{i}/attn/attention_weights``.

    ``decode=True`` generates with KV caches (:mod:`jattn.kvcache`), as
    :class:`jattn.linen.MultiHeadAttention`: ``init`` with tokens ``[B, capacity]`` creates
    the ``cache`` collection, then each ``apply(..., mutable=['cache'])`` takes the next
    chunk (the right-padded prompt with ``num_new`` real tokens per row, then one token).
    Each row's positions continue from its own cached length.
    :class:`jattn.generate.LinenDecodeFn` wraps it for :func:`jattn.generate.generate`.
    """

    config: TinyGPTConfig
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        tokens_BxT,
        *,
        deterministic: bool = True,
        sow_attention: bool = False,
        num_new=None,
    ):
        cfg = self.config
        tokens_BxT = jnp.asarray(tokens_BxT)
        if not jnp.issubdtype(tokens_BxT.dtype, jnp.integer) or tokens_BxT.ndim < 1:
            raise TypeError(
                f"TinyGPT takes int token ids [batch..., T], got {tokens_BxT.dtype} "
                f"{tokens_BxT.shape}."
            )
        if not isinstance(tokens_BxT, jax.core.Tracer) and tokens_BxT.size:
            # numpy: under jit a concrete (closed-over) array's jnp.min would be traced.
            ids = np.asarray(tokens_BxT)
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= cfg.vocab_size:  # an embedding lookup would give NaN
                raise ValueError(
                    f"TinyGPT got token ids from {low} to {high}, outside [0, vocab_size = "
                    f"{cfg.vocab_size})."
                )
        t = tokens_BxT.shape[-1]
        if t > cfg.context_length:
            raise ValueError(
                f"TinyGPT got {t} tokens but context_length is {cfg.context_length}; pass at "
                f"most the last {cfg.context_length} tokens."
            )
        # [1, T] (as many dims as the tokens: no implicit rank promotion); [B, T] when decoding
        pos = jnp.arange(t).reshape((1,) * (tokens_BxT.ndim - 1) + (t,))
        cache = self.variables.get("cache")
        if self.decode and cache:  # (init only creates the caches)
            # Row b's chunk starts where its tokens so far end: the first block's cache length.
            filled_B = cache["blocks_0"]["attn"]["kv"].lengths
            # Padding past the position table is clamped; its outputs are never used.
            pos = jnp.minimum(filled_B[..., None] + pos, cfg.context_length - 1)
        # [B, T, D]: token embedding plus a learned embedding of the position.
        x_BxTxD = nn.Embed(cfg.vocab_size, cfg.d_model, name="tok_emb")(tokens_BxT)
        x_BxTxD = x_BxTxD + nn.Embed(cfg.context_length, cfg.d_model, name="pos_emb")(pos)
        x_BxTxD = nn.Dropout(cfg.dropout)(x_BxTxD, deterministic=deterministic)
        for i in range(cfg.num_layers):
            x_BxTxD = Block(cfg, decode=self.decode, name=f"blocks_{i}")(
                x_BxTxD, deterministic=deterministic, sow_attention=sow_attention, num_new=num_new
            )
        # [B, T, D] -> [B, T, V]
        x_BxTxD = nn.LayerNorm(name="ln_final")(x_BxTxD)
        return nn.Dense(cfg.vocab_size, use_bias=False, name="head")(x_BxTxD)


def init_variables(config: TinyGPTConfig, key: jax.Array) -> dict:
    """Initial ``{'params': ...}`` of :class:`TinyGPT`; independent of ``config.causal``.

    Plain arrays: the sharding annotations are unboxed (``nn.get_partition_spec`` of
    ``TinyGPT(config).init(...)`` reads them).
    """
    tokens = jnp.zeros((1, config.context_length), jnp.int32)
    return nn.meta.unbox(TinyGPT(config).init({"params": key}, tokens, deterministic=True))
