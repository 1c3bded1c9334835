"""Pure attention functions: scores -> weights (mask, float32 softmax, dropout) -> context.

Shapes follow ``jax.nn.dot_product_attention`` and ``flax.linen.dot_product_attention``:
query ``[batch..., q_len, num_heads, head_dim]``, key/value
``[batch..., kv_len, num_kv_heads, head_dim]`` with any number (zero included) of
leading batch dims. Masks are boolean (True = attend) and broadcast to
``[batch..., num_heads, q_len, kv_len]``.

Nothing here imports a Flax module class: the Linen and NNX modules call in, never the
other way round (the one exception is a lazy import used only to *sow* weights into a
module that asked for it).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _prng, blockwise
from jattn import masks as masks_lib

__all__ = [
    "dot_product_attention",
    "dot_product_attention_weights",
    "dropout",
    "simplified_self_attention",
    "simplified_self_attention_loop",
]

Array = jax.Array
BroadcastDropout = bool | Literal["batch", "heads"]
Implementation = Literal["dense", "blockwise"]


# ----------------------------------------------------------------------------------------
# Validation helpers: every public entry point fails here, with a message naming the
# argument and the fix, rather than deep inside an einsum.
# ----------------------------------------------------------------------------------------


def _as_float_array(x, name: str) -> Array:
    if x is None:
        raise TypeError(f"{name} is required, got None.")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name} must have a floating dtype (float32, bfloat16, float16, ...), got "
            f"{x.dtype}. Token ids must go through an embedding first; cast other arrays "
            f"with `.astype(jnp.float32)`."
        )
    return x


def _check_rate(rate, name: str = "dropout_rate") -> None:
    if isinstance(rate, jax.core.Tracer):
        return  # a traced rate cannot be checked; the caller chose it
    if not isinstance(rate, numbers.Real) and not (
        isinstance(rate, (np.ndarray, jax.Array)) and np.ndim(rate) == 0
    ):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(rate).__name__}.")
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(
            f"{name} must be in [0, 1), got {rate}. It is the probability of *dropping* a "
            "weight; use deterministic=True (or rate 0) to switch dropout off."
        )


def _check_qkv(query, key, value) -> tuple[Array, Array, Array]:
    query = _as_float_array(query, "query")
    key = _as_float_array(key, "key")
    value = _as_float_array(value, "value")
    expected = "[batch..., length, num_heads, head_dim]"
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise ValueError(
                f"{name} must have shape {expected} (rank >= 3), got shape {x.shape}. "
                "Split heads first: x.reshape(*x.shape[:-1], num_heads, head_dim)."
            )
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(
            f"query, key and value must have the same rank, got shapes {query.shape}, "
            f"{key.shape} and {value.shape}."
        )
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(
            f"query, key and value must share batch dims, got {query.shape[:-3]}, "
            f"{key.shape[:-3]} and {value.shape[:-3]} (shapes {query.shape}, {key.shape}, "
            f"{value.shape})."
        )
    if key.shape[-3:-1] != value.shape[-3:-1]:
        raise ValueError(
            f"key and value must have the same length and number of heads, got shapes "
            f"{key.shape} and {value.shape}."
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same head_dim (last axis), got {query.shape[-1]} "
            f"and {key.shape[-1]}."
        )
    num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"the number of query heads ({num_heads}) must be a multiple of the number of "
            f"key/value heads ({num_kv_heads}) for grouped-query attention."
        )
    if 0 in query.shape[-3:] or 0 in key.shape[-3:]:
        raise ValueError(
            f"lengths, heads and head_dim must be >= 1, got query {query.shape} and key "
            f"{key.shape}."
        )
    return query, key, value


def _check_broadcast(x: Array, target: tuple[int, ...], name: str) -> None:
    try:
        ok = np.broadcast_shapes(x.shape, target) == tuple(target)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name} of shape {x.shape} does not broadcast to the attention logits shape "
            f"[batch..., num_heads, q_len, kv_len] = {tuple(target)}. Add singleton axes "
            f"(e.g. {name}[:, None, :, :]) for the dims it does not vary over."
        )


def _compute_dtype(dtype, *arrays: Array):
    if dtype is None:
        return jnp.result_type(*arrays)
    return masks_lib._check_float_dtype(dtype, "dtype")


def _check_scale(scale) -> None:
    if scale is None or isinstance(scale, jax.core.Tracer):
        return  # the default, or a traced scalar (checked for shape below when it is an array)
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number, got {scale}.")
        return
    if isinstance(scale, (np.ndarray, jax.Array)) and np.ndim(scale) == 0:
        if not jnp.issubdtype(scale.dtype, jnp.floating):
            raise TypeError(f"scale must be a float, got an array of dtype {scale.dtype}.")
        return
    raise TypeError(
        f"scale must be a number (the logit multiplier, default 1/sqrt(head_dim)) or a scalar "
        f"array, got {type(scale).__name__} {np.shape(scale) if hasattr(scale, 'shape') else ''}."
    )


def _check_flag(value, name: str) -> None:
    # A traced or array flag would fail later as an obscure tracer-to-bool error.
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool (a static option), got {value!r}.")


def _check_options(dropout_rate, scale, is_causal, broadcast_dropout) -> None:
    """The scalar options both attention entry points share."""
    _check_rate(dropout_rate)
    _check_scale(scale)
    _check_flag(is_causal, "is_causal")
    _dropout_shared(broadcast_dropout)  # validates it even when dropout is off


def _softmax_dtype(dtype):
    # Softmax runs in at least float32, whatever the input dtype (float64 stays float64).
    return jnp.promote_types(dtype, jnp.float32)


# ----------------------------------------------------------------------------------------
# Masks and dropout
# ----------------------------------------------------------------------------------------


def _mask_spec(
    mask,
    *,
    logits_shape: tuple[int, ...],
    query_seq_lengths,
    key_value_seq_lengths,
    local_window_size,
    query_segment_ids=None,
    key_value_segment_ids=None,
) -> dict[str, Any]:
    """Validates every masking option and returns them normalised (no [T, S] array is built).

    Returns a dict with ``mask`` (bool, broadcastable to the logits, or None), ``window``
    (``(left, right)`` or None), ``q_lengths`` / ``kv_lengths`` (int ``[batch...]`` or None)
    and ``q_segments`` / ``kv_segments`` (int ``[batch..., length]`` or None).
    """
    q_len, kv_len = logits_shape[-2:]
    batch_shape = logits_shape[:-3]
    spec: dict[str, Any] = dict.fromkeys(
        ("mask", "window", "q_lengths", "kv_lengths", "q_segments", "kv_segments")
    )
    if mask is not None:
        try:
            mask = jnp.asarray(mask)
        except TypeError:
            raise TypeError(
                f"mask must be a boolean array (True = attend), got {type(mask).__name__} "
                f"{mask!r:.40}. Build one with jattn.causal_mask, or use is_causal=True."
            ) from None
        if mask.dtype != jnp.bool_:
            if not (
                jnp.issubdtype(mask.dtype, jnp.integer) or jnp.issubdtype(mask.dtype, jnp.floating)
            ):
                raise TypeError(f"mask must be boolean (True = attend), got dtype {mask.dtype}.")
            # flax builds float 0/1 masks (nn.make_attention_mask); nonzero = attend.
            mask = mask != 0
        _check_broadcast(mask, logits_shape, "mask")
        spec["mask"] = mask
    if local_window_size is not None:
        if isinstance(local_window_size, numbers.Integral):
            left, right = int(local_window_size), int(local_window_size)
        else:
            try:
                left, right = local_window_size
            except (TypeError, ValueError):
                raise TypeError(
                    "local_window_size must be an int or a (left, right) pair of ints, got "
                    f"{local_window_size!r}."
                ) from None
        # Validated (and checked to be ints) by the mask builder itself.
        masks_lib.sliding_window_mask(1, 1, window_left=left, window_right=right)
        spec["window"] = (left, right)
    for name, lengths, field in (
        ("query_seq_lengths", query_seq_lengths, "q_lengths"),
        ("key_value_seq_lengths", key_value_seq_lengths, "kv_lengths"),
    ):
        if lengths is None:
            continue
        lengths = jnp.asarray(lengths)
        if lengths.shape != batch_shape:
            raise ValueError(
                f"{name} must have the batch shape {batch_shape} (one length per sequence), "
                f"got shape {lengths.shape}."
            )
        if not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise TypeError(f"{name} must hold integers, got dtype {lengths.dtype}.")
        limit = q_len if field == "q_lengths" else kv_len
        if not isinstance(lengths, jax.core.Tracer) and lengths.size:
            # numpy: under jit a concrete (closed-over) array's jnp.min would be traced.
            values = np.asarray(lengths)
            low, high = int(values.min()), int(values.max())
            if low < 0 or high > limit:
                raise ValueError(
                    f"{name} must be in [0, {limit}] (the padded length), got values from {low} "
                    f"to {high}."
                )
        spec[field] = lengths
    if key_value_segment_ids is not None and query_segment_ids is None:
        raise ValueError(
            "key_value_segment_ids needs query_segment_ids too (the segment of each query)."
        )
    if query_segment_ids is not None:
        if key_value_segment_ids is None:
            if q_len != kv_len:
                raise ValueError(
                    f"key_value_segment_ids is required when q_len ({q_len}) != kv_len "
                    f"({kv_len}); query_segment_ids stands for both only in self-attention."
                )
            key_value_segment_ids = query_segment_ids
        for name, ids, length in (
            ("query_segment_ids", query_segment_ids, q_len),
            ("key_value_segment_ids", key_value_segment_ids, kv_len),
        ):
            ids = jnp.asarray(ids)
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise TypeError(f"{name} must hold integers, got dtype {ids.dtype}.")
            if ids.shape != (*batch_shape, length):
                raise ValueError(
                    f"{name} must have shape [batch..., length] = {(*batch_shape, length)}, "
                    f"got {ids.shape}."
                )
            spec["q_segments" if name == "query_segment_ids" else "kv_segments"] = ids
    return spec


def _build_mask(spec: dict[str, Any], *, logits_shape: tuple[int, ...], is_causal: bool):
    """Combines a :func:`_mask_spec` and ``is_causal`` into one bool mask broadcastable to the logits."""
    q_len, kv_len = logits_shape[-2:]
    parts = [spec["mask"]]
    if is_causal:
        parts.append(masks_lib.causal_mask(q_len, kv_len))
    if spec["window"] is not None:
        left, right = spec["window"]
        parts.append(
            masks_lib.sliding_window_mask(q_len, kv_len, window_left=left, window_right=right)
        )
    if spec["q_lengths"] is not None:
        valid = masks_lib.lengths_to_valid(spec["q_lengths"], q_len)
        parts.append(masks_lib.padding_mask(query_valid=valid))
    if spec["kv_lengths"] is not None:
        valid = masks_lib.lengths_to_valid(spec["kv_lengths"], kv_len)
        parts.append(masks_lib.padding_mask(key_valid=valid))
    if spec["q_segments"] is not None:
        parts.append(masks_lib.segment_mask(spec["q_segments"], spec["kv_segments"]))
    return masks_lib.combine_masks(*parts)


def _keep_mask(rng: Array, keep_prob: float, shape: tuple[int, ...]) -> Array:
    """Boolean keep-mask, True with probability ``keep_prob``, drawn from ``rng`` alone.

    Every dropout in jattn draws here, or tile by tile from the same generator in the
    blockwise path (:mod:`jattn._prng`: Philox-4x32-10 counters at each element's
    position, keyed by words derived from ``rng``), so both paths drop the same weights.
    """
    return _prng.keep_mask(rng, keep_prob, shape)


def _check_rng(rng, argument: str) -> None:
    if rng is None:
        raise ValueError(
            f"dropout is active (rate > 0 and deterministic=False) but no random key was "
            f"given. Pass `{argument}=jax.random.key(seed)` (Linen modules: "
            "`rngs={'dropout': key}`; NNX: `rngs=nnx.Rngs(dropout=seed)`), or set "
            "`deterministic=True` for inference."
        )
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        single = rng.shape == ()
    else:  # legacy raw key data: uint32 [2] (threefry) or [4] (rbg)
        single = dtype == jnp.uint32 and np.ndim(rng) == 1
    if not single:
        got = f"{type(rng).__name__}" if dtype is None else f"dtype {dtype}, shape {rng.shape}"
        raise TypeError(
            f"{argument} must be one jax.random key (jax.random.key(seed), or a legacy "
            f"jax.random.PRNGKey(seed)), got {got}. For a batch of keys, jax.vmap the call."
        )


def dropout(
    x,
    rate: float,
    *,
    rng: Array | None = None,
    deterministic: bool = False,
    broadcast_dims: tuple[int, ...] = (),
) -> Array:
    """Inverted dropout: zeroes each element with probability ``rate`` and scales the rest by ``1/(1-rate)``.

    Args:
      x: float array of any shape.
      rate: drop probability in [0, 1).
      rng: a ``jax.random`` key; required unless ``deterministic`` or ``rate == 0``.
      deterministic: if True, return ``x`` unchanged (inference).
      broadcast_dims: axes along which one mask is shared (as in ``flax.linen.Dropout``).

    Returns:
      An array like ``x``.
    """
    _check_rate(rate, "rate")
    x = _as_float_array(x, "x")
    if deterministic or (not isinstance(rate, jax.core.Tracer) and float(rate) == 0.0):
        return x
    _check_rng(rng, "rng")
    shape = list(x.shape)
    for d in broadcast_dims:
        if not -x.ndim <= d < x.ndim:
            raise ValueError(
                f"broadcast_dims {tuple(broadcast_dims)} name an axis outside x's {x.ndim} axes "
                f"(shape {x.shape})."
            )
        shape[d] = 1
    keep_prob = 1.0 - rate
    keep = _keep_mask(rng, keep_prob, tuple(shape))
    return jnp.where(keep, x / jnp.asarray(keep_prob, x.dtype), jnp.zeros((), x.dtype))


def _dropout_shared(broadcast_dropout: BroadcastDropout) -> tuple[bool, bool]:
    """``(over_batch, over_heads)``: which axes share one dropout mask."""
    if broadcast_dropout is True:
        return True, True  # one mask for every example and head
    if broadcast_dropout is False:
        return False, False  # independent, as torch.nn.Dropout in the book
    if broadcast_dropout == "batch":
        return True, False
    if broadcast_dropout == "heads":
        return False, True
    raise ValueError(
        f"broadcast_dropout must be True, False, 'batch' or 'heads', got {broadcast_dropout!r}."
    )


def _dropout_shape(weights_shape, n_batch: int, broadcast_dropout: BroadcastDropout):
    batch, heads, rest = weights_shape[:n_batch], weights_shape[n_batch], weights_shape[-2:]
    over_batch, over_heads = _dropout_shared(broadcast_dropout)
    batch = (1,) * n_batch if over_batch else tuple(batch)
    return (*batch, 1 if over_heads else heads, *rest)


# ----------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------


def _logits_shape(query: Array, key: Array) -> tuple[int, ...]:
    *batch, q_len, num_heads, _ = query.shape
    return (*batch, num_heads, q_len, key.shape[-3])


def _check_bias(bias, logits_shape: tuple[int, ...]) -> Array | None:
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must be a float array, got dtype {bias.dtype}.")
    _check_broadcast(bias, logits_shape, "bias")
    return bias


def _attention_weights(query, key, bias, spec, *, is_causal, scale, dtype, precision):
    """Softmax weights ``[batch..., H, T, S]`` in float32 (or wider), no dropout.

    ``bias`` and ``spec`` come validated from :func:`_check_bias` and :func:`_mask_spec`.
    """
    n_batch = query.ndim - 3
    *batch, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[-2]
    groups = num_heads // num_kv_heads
    logits_shape = _logits_shape(query, key)
    sm_dtype = _softmax_dtype(dtype)

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)

    # [batch..., K, G, T, D]: query heads grouped by the key/value head they share, moved
    # before T (a small copy) so that the product below comes out as [.., T, S] without a
    # transpose of the [T, S] matrix.
    q_grouped = jnp.moveaxis(query.reshape(*batch, q_len, num_kv_heads, groups, head_dim), -4, -2)
    # [batch..., K, G, T, D] x [batch..., K, S, D] -> [batch..., K, G, T, S] -> [batch..., H, T, S]
    # (head h = k * G + g, as jax.nn)
    logits = jnp.einsum(
        "...kgtd,...ksd->...kgts",
        q_grouped,
        jnp.moveaxis(key, -3, -2),
        precision=precision,
        preferred_element_type=sm_dtype,
    ).reshape(logits_shape)
    logits = logits * jnp.asarray(scale, sm_dtype)

    if bias is not None:
        logits = logits + bias.astype(sm_dtype)

    combined = _build_mask(spec, logits_shape=logits_shape, is_causal=is_causal)
    if combined is None:
        return jax.nn.softmax(logits, axis=-1), n_batch

    # A large *finite* negative: exp() underflows to exactly 0 and nothing becomes NaN.
    logits = jnp.where(combined, logits, masks_lib.large_negative(sm_dtype))
    weights = jax.nn.softmax(logits, axis=-1)
    # A query that may attend nothing gets zero weights (and so zero output), like
    # PyTorch's scaled_dot_product_attention, instead of a uniform average over hidden keys.
    # The `where` also stops gradients through such rows, so they are exactly zero.
    row_has_key = jnp.any(combined, axis=-1, keepdims=True)
    weights = jnp.where(row_has_key, weights, jnp.zeros((), sm_dtype))
    return weights, n_batch


def _maybe_sow(module, weights: Array) -> None:
    if module is None:
        return
    from flax import nnx  # lazy: only a module that asked for its weights pays for this

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def dot_product_attention_weights(
    query,
    key,
    bias=None,
    mask=None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    query_segment_ids=None,
    key_value_segment_ids=None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = False,
    broadcast_dropout: BroadcastDropout = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    force_fp32_for_softmax: bool = True,
) -> Array:
    """Attention weights ``softmax(q kᵀ * scale + bias, masked)`` with optional dropout.

    Takes the same arguments as :func:`dot_product_attention` (without ``value`` and
    ``implementation``: the weights are the dense ``[q_len, kv_len]`` matrix) and
    returns the weights ``[batch..., num_heads, q_len, kv_len]`` in the computation
    dtype, after dropout when dropout is active. Rows sum to 1, except fully masked
    rows, which are all zeros.
    """
    del force_fp32_for_softmax  # accepted for flax compatibility; the softmax is always fp32+
    _check_options(dropout_rate, scale, is_causal, broadcast_dropout)
    query = _as_float_array(query, "query")
    key = _as_float_array(key, "key")
    query, key, _ = _check_qkv(query, key, key)
    dtype = _compute_dtype(dtype, query, key)
    query, key = query.astype(dtype), key.astype(dtype)
    logits_shape = _logits_shape(query, key)
    bias = _check_bias(bias, logits_shape)
    spec = _mask_spec(
        mask,
        logits_shape=logits_shape,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        query_segment_ids=query_segment_ids,
        key_value_segment_ids=key_value_segment_ids,
    )
    weights, n_batch = _attention_weights(
        query, key, bias, spec, is_causal=is_causal, scale=scale, dtype=dtype, precision=precision
    )
    _maybe_sow(module, weights.astype(dtype))
    weights = _apply_weight_dropout(
        weights, n_batch, dropout_rate, dropout_rng, deterministic, broadcast_dropout
    )
    return weights.astype(dtype)


def _dropout_active(rate, deterministic: bool) -> bool:
    return not (deterministic or (not isinstance(rate, jax.core.Tracer) and float(rate) == 0.0))


def _apply_weight_dropout(weights, n_batch, rate, rng, deterministic, broadcast_dropout):
    if not _dropout_active(rate, deterministic):
        return weights
    _check_rng(rng, "dropout_rng")
    keep_prob = 1.0 - rate
    keep = _keep_mask(rng, keep_prob, _dropout_shape(weights.shape, n_batch, broadcast_dropout))
    return jnp.where(keep, weights / jnp.asarray(keep_prob, weights.dtype), 0.0).astype(
        weights.dtype
    )


# The automatic rule's thresholds. On CPU the blockwise path is used when q_len and kv_len
# are both at least _AUTO_MIN_LEN: from there on it measured faster, below it dense was as
# fast or faster (benchmarks/results.md), and one-query decoding stays dense. Elsewhere
# (GPU/TPU, not measured here) dense is kept unless its [q_len, kv_len] logits per
# (batch, head) reach _AUTO_DENSE_MAX_SCORES elements.
_AUTO_MIN_LEN = 256
_AUTO_DENSE_MAX_SCORES = 4096 * 4096


def _blockwise_obstacle(bias, scale, module, return_weights) -> str | None:
    """Why the blockwise path cannot serve this call (None: it can)."""
    if return_weights or module is not None:
        return "return_weights=True and module= need the full [q_len, kv_len] weight matrix"
    if bias is not None:
        return "a bias array is added densely (it is [q_len, kv_len] already)"
    if scale is not None and not isinstance(scale, numbers.Real):
        return f"scale must be a Python number for it, got {type(scale).__name__}"
    return None


def _check_implementation(implementation, name: str = "implementation") -> None:
    """The one list of implementations (the core's argument, the modules' attribute)."""
    if implementation not in (None, "dense", "blockwise"):
        raise ValueError(
            f"{name} must be None (automatic), 'dense' or 'blockwise', got "
            f"{implementation!r}. 'dense' is the one forward-mode autodiff (jax.jvp, "
            "jax.jacfwd) works with; the blockwise path has a custom VJP only."
        )


def _choose_implementation(implementation, *, q_len: int, kv_len: int, obstacle) -> str:
    _check_implementation(implementation)
    if implementation == "blockwise" and obstacle is not None:
        raise ValueError(
            f"implementation='blockwise' cannot be used here: {obstacle}. Use "
            "implementation='dense' or None (automatic)."
        )
    if implementation is not None:
        return implementation
    if obstacle is not None:
        return "dense"
    if jax.default_backend() == "cpu":
        return "blockwise" if min(q_len, kv_len) >= _AUTO_MIN_LEN else "dense"
    return "blockwise" if q_len * kv_len >= _AUTO_DENSE_MAX_SCORES else "dense"


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    query_segment_ids=None,
    key_value_segment_ids=None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = False,
    broadcast_dropout: BroadcastDropout = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    return_weights: bool = False,
    force_fp32_for_softmax: bool = True,
    implementation: Implementation | None = None,
):
    """Scaled dot-product attention, ``softmax(q kᵀ / sqrt(head_dim)) v``, with masks and dropout.

    Drop-in for ``jax.nn.dot_product_attention`` (same shapes, masks and mask options)
    and usable as ``attention_fn`` of ``flax.linen.MultiHeadDotProductAttention`` and
    ``flax.nnx.MultiHeadAttention`` (it accepts every keyword they pass).

    Two implementations compute the same function (outputs agree to float32 rounding,
    ~1e-6, gradients too, and dropout drops the same weights for the same key):

    * ``'dense'``: builds the ``[q_len, kv_len]`` weights, masks them and multiplies;
      memory grows as ``q_len * kv_len``.
    * ``'blockwise'`` (FlashAttention-style, :mod:`jattn.blockwise`): streams the softmax
      over key blocks, never computes a tile that the causal / window / length /
      segment masks or an all-False tile of ``mask`` hide, and recomputes the tiles in a
      custom backward pass; memory grows as ``q_len + kv_len``.

    ``implementation=None`` (automatic) picks ``'dense'`` when the call needs the weight
    matrix (``return_weights=True``, ``module=``), adds a ``bias`` array or has a traced
    ``scale``; otherwise, on CPU, ``'blockwise'`` when ``q_len`` and ``kv_len`` are both at
    least 256 (where it measured faster, ``benchmarks/results.md``), and on other backends
    (not measured) ``'blockwise'`` only when ``q_len * kv_len >= 4096**2`` (memory).

    Args:
      query: ``[batch..., q_len, num_heads, head_dim]``.
      key: ``[batch..., kv_len, num_kv_heads, head_dim]``; ``num_heads`` must be a multiple
        of ``num_kv_heads`` (grouped-query / multi-query attention).
      value: ``[batch..., kv_len, num_kv_heads, v_head_dim]``.
      bias: optional float array broadcastable to ``[batch..., num_heads, q_len, kv_len]``,
        added to the scaled logits (dense implementation only).
      mask: optional boolean array broadcastable to ``[batch..., num_heads, q_len, kv_len]``,
        True = attend. Numeric masks (flax's float 0/1) count nonzero as True.
      is_causal: AND a causal mask (query ``i`` sees keys ``j <= i``, aligned top-left as
        ``torch.tril`` and ``jax.nn``). For bottom-right alignment (decoding) pass
        ``mask=jattn.causal_mask(q_len, kv_len, offset=kv_len - q_len)``.
      scale: multiplier of the logits; default ``1 / sqrt(head_dim)``.
      query_seq_lengths: optional int ``[batch...]``: queries past it are padding (zero output).
      key_value_seq_lengths: optional int ``[batch...]``: keys past it are hidden.
      local_window_size: optional int or ``(left, right)``: query ``i`` sees keys
        ``i-left ... i+right`` (as ``jax.nn``).
      query_segment_ids: optional int ``[batch..., q_len]`` for packed sequences: a query
        sees only keys with the same id (as :func:`jattn.segment_mask`, without building
        the ``[q_len, kv_len]`` mask).
      key_value_segment_ids: optional int ``[batch..., kv_len]``; defaults to
        ``query_segment_ids`` (self-attention).
      dropout_rate: probability of dropping an attention weight, in [0, 1).
      dropout_rng: ``jax.random`` key; required when dropout is active. The mask is a
        function of this key and each weight's position only (see :mod:`jattn._prng`).
      deterministic: True for inference: no dropout, no key needed.
      broadcast_dropout: which axes share one dropout mask: ``False`` (default, independent
        per example and head, as ``torch.nn.Dropout`` in the book), ``True`` (one mask
        for all examples and heads, flax's default), ``'batch'`` (shared across batch dims)
        or ``'heads'`` (shared across heads).
      dtype: computation and output dtype; default: the promoted dtype of q, k, v.
      precision: ``jax.lax.Precision`` for the two einsums.
      module: a Linen or NNX module; when given, the pre-dropout weights are sown into its
        intermediates as ``attention_weights`` (as flax does).
      return_weights: also return the pre-dropout weights ``[batch..., H, q_len, kv_len]``.
      force_fp32_for_softmax: accepted for flax compatibility; the softmax always runs in
        float32 (or float64 for float64 inputs).
      implementation: ``None`` (automatic, above), ``'dense'`` or ``'blockwise'``.

    Returns:
      ``[batch..., q_len, num_heads, v_head_dim]`` in ``dtype``; with ``return_weights``,
      ``(output, weights)``. Fully masked query rows give zero output and zero weights,
      with finite gradients.

    Raises:
      TypeError: non-float inputs, non-boolean masks of odd dtypes.
      ValueError: shapes that do not match, masks or biases that do not broadcast, a
        dropout rate outside [0, 1), active dropout without ``dropout_rng``,
        ``implementation='blockwise'`` with an option only the dense path has.
    """
    del force_fp32_for_softmax
    _check_options(dropout_rate, scale, is_causal, broadcast_dropout)
    query, key, value = _check_qkv(query, key, value)
    dtype = _compute_dtype(dtype, query, key, value)
    query, key, value = query.astype(dtype), key.astype(dtype), value.astype(dtype)
    logits_shape = _logits_shape(query, key)
    bias = _check_bias(bias, logits_shape)
    spec = _mask_spec(
        mask,
        logits_shape=logits_shape,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        query_segment_ids=query_segment_ids,
        key_value_segment_ids=key_value_segment_ids,
    )
    chosen = _choose_implementation(
        implementation,
        q_len=logits_shape[-2],
        kv_len=logits_shape[-1],
        obstacle=_blockwise_obstacle(bias, scale, module, return_weights),
    )
    if chosen == "blockwise":
        dropout_on = _dropout_active(dropout_rate, deterministic)
        if dropout_on:
            _check_rng(dropout_rng, "dropout_rng")
        return blockwise.blockwise_attention(
            query,
            key,
            value,
            scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else scale,
            is_causal=is_causal,
            local_window=spec["window"],
            mask=spec["mask"],
            query_seq_lengths=spec["q_lengths"],
            key_value_seq_lengths=spec["kv_lengths"],
            query_segment_ids=spec["q_segments"],
            key_value_segment_ids=spec["kv_segments"],
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng if dropout_on else None,
            dropout_shared=_dropout_shared(broadcast_dropout) if dropout_on else (False, False),
            precision=precision,
        )

    weights, n_batch = _attention_weights(
        query, key, bias, spec, is_causal=is_causal, scale=scale, dtype=dtype, precision=precision
    )
    _maybe_sow(module, weights.astype(dtype))
    dropped = _apply_weight_dropout(
        weights, n_batch, dropout_rate, dropout_rng, deterministic, broadcast_dropout
    )

    *batch, q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads, v_dim = value.shape[-3:]
    groups = num_heads // num_kv_heads
    # [batch..., H, T, S] -> [batch..., K, G, T, S]
    dropped = dropped.astype(dtype).reshape(*batch, num_kv_heads, groups, q_len, kv_len)
    # [batch..., K, G, T, S] x [batch..., K, S, Dv] -> [batch..., K, G, T, Dv]
    out = jnp.einsum(
        "...kgts,...ksd->...kgtd",
        dropped,
        jnp.moveaxis(value, -3, -2),
        precision=precision,
        preferred_element_type=_softmax_dtype(dtype),
    )
    # -> [batch..., T, K, G, Dv] -> [batch..., T, H, Dv]
    out = jnp.moveaxis(out, -2, -4).reshape(*batch, q_len, num_heads, v_dim).astype(dtype)
    if return_weights:
        return out, weights.astype(dtype)
    return out


# ----------------------------------------------------------------------------------------
# The chapter's teaching forms (section "A simple self-attention mechanism without
# trainable weights"): every token is its own query, key and value.
# ----------------------------------------------------------------------------------------


def _check_tokens(inputs) -> Array:
    inputs = _as_float_array(inputs, "inputs")
    if inputs.ndim < 2:
        raise ValueError(
            f"inputs must have shape [batch..., num_tokens, d] (rank >= 2), got {inputs.shape}."
        )
    return inputs


def simplified_self_attention_loop(inputs) -> Array:
    """The chapter's first form, one query at a time, written as the book's loops.

    For each query ``x_i``: scores ``w_ij = x_i · x_j``, weights ``softmax_j(w_ij)``,
    context ``z_i = sum_j a_ij x_j``. No scaling, no trainable weights.

    Args:
      inputs: ``[num_tokens, d]`` float array (no batch dims: this form is for reading).

    Returns:
      Context vectors ``[num_tokens, d]``.
    """
    inputs = _check_tokens(inputs)
    if inputs.ndim != 2:
        raise ValueError(
            f"simplified_self_attention_loop takes one sequence [num_tokens, d], got "
            f"{inputs.shape}; use simplified_self_attention for batches."
        )
    contexts = []
    for query in inputs:  # one query token at a time, as in the book
        scores = jnp.stack([jnp.dot(query, x_j) for x_j in inputs])  # [num_tokens]
        weights = jax.nn.softmax(scores)
        contexts.append(sum(a_j * x_j for a_j, x_j in zip(weights, inputs, strict=True)))
    return jnp.stack(contexts)


def simplified_self_attention(inputs, *, return_weights: bool = False):
    """The chapter's second form: the same computation as matrix products.

    ``softmax(X Xᵀ) X`` per sequence, for ``inputs`` ``[batch..., num_tokens, d]``.
    With ``return_weights`` also returns the weights ``[batch..., num_tokens, num_tokens]``.
    """
    inputs = _check_tokens(inputs)
    scores = jnp.einsum("...td,...sd->...ts", inputs, inputs)
    weights = jax.nn.softmax(scores.astype(_softmax_dtype(inputs.dtype)), axis=-1)
    context = jnp.einsum("...ts,...sd->...td", weights.astype(inputs.dtype), inputs)
    return (context, weights) if return_weights else context
