"""The kernel as a differentiable jax function: ``jax.ffi.ffi_call`` inside a custom VJP.

:func:`attention` takes float32 ``q [batch..., Tq, H, D]``, ``k [batch..., Tk, K, D]``,
``v [batch..., Tk, K, Dv]`` and the per-batch operands of :class:`Aux`, every one with the
same leading ``batch...`` (so ``vmap``, through ``vmap_method="broadcast_all"``, adds one
more leading axis to all of them and the kernel flattens them together). It returns
``out [batch..., Tq, H, Dv]`` and ``lse [batch..., H, Tq]``, both float32; both are
differentiable (the backward kernel takes the lse's cotangent in ``delta``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn.kernels.cpu import _library

Array = jax.Array

# A block mask's tile map entries other than a PARTIAL tile's slot (csrc/attention.h).
TILE_EMPTY = -1
TILE_FULL = -2

# From this many queries on, the forward reads K^T from one transposed copy of the keys
# (register-blocked tile products); below it, dot products against the keys in place.
TRANSPOSE_MIN_QUERIES = 16


class Aux(NamedTuple):
    """The per-batch operands (each with the call's leading ``batch...``).

    Attributes:
      q_len, kv_len: int32 ``[batch...]`` (the full lengths when the call has none).
      q_seg, kv_seg: int32 ``[batch..., Tq]``, ``[batch..., Tk]`` (``[batch..., 1]``
        placeholders, never read, without segment ids).
      sinks: float32 ``[batch..., H]`` (a ``[batch..., 1]`` placeholder without sinks).
      drop_k0, drop_k1: uint32 ``[batch..., H, Tq]``: each row's dropout keys
        (:func:`jattn._prng.row_keys`; ``[batch..., 1, 1]`` placeholders without dropout).
      drop_threshold: uint32 ``[batch...]`` (:func:`jattn._prng.keep_threshold`).
      drop_scale: float32 ``[batch...]``: 1 / keep probability.
      slopes: float32 ``[batch..., H]``: ALiBi slopes (a ``[batch..., 1]`` placeholder
        without ALiBi).
      bias: float32 in its own broadcast shape ``[batch...|1, H|1, Tq|1, Tk|1]`` (q's rank;
        a size-1 axis is broadcast, never copied), added to the logits after the score_mod
        (the dense path's order); all-ones-shaped placeholder without a bias.
      mask: bool, True = attend, in its broadcast shape like ``bias`` (placeholder without):
        the call's ``mask=`` array alone.
      blocks: int32 ``[batch...|1, H|1, nbq, nbk]``: a block mask's tile map
        (placeholder without): :data:`TILE_EMPTY`, :data:`TILE_FULL`, or a PARTIAL tile's
        slot in ``tile_mask``.
      tile_mask: bool ``[1..., n_partial, bm_q, bm_k]`` (q's rank; placeholder without): the
        block mask's ``mask_mod`` on its PARTIAL tiles alone, slot by slot.
    """

    q_len: Array
    kv_len: Array
    q_seg: Array
    kv_seg: Array
    sinks: Array
    drop_k0: Array
    drop_k1: Array
    drop_threshold: Array
    drop_scale: Array
    slopes: Array
    bias: Array
    mask: Array
    blocks: Array
    tile_mask: Array


@dataclasses.dataclass(frozen=True)
class Static:
    """The compile-time options (FFI attributes) of one call.

    Attributes:
      scale: the logit multiplier.
      softcap: ``cap`` of ``cap * tanh(logits / cap)``, or 0.0 for none.
      causal: query ``i`` sees keys ``j <= i``.
      window_left, window_right: the local window, -1 for no limit on that side.
      has_segments, has_sinks, has_dropout, has_bias, has_mask: whether ``Aux``'s segment
        ids, sinks, dropout, bias and mask operands are real.
      has_blocks: 0 without a block mask, 1 with one (``Aux.blocks`` and ``tile_mask``).
      block_mask_q, block_mask_k: the block mask's tile sizes (0 without).
      block_q, block_k: tile sizes.
      alibi: 0 (none), 1 (``slope * (j - i)``) or 2 (symmetric, ``-slope * |j - i|``).
      max_threads: most workers per call (0: every thread of XLA's intra-op pool).
    """

    scale: float
    softcap: float
    causal: bool
    window_left: int
    window_right: int
    has_segments: bool
    has_sinks: bool
    has_dropout: bool
    alibi: int
    has_bias: bool
    has_mask: bool
    has_blocks: int
    block_mask_q: int
    block_mask_k: int
    block_q: int
    block_k: int
    max_threads: int

    def attributes(self, *, backward: bool) -> dict:
        attrs = dict(
            scale=np.float32(self.scale),
            softcap=np.float32(self.softcap),
            causal=np.int64(self.causal),
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            has_segments=np.int64(self.has_segments),
            has_dropout=np.int64(self.has_dropout),
            alibi=np.int64(self.alibi),
            has_bias=np.int64(self.has_bias),
            has_mask=np.int64(self.has_mask),
            has_blocks=np.int64(self.has_blocks),
            block_mask_q=np.int64(self.block_mask_q),
            block_mask_k=np.int64(self.block_mask_k),
            block_q=np.int64(self.block_q),
            block_k=np.int64(self.block_k),
            max_threads=np.int64(self.max_threads),
        )
        if not backward:
            attrs["has_sinks"] = np.int64(self.has_sinks)
        return attrs


# Floats past the last key tile on each row of a transposed copy: rows a power of two of
# floats apart would all map to the same few L1 sets, and a tile's rows are read together
# (one 64-byte line more per row: the backward 7-10% faster at T=4096 on AVX-512).
ROW_SKEW = 16


def transposed_shape(x_shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """The shape of the transposed copy the kernel makes of ``[batch..., Tk, K, E]`` keys
    (or values): ``[batch..., K, E, Tkp]``, ``Tkp`` a multiple of ``block`` plus
    :data:`ROW_SKEW`.

    The kernel's products against keys read K^T (and the backward's V^T) tiles from this
    one copy instead of transposing every tile. The kernel writes it, on its workers, into a
    result XLA allocates (a workspace the caller drops): XLA's own transpose ran on one
    thread, a tenth of the forward on two.
    """
    *batch, tk, kh, e = x_shape
    return (*batch, kh, e, tk + (-tk % block) + ROW_SKEW)


def varying_axes(*xs) -> frozenset:
    """The manual mesh axes (inside ``shard_map``) that any of ``xs`` varies over."""
    return frozenset().union(*(jax.typeof(x).mat.varying for x in jax.tree.leaves(xs)))


def vary(tree, axes: frozenset):
    """Every array of ``tree`` cast to vary over ``axes`` (those it does not already), as a
    jax primitive's operands and results are: ``ffi_call`` returns its results unvarying,
    and a custom VJP's cotangents must match their primals' types."""

    def cast(x):
        missing = tuple(sorted(axes - jax.typeof(x).mat.varying))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree) if axes else tree


def _forward_call(q, k, v, aux: Aux, static: Static):
    if _library.library() is None:  # the adapter refuses first; this is a safety net
        raise RuntimeError(f"jattn's fused CPU kernel is {_library.status()}")
    *batch, tq, h, _ = q.shape
    dv = v.shape[-1]
    if q.shape[-3] >= TRANSPOSE_MIN_QUERIES:
        kt_shape = transposed_shape(k.shape, static.block_k)
    else:  # decoding: the kernel reads the keys in place (a copy would cost more than it saves)
        kt_shape = (*batch, 1)
    out_types = (
        jax.ShapeDtypeStruct((*batch, tq, h, dv), jnp.float32),
        jax.ShapeDtypeStruct((*batch, h, tq), jnp.float32),
        jax.ShapeDtypeStruct(kt_shape, jnp.float32),  # the kernel's workspace
    )
    call = functools.partial(
        jax.ffi.ffi_call(_library.FORWARD_TARGET, out_types, vmap_method="broadcast_all"),
        **static.attributes(backward=False),
    )
    out, lse, _ = _without_forward_mode(call)(q, k, v, *aux)
    return vary((out, lse), varying_axes(q, k, v, aux))


def attention(q: Array, k: Array, v: Array, aux: Aux, static: Static) -> tuple[Array, Array]:
    """``(out, lse)`` of the fused kernel (shapes: module docstring). Inside ``shard_map``
    the operands first vary over the same mesh axes (jax sums the gradient of one that did
    not, such as keys replicated over a head-sharded axis, when it transposes the cast)."""
    q, k, v, aux = vary((q, k, v, aux), varying_axes(q, k, v, aux))
    return _attention(q, k, v, aux, static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q: Array, k: Array, v: Array, aux: Aux, static: Static) -> tuple[Array, Array]:
    return _forward_call(q, k, v, aux, static)


def _attention_fwd(q, k, v, aux, static):
    out, lse = _forward_call(q, k, v, aux, static)
    return (out, lse), (q, k, v, aux, out, lse)


def _attention_bwd(static: Static, residuals, cotangents):
    q, k, v, aux, out, lse = residuals
    d_out, d_lse = cotangents
    # delta_i = sum_d dO_id O_id - dlse_i: the backward's per-row term (the lse's
    # cotangent enters dS = P * (dP - delta) like a constant shift).
    delta = jnp.swapaxes(jnp.sum(d_out * out, axis=-1), -1, -2) - d_lse  # [batch..., H, Tq]
    *batch, tq, h, _ = q.shape
    slope_rows = (*batch, h, tq) if static.alibi else (*batch, 1, 1)
    mode, bias_rows = _dbias_layout(aux.bias, static, (*batch, h, tq, k.shape[-3]))
    out_types = (
        jax.ShapeDtypeStruct(q.shape, jnp.float32),
        jax.ShapeDtypeStruct(k.shape, jnp.float32),
        jax.ShapeDtypeStruct(v.shape, jnp.float32),
        jax.ShapeDtypeStruct(slope_rows, jnp.float32),
        jax.ShapeDtypeStruct(bias_rows, jnp.float32),
        jax.ShapeDtypeStruct(transposed_shape(k.shape, static.block_k), jnp.float32),
        jax.ShapeDtypeStruct(transposed_shape(v.shape, static.block_k), jnp.float32),
    )  # the last two: the kernel's workspace, K^T and V^T
    call = functools.partial(
        jax.ffi.ffi_call(_library.BACKWARD_TARGET, out_types, vmap_method="broadcast_all"),
        **static.attributes(backward=True), dbias_mode=np.int64(mode),
    )  # fmt: skip
    *results, _, _ = _without_forward_mode(call)(
        q, k, v, aux.q_len, aux.kv_len, aux.q_seg, aux.kv_seg, d_out, lse, delta,
        aux.drop_k0, aux.drop_k1, aux.drop_threshold, aux.drop_scale, aux.slopes, aux.bias,
        aux.mask, aux.blocks, aux.tile_mask,
    )  # fmt: skip
    axes = varying_axes(q, k, v, aux, d_out, lse)
    dq, dk, dv, d_slope_rows, d_bias_rows = vary(results, axes)
    d_sinks = jnp.zeros_like(aux.sinks)
    if static.has_sinks:
        # d lse_i / d sink = p_sink,i = exp(sink - lse_i); d out_i / d sink = -p_sink,i out_i.
        # A -inf sink (a head without one) has p_sink 0, also in a row that sees no key,
        # whose lse is then -inf too (exp(-inf + inf) would be NaN).
        sinks = aux.sinks[..., None]
        p_sink = jnp.where(jnp.isneginf(sinks), 0.0, jnp.exp(sinks - lse))  # [batch..., H, Tq]
        d_sinks = -jnp.sum(p_sink * delta, axis=-1)
    d_slopes = jnp.sum(d_slope_rows, axis=-1) if static.alibi else jnp.zeros_like(aux.slopes)
    d_bias = jnp.zeros_like(aux.bias)
    if static.has_bias:
        d_bias = _reduce_to(d_bias_rows.reshape(_dbias_shape(mode, batch, h, tq, k.shape[-3])),
                            aux.bias.shape)  # fmt: skip
    # Only the float operands have gradients; the ints, bools and keys get None.
    d_aux = Aux(*[None] * len(Aux._fields))._replace(sinks=d_sinks, slopes=d_slopes, bias=d_bias)
    return dq, dk, dv, d_aux


def _without_forward_mode(call):
    """``call`` (a kernel's ``ffi_call``) with a forward-mode rule that names the fix.
    Forward over reverse mode traced around the attention call makes the routing take
    another path; applied from outside a ``jax.jit`` holding it (``jax.hessian(jax.jit(f))``)
    it reaches the kernels, where JAX's own error names only the FFI target."""

    @jax.custom_jvp
    def kernel(*operands):
        return call(*operands)

    @kernel.defjvp
    def _(primals, tangents):
        raise ValueError(
            "jattn's fused CPU kernel has no forward-mode derivative, and a second derivative "
            "(jax.hessian, jax.jacfwd or jax.grad of jax.grad) was taken outside a jax.jit "
            "holding the attention call, where the routing cannot see it. Apply jax.jit "
            "outside (jax.jit(jax.hessian(f))) or pass implementation='dense'."
        )

    return kernel


def _dbias_layout(bias, static: Static, logits: tuple[int, ...]) -> tuple[int, tuple]:
    """The kernel's bias-gradient mode and output shape (``Params::dbias_mode``): dS itself
    ``[batch..., H, Tq, Tk]`` (1), its row sums ``[batch..., H, Tq]`` for a bias broadcast
    over the keys (2), its column sums ``[batch..., H, Tk]`` for one broadcast over the
    queries (3); the broadcast batch and head axes are summed by XLA."""
    *batch, h, tq, tk = logits
    if not static.has_bias:
        return 0, (*batch, 1, 1)
    full_q, full_k = bias.shape[-2] == tq, bias.shape[-1] == tk
    if full_q and full_k:
        return 1, (*batch, h, tq, tk)
    if full_k:
        return 3, (*batch, h, tk)
    return 2, (*batch, h, tq)


def _dbias_shape(mode: int, batch, h: int, tq: int, tk: int) -> tuple[int, ...]:
    """The kernel's bias gradient with the logits' rank (size 1 on the summed axis)."""
    return (*batch, h, tq if mode in (1, 2) else 1, tk if mode in (1, 3) else 1)


def _reduce_to(x: Array, shape: tuple[int, ...]) -> Array:
    """``x`` summed over the axes where ``shape`` (same rank) broadcasts (size 1)."""
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if n != m)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


_attention.defvjp(_attention_fwd, _attention_bwd)
