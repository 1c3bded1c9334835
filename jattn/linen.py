"""Flax Linen modules for every attention form of chapter 3, with the book's names.

``SelfAttentionV1`` (also ``SelfAttention_v1``), ``SelfAttentionV2`` (``SelfAttention_v2``),
``CausalAttention``, ``MultiHeadAttentionWrapper`` and ``MultiHeadAttention`` take the
book's arguments without ``d_in`` (Linen infers it) and keep the book's parameter names
(``W_query``, ``W_key``, ``W_value``, ``out_proj``, ``heads_{i}``). Each class documents
its attributes and call; the modules guide (``docs/guides/modules.md``) gives the
conventions they share (``deterministic``, the dropout key, returned and sown weights,
``is_causal``), the decoding guide ``decode=True`` with its ``cache`` collection, the
fast-path guide the automatic ``attention_implementation``, and
:func:`jattn.convert.from_torch_state_dict` loads the book's weights.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

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

# Flax's defaults for Dense layers (the book's PyTorch nn.Linear uses a uniform init; load
# book weights with jattn.convert.from_torch_state_dict rather than matching initializers).
default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()
# SelfAttention_v1 draws its raw matrices with torch.rand: U[0, 1).
v1_kernel_init = nn.initializers.uniform(1.0)


def _paths(tree) -> frozenset[str]:
    return frozenset(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree))


_PARAM_PATHS: dict[tuple, frozenset[str] | None] = {}


def _param_paths(module: nn.Module, d_in: int, dtype) -> frozenset[str] | None:
    """The parameter paths ``module.init`` makes for inputs of width ``d_in`` (abstractly,
    once per module configuration); None where that cannot be told (the check is skipped)."""
    key = (repr(module), d_in, str(dtype))
    if key not in _PARAM_PATHS:
        rngs = {"params": jax.random.key(0), "dropout": jax.random.key(0)}
        x = jax.ShapeDtypeStruct((1, 1, d_in), dtype)
        try:
            variables = jax.eval_shape(lambda x: module.init(rngs, x), x)
            _PARAM_PATHS[key] = _paths(nn.meta.unbox(variables["params"]))
        except Exception:  # e.g. a mesh the module needs: no check rather than a wrong one
            _PARAM_PATHS[key] = None
    return _PARAM_PATHS[key]


class _Attention(nn.Module):
    """Keyword-only attributes of every class: numerics and initializers."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:  # flax's keywords get a clear error, not Python's
            cls.__init__ = mu.refuse_flax_keywords(cls.__dict__["__init__"])

    _: dataclasses.KW_ONLY
    dtype: Any = None
    """Computation dtype; None: inferred from the inputs and parameters."""
    param_dtype: Any = jnp.float32
    """Dtype of the parameters."""
    precision: Any = None
    """``jax.lax.Precision`` for the projections and the attention einsums."""
    kernel_init: Initializer = default_kernel_init
    """Initializer of every kernel (``[d_in, d_out]``)."""
    bias_init: Initializer = default_bias_init
    """Initializer of every bias."""
    attention_implementation: str | None = None
    """``implementation`` of :func:`jattn.dot_product_attention`: None (automatic), or a
    name such as ``'dense'`` (needed for ``jax.jvp`` of an already jitted apply at lengths
    where the automatic rule picks blockwise) or ``'blockwise'``. Also ``'cudnn'``,
    ``'pallas_triton'``, ``'splash'`` (kernels; decoding's mask refuses them)."""

    def __post_init__(self):
        self.config  # validates the options once, at construction  # noqa: B018
        super().__post_init__()

    @property
    def config(self) -> mu.ModuleConfig:
        """The attention options of this module (no mask, no dropout: the book's v1/v2)."""
        return mu.ModuleConfig(type(self).__name__, **self._numerics())

    def _numerics(self) -> dict:
        return dict(
            attention_implementation=self.attention_implementation,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
        )

    def _check_params(self, x: Array) -> None:
        """Clear errors for variables that do not fit ``x`` (flax would raise a Scope error)."""
        if self.is_initializing() or self.is_mutable_collection("params"):
            return
        name = type(self).__name__
        if not self.has_variable("params", "W_query"):
            raise ValueError(
                f"{name}: no parameter W_query in the variables. Pass what init returned, "
                "module.apply({'params': params}, x), not the params dict itself."
            )
        w_query = nn.meta.unbox(self.get_variable("params", "W_query"))
        d_in = (w_query if hasattr(w_query, "shape") else w_query["kernel"]).shape[0]
        if x.shape[-1] != d_in:
            raise mu.d_in_error(name, x.shape, d_in, params=True)
        got = _paths(nn.meta.unbox(self.variables["params"]))
        want = _param_paths(self.clone(parent=None), d_in, x.dtype)
        if want is not None and got != want:
            raise ValueError(
                f"{name}: the params do not fit this module's options: extra "
                f"{sorted(got - want) or 'none'} (flax would ignore them), missing "
                f"{sorted(want - got) or 'none'}. Build the module with the options the "
                "weights were made with (qkv_bias, out_bias, qk_norm, sinks, num_kv_heads, ...)."
            )

    def _dense(
        self, features: int, name: str, use_bias: bool, model_axis=None, split="columns",
        out_sharding=None,
    ) -> nn.Dense:  # fmt: skip
        # model_axis: annotate the kernel and bias for tensor parallelism (see mu).
        kernel_init, bias_init = mu.tensor_parallel_inits(
            nn.with_partitioning, self.kernel_init, self.bias_init, model_axis, split
        )
        return nn.Dense(
            features,
            use_bias=use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            kernel_init=kernel_init,
            bias_init=bias_init,
            dot_general=(
                None
                if out_sharding is None
                else functools.partial(jax.lax.dot_general, out_sharding=out_sharding)
            ),
            name=name,
        )

    def _qkv(self, x: Array, q_features: int, kv_features: int, use_bias: bool, model_axis=None):
        """The three projections ``W_query, W_key, W_value`` of ``x [batch..., T, d_in]``."""
        self._check_params(x)
        dense = functools.partial(self._dense, model_axis=model_axis)
        queries = dense(q_features, "W_query", use_bias)(x)  # [batch..., T, q_features]
        keys = dense(kv_features, "W_key", use_bias)(x)  # [batch..., T, kv_features]
        values = dense(kv_features, "W_value", use_bias)(x)  # [batch..., T, kv_features]
        return queries, keys, values


class _DropoutAttention(_Attention):
    """Keyword-only attributes of the classes with a causal mask and dropout."""

    _: dataclasses.KW_ONLY
    is_causal: bool = True
    """jattn extension: False drops the causal mask (a "leaky" model, for demonstrations)."""
    deterministic: bool | None = None
    """True: no dropout (inference). The call argument wins over this attribute."""
    broadcast_dropout: bool | str = False
    """Axes sharing one dropout mask: False (independent, as the book), True, 'batch', 'heads'."""
    decode: bool = False
    """Decode with a KV cache in the ``cache`` collection (see the module docstring)."""

    @property
    def config(self) -> mu.ModuleConfig:
        """The attention options of this module."""
        return mu.ModuleConfig(
            type(self).__name__,
            dropout=self.dropout,
            is_causal=self.is_causal,
            broadcast_dropout=self.broadcast_dropout,
            **self._numerics(),
        )

    def _attend(self, x, queries, keys, values, *, heads=None, num_new=None, **kwargs):
        """``mu.attend``; in decode mode through (and updating) the ``cache`` variable ``kv``."""
        num_kv_heads = 1 if heads is None else heads.num_kv_heads
        initialized = self.decode and self.has_variable("cache", "kv")
        if self.decode and not (self.is_initializing() or self.is_mutable_collection("cache")):
            raise ValueError(
                f"{type(self).__name__}: decode=True reads and extends the 'cache' collection; "
                "call apply({'params': params, 'cache': cache}, x, mutable=['cache']) with the "
                "cache from init (or use the module without decode=True)."
            )
        if self.decode and not self.is_initializing() and not initialized:
            raise ValueError(
                f"{type(self).__name__}: decode=True needs the cache init made, and the "
                "variables hold no 'cache' collection: pass apply({'params': params, 'cache': "
                "variables['cache']}, x, mutable=['cache']), with variables from init on an "
                "input [batch..., capacity, d_in]."
            )
        if self.decode:
            # Sized by the input, flax's convention: init with x [batch..., capacity, d_in].
            cache = self.variable(
                "cache",
                "kv",
                kvcache.init_cache,
                x.shape[:-2],
                x.shape[-2],
                num_kv_heads,
                keys.shape[-1] // num_kv_heads,
                dtype=keys.dtype,
            )
        if not initialized:  # not decoding, or init (which only creates the cache)
            kw = {} if self.decode else {"num_new": num_new}
            return mu.attend(self.config, queries, keys, values, heads=heads, **kwargs, **kw)
        out, cache.value = mu.attend(
            self.config,
            queries,
            keys,
            values,
            heads=heads,
            cache=cache.value,
            num_new=num_new,
            **kwargs,
        )
        return out

    def _dropout_setup(self, deterministic, dropout_rng) -> tuple[bool, Array | None]:
        """``(deterministic, key)`` for this call; raises when dropout is active without a key."""
        name = type(self).__name__
        deterministic = mu.resolve_deterministic(
            deterministic, self.deterministic, self.dropout, name
        )
        if deterministic or self.dropout == 0.0:
            return True, None
        if dropout_rng is None:
            if not self.has_rng("dropout"):
                raise mu.missing_key_error(name, "linen")
            dropout_rng = self.make_rng("dropout")
        return False, dropout_rng


class SelfAttentionV1(_Attention):
    """The book's ``SelfAttention_v1``: raw weight matrices, no mask, no dropout.

    ``softmax(q kᵀ / sqrt(d_out)) v`` with ``q = x @ W_query`` etc.

    Attributes:
      d_out: width of queries, keys, values and the output.
      kernel_init: default ``uniform(1.0)``, i.e. U[0, 1) as the book's ``torch.rand``.
    """

    d_out: int
    _: dataclasses.KW_ONLY
    kernel_init: Initializer = v1_kernel_init

    def __post_init__(self):
        mu.check_config(type(self).__name__, d_out=self.d_out)
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *, return_weights: bool = False, sow_weights: bool = False):
        """Self-attention of ``x [batch..., T, d_in]``.

        Returns:
          ``[batch..., T, d_out]``; with ``return_weights`` also ``[batch..., 1, T, T]``.
        """
        x = mu.check_tokens(x, type(self).__name__)
        self._check_params(x)
        d_in = x.shape[-1]
        shape = (d_in, self.d_out)
        # [batch..., T, d_out] each
        queries, keys, values = (
            mu.project_raw(
                x,
                self.param(name, self.kernel_init, shape, self.param_dtype),
                dtype=self.dtype,
                precision=self.precision,
            )
            for name in ("W_query", "W_key", "W_value")
        )
        return mu.attend(
            self.config,
            queries,
            keys,
            values,
            return_weights=return_weights,
            sow_into=self if sow_weights else None,
        )


class SelfAttentionV2(SelfAttentionV1):
    """The book's ``SelfAttention_v2``: ``V1`` with Dense projections (optional bias).

    Attributes:
      d_out: width of queries, keys, values and the output.
      qkv_bias: add a bias to the three projections.
    """

    qkv_bias: bool = False
    _: dataclasses.KW_ONLY
    kernel_init: Initializer = default_kernel_init

    @nn.compact
    def __call__(self, x, *, return_weights: bool = False, sow_weights: bool = False):
        """Self-attention of ``x [batch..., T, d_in]``.

        Returns:
          ``[batch..., T, d_out]``; with ``return_weights`` also ``[batch..., 1, T, T]``.
        """
        x = mu.check_tokens(x, type(self).__name__)
        queries, keys, values = self._qkv(x, self.d_out, self.d_out, self.qkv_bias)
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

    No output projection. ``d_in`` is inferred from the input.

    Attributes:
      d_out: width of queries, keys, values and the output.
      context_length: the most tokens a call may have.
      dropout: probability of dropping an attention weight, in [0, 1).
      qkv_bias: add a bias to the three projections.
    """

    d_out: int
    context_length: int
    dropout: float
    qkv_bias: bool = False

    def __post_init__(self):
        mu.check_config(
            type(self).__name__,
            d_out=self.d_out,
            context_length=self.context_length,
            dropout=self.dropout,
        )
        super().__post_init__()

    @nn.compact
    def __call__(
        self,
        x,
        mask=None,
        deterministic: bool | None = None,
        dropout_rng: Array | None = None,
        return_weights: bool = False,
        sow_weights: bool = False,
        num_new=None,
    ):
        """Causal self-attention of ``x [batch..., T, d_in]``, ``T <= context_length``.

        Args:
          x: ``[batch..., T, d_in]`` float array.
          mask: optional bool, True = attend, broadcastable to ``[batch..., 1, T, T]``;
            ANDed with the causal mask.
          deterministic: True for inference (no dropout); overrides the attribute.
          dropout_rng: dropout key; default ``self.make_rng('dropout')``.
          return_weights: also return the pre-dropout weights ``[batch..., 1, T, T]``.
          sow_weights: sow them into ``intermediates/attention_weights``.
          num_new: decode mode only: int ``[batch...]``, the real tokens of each row of
            ``x`` (the rest is right padding); default all ``T``.

        Returns:
          ``[batch..., T, d_out]`` (and the weights with ``return_weights``). In decode
          mode, the mask and the weights span the cache: ``[..., T, capacity]`` (a rolling
          cache: ``[..., T, capacity + T]``, its slots before the chunk, then the chunk).
        """
        x = mu.check_tokens(x, type(self).__name__, context_length=self.context_length)
        deterministic, dropout_rng = self._dropout_setup(deterministic, dropout_rng)
        queries, keys, values = self._qkv(x, self.d_out, self.d_out, self.qkv_bias)
        return self._attend(
            x,
            queries,
            keys,
            values,
            num_new=num_new,
            mask=mask,
            deterministic=deterministic,
            dropout_rng=dropout_rng,
            return_weights=return_weights,
            sow_into=self if sow_weights else None,
        )


class MultiHeadAttentionWrapper(_DropoutAttention):
    """The book's ``MultiHeadAttentionWrapper``: ``num_heads`` CausalAttention heads, concatenated.

    Output width ``num_heads * d_out``. The heads are the submodules ``heads_0``,
    ``heads_1``, ... (the book's ``heads.0``, ``heads.1``, ...).

    Attributes:
      d_out: width of *each* head.
      context_length: the most tokens a call may have.
      dropout: probability of dropping an attention weight, in [0, 1).
      num_heads: number of heads.
      qkv_bias: add a bias to the projections.
    """

    d_out: int
    context_length: int
    dropout: float
    num_heads: int
    qkv_bias: bool = False

    def __post_init__(self):
        mu.check_config(
            type(self).__name__,
            d_out=self.d_out,
            context_length=self.context_length,
            dropout=self.dropout,
            num_heads=self.num_heads,
            split_d_out=False,  # the wrapper's d_out is per head
        )
        super().__post_init__()

    def setup(self):
        self.heads = [
            CausalAttention(
                self.d_out,
                self.context_length,
                self.dropout,
                self.qkv_bias,
                deterministic=self.deterministic,
                decode=self.decode,
                **self.config.head_options(),
            )
            for _ in range(self.num_heads)
        ]

    def __call__(
        self,
        x,
        mask=None,
        deterministic: bool | None = None,
        dropout_rng: Array | None = None,
        return_weights: bool = False,
        sow_weights: bool = False,
        num_new=None,
    ):
        """Runs every head on ``x [batch..., T, d_in]`` and concatenates their outputs.

        Args: as :class:`CausalAttention`; a ``dropout_rng`` given here is folded with the
        head index, so each head drops independently. In decode mode each head keeps its
        own cache (``cache/heads_{i}/kv``).

        Returns:
          ``[batch..., T, num_heads * d_out]``; with ``return_weights`` also the weights
          ``[batch..., num_heads, T, T]``.
        """
        x = mu.check_tokens(x, type(self).__name__, context_length=self.context_length)
        deterministic, dropout_rng = self._dropout_setup(deterministic, dropout_rng)
        outs = [
            head(
                x,
                mask,
                deterministic=deterministic,
                dropout_rng=None if dropout_rng is None else jax.random.fold_in(dropout_rng, i),
                return_weights=return_weights,
                sow_weights=sow_weights,
                num_new=num_new,
            )
            for i, head in enumerate(self.heads)
        ]
        return mu.concat_heads(outs, return_weights)


class MultiHeadAttention(_DropoutAttention):
    """The book's ``MultiHeadAttention``: one Q/K/V projection each, split into heads.

    ``head_dim = d_out // num_heads``; the concatenated heads go through ``out_proj``
    (a Dense layer with bias, as the book). With ``num_kv_heads < num_heads`` the key and
    value projections have ``num_kv_heads * head_dim`` features and each key/value head
    serves ``num_heads // num_kv_heads`` query heads (grouped-query attention; not in the
    book).

    The book's later models (Llama 3, Qwen3) need four more options, keyword-only, whose
    defaults keep chapter 3's class and its parameter tree: ``head_dim`` (heads of their
    own width: ``W_query [d_in, num_heads * head_dim]``, ``W_key``/``W_value [d_in,
    num_kv_heads * head_dim]``, ``out_proj [num_heads * head_dim, d_out]``, scale
    ``1/sqrt(head_dim)``), ``out_bias=False``, ``qk_norm`` (submodules ``q_norm`` and
    ``k_norm``: RMSNorm over ``head_dim``, parameter ``scale [head_dim]``, applied to every
    head after the split) and ``rope`` (queries and keys rotated after QK-norm, before the
    KV-cache append, at the call's ``positions``).

    Attributes:
      d_out: output width (and, by default, width of the query projection).
      context_length: the most tokens a call may have.
      dropout: probability of dropping an attention weight, in [0, 1).
      num_heads: number of query heads; must divide ``d_out`` unless ``head_dim`` is given.
      qkv_bias: add a bias to the Q/K/V projections.
      num_kv_heads: number of key/value heads (GQA); default ``num_heads``.
      model_axis: tensor parallelism (not in the book): the mesh axis to split the heads
        over. The Q/K/V kernels ``[d_in, heads * head_dim]`` and biases are partitioned
        by columns, ``out_proj``'s kernel by rows (its bias replicated), through
        ``nn.with_partitioning``: ``init`` returns ``nn.Partitioned`` boxes whose
        ``nn.get_partition_spec`` gives the shardings. Default None: no annotations,
        plain arrays. Pick a head count divisible by the axis size.
      head_dim: features per head; None: ``d_out // num_heads`` (the book).
      out_bias: ``out_proj`` has a bias (the book's chapter 3: True; Llama 3 / Qwen3: False).
      qk_norm: RMSNorm on every query and key head (Qwen3).
      qk_norm_eps: epsilon of those RMSNorms (> 0).
      rope: a :class:`jattn.rope.RoPE` (Llama 3 / Qwen3), or None; needs an even head_dim.
      softcap: soft-cap the scaled logits at this value, ``cap * tanh(score / cap)`` (Gemma
        2 uses 50.0), or None. Applied after ``score_mod``.
      sinks: True: a learnable parameter ``sinks [num_heads]`` (zeros at init, in
        ``param_dtype``; partitioned over ``model_axis``): one attention-sink logit per
        head in every row's softmax (gpt-oss). Load trained values into the parameter
        tree as any other parameter.
      score_mod: a ``score_mod(score, b, h, q_idx, kv_idx)`` for every call
        (:mod:`jattn.mods`, e.g. ``mods.alibi(mods.alibi_slopes(num_heads))``), or None.
      mask_mod: a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` ANDed with the causal mask,
        e.g. ``mods.sliding_window(4096)``; for prefix-LM (keys after the query visible)
        build the module with ``is_causal=False``.

    In decode mode the modifiers' ``q_idx``/``kv_idx`` are absolute positions (each row's
    cache length onward), so decoding equals the full-sequence call.
    """

    d_out: int
    context_length: int
    dropout: float
    num_heads: int
    qkv_bias: bool = False
    _: dataclasses.KW_ONLY
    num_kv_heads: int | None = None
    model_axis: str | None = None
    head_dim: int | None = None
    out_bias: bool = True
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    rope: RoPE | None = None
    softcap: float | None = None
    sinks: bool = False
    score_mod: Callable | None = None
    mask_mod: Callable | None = None

    def __post_init__(self):
        mu.check_config(
            type(self).__name__,
            d_out=self.d_out,
            context_length=self.context_length,
            dropout=self.dropout,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            split_d_out=self.head_dim is None,
        )
        self.head_config  # validates the head options once  # noqa: B018
        super().__post_init__()

    @property
    def config(self) -> mu.ModuleConfig:
        """The attention options of this module (with ``model_axis`` and the modifiers)."""
        return dataclasses.replace(
            super().config,
            model_axis=self.model_axis,
            softcap=self.softcap,
            score_mod=self.score_mod,
            mask_mod=self.mask_mod,
            sinks=self.sinks,
        )

    @property
    def head_config(self) -> mu.HeadConfig:
        """The heads' layout and what happens to queries and keys (resolved ``head_dim``)."""
        return mu.HeadConfig.build(
            type(self).__name__,
            d_out=self.d_out,
            num_heads=self.num_heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            out_bias=self.out_bias,
            qk_norm=self.qk_norm,
            qk_norm_eps=self.qk_norm_eps,
            rope=self.rope,
        )

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads actually used (``num_kv_heads`` or ``num_heads``)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def _qk_norms(self, heads: mu.HeadConfig):
        """``(q_norm, k_norm)`` submodules (RMSNorm over head_dim), or None."""
        if not heads.qk_norm:
            return None
        norm = functools.partial(
            nn.RMSNorm, epsilon=heads.qk_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype
        )
        return norm(name="q_norm"), norm(name="k_norm")

    def _sinks_param(self, heads: mu.HeadConfig) -> Array | None:
        """The ``sinks`` parameter ``[num_heads]`` (zeros at init), or None."""
        if not self.sinks:
            return None
        init = nn.initializers.zeros_init()
        if self.model_axis is not None:
            init = nn.with_partitioning(init, (self.model_axis,))
        return self.param("sinks", init, (heads.num_heads,), self.param_dtype)

    @nn.compact
    def __call__(
        self,
        x,
        mask=None,
        deterministic: bool | None = None,
        dropout_rng: Array | None = None,
        return_weights: bool = False,
        sow_weights: bool = False,
        num_new=None,
        positions=None,
        segment_ids=None,
    ):
        """Multi-head causal self-attention of ``x [batch..., T, d_in]``, ``T <= context_length``.

        Args:
          x: ``[batch..., T, d_in]`` float array.
          mask: optional bool, True = attend, broadcastable to ``[batch..., num_heads, T, T]``
            (e.g. :func:`jattn.masks.padding_mask`); ANDed with the causal mask.
          deterministic: True for inference (no dropout); overrides the attribute.
          dropout_rng: dropout key; default ``self.make_rng('dropout')``.
          return_weights: also return the pre-dropout weights ``[batch..., num_heads, T, T]``.
          sow_weights: sow them into ``intermediates/attention_weights``.
          num_new: decode mode only: int ``[batch...]``, the real tokens of each row of
            ``x`` (the rest is right padding); default all ``T``.
          positions: with ``rope`` only: int ``[batch..., T]`` (broadcastable) positions of
            the tokens; default ``0 ... T-1``, in decode mode each row's cache length onward.
            For packed rows, each token's position in its document (``jattn.pack``).
          segment_ids: int ``[batch..., T]`` (broadcastable): the document of each token of
            packed rows (``jattn.pack(...).segment_ids``); a token attends only its own
            document. Not in decode mode.

        Returns:
          ``[batch..., T, d_out]`` (and the weights with ``return_weights``). In decode
          mode, the mask and the weights span the cache: ``[..., T, capacity]`` (a rolling
          cache: ``[..., T, capacity + T]``, its slots before the chunk, then the chunk).
        """
        x = mu.check_tokens(x, type(self).__name__, context_length=self.context_length)
        deterministic, dropout_rng = self._dropout_setup(deterministic, dropout_rng)
        heads = self.head_config
        # 1. projections: [batch..., T, num_heads * head_dim], [batch..., T, kv_heads * head_dim]
        queries, keys, values = self._qkv(
            x, heads.q_features, heads.kv_features, self.qkv_bias, self.model_axis
        )
        # 2. QK-norm and RoPE per head, attention, heads merged: [batch..., T, H * head_dim]
        attended = self._attend(
            x,
            queries,
            keys,
            values,
            heads=heads,
            qk_norms=self._qk_norms(heads),
            positions=positions,
            segment_ids=segment_ids,
            num_new=num_new,
            mask=mask,
            deterministic=deterministic,
            dropout_rng=dropout_rng,
            return_weights=return_weights,
            sow_into=self if sow_weights else None,
            sinks=self._sinks_param(heads),
        )
        context, weights = attended if return_weights else (attended, None)
        # 3. output projection: [batch..., T, d_out]
        sharding = mu.out_proj_sharding(context, self.model_axis)
        out_proj = self._dense(
            self.d_out, "out_proj", heads.out_bias, self.model_axis, "rows", sharding
        )
        out = out_proj(context)
        return (out, weights) if return_weights else out


# The book's own class names, as printed in chapter 3.
SelfAttention_v1 = SelfAttentionV1
SelfAttention_v2 = SelfAttentionV2
