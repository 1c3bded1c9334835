"""The demo on a device mesh: data parallel over ``data``, tensor parallel over ``model``.

Every run trains on a 2-D :class:`jax.sharding.Mesh` with axes ``('data', 'model')``;
one device is the same code on a 1x1 mesh. JAX's SPMD partitioner does the work: the
train step is one ``jax.jit`` whose inputs and outputs carry ``NamedSharding``\\ s
(:func:`jattn.toy.train.state_shardings`):

* the batch ``[B, T+1]`` split by rows over ``data``: each device computes the loss of
  its rows, and the mean gradient becomes an all-reduce;
* the attention heads and MLP hidden units split over ``model``, as annotated in
  :mod:`jattn.toy.model` (Q/K/V and ``mlp_in`` by columns, ``out_proj`` and ``mlp_out``
  by rows), the optimizer state like its parameters, everything else replicated.

Several hosts: :func:`initialize_distributed` (``jax.distributed.initialize``) runs
before any other JAX call; the mesh then spans every process's devices, every process
runs the same program, and each places on its own devices only the rows of the batch
they hold (:func:`shard_batch`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "DATA_AXIS",
    "MODEL_AXIS",
    "default_mesh",
    "initialize_distributed",
    "make_mesh",
    "mesh_shape",
    "replicate",
    "shard_batch",
    "sync",
    "to_host",
]

DATA_AXIS = "data"
MODEL_AXIS = "model"


def make_mesh(model_parallel: int = 1, devices=None) -> Mesh:
    """A ``('data', 'model')`` mesh of ``devices`` (default: every device of every process).

    Args:
      model_parallel: size of the ``model`` axis (tensor parallelism); the ``data`` axis
        gets the rest, ``len(devices) // model_parallel``.
      devices: the devices, default ``jax.devices()``.

    Raises:
      ValueError: ``model_parallel`` not an int >= 1 dividing the number of devices.
    """
    devices = jax.devices() if devices is None else list(devices)
    n = len(devices)
    if isinstance(model_parallel, bool) or not isinstance(model_parallel, int):
        raise ValueError(f"model_parallel must be an int >= 1, got {model_parallel!r}.")
    if model_parallel < 1 or n % model_parallel:
        raise ValueError(
            f"model_parallel ({model_parallel}) must be >= 1 and divide the number of devices "
            f"({n}): the mesh is (devices // model_parallel) x model_parallel."
        )
    # jax.devices() lists each process's devices together: a model group (the heavier
    # traffic, an all-reduce per layer) stays within a host when it fits in one.
    grid = np.array(devices, dtype=object).reshape(n // model_parallel, model_parallel)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def default_mesh() -> Mesh:
    """The 1x1 mesh of the default device (a one-device run)."""
    return make_mesh(1, jax.devices()[:1])


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """``{'data': n, 'model': m}``."""
    return {name: int(size) for name, size in mesh.shape.items()}


def shard_batch(windows, mesh: Mesh) -> jax.Array:
    """``windows [B, ...]`` for a step on ``mesh``, whose rows are split over ``data``.

    With several processes: one global array, each process copying to its own devices
    only the rows they hold, so each host feeds its own shard. (The demo's batch of a
    step is a pure function of the seed and the step, so every host can compute it.)
    With one process, ``windows`` as it is: the step's ``in_shardings`` split it over the
    devices without a trip through host memory.

    Raises:
      ValueError: ``B`` not divisible by the ``data`` axis size.
    """
    data = mesh.shape[DATA_AXIS]
    if windows.shape[0] % data:
        raise ValueError(
            f"the batch ({windows.shape[0]} windows) must be divisible by the data-parallel "
            f"size ({data} = devices / model parallel); change the batch size or the mesh."
        )
    if jax.process_count() == 1:
        return windows
    host = np.asarray(windows)
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicate(tree, mesh: Mesh):
    """Host arrays (the same on every process) as global arrays held whole by every device."""
    sharding = NamedSharding(mesh, P())

    def put(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)


def to_host(tree):
    """Global (possibly sharded, multi-process) arrays gathered to numpy on every process."""
    return multihost_utils.process_allgather(tree, tiled=True)


def sync(name: str) -> None:
    """Waits until every process gets here (nothing to wait for with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """``jax.distributed.initialize``: one process per host, before any other JAX call.

    Args:
      coordinator: ``host:port`` of process 0, reachable by every process; None lets JAX
        detect the cluster (SLURM, Open MPI, Cloud TPU, Kubernetes ...).
      num_processes: number of processes (None: detected).
      process_id: this process's index in ``[0, num_processes)`` (None: detected).
    """
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )
