"""Argument checks shared by every public entry point of jattn.

Each function validates one kind of argument and raises a ``TypeError`` or ``ValueError``
that names the argument and the fix. Public entries (``dot_product_attention``, the mask
builders, the modules, the KV cache, generation, ring attention, the converters) call
these once; the implementations below them trust their inputs and re-check nothing.

Checks that read *values* (not shapes) run only on concrete host-side values (Python
numbers, numpy arrays): reading a device array's values would block on a device-to-host
copy at every eager call on GPU/TPU. Device arrays and tracers pass through unchecked;
the traced alternatives are ``jax.experimental.checkify`` and :func:`jattn.kvcache.fits`.
Where a wrong value would silently change every answer (the sequence boundaries of
:func:`jattn.varlen_attention`), :func:`nan_unless` makes the output NaN instead.
"""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _util

Array = jax.Array

IMPLEMENTATIONS = _util.IMPLEMENTATIONS  # one list of names (jattn._util)
"""The names ``implementation=`` accepts (None: automatic). ``'xla'`` is jax.nn's name for
the dense path."""

# ----------------------------------------------------------------------------------------
# Sizes and dtypes
# ----------------------------------------------------------------------------------------


def size(value, name: str, *, allow_zero: bool = False, where: str = "") -> int:
    """Returns ``value`` as an int, or raises a clear error (``where``: a message prefix,
    e.g. ``'MultiHeadAttention: '``)."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{where}{name} must be a Python int (a static size), got {type(value).__name__} "
            f"{value!r}. Sizes decide array shapes, so they cannot be traced values; pass e.g. "
            "x.shape[-2]."
        ) from None
    if n < 0 or (n == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{where}{name} must be {bound}, got {n}.")
    return n


def batch_shape(value) -> tuple[int, ...]:
    """A cache's batch dims: an int or a tuple of positive ints, as a tuple."""
    try:
        shape = (value,) if isinstance(value, int) else tuple(value)
    except TypeError:
        raise TypeError(
            f"batch_shape must be an int or a tuple of ints (the batch dims), got {value!r}."
        ) from None
    for i, d in enumerate(shape):
        size(d, f"batch_shape[{i}]")
    return shape


def float_dtype(dtype, name: str = "dtype"):
    """``dtype`` as a numpy dtype, or a clear error: not a dtype, not floating, or float64
    while ``jax_enable_x64`` is off (JAX would silently compute in float32)."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{name} must be a floating dtype such as jnp.float32 or jnp.bfloat16, got {dtype!r}."
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {dtype}.")
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ValueError(
            f"{name}={dtype} needs 64-bit mode, which is off: enable it with "
            "jax.config.update('jax_enable_x64', True) (or `with jax.enable_x64(True):`), or "
            "use float32."
        )
    return dtype


def float_array(x, name: str, *, tokens: bool = False) -> Array:
    """``x`` as a floating array; integers are refused (``tokens``: the array is one that
    token ids get mistaken for, so the message says to embed them)."""
    if x is None:
        raise TypeError(f"{name} is required, got None.")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        fix = (
            "Token ids must go through an embedding first; cast other arrays with "
            "`.astype(jnp.float32)`."
            if tokens
            else "Cast it with `.astype(jnp.float32)`."
        )
        raise TypeError(
            f"{name} must have a floating dtype (float32, bfloat16, float16, ...), got "
            f"{x.dtype}. {fix}"
        )
    return x


def int_array(x, name: str, shape: tuple[int, ...] | None = None, what: str = "") -> Array:
    """``x`` as an integer array (of ``shape``, when given)."""
    if x is None:
        raise TypeError(f"{name} is required, got None.")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers, got dtype {x.dtype}.")
    if shape is not None and x.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {what}{tuple(shape)}, got {x.shape}.")
    return x


def is_host_value(x) -> bool:
    """True for values that can be read without a device-to-host copy: Python numbers and
    sequences of them, numpy arrays, and concrete jax arrays that live on CPU devices (a
    list of traced scalars is traced)."""
    if isinstance(x, (numbers.Number, np.ndarray, np.generic)):
        return True
    if isinstance(x, (list, tuple)):
        return all(is_host_value(item) for item in x)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        try:
            return all(d.platform == "cpu" for d in x.devices())
        except Exception:  # e.g. a deleted or not fully addressable array
            return False
    return False


def nan_unless(ok: Array) -> Array:
    """The traced counterpart of a value check that could not read its values (a tracer,
    or a device array off CPU): a float32 scalar, 1 where the traced bool ``ok`` holds and
    NaN otherwise, for the caller to multiply its inputs and output by, so that a mistake
    the values reveal never returns numbers (the output and every gradient NaN; times 1,
    the valid call's numbers are unchanged, bit for bit). No ``checkify.debug_check``
    beside it: a program holding one leaves jit's fast dispatch path (about 40 us more per
    call, a millisecond on a model's decoding step)."""
    return jnp.where(ok, np.float32(1), np.float32(np.nan))


def with_factor(x, factor: Array | None):
    """``x`` times a :func:`nan_unless` factor, in x's dtype; ``x`` itself for None, or for
    non-float ``x`` (left for the entry's dtype check)."""
    if factor is None:
        return x
    x = jnp.asarray(x)
    return x * factor.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


def in_range(x, name: str, low: int, high: int, hint: str = "") -> None:
    """Raises if a host-side integer array has values outside ``[low, high]``.

    Device arrays and tracers are not read (see the module docstring).
    """
    if not is_host_value(x):
        return
    values = np.asarray(x)
    if values.size and (values.min() < low or values.max() > high):
        raise ValueError(
            f"{name} must be in [{low}, {high}]{hint}, got values from {int(values.min())} "
            f"to {int(values.max())}."
        )


# ----------------------------------------------------------------------------------------
# Scalar options
# ----------------------------------------------------------------------------------------


def rate(value, name: str = "dropout_rate", *, where: str = "") -> None:
    """A dropout rate: a number (or scalar array) in [0, 1); a traced rate passes."""
    if isinstance(value, jax.core.Tracer):
        return  # a traced rate cannot be checked; the caller chose it
    if isinstance(value, (bool, np.bool_)) or not (
        isinstance(value, numbers.Real)
        or (isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0)
    ):
        raise TypeError(f"{where}{name} must be a float in [0, 1), got {value!r:.40}.")
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(
            f"{where}{name} must be in [0, 1), got {value}. It is the probability of "
            "*dropping* a weight; use deterministic=True (or rate 0) to switch dropout off."
        )


def scale(value) -> None:
    """The logit multiplier: None (default), a finite number or a float scalar array."""
    if value is None or isinstance(value, jax.core.Tracer):
        return
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"scale must be a finite number, got {value}.")
        return
    if isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0:
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(f"scale must be a float, got an array of dtype {value.dtype}.")
        if not np.isfinite(np.asarray(value)):  # concrete here (a tracer returned above)
            raise ValueError(f"scale must be finite, got an array holding {value}.")
        return
    raise TypeError(
        f"scale must be a number (the logit multiplier, default 1/sqrt(head_dim)) or a scalar "
        f"array, got {type(value).__name__} {np.shape(value) if hasattr(value, 'shape') else ''}."
    )


def flag(value, name: str) -> None:
    """A static bool option (a traced or array flag would fail later as a tracer-to-bool error)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool (a static option), got {value!r}.")


def implementation(value, name: str = "implementation") -> None:
    """The one list of implementation names (the core's argument, the modules' attribute)."""
    if value is not None and value not in IMPLEMENTATIONS:
        names = ", ".join(repr(n) for n in IMPLEMENTATIONS)
        raise ValueError(
            f"{name} must be None (automatic) or one of {names}, got {value!r}. 'dense' (alias "
            "'xla') supports every transformation, forward-mode autodiff included."
        )


def broadcast_dropout(value) -> tuple[bool, bool]:
    """``(over_batch, over_heads)``: which axes share one dropout mask."""
    if value is True:
        return True, True  # one mask for every example and head
    if value is False:
        return False, False  # independent, as torch.nn.Dropout in the book
    if value == "batch":
        return True, False
    if value == "heads":
        return False, True
    raise ValueError(f"broadcast_dropout must be True, False, 'batch' or 'heads', got {value!r}.")


def rng(value, argument: str) -> None:
    """One ``jax.random`` key (new-style or legacy), required when dropout is active."""
    if value is None:
        raise ValueError(
            f"dropout is active (rate > 0 and deterministic=False) but no random key was "
            f"given. Pass `{argument}=jax.random.key(seed)` (Linen modules: "
            "`rngs={'dropout': key}`; NNX: `rngs=nnx.Rngs(dropout=seed)`), or set "
            "`deterministic=True` for inference."
        )
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        single = value.shape == ()
    else:  # legacy raw key data: uint32 [2] (threefry) or [4] (rbg)
        single = dtype == jnp.uint32 and np.ndim(value) == 1
    if not single:
        got = f"{type(value).__name__}" if dtype is None else f"dtype {dtype}, shape {value.shape}"
        raise TypeError(
            f"{argument} must be one jax.random key (jax.random.key(seed), or a legacy "
            f"jax.random.PRNGKey(seed)), got {got}. For a batch of keys, jax.vmap the call."
        )


def window(value, name: str = "local_window_size", *, open_right: bool = False):
    """A local window as ``(left, right)``: an int ``n`` means ``(n, n)`` (as ``jax.nn``).

    With ``open_right``, ``right`` may be None (no limit on the right).
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        left = right = value
    else:
        try:
            left, right = value
        except (TypeError, ValueError):
            raise TypeError(
                f"{name} must be an int or a (left, right) pair of ints, got {value!r}."
            ) from None
    left = size(left, f"{name}[0] (left)", allow_zero=True)
    if right is None and open_right:
        return left, None
    return left, size(right, f"{name}[1] (right)", allow_zero=True)


# ----------------------------------------------------------------------------------------
# Arrays of an attention call
# ----------------------------------------------------------------------------------------


def qkv(query, key, value) -> tuple[Array, Array, Array]:
    """Query, key and value as float arrays ``[batch..., length, heads, head_dim]`` that fit."""
    query = float_array(query, "query", tokens=True)
    key = float_array(key, "key", tokens=True)
    value = float_array(value, "value", tokens=True)
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


def broadcasts(x: Array, target: tuple[int, ...], name: str) -> None:
    """Raises unless ``x`` broadcasts to the logits shape ``target``."""
    try:
        ok = np.broadcast_shapes(x.shape, target) == tuple(target)
    except ValueError:
        ok = False
    if ok:
        return
    *_, num_heads, q_len, kv_len = target
    if x.ndim >= 2 and x.shape[-2] == num_heads and x.shape[-2:] != (q_len, kv_len):
        # The book's (PyTorch's) [batch, heads, T, head_dim] read as [batch, T, heads, ...]:
        # the mask's query axis then matches what jattn takes for the head count.
        raise ValueError(
            f"{name} of shape {x.shape} does not broadcast to the attention logits shape "
            f"[batch..., num_heads, q_len, kv_len] = {tuple(target)}, but its query axis "
            f"({x.shape[-2]}) is the head count jattn read from query.shape[-2]: are query, "
            "key and value in the book's (PyTorch's) [batch, heads, T, head_dim] layout? "
            "jattn takes [batch..., T, heads, head_dim] (as jax.nn): pass "
            "jnp.swapaxes(x, -3, -2) for each of them (and swap the output back)."
        )
    raise ValueError(
        f"{name} of shape {x.shape} does not broadcast to the attention logits shape "
        f"[batch..., num_heads, q_len, kv_len] = {tuple(target)}. Add singleton axes "
        f"(e.g. {name}[:, None, :, :]) for the dims it does not vary over."
    )


def bias(value, logits_shape: tuple[int, ...]) -> Array | None:
    """An additive float bias broadcastable to the logits (None passes)."""
    if value is None:
        return None
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"bias must be a float array, got dtype {value.dtype}.")
    broadcasts(value, logits_shape, "bias")
    return value


def mask_array(value, name: str = "mask") -> Array:
    """A mask as a boolean array (True = attend), read by the rules of every jattn entry.

    * Boolean masks pass; numeric masks must hold only 0 and 1 (flax's float masks), read
      as ``!= 0``. Any other value (PyTorch's additive ``0 / -inf`` masks, negative or
      fractional values) is refused: that mask means "add me to the logits".
    * The book's causal buffer ``triu(ones(T, T), diagonal=1)`` (True = *hide*) is refused:
      read as True = attend it hides the diagonal and shows only later keys. The rule:
      its last two axes are square, ``T >= 4``, and every ``[T, T]`` slice is exactly
      ``j > i``. No mask that lets a query see itself trips it, nor an all-False mask,
      nor one with ``q_len != kv_len``; from 4 tokens on a random mask matches it with
      odds below 1e-4 (the book's buffers are ``context_length`` long).

    Both read values, so they run on host values only (:func:`is_host_value`, as every
    value check here): traced masks, and device arrays on GPU/TPU, are taken as given.
    """
    try:
        value = jnp.asarray(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a boolean array (True = attend), got {type(value).__name__} "
            f"{value!r:.40}. Build one with jattn.causal_mask, or use is_causal=True."
        ) from None
    if value.dtype != jnp.bool_:
        if not (
            jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating)
        ):
            raise TypeError(f"{name} must be boolean (True = attend), got dtype {value.dtype}.")
        _zeros_and_ones(value, name)
        value = value != 0
    _not_book_buffer(value, name)
    return value


def _zeros_and_ones(value: Array, name: str) -> None:
    if not is_host_value(value):
        return
    values = np.asarray(value)
    if not np.isin(values, (0, 1)).all():
        odd = values[~np.isin(values, (0, 1))].ravel()[0]
        raise ValueError(
            f"{name} holds values other than 0 and 1 (e.g. {odd}): it looks like an additive "
            "mask (0 = attend, -inf or a large negative = hide, as PyTorch's SDPA takes). "
            "jattn's masks are boolean, True = attend: pass `m == 0` as the mask, or pass the "
            "additive mask as `bias=m`."
        )


def _not_book_buffer(value: Array, name: str) -> None:
    if value.ndim < 2 or value.shape[-1] != value.shape[-2] or value.shape[-1] < 4:
        return
    if not is_host_value(value):
        return
    t = value.shape[-1]
    hide_future = np.triu(np.ones((t, t), bool), k=1)
    slices = np.asarray(value).reshape(-1, t, t)
    if (slices[0] == hide_future).all() and (slices == hide_future).all():
        raise ValueError(
            f"{name} is the book's causal buffer triu(ones(T, T), diagonal=1), where True (1) "
            "means *hide*. jattn's masks are True = attend, so it would let each query see "
            "only later tokens. For causal attention pass is_causal=True (no mask needed); "
            "for a mask of your own invert the buffer: `~buffer` (a 0/1 float buffer: "
            "`buffer == 0`)."
        )


def mask(value, logits_shape: tuple[int, ...]) -> Array | None:
    """A mask (:func:`mask_array`'s rules) broadcastable to the logits; None passes."""
    if value is None:
        return None
    value = mask_array(value)
    broadcasts(value, logits_shape, "mask")
    return value


def seq_lengths(value, name: str, batch_shape: tuple[int, ...], limit: int) -> Array | None:
    """Per-sequence lengths: int ``[batch...]`` in ``[0, limit]`` (None passes)."""
    if value is None:
        return None
    value_in = value
    value = jnp.asarray(value)
    if value.shape != batch_shape:
        raise ValueError(
            f"{name} must have the batch shape {batch_shape} (one length per sequence), "
            f"got shape {value.shape}."
        )
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers, got dtype {value.dtype}.")
    in_range(value_in, name, 0, limit, " (the padded length)")
    return value.astype(jnp.int32)


def segment_ids(
    query_ids, kv_ids, batch_shape: tuple[int, ...], q_len: int, kv_len: int
) -> tuple[Array | None, Array | None]:
    """Segment ids of queries and keys, ``[batch..., length]`` ints (keys default to queries).

    When the key/value ids default to the query ids (or are the same object), the second
    result *is* the first.
    """
    if kv_ids is not None and query_ids is None:
        raise ValueError(
            "key_value_segment_ids needs query_segment_ids too (the segment of each query)."
        )
    if query_ids is None:
        return None, None
    if kv_ids is None:
        if q_len != kv_len:
            raise ValueError(
                f"key_value_segment_ids is required when q_len ({q_len}) != kv_len "
                f"({kv_len}); query_segment_ids stands for both only in self-attention."
            )
        kv_ids = query_ids
    out = []
    for name, ids, length in (
        ("query_segment_ids", query_ids, q_len),
        ("key_value_segment_ids", kv_ids, kv_len),
    ):
        ids = int_array(ids, name)
        if ids.shape != (*batch_shape, length):
            raise ValueError(
                f"{name} must have shape [batch..., length] = {(*batch_shape, length)}, "
                f"got {ids.shape}."
            )
        if ids.dtype.itemsize > 4 and ids.size and is_host_value(ids):
            i32, lo, hi = np.iinfo(np.int32), np.min(np.asarray(ids)), np.max(np.asarray(ids))
            if not i32.min <= lo <= hi <= i32.max:  # wider ids would wrap (x64 mode)
                raise ValueError(
                    f"{name} hold ids from {lo} to {hi}; the paths compare them as int32, "
                    "so they must fit in it (renumber the documents)."
                )
        out.append(ids.astype(jnp.int32))
    # Self-attention ids come back as one object: kernels that take a single id array (the
    # Pallas Triton kernel) tell them from separate key/value ids by identity.
    return out[0], (out[0] if kv_ids is query_ids else out[1])


# ----------------------------------------------------------------------------------------
# Modifiers: score_mod, mask_mod, sinks, block_mask (see jattn.mods)
# ----------------------------------------------------------------------------------------

_SIGNATURES = {"score_mod": "(score, b, h, q_idx, kv_idx)", "mask_mod": "(b, h, q_idx, kv_idx)"}


def _modifier_signature(fn, name: str) -> None:
    """``fn`` is callable with FlexAttention's positional arguments for ``name``."""
    args = _SIGNATURES[name]
    if not callable(fn):
        raise TypeError(
            f"{name} must be a function {args} -> {'scores' if name == 'score_mod' else 'bool'}"
            f" (as FlexAttention's {name}), got {type(fn).__name__}."
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # e.g. some builtins: the trace below still checks it
        return
    try:
        signature.bind(*range(args.count(",") + 1))
    except TypeError:
        raise TypeError(
            f"{name} must take {args.count(',') + 1} positional arguments {args} (FlexAttention's "
            f"signature), but it is {getattr(fn, '__name__', type(fn).__name__)}{signature}."
        ) from None


def _index_structs(shape: tuple[int, int, int, int]) -> list:
    n, h, q_len, kv_len = shape
    shapes = ((n, 1, 1, 1), (1, h, 1, 1), (1, 1, q_len, 1), (1, 1, 1, kv_len))
    return [jax.ShapeDtypeStruct(s, jnp.int32) for s in shapes]


def _trace_modifier(fn, name: str, args: list):
    """``jax.eval_shape(fn, *args)``, with a failure turned into an error naming ``name``."""
    described = ", ".join(
        f"{arg_name} {a.dtype}{list(a.shape)}"
        for arg_name, a in zip(_SIGNATURES[name][1:-1].split(", "), args, strict=True)
    )
    try:
        out = jax.eval_shape(fn, *args)
    except Exception as e:
        cls = ValueError if isinstance(e, ValueError) else TypeError
        raise cls(
            f"{name} failed when traced on abstract inputs ({described}): {type(e).__name__}: {e}"
        ) from e
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise TypeError(f"{name} must return one array, got {type(out).__name__}.")
    return out


def _elementwise_shape(out, name: str, shape: tuple[int, ...]) -> None:
    try:
        ok = len(out.shape) <= 4 and np.broadcast_shapes(out.shape, shape) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name} must be elementwise: called on scores of shape {tuple(shape)} it returned "
            f"shape {tuple(out.shape)}, which does not broadcast to it. Index the arrays it "
            "closes over with b, h, q_idx, kv_idx (e.g. table[h, q_idx, kv_idx]) instead of "
            "using them whole; for a dense [q_len, kv_len] array pass bias= or mask=."
        )


def _modifier_shapes(shape: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """The call's ``[N, H, Tq, Tk]`` and a one-pair tile ``[N, H, 1, 1]`` (the blockwise
    path calls modifiers on tiles, so they must not depend on the full lengths)."""
    *batch, num_heads, q_len, kv_len = shape
    n = math.prod(batch)
    full = (n, num_heads, q_len, kv_len)
    return [full] if (q_len, kv_len) == (1, 1) else [full, (n, num_heads, 1, 1)]


def score_mod(fn, logits_shape: tuple[int, ...], dtype) -> None:
    """A ``score_mod(score, b, h, q_idx, kv_idx)`` returning floats of the scores' shape.

    Traced once per shape of :func:`_modifier_shapes` on abstract inputs (no compute).
    """
    if fn is None:
        return
    _modifier_signature(fn, "score_mod")
    for shape in _modifier_shapes(logits_shape):
        score = jax.ShapeDtypeStruct(shape, dtype)
        out = _trace_modifier(fn, "score_mod", [score, *_index_structs(shape)])
        if not jnp.issubdtype(out.dtype, jnp.floating):
            raise TypeError(
                f"score_mod must return floating scores (the modified logits), got dtype "
                f"{out.dtype}."
            )
        _elementwise_shape(out, "score_mod", shape)


def mask_mod(fn, logits_shape: tuple[int, ...]) -> None:
    """A ``mask_mod(b, h, q_idx, kv_idx)`` returning booleans broadcastable to the scores.

    Traced once per shape of :func:`_modifier_shapes` on abstract inputs (no compute).
    """
    if fn is None:
        return
    _modifier_signature(fn, "mask_mod")
    for shape in _modifier_shapes(logits_shape):
        out = _trace_modifier(fn, "mask_mod", _index_structs(shape))
        if out.dtype != jnp.bool_:
            raise TypeError(
                f"mask_mod must return booleans (True = attend), got dtype {out.dtype}; "
                "compare instead, e.g. q_idx >= kv_idx."
            )
        _elementwise_shape(out, "mask_mod", shape)


def modifier_sizes(fn, batch_size: int, num_heads: int, q_len, kv_len) -> None:
    """Lets a ready-made modifier (:mod:`jattn.mods`) check its arrays against the call
    (``q_len``/``kv_len`` None: lengths unknown, absolute positions)."""
    check = getattr(fn, "check_shapes", None)
    if fn is not None and check is not None:
        check(batch_size=batch_size, num_heads=num_heads, q_len=q_len, kv_len=kv_len)


def sinks(value, num_heads: int) -> Array | None:
    """Attention-sink logits: float ``[num_heads]`` (None passes)."""
    if value is None:
        return None
    try:
        value = jnp.asarray(value)
    except TypeError:
        raise TypeError(
            f"sinks must be a float array of per-head logits [num_heads], got "
            f"{type(value).__name__}."
        ) from None
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"sinks must be a float array of per-head logits [num_heads], got dtype {value.dtype}."
        )
    if value.shape != (num_heads,):
        raise ValueError(
            f"sinks must have shape [num_heads] = ({num_heads},) (one logit per query head), "
            f"got {value.shape}."
        )
    return value


@typing.runtime_checkable
class _BlockMaskLike(typing.Protocol):
    """What a :class:`jattn.BlockMask` has, for :func:`block_mask` (names the fields read)."""

    state: Array
    mask_mod: typing.Callable
    q_len: int
    kv_len: int
    block_q: int
    block_k: int

    def tile_flags(self) -> tuple[Array, Array]: ...


def block_mask(value, mask_mod_fn, logits_shape: tuple[int, ...]):
    """A :class:`jattn.BlockMask` that fits the call; returns ``(mask_mod, block_mask)``.

    The block mask carries its ``mask_mod``: ``mask_mod=`` may be omitted, or must be the
    same function.
    """
    if value is None:
        return mask_mod_fn, None
    # Structural: jattn.block_masks sits above this module (it uses these checks), and a
    # BlockMask checked its own fields when it was built.
    if not isinstance(value, _BlockMaskLike):
        raise TypeError(
            "block_mask must be built by jattn.block_mask(mask_mod, q_len=..., ...), got "
            f"{type(value).__name__}. For a dense boolean array use mask=."
        )
    if mask_mod_fn is not None and not _same_modifier(mask_mod_fn, value.mask_mod):
        raise ValueError(
            "mask_mod and block_mask disagree: the block mask carries the mask_mod it was "
            "built from. Pass block_mask= alone (or with that same mask_mod); to AND more "
            "masks, build the block mask from jattn.mods.and_masks(...)."
        )
    *batch, num_heads, q_len, kv_len = logits_shape
    if (value.q_len, value.kv_len) != (q_len, kv_len):
        raise ValueError(
            f"block_mask was built for q_len={value.q_len}, kv_len={value.kv_len} but the call "
            f"has q_len={q_len}, kv_len={kv_len}."
        )
    rows, heads = value.state.shape[:2]
    n = math.prod(batch)
    if rows not in (1, n) or heads not in (1, num_heads):
        raise ValueError(
            f"block_mask was built for batch {rows} and {heads} heads but the call has a "
            f"(flattened) batch of {n} and {num_heads} heads: build it with batch_shape= and "
            "num_heads= of the call (or without them, for a mask the same for every row/head)."
        )
    return value.mask_mod, value


def _same_modifier(a, b) -> bool:
    if a is b:
        return True
    try:  # value-equal ready-made masks (causal() == causal()); arrays compare by identity
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False
