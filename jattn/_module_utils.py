"""What the Linen and NNX modules share: checks, head reshapes, the one call into the core.

``jattn.linen`` and ``jattn.nnx`` hold parameters and projections only; every step that
does not depend on the Flax API lives here once, so the two APIs cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _util, functional, kvcache, mods
from jattn import rope as rope_lib

Array = jax.Array


# ----------------------------------------------------------------------------------------
# Construction-time checks
# ----------------------------------------------------------------------------------------


def _check_positive_int(value, name: str, cls_name: str) -> int:
    return _checks.size(value, name, where=f"{cls_name}: ")


def check_dropout(dropout, cls_name: str) -> float:
    """Validates a dropout rate: a number in [0, 1) (the probability of *dropping*)."""
    _checks.rate(dropout, "dropout", where=f"{cls_name}: ")
    return float(dropout)


def check_config(
    cls_name: str,
    *,
    d_out,
    d_in=None,
    context_length=None,
    dropout=0.0,
    num_heads=1,
    num_kv_heads=None,
    split_d_out: bool = True,
) -> int:
    """Validates the book's constructor arguments; returns the number of key/value heads.

    ``split_d_out``: d_out is split across the heads (MultiHeadAttention), so it must be
    divisible by num_heads; the wrapper's d_out is per head (False).

    Raises:
      TypeError: a size that is not an int, a dropout that is not a number.
      ValueError: a size < 1, ``d_out % num_heads != 0``, ``num_heads % num_kv_heads != 0``,
        a dropout rate outside [0, 1).
    """
    d_out = _check_positive_int(d_out, "d_out", cls_name)
    if d_in is not None:  # NNX modules get d_in at construction
        _check_positive_int(d_in, "d_in", cls_name)
    num_heads = _check_positive_int(num_heads, "num_heads", cls_name)
    if context_length is not None:
        _check_positive_int(context_length, "context_length", cls_name)
    check_dropout(dropout, cls_name)
    if split_d_out and d_out % num_heads:
        raise ValueError(
            f"{cls_name}: d_out ({d_out}) must be divisible by num_heads ({num_heads}): each "
            f"head gets d_out // num_heads features. Pick d_out a multiple of num_heads."
        )
    if num_kv_heads is None:
        return num_heads
    num_kv_heads = _check_positive_int(num_kv_heads, "num_kv_heads", cls_name)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{cls_name}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads}): each key/value head serves num_heads // num_kv_heads query heads."
        )
    return num_kv_heads


def check_numerics(cls_name: str, dtype, param_dtype, attention_implementation=None) -> None:
    """Validates ``dtype`` (None or floating), ``param_dtype`` (floating) and
    ``attention_implementation`` (None or a name of :data:`jattn._checks.IMPLEMENTATIONS`).

    Raises:
      TypeError: a dtype that is not floating (or not a dtype).
      ValueError: float64 while ``jax_enable_x64`` is off; an unknown implementation.
    """
    if dtype is not None:
        _checks.float_dtype(dtype, f"{cls_name}: dtype")
    _checks.float_dtype(param_dtype, f"{cls_name}: param_dtype")
    _checks.implementation(attention_implementation, f"{cls_name}: attention_implementation")


@dataclasses.dataclass(frozen=True)
class ModuleConfig:
    """The attention options every Linen and NNX class shares, validated once at construction.

    The classes keep the book's constructor arguments (``d_in``, ``d_out``,
    ``context_length``, ``dropout``, ``num_heads``, ``qkv_bias``) and build one of these from
    the rest; :func:`attend` reads the call's settings from it, and the wrapper hands it to
    its heads.

    Attributes:
      cls_name: the class, for error messages.
      dropout: probability of dropping an attention weight, in [0, 1).
      is_causal: AND the causal mask (False for the book's v1/v2, which have none).
      broadcast_dropout: axes sharing one dropout mask (see ``dot_product_attention``).
      attention_implementation: the core's ``implementation`` (None: automatic).
      dtype: computation dtype (None: inferred).
      param_dtype: dtype of the parameters.
      precision: ``jax.lax.Precision`` of the projections and the attention products.
      kernel_init: initializer of every kernel.
      bias_init: initializer of every bias.
      model_axis: mesh axis the heads are split over (tensor parallelism), or None.
      softcap: soft-cap the scaled logits, ``cap * tanh(score / cap)`` (Gemma 2), or None.
      score_mod: a ``score_mod(score, b, h, q_idx, kv_idx)`` (:mod:`jattn.mods`), or None;
        with ``softcap`` the cap applies after it (:meth:`score_modifier`).
      mask_mod: a ``mask_mod(b, h, q_idx, kv_idx) -> bool``, ANDed with the other masks.
      sinks: the module has a learnable ``sinks`` parameter ``[num_heads]`` (attention-sink
        logits, gpt-oss), passed to every call.
    """

    cls_name: str
    dropout: float = 0.0
    is_causal: bool = False
    broadcast_dropout: bool | str = False
    attention_implementation: str | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = None
    bias_init: Any = None
    model_axis: str | None = None
    softcap: float | None = None
    score_mod: Any = None
    mask_mod: Any = None
    sinks: bool = False

    def __post_init__(self):
        name = self.cls_name
        _check_modifier_options(self)
        object.__setattr__(self, "dropout", check_dropout(self.dropout, name))
        _checks.flag(self.is_causal, f"{name}: is_causal")
        _checks.broadcast_dropout(self.broadcast_dropout)
        check_numerics(name, self.dtype, self.param_dtype, self.attention_implementation)
        if self.model_axis is not None:
            if not isinstance(self.model_axis, str):
                raise TypeError(
                    f"model_axis must be the name of a mesh axis (a str) or None, got "
                    f"{self.model_axis!r}."
                )
            _check_no_user_annotations(self)

    def score_modifier(self):
        """The calls' ``score_mod``: ``score_mod``, then soft-capping (None: neither).

        The cap comes last, as Gemma 2 caps the logits after everything else is added, so
        capped logits stay within ``(-cap, cap)`` whatever ``score_mod`` adds. A bare
        ``softcap`` stays a :func:`jattn.mods.softcap` (kernels with native soft-capping
        take it).
        """
        cap = None if self.softcap is None else mods.softcap(self.softcap)
        if cap is None or self.score_mod is None:
            return cap if self.score_mod is None else self.score_mod
        return mods.compose(self.score_mod, cap)

    def head_options(self) -> dict:
        """The keyword options of a single-head class built from this configuration (the
        wrapper's heads), in the classes' own argument names."""
        return {
            "is_causal": self.is_causal,
            "broadcast_dropout": self.broadcast_dropout,
            "attention_implementation": self.attention_implementation,
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "precision": self.precision,
            "kernel_init": self.kernel_init,
            "bias_init": self.bias_init,
        }


@functools.lru_cache(maxsize=64)
def _annotated(init) -> bool:
    """Whether an initializer carries sharding annotations (``nn.with_partitioning``,
    ``nn.with_logical_partitioning``, ``nnx.with_partitioning``): it returns a box, not an
    array. Called once per initializer on a ``[1, 1]`` shape."""
    with jax.ensure_compile_time_eval():
        out = init(jax.random.key(0), (1, 1), jnp.float32)
    return not isinstance(out, (jax.Array, np.ndarray))


def _check_no_user_annotations(config: ModuleConfig) -> None:
    """``model_axis`` annotates every kernel and bias itself: refuse initializers that
    already carry annotations rather than silently override them."""
    for option in ("kernel_init", "bias_init"):
        init = getattr(config, option)
        if init is not None and _annotated(init):
            raise ValueError(
                f"{config.cls_name}: {option} carries sharding annotations and model_axis= "
                f"would annotate the same parameters. Use one: model_axis={config.model_axis!r} "
                "(Megatron-style heads, jattn's specs) or your own annotations with "
                "model_axis=None (they then apply to every kernel, out_proj's included)."
            )


def _check_modifier_options(config: ModuleConfig) -> None:
    """Validates ``softcap``, ``score_mod``, ``mask_mod`` and ``sinks`` of a module config.

    The modifiers' signatures and outputs are checked at each call (by
    :func:`jattn.dot_product_attention`, which knows the shapes).
    """
    name, cap = config.cls_name, config.softcap
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real):
            raise TypeError(f"{name}: softcap must be a float > 0 or None, got {cap!r}.")
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(
                f"{name}: softcap must be > 0 and finite (Gemma 2 uses 50.0), got {cap}."
            )
    for option in ("score_mod", "mask_mod"):
        fn = getattr(config, option)
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{name}: {option} must be a function (see jattn.mods) or None, got "
                f"{type(fn).__name__}."
            )
    _checks.flag(config.sinks, f"{name}: sinks")


def _check_eps(value, cls_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{cls_name}: qk_norm_eps must be a float > 0, got {value!r}.")
    if not 0.0 < float(value) < float("inf"):
        raise ValueError(
            f"{cls_name}: qk_norm_eps must be > 0 and finite, got {value}: it keeps the "
            "RMSNorm of a zero query or key from dividing by zero (Qwen3 uses 1e-6)."
        )
    return float(value)


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """MultiHeadAttention's heads: their layout, and what happens to queries and keys per head.

    The options of the book's later models (Llama 3, Qwen3) that chapter 3's class lacks.
    Built once by :meth:`build` at construction; :func:`attend` reads it.

    Attributes:
      cls_name: the class, for error messages.
      num_heads: query heads.
      num_kv_heads: key/value heads (a divisor of ``num_heads``).
      head_dim: features per head (queries, keys and values); scale ``1/sqrt(head_dim)``.
      out_bias: ``out_proj`` has a bias.
      qk_norm: RMSNorm over ``head_dim`` on every query and key head (submodules
        ``q_norm``, ``k_norm``), after the head split and before RoPE.
      qk_norm_eps: the epsilon of those RMSNorms.
      rope: rotate queries and keys (after QK-norm, before the cache append), or None.
    """

    cls_name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    out_bias: bool = True
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    rope: rope_lib.RoPE | None = None

    @classmethod
    def build(
        cls,
        cls_name: str,
        *,
        d_out: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim=None,
        out_bias=True,
        qk_norm=False,
        qk_norm_eps=1e-6,
        rope=None,
    ) -> HeadConfig:
        """Checks the options (sizes already checked by :func:`check_config`).

        ``head_dim=None`` means ``d_out // num_heads``.

        Raises:
          TypeError: a head_dim that is not an int, flags that are not bools, a
            ``qk_norm_eps`` that is not a number, a ``rope`` that is not a
            :class:`jattn.rope.RoPE`.
          ValueError: ``head_dim < 1``, ``qk_norm_eps <= 0``, an odd head_dim with ``rope``.
        """
        head_dim = d_out // num_heads if head_dim is None else head_dim
        head_dim = _check_positive_int(head_dim, "head_dim", cls_name)
        _checks.flag(out_bias, f"{cls_name}: out_bias")
        _checks.flag(qk_norm, f"{cls_name}: qk_norm")
        eps = _check_eps(qk_norm_eps, cls_name)
        if rope is not None and not isinstance(rope, rope_lib.RoPE):
            raise TypeError(
                f"{cls_name}: rope must be a jattn.rope.RoPE (e.g. RoPE(theta_base=10_000.0)) "
                f"or None, got {type(rope).__name__}."
            )
        if rope is not None and head_dim % 2:
            raise ValueError(
                f"{cls_name}: head_dim ({head_dim}) must be even with rope=: RoPE rotates pairs "
                "of features. Pick an even head_dim (or d_out // num_heads)."
            )
        return cls(
            cls_name, num_heads, num_kv_heads, head_dim, bool(out_bias), bool(qk_norm), eps, rope
        )

    @property
    def q_features(self) -> int:
        """Width of the query projection (and of ``out_proj``'s input)."""
        return self.num_heads * self.head_dim

    @property
    def kv_features(self) -> int:
        """Width of the key and value projections."""
        return self.num_kv_heads * self.head_dim


def tensor_parallel_inits(with_partitioning, kernel_init, bias_init, model_axis, split: str):
    """A projection's ``(kernel_init, bias_init)``, annotated for tensor parallelism.

    Megatron-style: Q/K/V kernels ``[d_in, heads * head_dim]`` are split by columns
    (``split='columns'``: each device holds whole heads when ``model_axis`` divides the
    head count), the output projection by rows (``split='rows'``: its input features are
    the heads), so attention needs no communication and ``out_proj`` one all-reduce.

    Args:
      with_partitioning: ``flax.linen.with_partitioning`` or ``flax.nnx.with_partitioning``.
      kernel_init: the kernel initializer.
      bias_init: the bias initializer.
      model_axis: mesh axis name to split over, or None (initializers returned unchanged:
        no annotation, the parameter tree is plain arrays).
      split: ``'columns'`` or ``'rows'``.

    ``model_axis`` was checked by :class:`ModuleConfig`.
    """
    if model_axis is None:
        return kernel_init, bias_init
    # kernel [d_in, d_out] and bias [d_out]
    if split == "columns":
        kernel_names, bias_names = (None, model_axis), (model_axis,)
    else:
        kernel_names, bias_names = (model_axis, None), (None,)
    return with_partitioning(kernel_init, kernel_names), with_partitioning(bias_init, bias_names)


# flax's attention-module keywords that jattn's classes spell the book's way.
FLAX_KEYWORDS = {
    "in_features": "d_in",
    "qkv_features": "d_out (or num_heads * head_dim with head_dim=)",
    "out_features": "d_out",
    "dropout_rate": "dropout",
    "use_bias": "qkv_bias (and out_bias)",
    "normalize_qk": "qk_norm",
    "attention_fn": "attention_implementation",
    "in_kv_features": "nothing: jattn's modules are self-attention",
}


def flax_keyword_error(cls_name: str, given, signature: str) -> TypeError | None:
    """The error for flax's keywords given to a jattn class, or None when there are none."""
    flax_names = [name for name in given if name in FLAX_KEYWORDS]
    if not flax_names:
        return None
    renames = "; ".join(f"{name} -> {FLAX_KEYWORDS[name]}" for name in flax_names)
    return TypeError(
        f"{cls_name} takes the book's arguments, not flax's: {cls_name}{signature}. "
        f"flax's keywords map as {renames}. Unlike flax's attention modules it is causal by "
        "default (is_causal=False for none) and its parameters are W_query, W_key, W_value, "
        "out_proj (jattn.convert.from_flax_attention converts a flax checkpoint)."
    )


def refuse_flax_keywords(init):
    """``init`` (a class's ``__init__``) that answers flax's keywords with
    :func:`flax_keyword_error` instead of Python's bare "unexpected keyword argument"."""
    params = inspect.signature(init).parameters.values()
    positional = [
        p.name if p.default is p.empty else f"{p.name}={p.default!r}"
        for p in params
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"
    ]
    signature = f"({', '.join([*positional, '*', '...'])})"

    @functools.wraps(init)
    def init_refusing_flax_keywords(self, *args, **kwargs):
        error = flax_keyword_error(type(self).__name__, kwargs, signature)
        if error is not None:
            raise error
        init(self, *args, **kwargs)

    return init_refusing_flax_keywords


def out_proj_sharding(context: Array, model_axis: str | None):
    """``out_sharding`` of the out projection on a mesh with explicit axes, else None.

    ``context [batch..., T, H * head_dim]`` is split over ``model_axis`` on its features,
    and so are the rows of ``out_proj``'s kernel: the product contracts a sharded axis,
    which explicit sharding (``jax.make_mesh``'s default) refuses to guess about. The
    output keeps the context's batch/token sharding with its features replicated (the
    partial sums all-reduced), as Megatron's row-parallel layer. With automatic axes (or
    no mesh) jax infers it: None.
    """
    if model_axis is None:
        return None
    sharding = getattr(jax.typeof(context), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    axis_types = getattr(mesh, "axis_types", ())
    if not any(t == jax.sharding.AxisType.Explicit for t in axis_types):
        return None
    spec = _util.axis_specs(context)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec[:-1], None))


# ----------------------------------------------------------------------------------------
# Call-time checks
# ----------------------------------------------------------------------------------------


def check_tokens(x, cls_name: str, *, context_length: int | None = None, d_in: int | None = None):
    """Validates module inputs ``x [batch..., num_tokens, d_in]`` and returns them as an array.

    Raises:
      TypeError: a non-float input (token ids must be embedded first).
      ValueError: rank < 2, no tokens or features, more tokens than ``context_length``, a last
        axis other than ``d_in``.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{cls_name}: x must be a float array [batch..., num_tokens, d_in], got dtype "
            f"{x.dtype}. Token ids must go through an embedding first."
        )
    if x.ndim < 2:
        raise ValueError(
            f"{cls_name}: x must have shape [batch..., num_tokens, d_in] (rank >= 2), got shape "
            f"{x.shape}."
        )
    num_tokens = x.shape[-2]
    if num_tokens == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"{cls_name}: x must hold at least one token of at least one feature, got shape "
            f"{x.shape}."
        )
    if context_length is not None and num_tokens > context_length:
        raise ValueError(
            f"{cls_name}: x has {num_tokens} tokens (axis -2 of shape {x.shape}) but "
            f"context_length is {context_length}. Truncate the input to the last "
            f"{context_length} tokens or build the module with a larger context_length."
        )
    if d_in is not None and x.shape[-1] != d_in:
        raise d_in_error(cls_name, x.shape, d_in)
    return x


def d_in_error(cls_name: str, shape: tuple[int, ...], d_in: int, *, params: bool = False):
    """The ValueError for inputs whose last axis is not ``d_in``, saying so when the axes
    look swapped (``[batch..., d_in, T]``); ``params``: ``d_in`` comes from the parameters."""
    if params:
        what = (
            f"x has {shape[-1]} features on its last axis (shape {shape}), but the parameters "
            f"were initialized for d_in = {d_in}."
        )
    else:
        what = f"x must have d_in = {d_in} features on its last axis, got shape {shape}."
    if shape[-2] == d_in:
        what += (
            f" Its axis -2 has {d_in}: is it [batch..., d_in, T]? jattn's modules take "
            "[batch..., T, d_in], as the book's: pass jnp.swapaxes(x, -1, -2)."
        )
    return ValueError(f"{cls_name}: {what}")


def resolve_deterministic(call, attribute, dropout: float, cls_name: str) -> bool:
    """The ``deterministic`` a call runs with: the call argument if given, else the attribute.

    A module whose dropout rate is 0 never needs it (it behaves the same either way).

    Raises:
      ValueError: dropout > 0 and ``deterministic`` given neither at the call nor as attribute.
    """
    if call is not None:
        return bool(call)
    if attribute is not None:
        return bool(attribute)
    if dropout == 0.0:
        return True
    raise ValueError(
        f"{cls_name} has dropout={dropout} but no `deterministic` was given. Pass "
        "deterministic=False (training, dropout on) or deterministic=True (inference) to the "
        "call or to the constructor (NNX modules: also .train() / .eval())."
    )


def missing_key_error(cls_name: str, api: str) -> ValueError:
    """The error for a training call with dropout active and no random key anywhere."""
    if api == "linen":
        ways = (
            "pass `rngs={'dropout': key}` to `module.apply(...)` (or to `init`), or pass "
            "`dropout_rng=key` to the call"
        )
    else:
        ways = (
            "pass `rngs=nnx.Rngs(dropout=seed)` to the constructor (any nnx.Rngs with a "
            "`dropout` or `default` stream: nnx.Rngs(params=0) has neither, so the module "
            "kept no dropout stream), or pass `rngs=` (an nnx.Rngs, RngStream or key) to the "
            "call"
        )
    return ValueError(
        f"{cls_name}: dropout is active (rate > 0, deterministic=False) but no random key was "
        f"given. Either {ways}; or run deterministically (deterministic=True"
        + (", or .eval()" if api == "nnx" else "")
        + ")."
    )


# ----------------------------------------------------------------------------------------
# Computation
# ----------------------------------------------------------------------------------------


def project_raw(x: Array, kernel: Array, *, dtype, precision) -> Array:
    """``x @ kernel`` for the book's raw weight matrices (SelfAttention_v1), as flax's Dense does.

    Args:
      x: ``[batch..., T, d_in]``.
      kernel: ``[d_in, d_out]``.
      dtype: computation dtype, or None for the promoted dtype of ``x`` and ``kernel``.
      precision: ``jax.lax.Precision`` of the matmul.

    Returns:
      ``[batch..., T, d_out]``.
    """
    dtype = dtype or jnp.result_type(x, kernel)
    # [batch..., T, d_in] x [d_in, d_out] -> [batch..., T, d_out]
    return jnp.einsum("...ti,io->...to", x.astype(dtype), kernel.astype(dtype), precision=precision)


def split_heads(x: Array, num_heads: int) -> Array:
    """``[batch..., T, num_heads * head_dim]`` -> ``[batch..., T, num_heads, head_dim]``.

    Head ``h`` holds features ``h * head_dim ... (h + 1) * head_dim - 1``, as the book's
    ``view(b, num_tokens, num_heads, head_dim)``.
    """
    return x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads)


def merge_heads(x: Array) -> Array:
    """``[batch..., T, num_heads, head_dim]`` -> ``[batch..., T, num_heads * head_dim]``."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def concat_heads(outs: list, return_weights: bool):
    """The wrapper's ``torch.cat([head(x) for head in self.heads], dim=-1)``.

    Args:
      outs: per head, ``[batch..., T, d_out]`` or (with ``return_weights``) a pair of it and
        the head's weights ``[batch..., 1, T, T]``.
      return_weights: whether ``outs`` holds pairs.

    Returns:
      ``[batch..., T, num_heads * d_out]``, and with ``return_weights`` the weights
      ``[batch..., num_heads, T, T]``.
    """
    if not return_weights:
        return jnp.concatenate(outs, axis=-1)
    contexts, weights = zip(*outs, strict=True)
    return jnp.concatenate(contexts, axis=-1), jnp.concatenate(weights, axis=-3)


def check_positions(positions, heads: HeadConfig | None, cls_name: str, batch_shape, length):
    """Validates the call's ``positions`` (int, broadcastable to ``[batch..., T]``), or None.

    Raises:
      ValueError: positions for a module without ``rope=`` (they would be ignored), or a
        shape that does not broadcast to ``[batch..., T]``.
      TypeError: positions that are not integers.
    """
    if positions is None:
        return None
    if heads is None or heads.rope is None:
        raise ValueError(
            f"{cls_name}: positions is only used with rope= (it sets the rotation of each "
            "token); this module has no RoPE. Build it with rope=jattn.rope.RoPE(...) or drop "
            "positions."
        )
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(
            f"{cls_name}: positions must hold integers (token positions), got dtype "
            f"{positions.dtype}."
        )
    target = (*batch_shape, length)
    ok = 1 <= positions.ndim <= len(target) and positions.shape[-1] == length
    try:
        ok = ok and jnp.broadcast_shapes(positions.shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{cls_name}: positions must be int [batch..., T] broadcastable to {target} (one "
            f"position per token of x), got shape {positions.shape}."
        )
    return positions


def check_segment_ids(segment_ids, cls_name: str, batch_shape, length, decoding: bool):
    """Validates the call's ``segment_ids`` (int, broadcastable to ``[batch..., T]``), or None.

    Returns them broadcast to ``[batch..., T]`` (the core takes exact shapes).

    Raises:
      TypeError: ids that are not integers.
      ValueError: a shape that does not broadcast to ``[batch..., T]``, or ids in decode
        mode (a KV cache row is one sequence; pack for training and prefill only).
    """
    if segment_ids is None:
        return None
    if decoding:
        raise ValueError(
            f"{cls_name}: segment_ids (packed documents) cannot be used in decode mode: each "
            "KV-cache row holds one sequence. Decode documents in rows of their own."
        )
    segment_ids = jnp.asarray(segment_ids)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(
            f"{cls_name}: segment_ids must hold integers (the document of each token), got "
            f"dtype {segment_ids.dtype}."
        )
    target = (*batch_shape, length)
    ok = 1 <= segment_ids.ndim <= len(target) and segment_ids.shape[-1] == length
    try:
        ok = ok and jnp.broadcast_shapes(segment_ids.shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{cls_name}: segment_ids must be int [batch..., T] broadcastable to {target} (one "
            f"document id per token of x, e.g. jattn.pack(...).segment_ids), got shape "
            f"{segment_ids.shape}."
        )
    return jnp.broadcast_to(segment_ids, target)


def prepare_qk(heads: HeadConfig, q: Array, k: Array, *, qk_norms=None, positions=None):
    """QK-norm, then RoPE: what happens to split queries and keys before attention.

    Args:
      heads: the module's :class:`HeadConfig`.
      q: ``[batch..., T, num_heads, head_dim]``.
      k: ``[batch..., T, num_kv_heads, head_dim]``.
      qk_norms: ``(q_norm, k_norm)``, the module's RMSNorms over ``head_dim`` (with
        ``heads.qk_norm``).
      positions: int ``[batch'..., T]`` (batch dims broadcastable), required with
        ``heads.rope``.

    Returns:
      ``(q, k)`` in their input dtypes.
    """
    if heads.qk_norm:
        q_norm, k_norm = qk_norms
        # [batch..., T, heads, head_dim]: normalized over head_dim, one scale for all heads
        q, k = q_norm(q).astype(q.dtype), k_norm(k).astype(k.dtype)
    if heads.rope is not None:
        q, k = heads.rope(q, positions), heads.rope(k, positions)
    return q, k


def _rope_positions(positions, cache, length: int) -> Array:
    """The call's positions, else ``0 ... T-1``, else (decoding) each row's cache length on."""
    if positions is not None:
        return positions
    if cache is None:
        return jnp.arange(length, dtype=jnp.int32)  # [T], broadcast over the batch
    # [batch..., T]: token t of row b at lengths[b] + t (a rolling cache counts every token)
    return rope_lib.positions_from_lengths(cache.lengths, length)


def attend(
    config: ModuleConfig,
    queries: Array,
    keys: Array,
    values: Array,
    *,
    heads: HeadConfig | None = None,
    qk_norms=None,
    positions=None,
    segment_ids=None,
    mask=None,
    deterministic: bool = True,
    dropout_rng: Array | None = None,
    return_weights: bool = False,
    sow_into: Any = None,
    cache: kvcache.KVCache | kvcache.RollingKVCache | None = None,
    num_new=None,
    sinks: Array | None = None,
):
    """Projected features in, attended features out: the modules' one call into the core.

    Args:
      config: the calling module's :class:`ModuleConfig`.
      queries: ``[batch..., T, num_heads * head_dim]``.
      keys: ``[batch..., T, num_kv_heads * head_dim]``.
      values: ``[batch..., T, num_kv_heads * head_dim]``.
      heads: MultiHeadAttention's :class:`HeadConfig` (head counts, QK-norm, RoPE); None
        for the single-head classes (one head, nothing applied to q and k).
      qk_norms: ``(q_norm, k_norm)`` modules when ``heads.qk_norm``.
      positions: int ``[batch..., T]`` (broadcastable) token positions for RoPE; default
        ``0 ... T-1``, in decode mode each row's cache length onward.
      segment_ids: int ``[batch..., T]`` (broadcastable) documents of packed rows
        (:func:`jattn.pack`): a token attends only tokens with its id (the core's
        ``query_segment_ids``); not in decode mode.
      mask: optional bool, True = attend, broadcastable to ``[batch..., num_heads, T, T]``.
      deterministic: True: no dropout.
      dropout_rng: the dropout key when ``deterministic`` is False.
      return_weights: also return the weights ``[batch..., num_heads, T, T]`` (pre-dropout).
      sow_into: a module to sow the weights into as ``attention_weights``, or None.
      cache: decode mode: a :class:`jattn.kvcache.KVCache` (or ``RollingKVCache``); the
        keys and values are appended to it (:func:`jattn.kvcache.update_and_attend`) and
        the queries attend over everything it holds, so ``mask`` and the weights have
        ``capacity`` keys (a rolling cache: ``capacity + T``).
      num_new: decode mode: int ``[batch...]``, real tokens of each row of the chunk.
      sinks: the module's ``sinks`` parameter ``[num_heads]`` (with ``config.sinks``).

    The call's ``score_mod`` (:meth:`ModuleConfig.score_modifier`) and ``mask_mod`` come
    from ``config``; in decode mode their ``q_idx``/``kv_idx`` are absolute positions
    (:mod:`jattn.kvcache`), so decoding equals the full-sequence call.

    Returns:
      Context ``[batch..., T, num_heads * head_dim]`` (and the weights if asked); in
      decode mode, ``(that, updated_cache)``.
    """
    num_heads, num_kv_heads = (1, 1) if heads is None else (heads.num_heads, heads.num_kv_heads)
    positions = check_positions(
        positions, heads, config.cls_name, queries.shape[:-2], queries.shape[-2]
    )
    segment_ids = check_segment_ids(
        segment_ids, config.cls_name, queries.shape[:-2], queries.shape[-2], cache is not None
    )
    # [batch..., T, H, D] and [batch..., T, K, D]
    q = split_heads(queries, num_heads)
    k = split_heads(keys, num_kv_heads)
    v = split_heads(values, num_kv_heads)
    if heads is not None:
        positions = _rope_positions(positions, cache, q.shape[-3]) if heads.rope else None
        q, k = prepare_qk(heads, q, k, qk_norms=qk_norms, positions=positions)
    options = dict(
        mask=mask,
        dropout_rate=config.dropout,
        dropout_rng=dropout_rng,
        deterministic=deterministic,
        broadcast_dropout=config.broadcast_dropout,
        dtype=config.dtype,
        precision=config.precision,
        module=sow_into,
        return_weights=return_weights,
        implementation=config.attention_implementation,
        score_mod=config.score_modifier(),
        mask_mod=config.mask_mod,
        sinks=sinks,
    )
    if cache is None and num_new is not None:
        raise ValueError(
            f"{config.cls_name}: num_new (real tokens per row of a decoding chunk) is only "
            "used in decode mode: Linen modules built with decode=True and a 'cache' collection, "
            "NNX modules after init_cache() and called with decode=True."
        )
    if cache is None:
        out = functional.dot_product_attention(
            q, k, v, is_causal=config.is_causal, query_segment_ids=segment_ids, **options
        )
    else:
        out, cache = kvcache.update_and_attend(
            cache, q, k, v, num_new=num_new, is_causal=config.is_causal, **options
        )
    if return_weights:
        context, weights = out
        out = merge_heads(context), weights
    else:
        out = merge_heads(out)
    return out if cache is None else (out, cache)
