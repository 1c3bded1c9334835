"""Tensor-parallel annotations of the modules on a 2x2 mesh, run by tests/test_sharding.py.

Needs 4 fake CPU devices, so it runs in its own process (the flag must be set before
JAX starts) and prints one JSON object of measurements for the tests to assert on.
"""

from __future__ import annotations

import json
import sys

from _fake_devices import force_cpu_devices

force_cpu_devices(4)

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jattn import linen as jl
from jattn import nnx as jn

D_IN, D_OUT, HEADS, T = 16, 32, 4, 8


def _layout(tree) -> dict:
    """``{'W_query/kernel': {'shape', 'shard_shape', 'spec'}, ...}`` of a tree of arrays."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        out[name] = {
            "shape": leaf.shape,
            "shard_shape": leaf.sharding.shard_shape(leaf.shape),
            # PartitionSpec drops trailing Nones: pad it to one entry per axis.
            "spec": [
                None if s is None else str(s)
                for s in (*leaf.sharding.spec, *(None,) * (leaf.ndim - len(leaf.sharding.spec)))
            ],
        }
    return out


def _max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)))


def check_linen(mesh, x) -> dict:
    module = jl.MultiHeadAttention(D_OUT, T, 0.0, HEADS, qkv_bias=True, model_axis="model")
    plain = jl.MultiHeadAttention(D_OUT, T, 0.0, HEADS, qkv_bias=True)
    key = jax.random.key(0)
    # The annotations give each parameter's PartitionSpec; jit creates it sharded.
    abstract = jax.eval_shape(module.init, key, x)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), nn.get_partition_spec(abstract))
    variables = jax.jit(module.init, out_shardings=shardings)(key, x)
    params = nn.meta.unbox(variables)["params"]
    reference = plain.init(key, x)
    x_sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    y = jax.jit(module.apply)(variables, x_sharded)
    return {
        "linen_layout": _layout(params),
        "linen_same_values": _max_err(
            jnp.concatenate([a.ravel() for a in jax.tree.leaves(params)]),
            jnp.concatenate([a.ravel() for a in jax.tree.leaves(reference["params"])]),
        ),
        "linen_forward_err": _max_err(y, plain.apply(reference, x)),
        "linen_output_shard_shape": y.sharding.shard_shape(y.shape),
        "linen_plain_is_array": all(
            type(leaf) is not nn.Partitioned
            for leaf in jax.tree.leaves(reference, is_leaf=lambda v: isinstance(v, nn.Partitioned))
        ),
    }


def check_nnx(mesh, x) -> dict:
    with jax.set_mesh(mesh):
        model = jn.MultiHeadAttention(
            D_IN, D_OUT, T, 0.0, HEADS, qkv_bias=True, model_axis="model", rngs=nnx.Rngs(0)
        )
    plain = jn.MultiHeadAttention(D_IN, D_OUT, T, 0.0, HEADS, qkv_bias=True, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    y = nnx.jit(lambda m, x: m(x))(model, jax.device_put(x, NamedSharding(mesh, P("data"))))
    return {
        "nnx_layout": _layout(nnx.to_pure_dict(params)),
        "nnx_forward_err": _max_err(y, plain(x)),
    }


def main() -> None:
    if len(jax.devices()) != 4:
        sys.exit(f"expected 4 fake CPU devices, got {jax.devices()}")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    x = jax.random.normal(jax.random.key(1), (4, T, D_IN))
    results = {}
    results.update(check_linen(mesh, x))
    results.update(check_nnx(mesh, x))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
