"""What one attention call asks for, after the public entry validated it.

:func:`jattn.dot_product_attention` checks its arguments once and describes the call with
two values that every implementation (dense, blockwise, accelerator kernels) takes:

* :class:`Operands`: the arrays (a NamedTuple, so a pytree: ``jit``, ``vmap`` and
  ``custom_vjp`` carry it as it is), with None where an option is absent;
* :class:`Settings`: the static options (a frozen, hashable dataclass).

Below the entry nothing re-checks them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

Array = jax.Array


class Operands(NamedTuple):
    """The array operands of one call, validated and normalised.

    Attributes:
      scale: the logit multiplier (a Python float, except on the dense path, where a
        traced scalar is allowed).
      bias: float, broadcastable to ``[batch..., H, Tq, Tk]``, added to the scaled logits.
      mask: bool, broadcastable to ``[batch..., H, Tq, Tk]``; True = attend.
      q_lengths: int32 ``[batch...]``: queries at or past it are padding (zero output).
      kv_lengths: int32 ``[batch...]``: keys at or past it are hidden.
      q_segments: int32 ``[batch..., Tq]``: a query sees only keys of its segment.
      kv_segments: int32 ``[batch..., Tk]`` (given whenever ``q_segments`` is; the same
        object as ``q_segments`` when the caller gave one id array for both).
      dropout_rate: drop probability (a float, or a traced scalar).
      dropout_rng: a ``jax.random`` key, or None when dropout is off.
      dropout_rows: uint32 ``[batch..., H]``, set only when the call is one device's share
        of a larger one (:mod:`jattn._per_device`, which runs only the kernels): the
        dropout mask's row of each (batch row, head)'s first query in the whole call
        (:func:`jattn._prng.row_starts`). None: the rows are numbered over this call.
      sinks: float ``[H]``: per-head attention-sink logits (one extra logit in each row's
        softmax that takes probability mass and contributes no value), or None.
      block_mask: a :class:`jattn.BlockMask` (tile states of ``Settings.mask_mod``, a
        pytree), or None.
    """

    scale: float | Array
    bias: Array | None = None
    mask: Array | None = None
    q_lengths: Array | None = None
    kv_lengths: Array | None = None
    q_segments: Array | None = None
    kv_segments: Array | None = None
    dropout_rate: float | Array = 0.0
    dropout_rng: Array | None = None
    dropout_rows: Array | None = None
    sinks: Array | None = None
    block_mask: Any = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """The static options of one call.

    Attributes:
      is_causal: query ``i`` sees keys ``j <= i`` (aligned top-left).
      window: ``(left, right)``: query ``i`` sees keys ``i - left ... i + right``.
      dropout_shared: ``(over_batch, over_heads)``: axes that share one dropout mask.
      precision: ``jax.lax.Precision`` of the products.
      return_residual: also return the log-sum-exp ``[batch..., Tq, H]`` (float32+).
      score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` on the scaled logits, or None.
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), or None; with a
        block mask, the block mask's.

    The modifiers are static here: arrays they close over (ALiBi slopes, a bias table,
    segment ids) are constants of their trace, so a path that wraps the attention in a
    ``custom_vjp`` must hoist them into explicit operands first to keep their gradients
    (:func:`jattn.blockwise._closure.hoist`).
    """

    is_causal: bool = False
    window: tuple[int, int] | None = None
    dropout_shared: tuple[bool, bool] = (False, False)
    precision: Any = None
    return_residual: bool = False
    score_mod: Any = None
    mask_mod: Any = None


class DenseExtras(NamedTuple):
    """What only the dense path offers: the weight matrix and flax's einsum hooks.

    Attributes:
      return_weights: also return the pre-dropout weights ``[batch..., H, Tq, Tk]``.
      module: a Linen or NNX module to sow the weights into (``attention_weights``).
      weights_dtype: dtype of the returned and sown weights.
      qk_einsum: flax's ``qk_attn_weights_einsum``: computes the logits.
      wv_einsum: flax's ``attn_weights_value_einsum``: weights times values.
      dot_general: flax's ``einsum_dot_general``, for jattn's own einsums.
    """

    return_weights: bool = False
    module: Any = None
    weights_dtype: Any = None
    qk_einsum: Any = None
    wv_einsum: Any = None
    dot_general: Any = None

    def needed(self) -> str | None:
        """Why the call needs the dense path (None: it does not)."""
        if self.return_weights or self.module is not None:
            return "return_weights=True and module= need the full [q_len, kv_len] weight matrix"
        if self.qk_einsum is not None or self.dot_general is not None:
            return "flax's einsum hooks (qk_attn_weights_einsum, einsum_dot_general) run dense"
        return None
