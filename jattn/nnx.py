"""Flax NNX modules for every attention form of chapter 3, with the book's names.

The same five classes as :mod:`jattn.linen` (and the book's ``SelfAttention_v1`` /
``SelfAttention_v2`` spellings), with the same parameter trees, so
:func:`jattn.convert.linen_to_nnx` / :func:`jattn.convert.nnx_to_linen` copy without
renaming. As in the book and in NNX, constructors take ``d_in`` first and ``rngs=`` last.
Each class documents its arguments and call; the modules guide
(``docs/guides/modules.md``) gives the conventions they share (``deterministic`` and
``.train()`` / ``.eval()``, where the dropout key comes from, weights via
``nnx.capture``), the decoding guide ``init_cache`` and ``decode=True``, and the fast-path
guide the automatic ``attention_implementation``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jattn import _module_utils as mu
from jattn import kvcache
from jattn.rope import RoPE

__all__ = [
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "SelfAttention_v1",
    "SelfAttention_v2",
]

Array = jax.Array
Initializer = Any
RngsArg = nnx.Rngs | nnx.RngStream | jax.Array | None

# Flax's defaults for Linear layers (the same as jattn.linen's).
default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()
# SelfAttention_v1 draws its raw matrices with torch.rand: U[0, 1).
v1_kernel_init = nnx.initializers.uniform(1.0)


class _Attention(nnx.Module):
    """What every class keeps: its :class:`jattn._module_utils.ModuleConfig` and a way to
    build its projections."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:  # flax's keywords get a clear error, not Python's
            cls.__init__ = mu.refuse_flax_keywords(cls.__dict__["__init__"])

    def _init_config(self, config: mu.ModuleConfig, rngs) -> None:
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"{config.cls_name}: rngs must be an nnx.Rngs (e.g. rngs=nnx.Rngs(0), or "
                f"nnx.Rngs(params=0, dropout=1)), got {type(rngs).__name__}."
            )
        self.config = config

    # Read-only views of the configuration, under the constructor's argument names.
    dtype = property(lambda self: self.config.dtype)
    param_dtype = property(lambda self: self.config.param_dtype)
    precision = property(lambda self: self.config.precision)
    attention_implementation = property(lambda self: self.config.attention_implementation)

    def _linear(self, d_in, features, use_bias, kernel_init, bias_init, rngs) -> nnx.Linear:
        return nnx.Linear(
            d_in,
            features,
            use_bias=use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            kernel_init=kernel_init,
            bias_init=bias_init,
            rngs=rngs,
        )

    def _init_qkv(self, d_in, q_features, kv_features, use_bias, kernel_init, bias_init, rngs):
        self.W_query = self._linear(d_in, q_features, use_bias, kernel_init, bias_init, rngs)
        self.W_key = self._linear(d_in, kv_features, use_bias, kernel_init, bias_init, rngs)
        self.W_value = self._linear(d_in, kv_features, use_bias, kernel_init, bias_init, rngs)

    def _qkv(self, x: Array):
        # [batch..., T, q_features], [batch..., T, kv_features] x 2
        return self.W_query(x), self.W_key(x), self.W_value(x)


class _DropoutAttention(_Attention):
    """What the classes with a causal mask and dropout add: mode flags and a dropout stream."""

    def _init_dropout(self, *, deterministic, keep_rngs, rngs) -> None:
        self.deterministic = deterministic
        stream = None
        if keep_rngs and self.dropout > 0.0:
            try:
                stream = rngs.dropout.fork()  # nnx.Rngs falls back to its 'default' stream
            except AttributeError:
                stream = None  # neither stream: a training call must then pass rngs=
        self.rngs = nnx.data(stream)

    dropout = property(lambda self: self.config.dropout)
    is_causal = property(lambda self: self.config.is_causal)
    broadcast_dropout = property(lambda self: self.config.broadcast_dropout)

    def init_cache(self, input_shape, dtype: Any = jnp.float32, *, rolling: bool = False) -> None:
        """Creates an empty KV cache for ``decode=True`` calls (and resets a filled one).

        Args:
          input_shape: ``(batch..., capacity, d_in)``, the shape of the longest input the
            cache must hold (flax's convention); ``capacity <= context_length``.
          dtype: dtype of the cached keys and values.
          rolling: a rolling cache (:class:`jattn.kvcache.RollingKVCache`) of the last
            ``capacity`` tokens: decoding attends over a sliding window (each token sees
            itself and the ``capacity`` tokens before it) and never overflows, so a row may
            run past ``context_length`` (a chunk still holds at most ``context_length``).
        """
        name = type(self).__name__
        try:
            input_shape = tuple(input_shape)
        except TypeError:
            raise TypeError(
                f"{name}: input_shape must be a tuple (batch..., capacity, d_in), got "
                f"{input_shape!r}."
            ) from None
        if len(input_shape) < 2 or input_shape[-1] != self.d_in:
            raise ValueError(
                f"{name}: input_shape must be (batch..., capacity, d_in={self.d_in}), got "
                f"{input_shape}."
            )
        if input_shape[-2] > self.context_length:
            raise ValueError(
                f"{name}: capacity {input_shape[-2]} exceeds context_length "
                f"{self.context_length}; the module never reads more tokens than that."
            )
        num_kv_heads, head_dim = self._cache_layout()
        self.cache = nnx.Cache(
            kvcache.init_cache(
                input_shape[:-2],
                input_shape[-2],
                num_kv_heads,
                head_dim,
                dtype=dtype,
                rolling=rolling,
            )
        )

    def _cache_layout(self) -> tuple[int, int]:
        """``(num_kv_heads, head_dim)`` of the cached keys; single-head classes: ``(1, d_out)``."""
        return 1, self.d_out

    def _attend(self, queries, keys, values, *, decode, num_new, **kwargs):
        """``mu.attend``; with ``decode`` through (and updating) the KV cache."""
        if not decode:
            return mu.attend(self.config, queries, keys, values, num_new=num_new, **kwargs)
        cache = getattr(self, "cache", None)
        if cache is None:
            raise ValueError(
                f"{type(self).__name__}: decode=True needs a KV cache; call "
                "init_cache(input_shape) first, with input_shape = (batch..., capacity, d_in)."
            )
        out, updated = mu.attend(
            self.config, queries, keys, values, cache=cache.get_value(), num_new=num_new, **kwargs
        )
        cache.set_value(updated)
        return out

    def set_view(self, deterministic: bool | None = None):
        """Used by ``nnx.view``: sets ``deterministic`` when given."""
        if deterministic is not None:
            self.deterministic = deterministic

    def _dropout_setup(self, deterministic, rngs: RngsArg) -> tuple[bool, Array | None]:
        """``(deterministic, key)`` for this call; see the module docstring for the key order."""
        name = type(self).__name__
        deterministic = mu.resolve_deterministic(
            deterministic, self.deterministic, self.dropout, name
        )
        if deterministic or self.dropout == 0.0:
            return True, None
        if rngs is None:
            rngs = self.rngs
        if rngs is None:
            raise mu.missing_key_error(name, "nnx")
        if isinstance(rngs, nnx.Rngs):
            return False, rngs.dropout()
        if isinstance(rngs, nnx.RngStream):
            return False, rngs()
        if isinstance(rngs, jax.Array):
            return False, rngs
        raise TypeError(
            f"{name}: rngs must be an nnx.Rngs, an nnx.RngStream or a jax.random key, got "
            f"{type(rngs).__name__}."
        )


class SelfAttentionV1(_Attention):
    """The book's ``SelfAttention_v1``: raw weight matrices, no mask, no dropout.

    ``softmax(q kᵀ / sqrt(d_out)) v`` with ``q = x @ W_query`` etc.

    Args:
      d_in: input width.
      d_out: width of queries, keys, values and the output.
      dtype: computation dtype; None: inferred from inputs and parameters.
      param_dtype: parameter dtype.
      precision: ``jax.lax.Precision`` of the matmuls.
      attention_implementation: ``implementation`` of :func:`jattn.dot_product_attention`
        (None: automatic; ``'dense'`` for ``jax.jvp`` of an already jitted call).
        Kernels (``'cudnn'``, ``'pallas_triton'``, ``'splash'``) refuse decoding's mask.
      kernel_init: default ``uniform(1.0)``, i.e. U[0, 1) as the book's ``torch.rand``.
      rngs: ``nnx.Rngs`` for the initialization (its ``params`` stream).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        attention_implementation: str | None = None,
        kernel_init: Initializer = v1_kernel_init,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        mu.check_config(name, d_in=d_in, d_out=d_out)
        self.d_in, self.d_out = d_in, d_out
        config = mu.ModuleConfig(
            name,
            attention_implementation=attention_implementation,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            kernel_init=kernel_init,
        )
        self._init_config(config, rngs)
        shape = (d_in, d_out)
        self.W_query = nnx.Param(kernel_init(rngs.params(), shape, param_dtype))
        self.W_key = nnx.Param(kernel_init(rngs.params(), shape, param_dtype))
        self.W_value = nnx.Param(kernel_init(rngs.params(), shape, param_dtype))

    def __call__(self, x, *, return_weights: bool = False, sow_weights: bool = False):
        """Self-attention of ``x [batch..., T, d_in]``.

        Returns:
          ``[batch..., T, d_out]``; with ``return_weights`` also ``[batch..., 1, T, T]``.
        """
        x = mu.check_tokens(x, type(self).__name__, d_in=self.d_in)
        # [batch..., T, d_out] each
        queries, keys, values = (
            mu.project_raw(x, w[...], dtype=self.dtype, precision=self.precision)
            for w in (self.W_query, self.W_key, self.W_value)
        )
        return mu.attend(
            self.config,
            queries,
            keys,
            values,
            return_weights=return_weights,
            sow_into=self if sow_weights else None,
        )


class SelfAttentionV2(_Attention):
    """The book's ``SelfAttention_v2``: ``V1`` with ``nnx.Linear`` projections (optional bias).

    Args:
      d_in: input width.
      d_out: width of queries, keys, values and the output.
      qkv_bias: add a bias to the three projections.
      dtype, param_dtype, precision, kernel_init, bias_init: as ``nnx.Linear``.
      attention_implementation: as :class:`SelfAttentionV1`.
      rngs: ``nnx.Rngs`` for the initialization.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        qkv_bias: bool = False,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        attention_implementation: str | None = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        mu.check_config(name, d_in=d_in, d_out=d_out)
        self.d_in, self.d_out, self.qkv_bias = d_in, d_out, qkv_bias
        config = mu.ModuleConfig(
            name,
            attention_implementation=attention_implementation,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            kernel_init=kernel_init,
            bias_init=bias_init,
        )
        self._init_config(config, rngs)
        self._init_qkv(d_in, d_out, d_out, qkv_bias, kernel_init, bias_init, rngs)

    def __call__(self, x, *, return_weights: bool = False, sow_weights: bool = False):
        """Self-attention of ``x [batch..., T, d_in]``.

        Returns:
          ``[batch..., T, d_out]``; with ``return_weights`` also ``[batch..., 1, T, T]``.
        """
        x = mu.check_tokens(x, type(self).__name__, d_in=self.d_in)
        queries, keys, values = self._qkv(x)
        return mu.attend(
            self.config,
            queries,
            keys,
            values,
            return_weights=return_weights,
            sow_into=self if sow_weights else None,
        )


class CausalAttention(_DropoutAttention):
    """The book's ``CausalAttention``: one head, causal mask, dropout on the weights.

    Args:
      d_in: input width.
      d_out: width of queries, keys, values and the output.
      context_length: the most tokens a call may have.
      dropout: probability of dropping an attention weight, in [0, 1).
      qkv_bias: add a bias to the three projections.
      is_causal: jattn extension: False drops the causal mask (a "leaky" model).
      deterministic: True: no dropout; None: decided by the call (or ``.train()/.eval()``).
      broadcast_dropout: axes sharing one dropout mask: False (independent, as the book),
        True, ``'batch'`` or ``'heads'``.
      dtype, param_dtype, precision, kernel_init, bias_init: as ``nnx.Linear``.
      attention_implementation: as :class:`SelfAttentionV1`.
      keep_rngs: keep a dropout stream forked from ``rngs`` (see the module docstring).
      rngs: ``nnx.Rngs`` for the initialization (and the dropout stream).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
        *,
        is_causal: bool = True,
        deterministic: bool | None = None,
        broadcast_dropout: bool | str = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        attention_implementation: str | None = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        keep_rngs: bool = True,
        rngs: nnx.Rngs,
    ):
        mu.check_config(
            type(self).__name__,
            d_in=d_in,
            d_out=d_out,
            context_length=context_length,
            dropout=dropout,
        )
        self.d_in, self.d_out, self.qkv_bias = d_in, d_out, qkv_bias
        self.context_length = context_length
        config = mu.ModuleConfig(
            type(self).__name__,
            dropout=dropout,
            is_causal=is_causal,
            broadcast_dropout=broadcast_dropout,
            attention_implementation=attention_implementation,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            kernel_init=kernel_init,
            bias_init=bias_init,
        )
        self._init_config(config, rngs)
        self._init_qkv(d_in, d_out, d_out, qkv_bias, kernel_init, bias_init, rngs)
        self._init_dropout(deterministic=deterministic, keep_rngs=keep_rngs, rngs=rngs)

    def __call__(
        self,
        x,
        mask=None,
        *,
        deterministic: bool | None = None,
        rngs: RngsArg = None,
        return_weights: bool = False,
        sow_weights: bool = False,
        decode: bool = False,
        num_new=None,
    ):
        """Causal self-attention of ``x [batch..., T, d_in]``, ``T <= context_length``.

        Args:
          x: ``[batch..., T, d_in]`` float array.
          mask: optional bool, True = attend, broadcastable to ``[batch..., 1, T, T]``;
            ANDed with the causal mask.
          deterministic: True for inference (no dropout); overrides the attribute.
          rngs: dropout key source for this call (overrides the stored stream).
          return_weights: also return the pre-dropout weights ``[batch..., 1, T, T]``.
          sow_weights: sow them as ``nnx.Intermediate`` ``attention_weights``.
          decode: decode through the KV cache made by :meth:`init_cache`.
          num_new: decode mode only: int ``[batch...]``, the real tokens of each row of
            ``x`` (the rest is right padding); default all ``T``.

        Returns:
          ``[batch..., T, d_out]`` (and the weights with ``return_weights``). In decode
          mode, the mask and the weights span the cache: ``[..., T, capacity]`` (a rolling
          cache: ``[..., T, capacity + T]``, its slots before the chunk, then the chunk).
        """
        name = type(self).__name__
        x = mu.check_tokens(x, name, context_length=self.context_length, d_in=self.d_in)
        deterministic, dropout_rng = self._dropout_setup(deterministic, rngs)
        queries, keys, values = self._qkv(x)
        return self._attend(
            queries,
            keys,
            values,
            decode=decode,
            num_new=num_new,
            mask=mask,
            deterministic=deterministic,
            dropout_rng=dropout_rng,
            return_weights=return_weights,
            sow_into=self if sow_weights else None,
        )


class MultiHeadAttentionWrapper(_DropoutAttention):
    """The book's ``MultiHeadAttentionWrapper``: ``num_heads`` CausalAttention heads, concatenated.

    Output width ``num_heads * d_out``. The heads are the attributes ``heads_0``,
    ``heads_1``, ... (also listed by :attr:`heads`), as in :mod:`jattn.linen`.

    Args: as :class:`CausalAttention`, plus ``num_heads``; ``d_out`` is the width of
    *each* head. Every head forks its own dropout stream from ``rngs``.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        is_causal: bool = True,
        deterministic: bool | None = None,
        broadcast_dropout: bool | str = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        attention_implementation: str | None = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        keep_rngs: bool = True,
        rngs: nnx.Rngs,
    ):
        mu.check_config(
            type(self).__name__,
            d_in=d_in,
            d_out=d_out,
            context_length=context_length,
            dropout=dropout,
            num_heads=num_heads,
            split_d_out=False,  # the wrapper's d_out is per head
        )
        self.d_in, self.d_out, self.qkv_bias = d_in, d_out, qkv_bias
        self.context_length, self.num_heads = context_length, num_heads
        config = mu.ModuleConfig(
            type(self).__name__,
            dropout=dropout,
            is_causal=is_causal,
            broadcast_dropout=broadcast_dropout,
            attention_implementation=attention_implementation,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            kernel_init=kernel_init,
            bias_init=bias_init,
        )
        self._init_config(config, rngs)
        # The heads keep the dropout streams; the wrapper keeps only the mode flags.
        self._init_dropout(deterministic=deterministic, keep_rngs=False, rngs=rngs)
        for i in range(num_heads):
            head = CausalAttention(
                d_in,
                d_out,
                context_length,
                dropout,
                qkv_bias,
                deterministic=deterministic,
                keep_rngs=keep_rngs,
                rngs=rngs,
                **config.head_options(),
            )
            setattr(self, f"heads_{i}", head)

    def init_cache(self, input_shape, dtype: Any = jnp.float32, *, rolling: bool = False) -> None:
        """Creates (or resets) every head's KV cache; see :meth:`CausalAttention.init_cache`."""
        for head in self.heads:
            head.init_cache(input_shape, dtype, rolling=rolling)

    @property
    def heads(self) -> list[CausalAttention]:
        """The heads in order (the book's ``self.heads``)."""
        return [getattr(self, f"heads_{i}") for i in range(self.num_heads)]

    def __call__(
        self,
        x,
        mask=None,
        *,
        deterministic: bool | None = None,
        rngs: RngsArg = None,
        return_weights: bool = False,
        sow_weights: bool = False,
        decode: bool = False,
        num_new=None,
    ):
        """Runs every head on ``x [batch..., T, d_in]`` and concatenates their outputs.

        Args: as :class:`CausalAttention`. ``rngs`` given here go to every head: an
        ``nnx.Rngs`` or stream gives each head the next key in turn; a key is folded with
        the head index. Without it, each head draws from its own stored stream.
        ``decode`` and ``num_new`` go to every head (each has its own cache).

        Returns:
          ``[batch..., T, num_heads * d_out]``; with ``return_weights`` also the weights
          ``[batch..., num_heads, T, T]``.
        """
        name = type(self).__name__
        x = mu.check_tokens(x, name, context_length=self.context_length, d_in=self.d_in)
        deterministic = mu.resolve_deterministic(
            deterministic, self.deterministic, self.dropout, name
        )
        active = not deterministic and self.dropout > 0.0
        if active and rngs is None and any(head.rngs is None for head in self.heads):
            raise mu.missing_key_error(name, "nnx")
        outs = []
        for i, head in enumerate(self.heads):
            head_rngs = jax.random.fold_in(rngs, i) if isinstance(rngs, jax.Array) else rngs
            outs.append(
                head(
                    x,
                    mask,
                    deterministic=deterministic,
                    rngs=head_rngs,
                    return_weights=return_weights,
                    sow_weights=sow_weights,
                    decode=decode,
                    num_new=num_new,
                )
            )
        return mu.concat_heads(outs, return_weights)


class MultiHeadAttention(_DropoutAttention):
    """The book's ``MultiHeadAttention``: one Q/K/V projection each, split into heads.

    ``head_dim = d_out // num_heads``; the concatenated heads go through ``out_proj``
    (a Linear layer with bias, as the book). With ``num_kv_heads < num_heads`` the key and
    value projections have ``num_kv_heads * head_dim`` features and each key/value head
    serves ``num_heads // num_kv_heads`` query heads (grouped-query attention).

    Args: as :class:`CausalAttention`, plus ``num_heads`` (must divide ``d_out`` unless
    ``head_dim`` is given) and ``num_kv_heads`` (default ``num_heads``); ``qkv_bias``
    applies to the Q/K/V projections only. ``model_axis`` (tensor parallelism, not in the
    book): the mesh axis to split the heads over; the Q/K/V kernels and biases get
    ``nnx.with_partitioning`` sharding metadata by columns, ``out_proj``'s kernel by rows
    (its bias replicated). Built under ``jax.set_mesh(mesh)`` the parameters are created
    sharded (flax's eager sharding); default None: no metadata, as before.

    The book's later models (Llama 3, Qwen3) use four more keyword options, as
    :class:`jattn.linen.MultiHeadAttention`: ``head_dim`` (None: ``d_out // num_heads``;
    given: ``W_query [d_in, num_heads * head_dim]``, ``W_key``/``W_value [d_in,
    num_kv_heads * head_dim]``, ``out_proj [num_heads * head_dim, d_out]``, a KV cache of
    ``(num_kv_heads, head_dim)``, scale ``1/sqrt(head_dim)``), ``out_bias`` (False:
    ``out_proj`` without bias), ``qk_norm`` / ``qk_norm_eps`` (``q_norm`` and ``k_norm``:
    ``nnx.RMSNorm(head_dim)`` on every query and key head) and ``rope`` (a
    :class:`jattn.rope.RoPE`: queries and keys rotated after QK-norm, before the cache
    append, at the call's ``positions``).

    Score and mask modifiers (:mod:`jattn.mods`), keyword options as
    :class:`jattn.linen.MultiHeadAttention`: ``softcap`` (``cap * tanh(score / cap)`` on
    the scaled logits, after ``score_mod``), ``sinks=True`` (a learnable ``nnx.Param``
    ``sinks [num_heads]``, zeros at init, in ``param_dtype``: one attention-sink logit per
    head; ``model.sinks`` is None without it), ``score_mod`` and ``mask_mod`` (FlexAttention's
    functions, applied at every call; ``mask_mod`` is ANDed with the causal mask, so
    prefix-LM needs ``is_causal=False``). With ``decode=True`` their ``q_idx``/``kv_idx``
    are absolute positions, so decoding equals the full-sequence call.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        num_kv_heads: int | None = None,
        model_axis: str | None = None,
        head_dim: int | None = None,
        out_bias: bool = True,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
        rope: RoPE | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        is_causal: bool = True,
        deterministic: bool | None = None,
        broadcast_dropout: bool | str = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        attention_implementation: str | None = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        keep_rngs: bool = True,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        self.kv_heads = mu.check_config(
            name,
            d_in=d_in,
            d_out=d_out,
            context_length=context_length,
            dropout=dropout,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            split_d_out=head_dim is None,
        )
        heads = mu.HeadConfig.build(
            name,
            d_out=d_out,
            num_heads=num_heads,
            num_kv_heads=self.kv_heads,
            head_dim=head_dim,
            out_bias=out_bias,
            qk_norm=qk_norm,
            qk_norm_eps=qk_norm_eps,
            rope=rope,
        )
        self.d_in, self.d_out, self.qkv_bias = d_in, d_out, qkv_bias
        self.context_length, self.num_heads, self.num_kv_heads = (
            context_length,
            num_heads,
            num_kv_heads,
        )
        self.head_config, self.head_dim = heads, heads.head_dim
        config = mu.ModuleConfig(
            name,
            dropout=dropout,
            is_causal=is_causal,
            broadcast_dropout=broadcast_dropout,
            attention_implementation=attention_implementation,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            kernel_init=kernel_init,
            bias_init=bias_init,
            model_axis=model_axis,
            softcap=softcap,
            score_mod=score_mod,
            mask_mod=mask_mod,
            sinks=sinks,
        )
        self._init_config(config, rngs)
        self._init_layers(heads, kernel_init, bias_init, rngs)
        self._init_dropout(deterministic=deterministic, keep_rngs=keep_rngs, rngs=rngs)

    def _init_layers(self, heads: mu.HeadConfig, kernel_init, bias_init, rngs) -> None:
        """``W_query``, ``W_key``, ``W_value``, ``out_proj`` and (QK-norm) ``q_norm``, ``k_norm``."""
        tp = functools.partial(mu.tensor_parallel_inits, nnx.with_partitioning)
        model_axis = self.model_axis
        self._init_qkv(
            self.d_in,
            heads.q_features,
            heads.kv_features,
            self.qkv_bias,
            *tp(kernel_init, bias_init, model_axis, "columns"),
            rngs,
        )
        out_inits = tp(kernel_init, bias_init, model_axis, "rows")
        self.out_proj = self._linear(heads.q_features, self.d_out, heads.out_bias, *out_inits, rngs)
        norm = functools.partial(
            nnx.RMSNorm,
            heads.head_dim,
            epsilon=heads.qk_norm_eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )
        # nnx.data: a submodule or None, so the attribute is data either way
        self.q_norm = nnx.data(norm() if heads.qk_norm else None)
        self.k_norm = nnx.data(norm() if heads.qk_norm else None)
        sinks = None
        if self.config.sinks:
            init = nnx.initializers.zeros_init()
            if model_axis is not None:
                init = nnx.with_partitioning(init, (model_axis,))
            sinks = nnx.Param(init(rngs.params(), (heads.num_heads,), self.param_dtype))
        self.sinks = nnx.data(sinks)

    model_axis = property(lambda self: self.config.model_axis)
    out_bias = property(lambda self: self.head_config.out_bias)
    qk_norm = property(lambda self: self.head_config.qk_norm)
    qk_norm_eps = property(lambda self: self.head_config.qk_norm_eps)
    rope = property(lambda self: self.head_config.rope)
    softcap = property(lambda self: self.config.softcap)
    score_mod = property(lambda self: self.config.score_mod)
    mask_mod = property(lambda self: self.config.mask_mod)

    def _cache_layout(self) -> tuple[int, int]:
        return self.kv_heads, self.head_dim

    def __call__(
        self,
        x,
        mask=None,
        *,
        positions=None,
        segment_ids=None,
        deterministic: bool | None = None,
        rngs: RngsArg = None,
        return_weights: bool = False,
        sow_weights: bool = False,
        decode: bool = False,
        num_new=None,
    ):
        """Multi-head causal self-attention of ``x [batch..., T, d_in]``, ``T <= context_length``.

        Args:
          x: ``[batch..., T, d_in]`` float array.
          mask: optional bool, True = attend, broadcastable to ``[batch..., num_heads, T, T]``
            (e.g. :func:`jattn.masks.padding_mask`); ANDed with the causal mask.
          positions: with ``rope`` only: int ``[batch..., T]`` (broadcastable) positions of
            the tokens; default ``0 ... T-1``, with ``decode`` each row's cache length onward.
            For packed rows, each token's position in its document (``jattn.pack``).
          segment_ids: int ``[batch..., T]`` (broadcastable): the document of each token of
            packed rows (``jattn.pack(...).segment_ids``); a token attends only its own
            document. Not with ``decode``.
          deterministic: True for inference (no dropout); overrides the attribute.
          rngs: dropout key source for this call (overrides the stored stream).
          return_weights: also return the pre-dropout weights ``[batch..., num_heads, T, T]``.
          sow_weights: sow them as ``nnx.Intermediate`` ``attention_weights``.
          decode: decode through the KV cache made by :meth:`init_cache`.
          num_new: decode mode only: int ``[batch...]``, the real tokens of each row of
            ``x`` (the rest is right padding); default all ``T``.

        Returns:
          ``[batch..., T, d_out]`` (and the weights with ``return_weights``). In decode
          mode, the mask and the weights span the cache: ``[..., T, capacity]`` (a rolling
          cache: ``[..., T, capacity + T]``, its slots before the chunk, then the chunk).
        """
        name = type(self).__name__
        x = mu.check_tokens(x, name, context_length=self.context_length, d_in=self.d_in)
        deterministic, dropout_rng = self._dropout_setup(deterministic, rngs)
        heads = self.head_config
        # 1. projections: [batch..., T, num_heads * head_dim], [batch..., T, kv_heads * head_dim]
        queries, keys, values = self._qkv(x)
        # 2. QK-norm and RoPE per head, attention, heads merged: [batch..., T, H * head_dim]
        attended = self._attend(
            queries,
            keys,
            values,
            decode=decode,
            num_new=num_new,
            heads=heads,
            qk_norms=None if self.q_norm is None else (self.q_norm, self.k_norm),
            positions=positions,
            segment_ids=segment_ids,
            mask=mask,
            deterministic=deterministic,
            dropout_rng=dropout_rng,
            return_weights=return_weights,
            sow_into=self if sow_weights else None,
            sinks=None if self.sinks is None else self.sinks[...],
        )
        context, weights = attended if return_weights else (attended, None)
        # 3. output projection: [batch..., T, d_out]
        out = self.out_proj(context, out_sharding=mu.out_proj_sharding(context, self.model_axis))
        return (out, weights) if return_weights else out


# The book's own class names, as printed in chapter 3.
SelfAttention_v1 = SelfAttentionV1
SelfAttention_v2 = SelfAttentionV2
