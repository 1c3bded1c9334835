"""The public attention functions: check the arguments once, pick an implementation, call it.

:func:`dot_product_attention` documents the shapes and masks (the conventions guide,
``docs/guides/conventions.md``, says why). The layers below this one take the validated
call as :class:`jattn._call.Operands` (arrays) and :class:`jattn._call.Settings` (static
options) and re-check nothing. Nothing here imports Flax (the dense path imports it
lazily only to *sow* weights into a module).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jattn import _checks, _prng, _routing, _util, dense, masks
from jattn._call import DenseExtras, Operands, Settings

__all__ = [
    "CausalAlignmentWarning",
    "dot_product_attention",
    "dot_product_attention_weights",
    "dropout",
    "simplified_self_attention",
    "simplified_self_attention_loop",
]

Array = jax.Array
BroadcastDropout = bool | Literal["batch", "heads"]
Implementation = _util.Implementation  # the one list of names


class CausalAlignmentWarning(UserWarning):
    """``is_causal=True`` with fewer queries than keys: the mask is aligned top-left.

    Query ``i`` then sees keys ``0 ... i`` (as ``jax.nn`` and ``torch``), not the last
    keys, which a decoding query (the newest position) needs. Pass the mask that says
    which alignment is meant instead: ``mask=jattn.causal_mask(q_len, kv_len,
    offset=kv_len - q_len)`` (bottom-right) or ``mask=jattn.causal_mask(q_len, kv_len)``
    (top-left); or filter this class with :mod:`warnings`.
    """


def _warn_top_left(q_len: int, kv_len: int) -> None:
    warnings.warn(
        CausalAlignmentWarning(
            f"is_causal=True with fewer queries ({q_len}) than keys ({kv_len}) aligns the "
            "causal mask top-left, as jax.nn and torch do: query i sees keys 0..i, so a query "
            "for the newest position (a decoding step, q[:, -1:]) sees only the first key. "
            "If the queries are the last q_len positions pass mask=jattn.causal_mask(q_len, "
            "kv_len, offset=kv_len - q_len) (bottom-right), or decode with jattn.kvcache; to "
            "keep top-left without this warning pass mask=jattn.causal_mask(q_len, kv_len)."
        ),
        stacklevel=4,
    )


def _dropout_active(rate, deterministic: bool) -> bool:
    return not (deterministic or (not isinstance(rate, jax.core.Tracer) and float(rate) == 0.0))


def _cast_inputs(arrays, dtype, promote_dtype):
    """The inputs in the computation dtype: ``dtype``, or their promoted dtype.

    ``promote_dtype`` (flax NNX's hook) does the casting when given, as in flax.
    """
    if promote_dtype is not None:
        if not callable(promote_dtype):
            raise TypeError(
                f"promote_dtype must be a function (args, dtype=...) -> args, as flax's "
                f"nnx.nn.dtypes.promote_dtype, got {type(promote_dtype).__name__}."
            )
        arrays = tuple(promote_dtype(tuple(arrays), dtype=dtype))
        names = ("query", "key", "value")[: len(arrays)]
        arrays = tuple(
            _checks.float_array(x, n, tokens=True) for x, n in zip(arrays, names, strict=True)
        )
        if len({x.dtype for x in arrays}) != 1:
            raise TypeError(
                "promote_dtype must return arrays of one dtype, got "
                f"{[str(x.dtype) for x in arrays]}."
            )
        return arrays
    dtype = jnp.result_type(*arrays) if dtype is None else _checks.float_dtype(dtype, "dtype")
    return tuple(x.astype(dtype) for x in arrays)


def _operands_and_settings(
    logits_shape, *, scale, head_dim, bias, mask, is_causal, query_seq_lengths,
    key_value_seq_lengths, local_window_size, query_segment_ids, key_value_segment_ids,
    dropout_rate, dropout_rng, deterministic, broadcast_dropout, precision, return_residual,
    modifiers,
):  # fmt: skip
    """Validates every option of a call and returns its :class:`Operands` and :class:`Settings`.

    ``modifiers`` is ``(score_mod, mask_mod, sinks, block_mask, dtype)`` (see :func:`_modifiers`).
    """
    _checks.rate(dropout_rate)
    _checks.scale(scale)
    _checks.flag(is_causal, "is_causal")
    _checks.flag(return_residual, "return_residual")
    shared = _checks.broadcast_dropout(broadcast_dropout)  # validated even when dropout is off
    batch, q_len, kv_len = logits_shape[:-3], logits_shape[-2], logits_shape[-1]
    if is_causal and q_len < kv_len:
        _warn_top_left(q_len, kv_len)
    q_segments, kv_segments = _checks.segment_ids(
        query_segment_ids, key_value_segment_ids, batch, q_len, kv_len
    )
    dropout_on = _dropout_active(dropout_rate, deterministic)
    if dropout_on:
        _checks.rng(dropout_rng, "dropout_rng")
    score_mod, mask_mod, sinks, block_mask = _modifiers(logits_shape, *modifiers)
    ops = Operands(
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
        bias=_floored(_checks.bias(bias, logits_shape)),
        mask=_checks.mask(mask, logits_shape),
        q_lengths=_checks.seq_lengths(query_seq_lengths, "query_seq_lengths", batch, q_len),
        kv_lengths=_checks.seq_lengths(
            key_value_seq_lengths, "key_value_seq_lengths", batch, kv_len
        ),
        q_segments=q_segments,
        kv_segments=kv_segments,
        dropout_rate=dropout_rate if dropout_on else 0.0,
        dropout_rng=dropout_rng if dropout_on else None,
        sinks=sinks,
        block_mask=block_mask,
    )
    settings = Settings(
        is_causal=bool(is_causal),
        window=(
            None
            if local_window_size is None
            else _bounded(_checks.window(local_window_size, open_right=True), q_len, kv_len)
        ),
        dropout_shared=shared,
        precision=precision,
        return_residual=bool(return_residual),
        score_mod=score_mod,
        mask_mod=mask_mod,
    )
    return ops, settings


def _floored(bias: Array | None) -> Array | None:
    """``bias`` with ``-inf`` entries at the dtype's ``finfo.min`` (their gradient zero):
    a key hidden by an additive ``-inf`` (PyTorch's additive masks) weighs exactly what
    it weighs at ``finfo.min`` (nothing, beside any finite logit), and a row hidden that
    way throughout averages its visible keys on every path instead of giving NaN (``0 /
    0``) on some and zeros on others. Use a boolean mask to hide keys outright."""
    if bias is None:
        return None
    return jnp.where(bias == -jnp.inf, jnp.finfo(bias.dtype).min, bias)


def _bounded(window: tuple, q_len: int, kv_len: int) -> tuple:
    """``(left, right)`` capped at ``max(q_len, kv_len)``: no query and key are further apart,
    so the window is the same, and the paths' int32 positions (int64 in C++) cannot
    overflow on a huge one (``sys.maxsize`` gave wrong numbers on the fused kernel)."""
    bound = max(q_len, kv_len)
    left, right = window
    return min(left, bound), None if right is None else min(right, bound)


def _modifiers(logits_shape, score_mod, mask_mod, sinks, block_mask, dtype):
    """Validates the FlexAttention-style options: ``(score_mod, mask_mod, sinks, block_mask)``.

    Each modifier is traced once on abstract inputs (:func:`jattn._checks.score_mod`);
    a block mask brings its own ``mask_mod``.
    """
    *batch, num_heads, q_len, kv_len = logits_shape
    sizes = (math.prod(batch), num_heads, q_len, kv_len)
    mask_mod, block_mask = _checks.block_mask(block_mask, mask_mod, logits_shape)
    _checks.score_mod(score_mod, logits_shape, dense.softmax_dtype(dtype))
    _checks.mask_mod(mask_mod, logits_shape)
    for fn in (score_mod, mask_mod):
        _checks.modifier_sizes(fn, *sizes)
    return score_mod, mask_mod, _checks.sinks(sinks, num_heads), block_mask


def _dense_extras(
    *, dtype, return_weights, module, force_fp32_for_softmax, precision,
    einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum,
):  # fmt: skip
    """Validates the dense-only options (flax's hooks included)."""
    _checks.flag(return_weights, "return_weights")
    _checks.flag(force_fp32_for_softmax, "force_fp32_for_softmax")
    hooks = {
        "einsum_dot_general": einsum_dot_general,
        "qk_attn_weights_einsum": qk_attn_weights_einsum,
        "attn_weights_value_einsum": attn_weights_value_einsum,
    }
    for name, hook in hooks.items():
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} must be a function, got {type(hook).__name__}.")
    if (qk_attn_weights_einsum is None) != (attn_weights_value_einsum is None):
        raise ValueError(
            "qk_attn_weights_einsum and attn_weights_value_einsum must be given together "
            "(as flax requires): one computes the logits, the other weights times values."
        )
    if qk_attn_weights_einsum is not None and (
        precision is not None or einsum_dot_general is not None
    ):
        raise ValueError(
            "precision/einsum_dot_general and qk_attn_weights_einsum/attn_weights_value_einsum "
            "are mutually exclusive (as in flax): the einsum hooks decide how the products run."
        )
    return DenseExtras(
        return_weights=bool(return_weights),
        module=module,
        # flax: with force_fp32_for_softmax the weights stay in float32 (returned and sown).
        weights_dtype=dense.softmax_dtype(dtype) if force_fp32_for_softmax else dtype,
        qk_einsum=qk_attn_weights_einsum,
        wv_einsum=attn_weights_value_einsum,
        dot_general=einsum_dot_general,
    )


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
    return_residual: bool = False,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general=None,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    promote_dtype=None,
    implementation: Implementation | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    sinks=None,
    block_mask=None,
):
    """Scaled dot-product attention, ``softmax(q kᵀ / sqrt(head_dim)) v``, with masks and dropout.

    * **Shapes** as ``jax.nn`` and flax: query ``[batch..., q_len, num_heads, head_dim]``,
      key/value ``[batch..., kv_len, num_kv_heads, head_dim]``. The book's PyTorch code
      uses ``[batch, heads, T, head_dim]``: swap with ``jnp.swapaxes(x, -3, -2)``.
    * **Masks** are boolean, True = attend (flax's float 0/1 masks too), broadcast to
      ``[batch..., num_heads, q_len, kv_len]``. The book's buffer ``triu(ones, diagonal=1)``
      (True = *hide*) and additive masks (0 / ``-inf``) are refused with the fix
      (``is_causal=True``, ``~buffer``, ``bias=``); traced masks are taken as given.
    * **is_causal=True** aligns the mask top-left (query ``i`` sees keys ``0 ... i``), as
      ``jax.nn`` and torch: a decoding step (fewer queries than keys) needs
      ``mask=jattn.causal_mask(q_len, kv_len, offset=kv_len - q_len)`` instead, and the
      call warns (:class:`CausalAlignmentWarning`).
    * **Dropout** drops attention weights with the explicit key ``dropout_rng``;
      ``deterministic=True`` (inference) needs no key.

    A drop-in for ``jax.nn.dot_product_attention`` and flax's ``dot_product_attention``
    (usable as ``attention_fn`` of flax's attention modules: it honours every keyword
    they pass). ``implementation=None`` takes, per backend, the fastest path that honours
    the call; every path computes the same function (outputs and gradients agree to the
    dtype's rounding, and the same key drops the same weights). Which path runs when,
    what each accelerator kernel takes, and autodiff on the fast paths: the fast-path
    guide (``docs/guides/fast_path.md``).

    Args:
      query: ``[batch..., q_len, num_heads, head_dim]``.
      key: ``[batch..., kv_len, num_kv_heads, head_dim]``; ``num_heads`` must be a multiple
        of ``num_kv_heads`` (grouped-query / multi-query attention).
      value: ``[batch..., kv_len, num_kv_heads, v_head_dim]``.
      bias: optional float array broadcastable to ``[batch..., num_heads, q_len, kv_len]``,
        added to the scaled logits.
      mask: optional boolean array broadcastable to ``[batch..., num_heads, q_len, kv_len]``,
        True = attend; numeric masks must hold only 0 and 1 (flax's float masks). Its
        values are checked when they can be read without a device copy (not under
        ``jit``, not on GPU/TPU): see above.
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
      dropout_rng: ``jax.random`` key; required when dropout is active. The dropout mask is
        a function of this key and each weight's position only, the same on every path.
      deterministic: True for inference: no dropout, no key needed.
      broadcast_dropout: which axes share one dropout mask: ``False`` (default, independent
        per example and head, as ``torch.nn.Dropout`` in the book), ``True`` (one mask
        for all examples and heads, flax's default), ``'batch'`` (shared across batch dims)
        or ``'heads'`` (shared across heads).
      dtype: computation and output dtype; default: the promoted dtype of q, k, v.
      precision: ``jax.lax.Precision`` for the products.
      module: a Linen or NNX module; when given, the pre-dropout weights are sown into its
        intermediates as ``attention_weights`` (as flax does).
      return_weights: also return the pre-dropout weights ``[batch..., H, q_len, kv_len]``.
      return_residual: also return the log-sum-exp of the scaled, masked logits,
        ``[batch..., q_len, num_heads]`` in the input dtype (as jax.nn: its layout and
        dtype; computed in float32), differentiable; rows that attend nothing get
        :func:`jattn.large_negative` of that dtype (with ``sinks``: the log-sum-exp
        includes the sink, see Returns).
      force_fp32_for_softmax: as flax: the weights returned and sown are float32 (the
        softmax dtype) instead of ``dtype``. The softmax itself always runs in float32
        (float64 for float64 inputs).
      einsum_dot_general: flax's hook: the ``dot_general`` of both products (dense path).
      qk_attn_weights_einsum: flax's hook (e.g. quantized einsums): computes the logits as
        ``einsum('...qhd,...khd->...hqk', query * scale, key)``; with
        ``attn_weights_value_einsum``, which computes ``einsum('...hqk,...khd->...qhd',
        weights, value)`` (dense path; key/value heads are repeated for GQA).
      attn_weights_value_einsum: see above.
      promote_dtype: flax NNX's hook: ``promote_dtype((q, k, v), dtype=dtype)`` casts the
        inputs (default: jattn's promotion, the result dtype of q, k, v, or ``dtype``).
      implementation: ``None`` (automatic), ``'dense'`` (``'xla'``: jax.nn's name for it;
        every transformation, forward-mode autodiff included), ``'blockwise'``
        (FlashAttention-style, memory ``q_len + kv_len``), or an accelerator kernel:
        ``'cudnn'``, ``'pallas_triton'``, ``'splash'``, or jattn's own Pallas kernel
        ``'pallas'`` (the fast-path guide). One that
        cannot honour the call raises a ValueError naming the option it lacks and what to
        use instead.
      score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``,
        applied elementwise to the scaled logits ``scale * q·k`` before ``bias`` is added
        and before any mask (so a mask given as a large negative bias stays masked after,
        e.g., soft-capping). Indices: see :mod:`jattn.mods` (``b`` the flattened batch
        index, ``h`` the query head, ``q_idx``/``kv_idx`` positions, int32 arrays that
        broadcast like the scores ``[N, H, Tq, Tk]``). Arrays it closes over get
        gradients. Ready-made ones: :mod:`jattn.mods`.
      mask_mod: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool``, True = attend,
        ANDed with every other mask.
      sinks: float ``[num_heads]`` attention-sink logits (gpt-oss, StreamingLLM): one extra
        logit per row's softmax (not scaled, not modified, not masked) that takes
        probability mass and contributes no value; gradients flow to it. A row whose
        every key is masked attends only its sink: zero output (and zero gradients to q,
        k, v), as without sinks.
      block_mask: a :class:`jattn.BlockMask` from :func:`jattn.block_mask`: its
        ``mask_mod`` evaluated per tile once, reusable across calls (the blockwise path
        skips its EMPTY tiles and masks only its PARTIAL ones, coarsening its states to
        the path's tiles when those are multiples of its tiles, else evaluating the
        ``mask_mod`` again at the path's tiles; the dense path applies its ``mask_mod``).
        It replaces ``mask_mod`` (or must carry the same one).

    Returns:
      ``[batch..., q_len, num_heads, v_head_dim]`` in ``dtype``; with ``return_weights``
      and/or ``return_residual``, a tuple ``(output, weights?, residual?)`` in that order.
      Fully masked query rows give zero output and zero weights, with finite gradients.
      With ``sinks`` the weights are those of the real keys: each row sums to
      ``1 - p_sink`` (less than 1), and the residual includes the sink,
      ``log(sum_j exp(s_j) + exp(sink_h))`` (the sink's logit in a fully masked row).

    Raises:
      TypeError: non-float inputs, non-boolean masks of odd dtypes, hooks that are not
        functions; a ``score_mod``/``mask_mod`` that is not a function of FlexAttention's
        arguments or returns the wrong dtype; ``sinks`` not float; a ``block_mask`` not
        built by :func:`jattn.block_mask`.
      ValueError: shapes that do not match, masks or biases that do not broadcast, a
        dropout rate outside [0, 1), active dropout without ``dropout_rng``, an
        ``implementation`` that cannot honour the call; a modifier that is not
        elementwise; ``sinks`` not ``[num_heads]``; a ``block_mask`` built for other sizes.
    """
    query, key, value = _checks.qkv(query, key, value)
    query, key, value = _cast_inputs((query, key, value), dtype, promote_dtype)
    shape = dense.logits_shape(query, key)
    ops, settings = _operands_and_settings(
        shape,
        scale=scale,
        head_dim=query.shape[-1],
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        query_segment_ids=query_segment_ids,
        key_value_segment_ids=key_value_segment_ids,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        deterministic=deterministic,
        broadcast_dropout=broadcast_dropout,
        precision=precision,
        return_residual=return_residual,
        modifiers=(score_mod, mask_mod, sinks, block_mask, query.dtype),
    )
    extras = _dense_extras(
        dtype=query.dtype,
        return_weights=return_weights,
        module=module,
        force_fp32_for_softmax=force_fp32_for_softmax,
        precision=precision,
        einsum_dot_general=einsum_dot_general,
        qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum,
    )
    out, weights, residual = _routing.run(implementation, query, key, value, ops, settings, extras)
    if residual is not None:
        residual = _residual_in(residual, query.dtype)
    extra_outputs = [x for x in (weights, residual) if x is not None]
    return (out, *extra_outputs) if extra_outputs else out


def _residual_in(lse: Array, dtype) -> Array:
    """Every path's float32 log-sum-exp in the input dtype, as ``jax.nn`` returns it.

    Rows that attend nothing hold float32's large negative, which float16 cannot hold:
    clipped to the dtype's own first, so they stay finite.
    """
    if lse.dtype == dtype:
        return lse
    return jnp.maximum(lse, masks.large_negative(dtype).astype(lse.dtype)).astype(dtype)


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
    force_fp32_for_softmax: bool = False,
    einsum_dot_general=None,
    promote_dtype=None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    sinks=None,
    block_mask=None,
) -> Array:
    """Attention weights ``softmax(q kᵀ * scale + bias, masked)`` with optional dropout.

    Takes the same arguments as :func:`dot_product_attention` (without ``value``,
    ``implementation`` and the value product's hooks: the weights are the dense
    ``[q_len, kv_len]`` matrix; ``score_mod``, ``mask_mod``, ``sinks`` and ``block_mask``
    included) and returns the weights ``[batch..., num_heads, q_len, kv_len]`` in the
    computation dtype (float32 with ``force_fp32_for_softmax``, as flax), after dropout
    when dropout is active. Rows sum to 1, except fully masked rows, which are all zeros,
    and rows with ``sinks``, which sum to ``1 - p_sink``.
    """
    query, key, _ = _checks.qkv(query, key, key)
    query, key = _cast_inputs((query, key, key), dtype, promote_dtype)[:2]
    shape = dense.logits_shape(query, key)
    ops, settings = _operands_and_settings(
        shape,
        scale=scale,
        head_dim=query.shape[-1],
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        query_segment_ids=query_segment_ids,
        key_value_segment_ids=key_value_segment_ids,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        deterministic=deterministic,
        broadcast_dropout=broadcast_dropout,
        precision=precision,
        return_residual=False,
        modifiers=(score_mod, mask_mod, sinks, block_mask, query.dtype),
    )
    extras = _dense_extras(
        dtype=query.dtype,
        return_weights=True,
        module=module,
        force_fp32_for_softmax=force_fp32_for_softmax,
        precision=precision,
        einsum_dot_general=einsum_dot_general,
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
    )
    weights, _ = dense.weights_and_lse(query, key, ops, settings, extras)
    out_dtype = extras.weights_dtype
    if module is not None:
        dense.sow(module, weights.astype(out_dtype))
    return dense.dropout_weights(weights, ops, settings).astype(out_dtype)


def dropout(
    x,
    rate: float,
    *,
    rng: Array | None = None,
    deterministic: bool = False,
    broadcast_dims: tuple[int, ...] = (),
) -> Array:
    """Inverted dropout: zeroes each element with probability ``rate`` and scales the rest by ``1/(1-rate)``.

    Every dropout in jattn draws its bits from the same generator (:mod:`jattn._prng`:
    Philox-4x32-10 counters at each element's position, keyed by words derived from
    ``rng``), so the dense and blockwise paths drop the same weights.

    Args:
      x: float array of any shape.
      rate: drop probability in [0, 1).
      rng: a ``jax.random`` key; required unless ``deterministic`` or ``rate == 0``.
      deterministic: if True, return ``x`` unchanged (inference).
      broadcast_dims: axes along which one mask is shared (as in ``flax.linen.Dropout``).

    Returns:
      An array like ``x``.
    """
    _checks.rate(rate, "rate")
    x = _checks.float_array(x, "x")
    if not _dropout_active(rate, deterministic):
        return x
    _checks.rng(rng, "rng")
    shape = list(x.shape)
    for d in broadcast_dims:
        if not -x.ndim <= d < x.ndim:
            raise ValueError(
                f"broadcast_dims {tuple(broadcast_dims)} name an axis outside x's {x.ndim} axes "
                f"(shape {x.shape})."
            )
        shape[d] = 1
    keep_prob = 1.0 - rate
    keep = _prng.keep_mask(rng, keep_prob, tuple(shape))
    return jnp.where(keep, x / jnp.asarray(keep_prob, x.dtype), jnp.zeros((), x.dtype))


# ----------------------------------------------------------------------------------------
# The chapter's teaching forms (section "A simple self-attention mechanism without
# trainable weights"): every token is its own query, key and value.
# ----------------------------------------------------------------------------------------


def _check_tokens(inputs) -> Array:
    inputs = _checks.float_array(inputs, "inputs", tokens=True)
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
    weights = jax.nn.softmax(scores.astype(dense.softmax_dtype(inputs.dtype)), axis=-1)
    context = jnp.einsum("...ts,...sd->...td", weights.astype(inputs.dtype), inputs)
    return (context, weights) if return_weights else context
