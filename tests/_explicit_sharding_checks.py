"""The modules' ``model_axis`` on a mesh from ``jax.make_mesh`` (explicit axes, its default).

Run by tests/test_flax_interop.py as ``python _explicit_sharding_checks.py N`` (N fake CPU
devices, a ``('batch', 'model')`` mesh of ``(N // 2, 2)``); prints one JSON object.
"""

from __future__ import annotations

import json
import sys

from _fake_devices import force_cpu_devices

DEVICES = int(sys.argv[1])
force_cpu_devices(DEVICES)

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn import linen as jl
from jattn import nnx as jn

D_IN, D_OUT, HEADS, T = 16, 32, 4, 8


def _result(y, reference) -> dict:
    spec = [None if s is None else str(s) for s in y.sharding.spec]
    return {"err": float(jnp.max(jnp.abs(y - reference))), "spec": spec}


def check_nnx(mesh, x_host) -> dict:
    plain = jn.MultiHeadAttention(D_IN, D_OUT, T, 0.0, HEADS, rngs=nnx.Rngs(0))
    reference = plain(x_host)
    with jax.set_mesh(mesh):
        module = jn.MultiHeadAttention(
            D_IN, D_OUT, T, 0.0, HEADS, model_axis="model", rngs=nnx.Rngs(0)
        )
        x = jax.device_put(x_host, NamedSharding(mesh, P("batch")))
        eager = module(x)
        jitted = nnx.jit(lambda m, x: m(x))(module, x)
        kernel_spec = [
            None if s is None else str(s) for s in module.out_proj.kernel[...].sharding.spec
        ]
    return {
        "eager": _result(eager, reference),
        "jit": _result(jitted, reference),
        "out_kernel": kernel_spec,
    }


def check_linen(mesh, x_host) -> dict:
    module = jl.MultiHeadAttention(D_OUT, T, 0.0, HEADS, model_axis="model")
    variables = module.init(jax.random.key(0), x_host)
    reference = module.apply(nn.meta.unbox(variables), x_host)
    specs = nn.get_partition_spec(variables)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    variables = jax.device_put(nn.meta.unbox(variables), shardings)
    with jax.set_mesh(mesh):
        x = jax.device_put(x_host, NamedSharding(mesh, P("batch")))
        eager = module.apply(variables, x)
        jitted = jax.jit(module.apply)(variables, x)
    return {"eager": _result(eager, reference), "jit": _result(jitted, reference)}


def main() -> None:
    mesh = jax.make_mesh((DEVICES // 2, 2), ("batch", "model"))
    x = jax.random.normal(jax.random.key(1), (4, T, D_IN))
    print(
        json.dumps(
            {
                "axis_types": [str(t) for t in mesh.axis_types],
                "nnx": check_nnx(mesh, x),
                "linen": check_linen(mesh, x),
            }
        )
    )


if __name__ == "__main__":
    main()
