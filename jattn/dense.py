"""The dense implementation: build the ``[q_len, kv_len]`` weights, mask them, multiply.

``softmax(q kᵀ * scale + bias, masked) v`` per (batch, head), with the logits and the
softmax in float32 (float64 stays float64). Memory grows as ``q_len * kv_len``; it is the
path that returns or sows the weight matrix, honours flax's einsum hooks and a traced
``scale``, and supports every transformation (forward-mode autodiff included).

Inputs come validated from :func:`jattn.dot_product_attention` (see :mod:`jattn._call`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import _prng, mods
from jattn import masks as masks_lib
from jattn._call import DenseExtras, Operands, Settings
from jattn._util import expand_rank, softmax_dtype

Array = jax.Array
NO_EXTRAS = DenseExtras()


def logits_shape(query: Array, key: Array) -> tuple[int, ...]:
    """``[batch..., num_heads, q_len, kv_len]`` of ``query [batch..., Tq, H, D]``."""
    *batch, q_len, num_heads, _ = query.shape
    return (*batch, num_heads, q_len, key.shape[-3])


def combined_mask(ops: Operands, settings: Settings, shape: tuple[int, ...]) -> Array | None:
    """Every masking option of the call as one bool mask of rank ``len(shape)`` (or None)."""
    q_len, kv_len = shape[-2:]
    parts = [ops.mask]
    if settings.is_causal:
        parts.append(masks_lib.causal_mask(q_len, kv_len))
    if settings.window is not None:
        left, right = settings.window
        parts.append(masks_lib.sliding_window_mask(q_len, kv_len, local_window_size=(left, right)))
    if ops.q_lengths is not None:
        valid = masks_lib.lengths_to_valid(ops.q_lengths, q_len)
        parts.append(masks_lib.padding_mask(query_valid=valid))
    if ops.kv_lengths is not None:
        valid = masks_lib.lengths_to_valid(ops.kv_lengths, kv_len)
        parts.append(masks_lib.padding_mask(key_valid=valid))
    if ops.q_segments is not None:
        parts.append(masks_lib.segment_mask(ops.q_segments, ops.kv_segments))
    if settings.mask_mod is not None:
        parts.append(mods.evaluate_mask_mod(settings.mask_mod, shape))
    mask = masks_lib.combine_masks(*parts)
    return None if mask is None else expand_rank(mask, len(shape))


def _einsum(extras: DenseExtras, precision):
    """jnp.einsum with the call's precision and flax's ``einsum_dot_general``, if given."""
    kwargs = {"precision": precision}
    if extras.dot_general is not None:
        kwargs["_dot_general"] = extras.dot_general
    return lambda spec, a, b, **kw: jnp.einsum(spec, a, b, **kwargs, **kw)


def _repeat_kv(x: Array, num_heads: int) -> Array:
    """``[batch..., S, K, D]`` -> ``[batch..., S, H, D]``: each key/value head serves H/K."""
    return jnp.repeat(x, num_heads // x.shape[-2], axis=-2)


def _logits(query, key, ops: Operands, settings: Settings, extras: DenseExtras) -> Array:
    """Scaled logits ``[batch..., H, Tq, Tk]`` in the softmax dtype, ``score_mod`` applied,
    then the bias added (a mask given as a bias stays a mask whatever the modifier)."""
    *batch, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[-2]
    sm_dtype = softmax_dtype(query.dtype)
    shape = logits_shape(query, key)
    if extras.qk_einsum is not None:
        # flax's convention for its einsum hooks: scale the query, flax's subscripts.
        scaled = query * jnp.asarray(ops.scale, query.dtype)
        logits = extras.qk_einsum(
            "...qhd,...khd->...hqk", scaled, _repeat_kv(key, num_heads)
        ).astype(sm_dtype)
    else:
        groups = num_heads // num_kv_heads
        # [batch..., K, G, T, D]: query heads grouped by the key/value head they share,
        # moved before T (a small copy) so the product comes out as [.., T, S].
        q_grouped = jnp.moveaxis(
            query.reshape(*batch, q_len, num_kv_heads, groups, head_dim), -4, -2
        )
        # [batch..., K, G, T, D] x [batch..., K, S, D] -> [batch..., K, G, T, S]
        # -> [batch..., H, T, S] (head h = k * G + g, as jax.nn)
        logits = _einsum(extras, settings.precision)(
            "...kgtd,...ksd->...kgts",
            q_grouped,
            jnp.moveaxis(key, -3, -2),
            preferred_element_type=sm_dtype,
        ).reshape(shape)
        logits = logits * jnp.asarray(ops.scale, sm_dtype)
    if settings.score_mod is not None:
        logits = mods.apply_score_mod(settings.score_mod, logits)
    if ops.bias is not None:
        logits = logits + expand_rank(ops.bias, len(shape)).astype(sm_dtype)
    return logits


def weights_and_lse(query, key, ops: Operands, settings: Settings, extras: DenseExtras = NO_EXTRAS):
    """Softmax weights ``[batch..., H, Tq, Tk]`` (softmax dtype, no dropout) and the
    log-sum-exp ``[batch..., H, Tq]`` of the masked logits (and the sink, when given).

    A query that may attend nothing gets zero weights (PyTorch SDPA semantics, where
    ``jax.nn`` averages) and a log-sum-exp of :func:`jattn.large_negative` (with sinks:
    its sink's logit, the one term left in its softmax).
    """
    logits = _logits(query, key, ops, settings, extras)
    mask = combined_mask(ops, settings, logits.shape)
    if ops.sinks is not None:
        return _weights_with_sinks(logits, mask, ops.sinks)
    if mask is None and settings.score_mod is None:
        return jax.nn.softmax(logits, axis=-1), jax.nn.logsumexp(logits, axis=-1)
    return _masked_softmax(logits, mask, robust=settings.score_mod is not None)


def _masked_softmax(logits: Array, mask: Array | None, robust: bool):
    """``(weights, lse)`` of the softmax over each row's visible keys alone.

    Hidden keys are ``-inf``, not a finite large negative: a row whose every visible logit
    lies below :func:`jattn.large_negative` (an additive ``finfo.min`` bias on a padding
    query's keys) still weighs its visible keys, where a finite stand-in would have given
    the hidden ones (future keys included) all the weight. A row that sees no key gets
    zero weights, zero gradients and an lse of :func:`jattn.large_negative`: its logits
    become zeros before the softmax (no ``-inf - (-inf)``), and the ``where`` after it
    stops their gradients.

    Which rows see a key: from the mask alone (a reduction over the mask's own broadcast
    shape: no extra pass over every head's logits, which costs the dense path up to 2x),
    since a visible logit is finite (the entry floors a ``-inf`` bias at ``finfo.min``).
    ``robust``: a ``score_mod`` may still return ``-inf`` (FlexAttention's way of hiding a
    key), so its rows are read from the logits' max.
    """
    visible = logits if mask is None else jnp.where(mask, logits, -jnp.inf)
    if robust:
        top = jax.lax.stop_gradient(jnp.max(visible, axis=-1, keepdims=True))
        has_key = top > -jnp.inf
    else:
        has_key = jnp.any(mask, axis=-1, keepdims=True)
    visible = jnp.where(has_key, visible, 0.0)
    weights = jnp.where(has_key, jax.nn.softmax(visible, axis=-1), 0.0)
    neg = masks_lib.large_negative(logits.dtype)
    lse = jnp.where(has_key[..., 0], jax.nn.logsumexp(visible, axis=-1), neg)
    return weights, lse


def _weights_with_sinks(logits: Array, mask: Array | None, sinks: Array):
    """Softmax over each row's keys plus one sink logit per head (gpt-oss's attention sinks).

    ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink_h))``: the sink takes probability mass
    and contributes no value, so the weights of the real keys sum to ``1 - p_sink``.

    Args:
      logits: ``[batch..., H, Tq, Tk]`` in the softmax dtype.
      mask: bool broadcastable to ``logits`` (True = attend), or None.
      sinks: float ``[H]``.

    Returns:
      ``(weights [batch..., H, Tq, Tk], lse [batch..., H, Tq])``, the log-sum-exp over the
      visible keys and the sink (the sink alone in a fully masked row, whose weights are 0).
    """
    # [H] -> [1..., H, 1]: against the per-row max and sum [batch..., H, Tq]
    sink = expand_rank(sinks.astype(logits.dtype)[:, None], logits.ndim - 1)
    if mask is not None:
        logits = jnp.where(mask, logits, masks_lib.large_negative(logits.dtype))
    # The softmax is unchanged by the shift; stopping its gradient is exact (as logsumexp).
    shift = jax.lax.stop_gradient(jnp.maximum(jnp.max(logits, axis=-1), sink))
    exp = jnp.exp(logits - shift[..., None])
    if mask is not None:
        exp = jnp.where(mask, exp, 0.0)  # a masked key counts for nothing, even in a row of them
    # Every row's sum is >= 1: the largest of its visible logits and its sink is the shift.
    # (A sink of -inf over a fully masked row would give 0: kept finite below.)
    total = jnp.sum(exp, axis=-1) + jnp.exp(sink - shift)
    total = jnp.where(total > 0, total, 1.0)
    return exp / total[..., None], shift + jnp.log(total)


def dropout_weights(weights: Array, ops: Operands, settings: Settings) -> Array:
    """Inverted dropout on ``weights [batch..., H, Tq, Tk]`` (identity without a key)."""
    if ops.dropout_rng is None:
        return weights
    over_batch, over_heads = settings.dropout_shared
    *batch, heads, q_len, kv_len = weights.shape
    shape = (
        *((1,) * len(batch) if over_batch else batch),
        1 if over_heads else heads,
        q_len,
        kv_len,
    )
    keep_prob = 1.0 - ops.dropout_rate
    keep = _prng.keep_mask(ops.dropout_rng, keep_prob, shape)
    scaled = weights / jnp.asarray(keep_prob, weights.dtype)
    return jnp.where(keep, scaled, jnp.zeros((), weights.dtype))


def attention(
    query, key, value, ops: Operands, settings: Settings, extras: DenseExtras = NO_EXTRAS
):
    """Dense attention of validated inputs (see :mod:`jattn._call`).

    Args:
      query: ``[batch..., Tq, H, D]`` in the computation dtype.
      key: ``[batch..., Tk, K, D]``.
      value: ``[batch..., Tk, K, Dv]``.
      ops: the array operands.
      settings: the static options.
      extras: the dense-only options (weights, sowing, einsum hooks).

    Returns:
      ``(out, weights, lse)``: out ``[batch..., Tq, H, Dv]`` in the input dtype; the
      pre-dropout weights (``extras.weights_dtype``) when ``extras.return_weights``, else
      None; the log-sum-exp ``[batch..., Tq, H]`` when ``settings.return_residual``, else None.
    """
    dtype = query.dtype
    weights, lse = weights_and_lse(query, key, ops, settings, extras)
    weights_out = weights.astype(extras.weights_dtype or dtype)
    if extras.module is not None:
        sow(extras.module, weights_out)
    dropped = dropout_weights(weights, ops, settings).astype(dtype)
    *batch, q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads, v_dim = value.shape[-3:]
    if extras.wv_einsum is not None:
        out = extras.wv_einsum("...hqk,...khd->...qhd", dropped, _repeat_kv(value, num_heads))
    else:
        groups = num_heads // num_kv_heads
        # [batch..., H, T, S] -> [batch..., K, G, T, S]
        dropped = dropped.reshape(*batch, num_kv_heads, groups, q_len, kv_len)
        # [batch..., K, G, T, S] x [batch..., K, S, Dv] -> [batch..., K, G, T, Dv]
        out = _einsum(extras, settings.precision)(
            "...kgts,...ksd->...kgtd",
            dropped,
            jnp.moveaxis(value, -3, -2),
            preferred_element_type=softmax_dtype(dtype),
        )
        # -> [batch..., T, K, G, Dv] -> [batch..., T, H, Dv]
        out = jnp.moveaxis(out, -2, -4).reshape(*batch, q_len, num_heads, v_dim)
    residual = jnp.swapaxes(lse, -1, -2) if settings.return_residual else None
    return out.astype(dtype), (weights_out if extras.return_weights else None), residual


def sow(module, weights: Array) -> None:
    """Sows ``weights`` into a Linen or NNX module's intermediates as ``attention_weights``."""
    from flax import nnx  # lazy: only a module that asked for its weights pays for this

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)
