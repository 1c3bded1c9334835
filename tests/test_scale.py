"""The training demo on a device mesh: data parallel (4x1) and data + model parallel (2x2).

The runs need 4 fake CPU devices, which XLA creates only when the flag is set before
JAX starts: tests/_scale_checks.py runs them once in a subprocess (the one-device
reference on a 1x1 mesh of the same process) and prints its measurements as JSON.
The single-device checks of jattn.toy.parallel run here.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from _fake_devices import run_checks

from jattn.toy import parallel

CHECKS = Path(__file__).with_name("_scale_checks.py")
STEPS = 16


@pytest.fixture(scope="module")
def multi(tmp_path_factory) -> dict:
    """Results of tests/_scale_checks.py on 4 fake CPU devices."""
    return run_checks(CHECKS, tmp_path_factory.mktemp("scale"))


@pytest.mark.parametrize("mesh", ["4x1", "2x2"])
def test_losses_match_one_device(multi, mesh):
    # The same data, initial weights and dropout masks on every mesh: the losses differ
    # only by the order of float sums (all-reduces), far below 1e-3 relative.
    one = np.array([loss for _, loss in multi["losses"]["1x1"]])
    many = np.array([loss for _, loss in multi["losses"][mesh]])
    assert [s for s, _ in multi["losses"][mesh]] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(many, one, rtol=1e-3, atol=0)
    assert abs(many[-1] - one[-1]) <= 1e-3 * abs(one[-1])
    assert many[-1] < one[0]  # and it learns


@pytest.mark.parametrize("mesh", ["1x1", "4x1", "2x2"])
def test_step_compiles_once(multi, mesh):
    assert multi["compiles"][mesh] == 1  # for all STEPS steps


# [d_in, d_out] kernels of the tiny model (d_model 16, 2 heads, MLP 64) on the 2x2 mesh:
# the 'model' axis (2) splits heads and hidden units; 'data' splits no parameter.
SHARDED = {
    "['blocks_0']['attn']['W_query']['kernel']": ([16, 16], [16, 8]),
    "['blocks_0']['attn']['W_key']['kernel']": ([16, 16], [16, 8]),
    "['blocks_0']['attn']['W_value']['kernel']": ([16, 16], [16, 8]),
    "['blocks_0']['attn']['out_proj']['kernel']": ([16, 16], [8, 16]),
    "['blocks_0']['mlp_in']['kernel']": ([16, 64], [16, 32]),
    "['blocks_0']['mlp_in']['bias']": ([64], [32]),
    "['blocks_0']['mlp_out']['kernel']": ([64, 16], [32, 16]),
}


@pytest.mark.parametrize("tree", ["params", "adam_mu"])
def test_parameters_really_sharded(multi, tree):
    layout = multi["layout_2x2"][tree]
    for path, (shape, shard) in layout.items():
        want = SHARDED.get(path, (shape, shape))  # everything else is replicated
        assert (shape, shard) == (list(want[0]), list(want[1])), path
    assert set(SHARDED) <= set(layout)


def test_resume_from_sharded_checkpoint(multi):
    # Stopped at step 10 and resumed: bit-exact, restored in the mesh's shardings, and
    # through the step compiled before (no compilation).
    assert multi["resume_diff"] == 0.0
    assert multi["resume_restored_sharded"]
    assert multi["resume_compiles"] == 0


def test_checkpoint_restores_onto_another_mesh(multi):
    assert multi["reshard_step"] == 10
    assert multi["reshard_diff"] == 0.0
    assert multi["reshard_sharded"]


def test_cli_model_parallel(multi):
    assert multi["cli_status"] == 0
    assert multi["cli_summary"] == {"devices": 4, "mesh": {"data": 2, "model": 2}, "processes": 1}
    # Its last step's loss is the API run's on the same mesh (train_loss averages the
    # last max(1, steps // 10) = 1 step).
    assert multi["cli_train_loss"] == multi["losses"]["2x2"][-1][1]


@pytest.mark.parametrize(
    "name, message",
    [
        ("model_parallel_3", "--model-parallel: model_parallel (3) must be >= 1 and divide"),
        ("batch_indivisible", "--batch-size (6) must be a multiple of the data-parallel size (4"),
    ],
)
def test_cli_mesh_errors(multi, name, message):
    code, stderr = multi["cli_errors"][name]
    assert code == 1 and message in stderr and "\n" not in stderr


# ----------------------------------------------------------------------------------------
# One device (in process)
# ----------------------------------------------------------------------------------------


def test_one_device_is_a_1x1_mesh():
    mesh = parallel.default_mesh()
    assert parallel.mesh_shape(mesh) == {"data": 1, "model": 1}
    assert list(mesh.devices.flat) == [jax.devices()[0]]


@pytest.mark.parametrize("bad", [0, 3, True, 1.0])
def test_make_mesh_errors(bad):
    devices = jax.devices()[:1] * 2  # (only the count matters for the check)
    with pytest.raises(ValueError, match="model_parallel"):
        parallel.make_mesh(bad, devices)


def test_shard_batch_needs_divisible_batch():
    mesh = parallel.default_mesh()
    windows = np.zeros((6, 9), np.int32)
    assert parallel.shard_batch(windows, mesh) is windows  # one process: placed by the step
    fake = type("Mesh", (), {"shape": {"data": 4, "model": 1}})()
    with pytest.raises(ValueError, match=r"the batch \(6 windows\) must be divisible"):
        parallel.shard_batch(windows, fake)


def test_replicate_and_to_host_round_trip():
    mesh = parallel.default_mesh()
    tree = {"a": np.arange(6.0).reshape(2, 3), "b": np.int32(4)}
    placed = parallel.replicate(tree, mesh)
    assert placed["a"].sharding.is_fully_replicated
    back = parallel.to_host(placed)
    np.testing.assert_array_equal(back["a"], tree["a"])
    assert int(back["b"]) == 4
