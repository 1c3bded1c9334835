"""Attention on batch-sharded operands of a mesh with explicit axes, in one process.

On ``jax.make_mesh``'s explicit axes jattn runs its fused CPU kernel on each device's
rows inside ``jax.shard_map`` (``jattn/_per_device.py``), dropout included since each
device is given its rows' numbers in the whole call, and a block mask of packed documents
per row since each device is given its rows of tiles and segment ids; before, such calls
went to ``blockwise``, which XLA partitions itself. This script times a training step's
attention (the jitted gradient of ``sum(out * cotangent)`` with respect to q, k and v;
causal with dropout 0.1 from one key, or packed documents) on ``--devices`` fake CPU devices
(``--xla_force_host_platform_device_count``), queries, keys and values sharded over the
batch, for each path by name, and ``cpu_fused`` on one device with the same arrays
unsharded, the candidates in turn (medians of ``--repeats`` rounds). Each path's output
is checked against the dense one first: the same key gives the same dropout mask.

The fake devices share this machine's cores (2 here): the figure says what the sharded
program costs against the same call on one device, not what more devices would buy.

Usage (from the repository root)::

    PYTHONPATH=$PWD python benchmarks/bench_sharded.py            # prints the table
    PYTHONPATH=$PWD python benchmarks/bench_sharded.py --write    # also sharded_results.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time


def _devices_flag(argv) -> int:
    """``--devices`` read before jax is imported (the fake devices are fixed then)."""
    for i, arg in enumerate(argv):
        if arg == "--devices":
            return int(argv[i + 1])
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 2


DEVICES = _devices_flag(sys.argv[1:])
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import cpu_description, settle, sgemm_gflops  # noqa: E402

import jattn  # noqa: E402

PATHS = ("cpu_fused", "blockwise", "dense")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_results.md")


def workloads(b: int, t: int) -> dict:
    """``{name: key -> keyword arguments}``: causal with dropout 0.1; packed documents of
    random lengths, a different packing per row, as a block mask (tiles per row)."""
    ids = np.sort(np.random.default_rng(1).integers(0, 4, size=(b, t)), axis=1)
    docs = jattn.mods.and_masks(jattn.mods.causal(), jattn.mods.document(ids.astype(np.int32)))
    packed = jattn.block_mask(docs, q_len=t, batch_shape=b)
    return {
        "causal, dropout 0.1": lambda key: dict(is_causal=True, dropout_rate=0.1, dropout_rng=key),
        "packed documents (block mask per row)": lambda key: dict(block_mask=packed),
    }


def step(implementation: str, options):
    """The jitted gradient of one attention call (q, k, v, cotangent, key), ``options(key)``
    its keyword arguments."""

    def loss(q, k, v, cot, key):
        out = jattn.dot_product_attention(q, k, v, implementation=implementation, **options(key))
        return jnp.sum(out * cot)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def arrays(b: int, t: int, h: int, d: int) -> list:
    rng = np.random.default_rng(0)
    return [rng.normal(size=(b, t, h, d)).astype(np.float32) for _ in range(4)]


def candidates(mesh, shape, options) -> dict:
    """``{name: () -> gradients}``: each path on batch-sharded operands (under
    ``jax.set_mesh``), and cpu_fused on one device, with ``options``; each checked against
    the sharded dense path's gradients first."""
    host = arrays(*shape)
    key = jax.random.key(0)
    sharded = [jax.device_put(x, NamedSharding(mesh, P("b"))) for x in host]
    one = [jax.device_put(x, jax.devices()[0]) for x in host]
    calls = {f"{p}, sharded": (step(p, options), sharded, mesh) for p in PATHS}
    calls["cpu_fused, one device"] = (step("cpu_fused", options), one, None)

    def bound(f, args, on):
        def run():
            with jax.set_mesh(on) if on is not None else contextlib.nullcontext():
                return jax.block_until_ready(f(*args, key))

        return run

    runs = {name: bound(*call) for name, call in calls.items()}
    want = runs["dense, sharded"]()
    for name, run in runs.items():
        err = max(
            float(jnp.max(jnp.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(run(), want, strict=True)
        )
        if err > 1e-3:
            raise AssertionError(f"{name}: gradients differ from dense's by {err}")
    return runs


def medians(calls: dict, repeats: int) -> dict:
    """Median seconds per call, the candidates in turn each round."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, run in calls.items():
            settle()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def table(results: dict) -> str:
    """One row per (workload, shape) of ``results``."""
    names = list(next(iter(results.values())))
    head = ["workload", "[B, T, H, D]", *(f"{n} (ms)" for n in names), "blockwise / cpu_fused"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (workload, shape), m in results.items():
        ratio = m["blockwise, sharded"] / m["cpu_fused, sharded"]
        cells = " | ".join(f"{m[n] * 1e3:.1f}" for n in names)
        lines.append(f"| {workload} | {list(shape)} | {cells} | **{ratio:.2f}x** |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--write", action="store_true", help=f"write {os.path.basename(RESULTS)}")
    args = p.parse_args(argv)
    mesh = jax.make_mesh((args.devices,), ("b",))
    machine = (
        f"CPU: {cpu_description()}; XLA sgemm {sgemm_gflops():.0f} GFLOP/s (this run); "
        f"jax {jax.__version__}"
    )
    print(machine)
    before = "/".join(f"{x:.1f}" for x in os.getloadavg())
    results = {}
    for shape in ((4, 512, 8, 64), (4, 1024, 8, 64)):
        for workload, options in workloads(*shape[:2]).items():
            results[workload, shape] = medians(candidates(mesh, shape, options), args.repeats)
    after = "/".join(f"{x:.1f}" for x in os.getloadavg())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = (
        f"Command: `PYTHONPATH=$PWD python benchmarks/bench_sharded.py`, {when}. {machine}; "
        f"{args.devices} fake CPU devices on this machine's cores. Load average (1/5/15 min) "
        f"{before} before, {after} after.\n\n"
        "The jitted gradient (q, k, v) of attention, causal with dropout 0.1 or over packed "
        "documents (a block mask of tiles per row, a different packing per row), queries, "
        "keys and values sharded over the batch on a mesh of explicit axes; medians of "
        f"{args.repeats} rounds, the candidates in turn. Every path's gradients were checked "
        "against the dense path's first (the same key drops the same weights on each). "
        "Before, the automatic rule took blockwise for both.\n\n"
        f"{table(results)}\n"
    )
    print(text)
    if args.write:
        with open(RESULTS, "w") as f:
            f.write("# Attention on batch-sharded operands (`benchmarks/bench_sharded.py`)\n\n")
            f.write(text)


if __name__ == "__main__":
    main()
