"""Multi-device checks of :mod:`jattn.ring`, run by tests/test_ring.py in a subprocess.

XLA's fake CPU devices (``--xla_force_host_platform_device_count=4``) must be set before
JAX starts, which pytest's process has already done with one device; so this script
runs alone, computes every comparison against the single-device references and prints
one JSON object of results that the tests assert on.
"""

from __future__ import annotations

import collections
import json
import sys

from _fake_devices import force_cpu_devices

force_cpu_devices(4)

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jattn
from jattn import blockwise, ring

SEQ = 4  # ring size on the 1-D mesh


def _inputs(batch, t, heads, kv_heads, d, dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (*batch, t, heads, d), dtype)
    k = jax.random.normal(kk, (*batch, t, kv_heads, d), dtype)
    v = jax.random.normal(kv, (*batch, t, kv_heads, d), dtype)
    return q, k, v


def _max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def _loss(attn, t):
    # A loss that weighs every position differently, so every gradient entry matters.
    # [batch..., T, H, D] -> scalar
    return lambda q, k, v: jnp.sum(attn(q, k, v) ** 2 * jnp.arange(1, t + 1)[:, None, None])


def _dense(causal):
    return lambda q, k, v: jattn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="dense"
    )


class _BlockCounter:
    """Counts, per device, the blockwise forward and backward calls that actually run.

    While active, ``blockwise.forward`` / ``backward`` are wrapped with a
    ``jax.debug.callback`` that fires only when the call executes: inside a ``lax.cond``
    branch that is not taken, it does not.
    """

    def __init__(self):
        self.counts = collections.Counter()
        self.original = {"forward": blockwise.forward, "backward": blockwise.backward}

    def _wrap(self, name):
        def record(device):
            self.counts[(name, int(device))] += 1

        def wrapped(*args):
            jax.debug.callback(record, lax.axis_index("seq"))
            return self.original[name](*args)

        return wrapped

    def __enter__(self):
        for name in self.original:
            setattr(blockwise, name, self._wrap(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.original.items():
            setattr(blockwise, name, fn)

    def per_device(self) -> dict:
        jax.effects_barrier()
        return {name: [self.counts[(name, i)] for i in range(SEQ)] for name in self.original}


def check_equal_to_single_device(mesh_1d) -> dict:
    """Forward and gradients of ring attention vs dense attention on one device.

    Also counts the blocks each device computes in one forward + backward pass.
    """
    results = {"blocks_computed": {}}
    t = 64
    q, k, v = _inputs((2,), t, 4, 2, 8)  # grouped-query: 4 query heads, 2 key/value heads
    for causal in (False, True):

        def attn(q, k, v, causal=causal):
            return ring.ring_attention(
                q, k, v, mesh=mesh_1d, is_causal=causal, block_q=8, block_k=8
            )

        name = "causal" if causal else "full"

        @jax.jit
        def forward_backward(q, k, v, attn=attn):
            # One forward + backward pass: the output and (dq, dk, dv) of _loss.
            out, pullback = jax.vjp(attn, q, k, v)
            return out, pullback(2 * out * jnp.arange(1, t + 1)[:, None, None])

        with _BlockCounter() as counter:
            out, grads = jax.block_until_ready(forward_backward(q, k, v))
            results["blocks_computed"][name] = counter.per_device()
        ref = _dense(causal)(q, k, v)
        grads_ref = jax.grad(_loss(_dense(causal), t), argnums=(0, 1, 2))(q, k, v)
        results[f"forward_{name}"] = {
            "err": _max_err(out, ref),
            "scale": float(jnp.max(jnp.abs(ref))),
            "shard_shape": out.sharding.shard_shape(out.shape),
        }
        results[f"grad_{name}"] = [
            {"err": _max_err(g, r), "scale": float(jnp.max(jnp.abs(r)))}
            for g, r in zip(grads, grads_ref, strict=True)
        ]
    return results


def check_padded_tiles(mesh_1d) -> dict:
    """Local blocks of 13 tokens with 8-token tiles: blockwise pads inside each device."""
    t = SEQ * 13
    q, k, v = _inputs((), t, 2, 2, 4, seed=1)  # no batch dims at all

    def attn(q, k, v):
        return ring.ring_attention(q, k, v, mesh=mesh_1d, is_causal=True, block_q=8, block_k=8)

    out = jax.jit(attn)(q, k, v)
    grads = jax.jit(jax.grad(_loss(attn, t), argnums=(0, 1, 2)))(q, k, v)
    grads_ref = jax.grad(_loss(_dense(True), t), argnums=(0, 1, 2))(q, k, v)
    return {
        "padded_forward_err": _max_err(out, _dense(True)(q, k, v)),
        "padded_grad_err": max(_max_err(g, r) for g, r in zip(grads, grads_ref, strict=True)),
    }


def check_2d_meshes() -> dict:
    """Batch x seq and seq x heads meshes: the other axes need no communication."""
    devices = np.array(jax.devices()).reshape(2, 2)
    t = 32
    q, k, v = _inputs((2, 3), t, 4, 4, 8, seed=2)
    ref = _dense(True)(q, k, v)
    batch_seq = Mesh(devices, ("data", "seq"))
    out_bs = jax.jit(
        lambda q, k, v: ring.ring_attention(
            q, k, v, mesh=batch_seq, batch_axis="data", is_causal=True
        )
    )(q, k, v)
    seq_heads = Mesh(devices, ("seq", "model"))
    out_sh = jax.jit(
        lambda q, k, v: ring.ring_attention(
            q, k, v, mesh=seq_heads, head_axis="model", is_causal=True
        )
    )(q, k, v)
    return {
        "shape_2d": ref.shape,
        "batch_seq": {
            "err": _max_err(out_bs, ref),
            "shard_shape": out_bs.sharding.shard_shape(out_bs.shape),
        },
        "seq_heads": {
            "err": _max_err(out_sh, ref),
            "shard_shape": out_sh.sharding.shard_shape(out_sh.shape),
        },
    }


def check_inside_user_shard_map(mesh_1d) -> dict:
    """``ring_attention_shard`` called from a user's own ``shard_map`` on local blocks."""
    t = 32
    q, k, v = _inputs((2,), t, 2, 2, 8, seed=3)
    spec = P(None, "seq", None, None)

    def body(q, k, v):
        # [B, T/n, H, D] local blocks
        return ring.ring_attention_shard(q, k, v, axis_name="seq", is_causal=True)

    out = jax.jit(
        jax.shard_map(body, mesh=mesh_1d, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    )(q, k, v)
    return {"user_shard_map_err": _max_err(out, _dense(True)(q, k, v))}


def check_bfloat16(mesh_1d) -> dict:
    t = 32
    q, k, v = _inputs((2,), t, 2, 2, 8, seed=4)
    out = ring.ring_attention(
        q.astype(jnp.bfloat16),
        k.astype(jnp.bfloat16),
        v.astype(jnp.bfloat16),
        mesh=mesh_1d,
        is_causal=True,
    )
    ref = _dense(True)(q, k, v)
    dense_bf16 = _dense(True)(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    return {
        "bf16_dtype": str(out.dtype),
        "bf16_err": _max_err(out, ref),
        "bf16_dense_err": _max_err(dense_bf16, ref),
    }


def check_explicit_axes(mesh_1d) -> dict:
    """A mesh from jax.make_mesh (explicit axes, its default), eager and jitted, 2-D too."""
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((SEQ,), ("seq",), axis_types=(explicit,))
    mesh_2d = jax.make_mesh((2, 2), ("data", "seq"), axis_types=(explicit, explicit))
    q, k, v = _inputs((2,), 32, 4, 2, 8, seed=3)
    ref = _dense(True)(q, k, v)

    def attn(mesh, **kw):
        return lambda q, k, v: ring.ring_attention(q, k, v, mesh=mesh, is_causal=True, **kw)

    grads = jax.jit(jax.grad(_loss(attn(mesh), 32), argnums=(0, 1, 2)))(q, k, v)
    grads_ref = jax.grad(_loss(_dense(True), 32), argnums=(0, 1, 2))(q, k, v)
    return {
        "explicit_axes": {
            "eager_err": _max_err(attn(mesh)(q, k, v), ref),
            "jit_err": _max_err(jax.jit(attn(mesh))(q, k, v), ref),
            "grad_err": max(_max_err(g, r) for g, r in zip(grads, grads_ref, strict=True)),
            "batch_seq_err": _max_err(jax.jit(attn(mesh_2d, batch_axis="data"))(q, k, v), ref),
        }
    }


def check_errors(mesh_1d) -> dict:
    q, k, v = _inputs((1,), 30, 2, 2, 4)  # 30 is not a multiple of 4
    errors = {}
    try:
        ring.ring_attention(q, k, v, mesh=mesh_1d)
    except ValueError as e:
        errors["indivisible_length"] = str(e)
    return {"errors": errors}


def main() -> None:
    if len(jax.devices()) != SEQ:
        sys.exit(f"expected {SEQ} fake CPU devices, got {jax.devices()}")
    mesh_1d = Mesh(np.array(jax.devices()), ("seq",))
    results = {"devices": len(jax.devices())}
    for check in (
        check_equal_to_single_device,
        check_padded_tiles,
        check_inside_user_shard_map,
        check_bfloat16,
        check_explicit_axes,
        check_errors,
    ):
        results.update(check(mesh_1d))
    results.update(check_2d_meshes())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
