"""Tensor parallelism in the modules: ``model_axis`` shards Q/K/V by columns, out_proj by rows.

The 2x2-mesh checks need 4 fake CPU devices, set before JAX starts: they run once in a
subprocess (tests/_sharding_checks.py) that prints its measurements as JSON. The
single-device checks (defaults unchanged, errors) run here.
"""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _fake_devices import run_checks
from flax import nnx

from jattn import linen as jl
from jattn import nnx as jn

CHECKS = Path(__file__).with_name("_sharding_checks.py")

# W_query / W_key / W_value kernels [16, 32] split by columns over 'model' (2 devices);
# out_proj's kernel [32 -> 32] by rows, its bias replicated.
EXPECTED = {
    "W_query/kernel": ([16, 16], [None, "model"]),
    "W_query/bias": ([16], ["model"]),
    "W_key/kernel": ([16, 16], [None, "model"]),
    "W_key/bias": ([16], ["model"]),
    "W_value/kernel": ([16, 16], [None, "model"]),
    "W_value/bias": ([16], ["model"]),
    "out_proj/kernel": ([16, 32], ["model", None]),
    "out_proj/bias": ([32], [None]),
}


@pytest.fixture(scope="module")
def multi() -> dict:
    """Results of tests/_sharding_checks.py on a 2x2 ('data', 'model') mesh."""
    return run_checks(CHECKS)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_parameters_sharded_over_model_axis(multi, api):
    layout = multi[f"{api}_layout"]
    assert set(layout) == set(EXPECTED)
    for name, (shard_shape, spec) in EXPECTED.items():
        assert (layout[name]["shard_shape"], layout[name]["spec"]) == (shard_shape, spec), name


def test_linen_annotations_change_no_values(multi):
    # with_partitioning only adds metadata: same key, same initial values.
    assert multi["linen_same_values"] == 0.0
    assert multi["linen_plain_is_array"]


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_sharded_forward_equals_unsharded(multi, api):
    assert multi[f"{api}_forward_err"] < 1e-5


def test_output_follows_batch_sharding(multi):
    # x [4, 8, 16] sharded over 'data' (2): each device computes 2 sequences.
    assert multi["linen_output_shard_shape"] == [2, 8, 32]


def test_default_has_no_annotations():
    x = jnp.ones((2, 4, 6))
    variables = jl.MultiHeadAttention(8, 4, 0.0, 2).init(jax.random.key(0), x)
    boxed = [
        leaf
        for leaf in jax.tree.leaves(variables, is_leaf=lambda v: isinstance(v, nn.Partitioned))
        if isinstance(leaf, nn.Partitioned)
    ]
    assert boxed == []
    model = jn.MultiHeadAttention(6, 8, 4, 0.0, 2, rngs=nnx.Rngs(0))
    assert model.W_query.kernel.get_metadata().get("out_sharding") is None


def test_linen_partition_specs_without_devices():
    # The specs are there at init, on one device too (no mesh needed for Linen).
    x = jnp.ones((2, 4, 6))
    module = jl.MultiHeadAttention(8, 4, 0.0, 2, num_kv_heads=1, model_axis="tp")
    specs = nn.get_partition_spec(module.init(jax.random.key(0), x))["params"]
    assert specs["W_key"]["kernel"] == jax.sharding.PartitionSpec(None, "tp")
    assert specs["out_proj"]["kernel"] == jax.sharding.PartitionSpec("tp", None)


@pytest.mark.parametrize("bad", [1, ("model",)])
def test_model_axis_must_be_a_name(bad):
    x = jnp.ones((2, 4, 6))
    with pytest.raises(TypeError, match="model_axis must be the name of a mesh axis"):
        jl.MultiHeadAttention(8, 4, 0.0, 2, model_axis=bad).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="model_axis must be the name of a mesh axis"):
        jn.MultiHeadAttention(6, 8, 4, 0.0, 2, model_axis=bad, rngs=nnx.Rngs(0))


def test_nnx_model_axis_needs_a_mesh():
    # flax's eager sharding: annotated NNX variables are created sharded, under a mesh.
    with pytest.raises(ValueError, match="mesh"):
        jn.MultiHeadAttention(6, 8, 4, 0.0, 2, model_axis="model", rngs=nnx.Rngs(0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with jax.set_mesh(mesh):
        model = jn.MultiHeadAttention(6, 8, 4, 0.0, 2, model_axis="model", rngs=nnx.Rngs(0))
    assert model.W_value.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")
