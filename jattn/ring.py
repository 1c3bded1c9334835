"""Sequence-parallel (ring) attention: the blockwise core distributed over a mesh axis.

For contexts too long for one device, the sequence is split in ``n`` contiguous blocks
over a ``seq`` mesh axis: device ``i`` holds queries, keys and values of positions
``i * T/n ... (i + 1) * T/n - 1``. The key/value blocks travel around the ring
(``lax.ppermute`` to the next device, ``n - 1`` times), and each device attends its
query block to every key/value block as it passes with :mod:`jattn.blockwise`'s tiled
forward pass, merging the partial results exactly through their log-sum-exp
(Liu et al. 2023, "Ring Attention with Blockwise Transformers"). No device ever holds
more than two key/value blocks, and no ``[T, T]`` matrix exists anywhere.

With ``is_causal=True`` a key/value block that lies entirely in the future of a
device's query block is skipped (a ``lax.cond`` per device: device ``i`` computes
``i + 1`` of the ``n`` blocks, the diagonal one with the causal mask, the others
unmasked). The blocks are contiguous, so the work is unbalanced (the last device does
``n`` blocks, the first one); a zigzag/striped layout would even it out.

The backward pass is a second trip around the ring (FlashAttention-2's backward per
block, :func:`jattn.blockwise.backward`, with the *global* output and log-sum-exp):
each device accumulates ``dq`` for its own queries while the ``dk, dv`` accumulators
travel with their key/value block and arrive home after ``n`` hops.

Two entry points:

* :func:`ring_attention`: global arrays in, global arrays out, given a ``Mesh``; it wraps
  the call in ``jax.shard_map``.
* :func:`ring_attention_shard`: the per-device function, for use inside a user's own
  ``jax.shard_map`` (its arguments are the local blocks).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jattn import _checks, blockwise
from jattn._util import softmax_dtype

__all__ = ["ring_attention", "ring_attention_shard"]

Array = jax.Array

# blockwise's per-call arrays (lengths, segments, mask, dropout): ring attention has none.
_NO_AUX = blockwise.Aux()


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring call (hashable: it keys the custom VJP's trace)."""

    axis_name: Any
    axis_size: int
    causal: bool
    diagonal: blockwise.Config  # a device's own key/value block (causal mask if causal)
    off_diagonal: blockwise.Config  # any other block that is computed: no mask at all


def _shift(tree, ring: _Ring):
    """Sends every array of ``tree`` to the next device on the ring (``i -> i + 1``)."""
    n = ring.axis_size
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), tree)


def _block_branch(ring: _Ring, step):
    """Which key/value block a device holds at ``step`` and whether to compute it.

    At ``step`` (>= 1) device ``i`` holds the block of device ``(i - step) mod n``;
    causally it is visible only when that block lies in the past (``step <= i``).
    """
    if not ring.causal:
        return jnp.asarray(True)
    return step <= lax.axis_index(ring.axis_name)


def _merge(out, lse, out_b, lse_b):
    """Softmax-merges two partial results over disjoint key sets.

    ``out`` ``[N, K, G, Tq, Dv]`` (float32) and ``lse`` ``[N, K, G, Tq]`` are the output and
    log-sum-exp over the keys seen so far; ``out_b, lse_b`` those over another block.
    """
    m = jnp.maximum(lse, lse_b)
    w, w_b = jnp.exp(lse - m), jnp.exp(lse_b - m)
    total = w + w_b
    out = (w[..., None] * out + w_b[..., None] * out_b.astype(out.dtype)) / total[..., None]
    return out, m + jnp.log(total)


def _ring_forward(ring: _Ring, q, k, v):
    """``(out, lse)`` of the local queries over all keys: out in q's dtype, lse float32."""
    # Step 0: the device's own block, always visible (the diagonal under a causal mask).
    out, lse = blockwise.forward(ring.diagonal, q, k, v, _NO_AUX)
    out = out.astype(softmax_dtype(q.dtype))

    def step(s, carry):
        k_s, v_s, out, lse = _shift(carry[:2], ring) + carry[2:]

        def attend(c):
            out_b, lse_b = blockwise.forward(ring.off_diagonal, q, k_s, v_s, _NO_AUX)
            return _merge(*c, out_b, lse_b)

        out, lse = lax.cond(_block_branch(ring, s), attend, lambda c: c, (out, lse))
        return k_s, v_s, out, lse

    _, _, out, lse = lax.fori_loop(1, ring.axis_size, step, (k, v, out, lse))
    return out.astype(q.dtype), lse


def _ring_backward(ring: _Ring, q, k, v, out, lse, d_out):
    """``(dq, dk, dv)`` of the local blocks: a second trip around the ring."""
    # Own block first; the dk, dv accumulators then travel with their key/value block.
    dq, dk, dv = blockwise.backward(ring.diagonal, q, k, v, _NO_AUX, out, lse, d_out)
    f32 = softmax_dtype(q.dtype)
    dq, dk, dv = dq.astype(f32), dk.astype(f32), dv.astype(f32)

    def step(s, carry):
        k_s, v_s, dk_s, dv_s, dq = _shift(carry[:4], ring) + carry[4:]

        def attend(c):
            dq, dk_s, dv_s = c
            dq_b, dk_b, dv_b = blockwise.backward(
                ring.off_diagonal, q, k_s, v_s, _NO_AUX, out, lse, d_out
            )
            return dq + dq_b, dk_s + dk_b, dv_s + dv_b

        dq, dk_s, dv_s = lax.cond(_block_branch(ring, s), attend, lambda c: c, (dq, dk_s, dv_s))
        return k_s, v_s, dk_s, dv_s, dq

    _, _, dk, dv, dq = lax.fori_loop(1, ring.axis_size, step, (k, v, dk, dv, dq))
    # After n - 1 hops each accumulator sits one device short of its block's owner.
    dk, dv = _shift((dk, dv), ring)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v):
    return _ring_forward(ring, q, k, v)[0]


def _ring_attention_fwd(ring, q, k, v):
    out, lse = _ring_forward(ring, q, k, v)
    return out, (q, k, v, out, lse)


def _ring_attention_bwd(ring, residuals, d_out):
    return _ring_backward(ring, *residuals, d_out)


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def _check_options(scale, is_causal, block_q, block_k) -> None:
    _checks.scale(scale)
    _checks.flag(is_causal, "is_causal")
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if block is not None:
            _checks.size(block, name)


def _to_tiles(x: Array, groups: int, padded: int) -> Array:
    """``[batch..., T, heads, D]`` -> blockwise's ``[N, K, G, T_pad, D]`` (``G=1`` for keys)."""
    *batch, t, heads, d = x.shape
    k_heads = heads // groups
    # [batch..., T, K, G, D] -> [N, K, G, T, D]
    x = x.reshape(math.prod(batch), t, k_heads, groups, d).transpose(0, 2, 3, 1, 4)
    return jnp.pad(x, ((0, 0),) * 3 + ((0, padded - t), (0, 0)))


def ring_attention_shard(
    query,
    key,
    value,
    *,
    axis_name: Any,
    is_causal: bool = False,
    scale: float | None = None,
    precision: Any = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Array:
    """Ring attention on the local blocks; call it inside ``jax.shard_map(..., check_vma=False)``.

    (``check_vma=False``: the blockwise loops start from carries that do not vary over
    the mesh axis, which the varying-manual-axes type check rejects.)

    Device ``i`` of the ``axis_name`` ring holds block ``i`` of the sequence (contiguous,
    equal-length blocks): ``query`` ``[batch..., T/n, H, D]``, ``key`` and ``value``
    ``[batch..., T/n, K, D]``. The result equals the ``i``-th block of
    ``jattn.dot_product_attention`` on the whole sequence.

    Args:
      query: local block ``[batch..., q_block, num_heads, head_dim]``.
      key: local block ``[batch..., kv_block, num_kv_heads, head_dim]`` (``num_heads`` a
        multiple of ``num_kv_heads``).
      value: local block ``[batch..., kv_block, num_kv_heads, v_head_dim]``.
      axis_name: the mesh axis the sequence is split over.
      is_causal: causal mask over *global* positions (query ``i`` sees keys ``j <= i``);
        needs ``q_block == kv_block``. Blocks entirely in the future are not computed.
      scale: logit multiplier; default ``1 / sqrt(head_dim)``.
      precision: ``jax.lax.Precision`` of the tile products.
      block_q: query tile length inside each device (default: blockwise's).
      block_k: key tile length inside each device (default: blockwise's).

    Returns:
      The local output block ``[batch..., q_block, num_heads, v_head_dim]`` in the
      inputs' dtype.

    Raises:
      ValueError: shapes that do not match (see :func:`jattn.dot_product_attention`), or
        ``is_causal`` with query and key blocks of different lengths.
      TypeError: non-float inputs.
    """
    query, key, value = _checks.qkv(query, key, value)
    _check_options(scale, is_causal, block_q, block_k)
    dtype = jnp.result_type(query, key, value)
    query, key, value = query.astype(dtype), key.astype(dtype), value.astype(dtype)
    *batch, q_len, num_heads, d = query.shape
    kv_len, k_heads, dv = value.shape[-3:]
    if is_causal and q_len != kv_len:
        raise ValueError(
            f"ring_attention with is_causal=True needs query and key blocks of the same "
            f"length (self-attention), got {q_len} and {kv_len}."
        )
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    try:
        ring_size = lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"axis_name={axis_name!r} is not a mesh axis bound here: call ring_attention_shard "
            "inside jax.shard_map over a mesh with that axis, or use ring_attention(mesh=...)."
        ) from None
    configs = {
        name: blockwise.make_config(
            q_len=q_len,
            kv_len=kv_len,
            num_heads=num_heads,
            kv_heads=k_heads,
            batch_size=math.prod(batch),
            scale=scale,
            is_causal=causal,
            precision=precision,
            block_q=block_q or blockwise.DEFAULT_BLOCK_Q,
            block_k=block_k or blockwise.DEFAULT_BLOCK_K,
        )
        for name, causal in (("diagonal", is_causal), ("off_diagonal", False))
    }
    ring = _Ring(axis_name=axis_name, axis_size=ring_size, causal=is_causal, **configs)
    cfg = ring.diagonal
    groups = num_heads // k_heads
    # [N, K, G, Tq_pad, D] and [N, K, 1, Tk_pad, D] -> [N, K, Tk_pad, D]
    q = _to_tiles(query, groups, cfg.padded_q)
    k = _to_tiles(key, 1, cfg.padded_kv)[:, :, 0]
    v = _to_tiles(value, 1, cfg.padded_kv)[:, :, 0]
    out = _ring_attention(ring, q, k, v)
    # [N, K, G, Tq_pad, Dv] -> [batch..., q_len, H, Dv]
    out = out[:, :, :, :q_len].transpose(0, 3, 1, 2, 4)
    return out.reshape(*batch, q_len, num_heads, dv)


def ring_attention(
    query,
    key,
    value,
    *,
    mesh: Mesh,
    seq_axis: str = "seq",
    batch_axis: str | tuple[str, ...] | None = None,
    head_axis: str | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    precision: Any = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Array:
    """Attention of whole sequences, split over the ``seq_axis`` of ``mesh`` (ring attention).

    Computes the same function as ``jattn.dot_product_attention(query, key, value,
    is_causal=is_causal, scale=scale)``, with the sequence axis sharded over
    ``seq_axis``, optionally the first batch axis over ``batch_axis`` and the heads over
    ``head_axis`` (those two need no communication). Differentiable (custom VJP, a
    second ring pass).

    Args:
      query: ``[batch..., q_len, num_heads, head_dim]``; ``q_len`` a multiple of the
        ``seq_axis`` size.
      key: ``[batch..., kv_len, num_kv_heads, head_dim]``.
      value: ``[batch..., kv_len, num_kv_heads, v_head_dim]``.
      mesh: the device mesh.
      seq_axis: mesh axis over which the sequence is split into contiguous blocks.
      batch_axis: mesh axis (or axes) for the first batch dim, or None (replicated).
      head_axis: mesh axis for the heads (query and key/value heads), or None.
      is_causal: causal mask (query ``i`` sees keys ``j <= i``); needs ``q_len == kv_len``.
      scale: logit multiplier; default ``1 / sqrt(head_dim)``.
      precision: ``jax.lax.Precision`` of the tile products.
      block_q: query tile length inside each device.
      block_k: key tile length inside each device.

    Returns:
      ``[batch..., q_len, num_heads, v_head_dim]``, sharded like ``query``.

    Raises:
      ValueError: an axis name not in ``mesh``, a length or head count that does not
        divide evenly over its axis, a batch axis without batch dims, plus the shape
        errors of :func:`ring_attention_shard`.
    """
    query, key, value = _checks.qkv(query, key, value)
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((n,), ('seq',))), got "
            f"{type(mesh).__name__}."
        )
    _check_options(scale, is_causal, block_q, block_k)
    for name, axis in (("seq_axis", seq_axis), ("head_axis", head_axis)):
        if axis is not None and axis not in mesh.shape:
            raise ValueError(
                f"{name}={axis!r} is not an axis of the mesh (axes {tuple(mesh.shape)})."
            )
    batch_axes = (batch_axis,) if isinstance(batch_axis, str) else tuple(batch_axis or ())
    for axis in batch_axes:
        if axis not in mesh.shape:
            raise ValueError(
                f"batch_axis {axis!r} is not an axis of the mesh (axes {tuple(mesh.shape)})."
            )
    n_batch = query.ndim - 3
    if batch_axes and n_batch == 0:
        raise ValueError("batch_axis was given but query has no batch dims.")
    ring_size = mesh.shape[seq_axis]
    for name, length in (("q_len", query.shape[-3]), ("kv_len", key.shape[-3])):
        if length % ring_size:
            raise ValueError(
                f"{name} ({length}) must be a multiple of the {seq_axis!r} axis size "
                f"({ring_size}): each device holds an equal block. Pad the sequence "
                "(and mask the padding) or pick another mesh."
            )
    if head_axis is not None and key.shape[-2] % mesh.shape[head_axis]:
        raise ValueError(
            f"num_kv_heads ({key.shape[-2]}) must be a multiple of the {head_axis!r} axis "
            f"size ({mesh.shape[head_axis]}) to shard the heads over it."
        )
    batch_spec = (batch_axes or None,) + (None,) * (n_batch - 1) if n_batch else ()
    spec = P(*batch_spec, seq_axis, head_axis, None)
    shard = functools.partial(
        ring_attention_shard,
        axis_name=seq_axis,
        is_causal=is_causal,
        scale=scale,
        precision=precision,
        block_q=block_q,
        block_k=block_k,
    )
    if jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
        # Explicit mesh axes (jax.make_mesh's default): shard_map takes inputs already laid
        # out as in_specs says, and does not move them itself.
        layout = jax.sharding.NamedSharding(mesh, spec)
        query, key, value = (jax.reshard(x, layout) for x in (query, key, value))
    # check_vma=False: blockwise's loops start from fresh (device-invariant) carries.
    return jax.shard_map(
        shard, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
    )(query, key, value)
