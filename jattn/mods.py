"""Score and mask modifiers: PyTorch FlexAttention's ``score_mod`` / ``mask_mod`` for jattn.

:func:`jattn.dot_product_attention` takes two small functions:

* ``score_mod(score, b, h, q_idx, kv_idx) -> score``: changes the *scaled* logits
  ``score = scale * q·k`` elementwise, before any bias or mask (soft-capping, ALiBi, a
  learned relative-position bias, ...);
* ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True = attend, ANDed with every other mask
  of the call (causal, windows, documents, prefix-LM, ...).

**Indices.** For scores ``[batch..., H, q_len, kv_len]`` the modifiers see rank-4 arrays
(the batch dims flattened, row-major, into one axis of size ``N = prod(batch)``)::

    score   float [N, H, Tq, Tk]   (float32; float64 for float64 inputs)
    b       int32 [N, 1, 1, 1]     flattened batch index: (i1, i2) of batch (B1, B2) is i1*B2 + i2
    h       int32 [1, H, 1, 1]     query head (grouped-query attention: the *query* head)
    q_idx   int32 [1, 1, Tq, 1]    query position, 0 ... q_len - 1
    kv_idx  int32 [1, 1, 1, Tk]    key position, 0 ... kv_len - 1

They broadcast like the scores, so a modifier is written with plain ``jnp`` operations
(``score + slopes[h] * (kv_idx - q_idx)``, ``q_idx >= kv_idx``). A modifier must be
*elementwise*: each output element depends only on its own ``(score, b, h, q_idx,
kv_idx)``, because the blockwise path calls it on tiles (``Tq``, ``Tk`` then are tile
lengths and the positions the tile's). ``score_mod`` returns a float array that
broadcasts to the score's shape; ``mask_mod`` a bool array that broadcasts to it.
:func:`jattn.dot_product_attention` traces both once on abstract inputs and raises a
clear error otherwise.

**Gradients.** Arrays a modifier closes over (ALiBi slopes, a bias table) get gradients:
differentiate with respect to them as usual (``jax.grad(loss)(slopes)``). The
ready-made modifiers below are pytrees (their arrays are leaves), so they can also be
passed through ``jax.jit`` and differentiated as a whole (``jax.grad(loss)(alibi(s))``).

**Ready-made modifiers.** Score: :func:`softcap`, :func:`alibi`, :func:`relative_bias`.
Mask: :func:`causal`, :func:`sliding_window`, :func:`prefix_lm`, :func:`document`.
Combine with :func:`compose` (score mods, applied in order), :func:`and_masks`,
:func:`or_masks` (or ``&`` / ``|`` between ready-made masks). A block mask for the
blockwise path's tile skipping is built by :func:`jattn.block_mask`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _util

__all__ = [
    "Alibi",
    "Causal",
    "Compose",
    "Document",
    "MaskAnd",
    "MaskMod",
    "MaskOr",
    "PrefixLM",
    "RelativeBias",
    "ScoreMod",
    "SlidingWindow",
    "SoftCap",
    "alibi",
    "alibi_slopes",
    "and_masks",
    "causal",
    "compose",
    "document",
    "or_masks",
    "prefix_lm",
    "relative_bias",
    "relative_position_bucket",
    "sliding_window",
    "softcap",
]

Array = jax.Array


# ----------------------------------------------------------------------------------------
# Indices and evaluation: what jattn's paths call (module functions, not in __all__)
# ----------------------------------------------------------------------------------------


def indices(batch_size: int, num_heads: int, q_len: int, kv_len: int, *, q_offset=0, kv_offset=0):
    """The index arrays ``(b, h, q_idx, kv_idx)`` of scores ``[N, H, Tq, Tk]`` (int32).

    Args:
      batch_size: ``N``, the flattened batch size.
      num_heads: ``H``, query heads.
      q_len: query positions in this block of scores (a tile length on the blockwise path).
      kv_len: key positions in this block.
      q_offset: position of the block's first query (int or traced int scalar).
      kv_offset: position of the block's first key.

    Returns:
      ``b [N,1,1,1]``, ``h [1,H,1,1]``, ``q_idx [1,1,Tq,1]``, ``kv_idx [1,1,1,Tk]``.
    """
    i32 = jnp.int32
    b = jax.lax.broadcasted_iota(i32, (batch_size, 1, 1, 1), 0)
    h = jax.lax.broadcasted_iota(i32, (1, num_heads, 1, 1), 1)
    q = jax.lax.broadcasted_iota(i32, (1, 1, q_len, 1), 2) + jnp.asarray(q_offset, i32)
    kv = jax.lax.broadcasted_iota(i32, (1, 1, 1, kv_len), 3) + jnp.asarray(kv_offset, i32)
    return b, h, q, kv


def apply_score_mod(score_mod: Callable, scores: Array) -> Array:
    """``score_mod`` applied to scores ``[batch..., H, Tq, Tk]`` (same shape and dtype).

    The batch dims are flattened into ``b`` (see the module docstring) and restored.
    """
    *batch, num_heads, q_len, kv_len = scores.shape
    n = math.prod(batch)
    flat = scores.reshape(n, num_heads, q_len, kv_len)
    out = jnp.asarray(score_mod(flat, *indices(n, num_heads, q_len, kv_len)))
    out = _util.expand_rank(out, 4)
    return jnp.broadcast_to(out.astype(scores.dtype), flat.shape).reshape(scores.shape)


def evaluate_mask_mod(mask_mod: Callable, logits_shape: tuple[int, ...]) -> Array:
    """``mask_mod`` over every (batch, head, query, key) of ``[batch..., H, Tq, Tk]``.

    Returns:
      bool of rank ``len(logits_shape)`` broadcastable to it: axes the mask does not vary
      over stay size 1 (a causal mask is ``[1..., 1, Tq, Tk]``, nothing per batch row).
    """
    *batch, num_heads, q_len, kv_len = logits_shape
    n = math.prod(batch)
    mask = _util.expand_rank(jnp.asarray(mask_mod(*indices(n, num_heads, q_len, kv_len))), 4)
    if mask.shape[0] == 1:
        return mask.reshape((1,) * len(batch) + mask.shape[1:])
    mask = jnp.broadcast_to(mask, (n, *mask.shape[1:]))
    return mask.reshape(*batch, *mask.shape[1:])


def native_softcap(score_mod: Callable | None) -> float | None:
    """The cap of a ``score_mod`` that is exactly :func:`softcap` (else None).

    For the accelerator routes: a kernel with native soft-capping (splash attention's
    ``attn_logits_soft_cap``) takes such a call; any other ``score_mod`` it must refuse.
    """
    return score_mod.cap if isinstance(score_mod, SoftCap) else None


# ----------------------------------------------------------------------------------------
# Base classes and combinators
# ----------------------------------------------------------------------------------------


class ScoreMod(abc.ABC):
    """A ready-made ``score_mod``: ``mod(score, b, h, q_idx, kv_idx) -> score``."""

    @abc.abstractmethod
    def __call__(self, score, b, h, q_idx, kv_idx) -> Array:
        """The modified scores (see the module docstring for the arguments)."""

    def check_shapes(
        self, *, batch_size: int, num_heads: int, q_len: int | None, kv_len: int | None
    ):
        """Raises a ValueError if the modifier's arrays do not fit the call's sizes.

        :func:`jattn.dot_product_attention` calls it once per call (on full lengths; the
        modifier itself is also called on tiles, where lengths are tile lengths).
        ``q_len`` and ``kv_len`` are None when positions are absolute and the lengths
        unknown (decoding through :mod:`jattn.kvcache`): only batch and heads are checked.
        """
        del batch_size, num_heads, q_len, kv_len


class MaskMod(abc.ABC):
    """A ready-made ``mask_mod``: ``mod(b, h, q_idx, kv_idx) -> bool`` (True = attend).

    Ready-made masks combine with ``&`` (:func:`and_masks`) and ``|`` (:func:`or_masks`).
    """

    @abc.abstractmethod
    def __call__(self, b, h, q_idx, kv_idx) -> Array:
        """True where the query may attend the key (see the module docstring)."""

    def check_shapes(
        self, *, batch_size: int, num_heads: int, q_len: int | None, kv_len: int | None
    ):
        """Raises a ValueError if the modifier's arrays do not fit the call's sizes
        (``q_len``/``kv_len`` None: unknown, see :meth:`ScoreMod.check_shapes`)."""
        del batch_size, num_heads, q_len, kv_len

    def __and__(self, other):
        return and_masks(self, other)

    def __or__(self, other):
        return or_masks(self, other)


def is_modifier(fn) -> bool:
    """True for jattn's ready-made modifiers (pytrees whose arrays are leaves)."""
    return isinstance(fn, (ScoreMod, MaskMod))


def _flatten_parts(parts):
    # Ready-made parts are pytree children (their arrays trace through jit); any other
    # callable (a lambda) is static, like a function passed to jax.jit.
    dynamic = tuple(p if is_modifier(p) else None for p in parts)
    static = tuple(None if is_modifier(p) else p for p in parts)
    return dynamic, static


def _unflatten_parts(static, dynamic):
    return tuple(s if d is None else d for s, d in zip(static, dynamic, strict=True))


def _check_parts(parts, **sizes):
    for part in parts:
        if is_modifier(part):
            part.check_shapes(**sizes)


def _callables(fns, what: str) -> tuple:
    if not fns:
        raise ValueError(f"{what} needs at least one modifier.")
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"{what}: argument {i} is not a function, got {type(fn).__name__}.")
    return tuple(fns)


@dataclasses.dataclass(frozen=True, eq=False)
class Compose(ScoreMod):
    """Score mods applied in order: ``mods[-1](... mods[0](score) ...)``."""

    mods: tuple

    def __call__(self, score, b, h, q_idx, kv_idx):
        for mod in self.mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    def check_shapes(self, **sizes):
        _check_parts(self.mods, **sizes)


@dataclasses.dataclass(frozen=True, eq=False)
class MaskAnd(MaskMod):
    """A key is visible iff every mask lets it through."""

    mods: tuple

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.mods[0](b, h, q_idx, kv_idx)
        for mod in self.mods[1:]:
            out = jnp.logical_and(out, mod(b, h, q_idx, kv_idx))
        return out

    def check_shapes(self, **sizes):
        _check_parts(self.mods, **sizes)


@dataclasses.dataclass(frozen=True, eq=False)
class MaskOr(MaskMod):
    """A key is visible iff some mask lets it through."""

    mods: tuple

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.mods[0](b, h, q_idx, kv_idx)
        for mod in self.mods[1:]:
            out = jnp.logical_or(out, mod(b, h, q_idx, kv_idx))
        return out

    def check_shapes(self, **sizes):
        _check_parts(self.mods, **sizes)


for _cls in (Compose, MaskAnd, MaskOr):
    jax.tree_util.register_pytree_node(
        _cls,
        lambda m: _flatten_parts(m.mods),
        lambda static, dynamic, cls=_cls: cls(_unflatten_parts(static, dynamic)),
    )


def compose(*score_mods: Callable) -> Compose:
    """One score mod applying ``score_mods`` in order (the first sees the scaled logits).

    Example: ``compose(alibi(slopes), softcap(50.0))`` adds ALiBi, then caps.
    """
    return Compose(_callables(score_mods, "compose"))


def and_masks(*mask_mods: Callable) -> MaskAnd:
    """One mask mod: True where every one of ``mask_mods`` is True (as torch's ``and_masks``)."""
    return MaskAnd(_callables(mask_mods, "and_masks"))


def or_masks(*mask_mods: Callable) -> MaskOr:
    """One mask mod: True where any of ``mask_mods`` is True (as torch's ``or_masks``)."""
    return MaskOr(_callables(mask_mods, "or_masks"))


# ----------------------------------------------------------------------------------------
# Score modifiers
# ----------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SoftCap(ScoreMod):
    """``cap * tanh(score / cap)`` (Gemma 2's logit soft-capping); ``cap`` is static."""

    cap: float = dataclasses.field(metadata={"static": True})

    def __call__(self, score, b, h, q_idx, kv_idx):
        cap = jnp.asarray(self.cap, score.dtype)
        return cap * jnp.tanh(score / cap)


def softcap(cap: float) -> SoftCap:
    """Soft-capping of the scaled logits: ``cap * tanh(score / cap)`` (Gemma 2 uses 50).

    Args:
      cap: a positive, finite Python number (static: kernels with native soft-capping,
        such as splash attention, take it as a constant).
    """
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real):
        raise TypeError(f"softcap cap must be a Python number, got {type(cap).__name__}.")
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap cap must be > 0 and finite, got {cap}.")
    return SoftCap(float(cap))


def _per_head(x: Array, num_heads: int, what: str, axis: int = -1) -> None:
    if x.shape[axis] != num_heads:
        raise ValueError(
            f"{what} must have one entry per query head: {x.shape[axis]} for {num_heads} heads "
            f"(shape {x.shape})."
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Alibi(ScoreMod):
    """ALiBi: ``score + slopes[h] * (kv_idx - q_idx)`` (``-slopes[h] * |kv_idx - q_idx|``
    when ``symmetric``); ``slopes`` ``[num_heads]`` is an array (learnable)."""

    slopes: Array
    symmetric: bool = dataclasses.field(default=False, metadata={"static": True})

    def __call__(self, score, b, h, q_idx, kv_idx):
        distance = (kv_idx - q_idx).astype(score.dtype)
        if self.symmetric:
            distance = -jnp.abs(distance)
        return score + self.slopes[h].astype(score.dtype) * distance

    def check_shapes(self, *, batch_size, num_heads, q_len, kv_len):
        _per_head(self.slopes, num_heads, "alibi slopes")


def alibi_slopes(num_heads: int) -> Array:
    """The ALiBi paper's head slopes (Press et al., 2022), float32 ``[num_heads]``.

    For ``n`` a power of two: the geometric sequence ``2^(-8/n), 2^(-16/n), ..., 2^-8``.
    Otherwise (the paper's rule for other head counts): the slopes of the closest power
    of two ``c < n``, followed by every other slope of ``2c`` (``[0::2]``), ``n - c`` of them.
    """
    num_heads = _checks.size(num_heads, "num_heads")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads & (num_heads - 1) == 0:
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return jnp.asarray(np.array(slopes, np.float32))


def alibi(slopes, *, symmetric: bool = False) -> Alibi:
    """ALiBi position biases (Press et al., 2022) as a ``score_mod``.

    ``score + slopes[h] * (kv_idx - q_idx)``: with a causal mask every visible key is at
    or before the query, so the bias is ``-slope * distance``, the paper's. (Without a
    causal mask later keys get a positive bias, as FlexAttention's ALiBi example; for
    encoders pass ``symmetric=True``: ``-slope * |kv_idx - q_idx|``.)

    Args:
      slopes: float ``[num_heads]``, e.g. :func:`alibi_slopes` (a parameter if learned:
        gradients flow to it).
      symmetric: penalise distance in both directions.
    """
    slopes = _checks.float_array(slopes, "alibi slopes")
    if slopes.ndim != 1:
        raise ValueError(f"alibi slopes must have shape [num_heads], got {slopes.shape}.")
    _checks.flag(symmetric, "symmetric")
    return Alibi(slopes, bool(symmetric))


def relative_position_bucket(
    relative_position, *, num_buckets: int = 32, bidirectional: bool = True, max_distance: int = 128
) -> Array:
    """T5's bucket of a relative position ``kv_idx - q_idx`` (Raffel et al., 2020).

    Half the buckets (all of them when not ``bidirectional``, where later keys share
    bucket 0) hold exact distances ``0 .. n/2 - 1``; the rest grow logarithmically up to
    ``max_distance``, beyond which distances share the last bucket. With
    ``bidirectional`` the upper half of the buckets is for keys after the query. Computed
    in float32 as in T5's reference code (Mesh TensorFlow, HF transformers).

    Returns:
      int32 buckets in ``[0, num_buckets)``, the shape of ``relative_position``.
    """
    rel = jnp.asarray(relative_position).astype(jnp.int32)
    n = num_buckets
    bucket = jnp.zeros(rel.shape, jnp.int32)
    if bidirectional:
        n //= 2
        bucket = jnp.where(rel > 0, n, 0).astype(jnp.int32)
        rel = jnp.abs(rel)
    else:
        rel = -jnp.minimum(rel, 0)
    max_exact = n // 2
    scaled = jnp.log(jnp.maximum(rel, 1).astype(jnp.float32) / max_exact)
    scaled = scaled / math.log(max_distance / max_exact) * (n - max_exact)
    large = jnp.minimum(max_exact + scaled.astype(jnp.int32), n - 1)
    return bucket + jnp.where(rel < max_exact, rel, large)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class RelativeBias(ScoreMod):
    """``score + table[bucket(kv_idx - q_idx), h]`` with T5's buckets; ``table`` is an array."""

    table: Array
    bidirectional: bool = dataclasses.field(default=True, metadata={"static": True})
    max_distance: int = dataclasses.field(default=128, metadata={"static": True})

    def __call__(self, score, b, h, q_idx, kv_idx):
        bucket = relative_position_bucket(
            kv_idx - q_idx,
            num_buckets=self.table.shape[0],
            bidirectional=self.bidirectional,
            max_distance=self.max_distance,
        )
        return score + self.table[bucket, h].astype(score.dtype)

    def check_shapes(self, *, batch_size, num_heads, q_len, kv_len):
        _per_head(self.table, num_heads, "relative_bias table [num_buckets, num_heads]")


def relative_bias(table, *, bidirectional: bool = True, max_distance: int = 128) -> RelativeBias:
    """A learned relative-position bias, T5-style: ``score + table[bucket(kv_idx - q_idx), h]``.

    Positions are bucketed as in T5 (:func:`relative_position_bucket`): exact for short
    distances, logarithmic up to ``max_distance``, shared beyond it. For a plain
    (unbucketed) table, write the mod directly, e.g.
    ``lambda s, b, h, q, k: s + tbl[jnp.clip(k - q, -m, m) + m, h]``.

    Args:
      table: float ``[num_buckets, num_heads]`` (T5's ``relative_attention_bias``
        embedding); gradients flow to it.
      bidirectional: separate buckets for keys after the query (encoders); False for
        causal decoders (every later key falls in bucket 0).
      max_distance: distances from here on share the last bucket.
    """
    table = _checks.float_array(table, "relative_bias table")
    if table.ndim != 2:
        raise ValueError(
            f"relative_bias table must have shape [num_buckets, num_heads], got {table.shape}."
        )
    _checks.flag(bidirectional, "bidirectional")
    max_distance = _checks.size(max_distance, "max_distance")
    exact = table.shape[0] // (2 if bidirectional else 1) // 2
    if exact < 1:
        raise ValueError(
            f"relative_bias needs at least {4 if bidirectional else 2} buckets "
            f"(bidirectional={bidirectional}), got a table of shape {table.shape}."
        )
    if max_distance <= exact:
        raise ValueError(
            f"max_distance must be larger than the {exact} exact-distance buckets, got "
            f"{max_distance}."
        )
    return RelativeBias(table, bool(bidirectional), max_distance)


# ----------------------------------------------------------------------------------------
# Mask modifiers
# ----------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Causal(MaskMod):
    """``q_idx >= kv_idx`` (aligned top-left, as ``is_causal=True``)."""

    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx >= kv_idx


def causal() -> Causal:
    """The causal mask as a ``mask_mod``: query ``i`` sees keys ``j <= i``."""
    return Causal()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlidingWindow(MaskMod):
    """``q_idx - left <= kv_idx <= q_idx + right`` (``right`` None: no bound on the right)."""

    left: int = dataclasses.field(metadata={"static": True})
    right: int | None = dataclasses.field(default=0, metadata={"static": True})

    def __call__(self, b, h, q_idx, kv_idx):
        visible = kv_idx >= q_idx - self.left
        if self.right is not None:
            visible = visible & (kv_idx <= q_idx + self.right)
        return visible


def sliding_window(left: int, right: int | None = 0) -> SlidingWindow:
    """Local attention as a ``mask_mod``: query ``i`` sees keys ``i-left ... i+right``.

    ``sliding_window(w)`` is causal attention to the last ``w`` keys and the query itself
    (as ``local_window_size=(w, 0)``); ``right=None`` removes the bound on the right.
    """
    left = _checks.size(left, "sliding_window left", allow_zero=True)
    right = None if right is None else _checks.size(right, "sliding_window right", allow_zero=True)
    return SlidingWindow(left, right)


def _batch_rows(x: Array, batch_size: int, what: str) -> None:
    if x.shape[0] not in (1, batch_size):
        raise ValueError(
            f"{what} has {x.shape[0]} batch rows (flattened) but the call has {batch_size}: "
            "give one row per sequence, or one shared row."
        )


def _at(ids: Array, b: Array, pos: Array) -> Array:
    """``ids[b, pos]`` for per-sequence rows ``[N, T]``, ``ids[0, pos]`` for one shared row."""
    return ids[0][pos] if ids.shape[0] == 1 else _readable(ids)[b, pos]


def _readable(rows: Array) -> Array:
    """Per-sequence ``rows`` replicated when their type shards them over a mesh's explicit
    axes: jax cannot type a gather of rows split over devices by the full batch's indices
    (it raises ShardingTypeError); the rows are small (lengths, segment ids)."""
    if not _util.sharded_axes(rows):
        return rows
    mesh = jax.typeof(rows).sharding.mesh  # the rows' own: no jax.set_mesh needed
    return jax.sharding.reshard(rows, jax.sharding.NamedSharding(mesh, jax.P()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class PrefixLM(MaskMod):
    """Causal, plus full attention inside the prefix: ``kv_idx <= q_idx or kv_idx < prefix[b]``."""

    prefix_lengths: Array  # int32 [N] or [1]

    def __call__(self, b, h, q_idx, kv_idx):
        p = self.prefix_lengths
        prefix = p.reshape(1, 1, 1, 1) if p.shape[0] == 1 else _readable(p)[b]  # [N|1, 1, 1, 1]
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    def check_shapes(self, *, batch_size, num_heads, q_len, kv_len):
        _batch_rows(self.prefix_lengths, batch_size, "prefix_lm prefix_lengths")


def prefix_lm(prefix_lengths) -> PrefixLM:
    """Prefix-LM masking (T5 / UniLM): bidirectional inside the prefix, causal after it.

    Query ``i`` of sequence ``b`` sees key ``j`` iff ``j <= i`` or ``j < prefix_lengths[b]``.

    Args:
      prefix_lengths: int, or int ``[batch...]`` (one prefix length per sequence).
    """
    lengths = _checks.int_array(prefix_lengths, "prefix_lengths")
    _checks.in_range(prefix_lengths, "prefix_lengths", 0, np.iinfo(np.int32).max)
    return PrefixLM(lengths.astype(jnp.int32).reshape(-1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Document(MaskMod):
    """``q_segments[b, q_idx] == kv_segments[b, kv_idx]`` (packed documents)."""

    q_segments: Array  # int32 [N or 1, Tq]
    kv_segments: Array  # int32 [N or 1, Tk]

    def __call__(self, b, h, q_idx, kv_idx):
        # [N|1, 1, Tq, 1] == [N|1, 1, 1, Tk]: the documents of this block's positions
        return _at(self.q_segments, b, q_idx) == _at(self.kv_segments, b, kv_idx)

    def check_shapes(self, *, batch_size, num_heads, q_len, kv_len):
        _batch_rows(self.q_segments, batch_size, "document segment_ids")
        for ids, length, name in (
            (self.q_segments, q_len, "q_len"),
            (self.kv_segments, kv_len, "kv_len"),
        ):
            if length is not None and ids.shape[1] != length:
                raise ValueError(
                    f"document segment ids have {ids.shape[1]} positions but the call's "
                    f"{name} is {length}."
                )


def document(segment_ids, kv_segment_ids=None) -> Document:
    """Packed documents as a ``mask_mod``: a query sees only keys of its own document.

    ``causal() & document(ids)`` is the usual packed causal LM mask.

    Args:
      segment_ids: int ``[batch..., q_len]`` (or ``[q_len]``, shared by the batch): the
        document of each query (and each key, in self-attention).
      kv_segment_ids: int ``[batch..., kv_len]``: the keys' documents when they differ
        (cross-attention); default ``segment_ids``.
    """
    q_ids = _checks.int_array(segment_ids, "segment_ids")
    kv_ids = (
        q_ids if kv_segment_ids is None else _checks.int_array(kv_segment_ids, "kv_segment_ids")
    )
    for ids, name in ((q_ids, "segment_ids"), (kv_ids, "kv_segment_ids")):
        if ids.ndim < 1:
            raise ValueError(f"{name} must have shape [batch..., length], got a scalar.")
    if q_ids.shape[:-1] != kv_ids.shape[:-1]:
        raise ValueError(
            f"segment_ids and kv_segment_ids must share batch dims, got {q_ids.shape} and "
            f"{kv_ids.shape}."
        )

    def rows(ids):
        return ids.astype(jnp.int32).reshape(-1, ids.shape[-1])

    return Document(rows(q_ids), rows(kv_ids))
