"""Ring (sequence-parallel) attention: equal to single-device attention, causal blocks skipped.

The multi-device checks need 4 fake CPU devices, which XLA only creates when the flag is
set before JAX starts; they run once in a subprocess (tests/_ring_checks.py) that
prints its measurements as JSON, and the tests below assert on them. The rest runs here,
on a one-device mesh.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _fake_devices import run_checks
from jax.sharding import Mesh

import jattn
from jattn import ring

CHECKS = Path(__file__).with_name("_ring_checks.py")
FORWARD_TOL = 1e-5  # float32 rounding of a different summation order (outputs are O(1))
GRAD_TOL = 2e-6  # relative to the largest gradient entry (blockwise vs dense: ~5e-7)


@pytest.fixture(scope="module")
def multi() -> dict:
    """Results of tests/_ring_checks.py on 4 fake CPU devices."""
    return run_checks(CHECKS)


def _inputs(shape_q, kv_heads, seed=0):
    *batch, t, _, d = shape_q
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, shape_q),
        jax.random.normal(kk, (*batch, t, kv_heads, d)),
        jax.random.normal(kv, (*batch, t, kv_heads, d)),
    )


# ----------------------------------------------------------------------------------------
# 4 devices (subprocess)
# ----------------------------------------------------------------------------------------


def test_runs_on_four_devices(multi):
    assert multi["devices"] == 4


@pytest.mark.parametrize("name", ["full", "causal"])
def test_forward_equals_single_device(multi, name):
    result = multi[f"forward_{name}"]
    assert result["err"] < FORWARD_TOL, result
    # [B, T, H, D] = [2, 64, 4, 8]: each device holds a quarter of the sequence.
    assert tuple(result["shard_shape"]) == (2, 16, 4, 8)


@pytest.mark.parametrize("name", ["full", "causal"])
def test_gradients_equal_single_device(multi, name):
    for arg, result in zip("qkv", multi[f"grad_{name}"], strict=True):
        assert result["err"] < GRAD_TOL * result["scale"], (arg, result)


def test_causal_blocks_in_the_future_are_not_computed(multi):
    # Device i holds query block i: causally it needs key blocks 0..i, i.e. i + 1 of 4,
    # in the forward pass and again in the backward pass; without a mask, all 4.
    computed = multi["blocks_computed"]
    assert computed["causal"] == {"forward": [1, 2, 3, 4], "backward": [1, 2, 3, 4]}
    assert computed["full"] == {"forward": [4, 4, 4, 4], "backward": [4, 4, 4, 4]}


def test_local_blocks_padded_to_tiles(multi):
    # 13 tokens per device, 8-token tiles: the padding stays invisible.
    assert multi["padded_forward_err"] < FORWARD_TOL
    assert multi["padded_grad_err"] < 1e-4


def test_inside_a_user_shard_map(multi):
    assert multi["user_shard_map_err"] < FORWARD_TOL


def test_bfloat16_as_accurate_as_dense(multi):
    assert multi["bf16_dtype"] == "bfloat16"
    # Partial outputs are rounded to bfloat16 before the merge: allow twice dense's error.
    assert multi["bf16_err"] <= 2 * multi["bf16_dense_err"] + 1e-3, multi


@pytest.mark.parametrize(
    "mesh_name, shard", [("batch_seq", (1, 3, 16, 4, 8)), ("seq_heads", (2, 3, 16, 2, 8))]
)
def test_two_dimensional_meshes(multi, mesh_name, shard):
    # [2, 3, 32, 4, 8] over a 2x2 mesh: (data, seq) or (seq, model).
    assert tuple(multi["shape_2d"]) == (2, 3, 32, 4, 8)
    assert multi[mesh_name]["err"] < FORWARD_TOL
    assert tuple(multi[mesh_name]["shard_shape"]) == shard


def test_meshes_with_explicit_axes(multi):
    """jax.make_mesh's default (explicit axes): shard_map does not move inputs itself there."""
    result = multi["explicit_axes"]
    assert result["eager_err"] < FORWARD_TOL, result
    assert result["jit_err"] < FORWARD_TOL, result
    assert result["batch_seq_err"] < FORWARD_TOL, result
    assert result["grad_err"] < 1e-4, result


def test_indivisible_length_error(multi):
    assert (
        "q_len (30) must be a multiple of the 'seq' axis size (4)"
        in (multi["errors"]["indivisible_length"])
    )


# ----------------------------------------------------------------------------------------
# One device (in process)
# ----------------------------------------------------------------------------------------


@pytest.fixture
def mesh1():
    return Mesh(np.array(jax.devices()[:1]), ("seq",))


@pytest.mark.parametrize("causal", [False, True])
def test_one_device_ring_equals_dot_product_attention(mesh1, causal):
    q, k, v = _inputs((2, 24, 4, 8), kv_heads=2)
    out = jax.jit(
        lambda q, k, v: ring.ring_attention(
            q, k, v, mesh=mesh1, is_causal=causal, scale=0.3, block_q=8
        )
    )(q, k, v)
    ref = jattn.dot_product_attention(q, k, v, is_causal=causal, scale=0.3, implementation="dense")
    np.testing.assert_allclose(out, ref, atol=FORWARD_TOL, rtol=0)


def test_one_device_gradients(mesh1):
    q, k, v = _inputs((1, 16, 2, 4), kv_heads=2, seed=1)

    def loss(attn):
        return lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v)))

    got = jax.jit(
        jax.grad(
            loss(lambda q, k, v: ring.ring_attention(q, k, v, mesh=mesh1, is_causal=True)),
            argnums=(0, 1, 2),
        )
    )(q, k, v)
    want = jax.grad(
        loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_bad_axis_names(mesh1):
    q, k, v = _inputs((1, 8, 2, 4), kv_heads=2)
    with pytest.raises(ValueError, match="seq_axis='tokens' is not an axis of the mesh"):
        ring.ring_attention(q, k, v, mesh=mesh1, seq_axis="tokens")
    with pytest.raises(ValueError, match="head_axis='model' is not an axis"):
        ring.ring_attention(q, k, v, mesh=mesh1, head_axis="model")
    with pytest.raises(ValueError, match="batch_axis 'data' is not an axis"):
        ring.ring_attention(q, k, v, mesh=mesh1, batch_axis="data")


def test_batch_axis_needs_batch_dims():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))
    q, k, v = _inputs((8, 2, 4), kv_heads=2)
    with pytest.raises(ValueError, match="batch_axis was given but query has no batch dims"):
        ring.ring_attention(q, k, v, mesh=mesh, batch_axis="data")


def test_causal_needs_equal_lengths(mesh1):
    q, _, _ = _inputs((1, 8, 2, 4), kv_heads=2)
    _, k, v = _inputs((1, 16, 2, 4), kv_heads=2)
    with pytest.raises(ValueError, match="same length"):
        ring.ring_attention(q, k, v, mesh=mesh1, is_causal=True)
    # Without the causal mask, cross-attention over blocks of different lengths is fine.
    out = jax.jit(lambda q, k, v: ring.ring_attention(q, k, v, mesh=mesh1))(q, k, v)
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(q, k, v), atol=FORWARD_TOL)


def test_integer_inputs_rejected(mesh1):
    q, k, v = _inputs((1, 8, 2, 4), kv_heads=2)
    with pytest.raises(TypeError, match="query must have a floating dtype"):
        ring.ring_attention(q.astype(jnp.int32), k, v, mesh=mesh1)
