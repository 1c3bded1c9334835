"""Two or more builds of the fused CPU paged-attention kernel against each other, in one process.

Each build (a copy of ``_jattn_cpu*.so``) is loaded with :mod:`ctypes` and its paged
handler registered under a name of its own, so the builds run the same calls in turn,
under the same load; their outputs are checked equal (to float32 rounding) first.

Shapes: one decoding step of ``--rows`` rows (one query each; ``--queries 64``: a prefill
chunk of 64 new tokens a row, causal) on ``--heads`` kv heads of ``--head-dim`` (as many
query heads), pages of 16 positions, rows ``--fill`` of a capacity of ``--capacity``
positions filled (the new tokens included). Two settings per fill: *warm*, every call on
the same pools (they stay in the CPU's caches when they fit), and *cold*, each call on
the next of four sets of pools (four layers' worth) after reading, untimed, a buffer twice
the last-level cache: the call's pages are out of the caches whatever the fill, as in a
model's step where the other layers' weights and pages came between. (Four sets alone are
not enough at low fills: four calls' pages at 10% of this capacity fit a 32 MiB cache.)
A cold call also pays what any call pays after other work (on a 2-core VM about 100 us,
even for a no-op jit): the same for every build, so compare builds, not fills.

Usage (from the repository root)::

    cp jattn/kernels/cpu/_jattn_cpu*.so /tmp/before.so     # then change, rebuild:
    python setup.py build_ext --inplace --force
    cp jattn/kernels/cpu/_jattn_cpu*.so /tmp/after.so
    python benchmarks/ab_paged_kernel.py /tmp/before.so /tmp/after.so

``--step`` times the builds inside ``generate_many``'s whole decoding step instead
(``bench_serving.step_candidates``: the scaled GPT-2, 16 rows, greedy pick), with one page a
row and at each ``--fill`` (10% and 100% among them), in ``bench_serving.MODES`` (one call
at a time, in runs of 8, calls 17-32 of runs of 32), after checking the builds pick the
same tokens: what a change costs or saves where the kernel runs between the model's
matmuls, with their weights in the caches beside its pages and XLA's pool threads woken as
the step wakes them.

``--same-bits 600`` first requires every build to give the first one's bits on 600 random
calls (float and int8 pages, GQA, chunks, key splits): for a change meant to leave the
arithmetic alone. ``JATTN_CPU_ISA=avx2`` (or ``generic``) runs the builds' narrower kernels.
``--pages bfloat16`` (or ``float16``) makes 16-bit pools; ``--convert`` also times each
build on the pools converted to float32 inside the call, as jattn passed 16-bit pools before
the kernel read them in place (a build from before then runs only that way:
``python benchmarks/ab_paged_kernel.py after.so --pages bfloat16 --convert``).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import time
from functools import partial
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jattn.kernels.cpu import _library  # --step patches its target name

PAGE = 16


def target(i: int) -> str:
    """The FFI target name build ``i`` is registered under."""
    return f"ab_paged_{i}"


def register(paths: list[str]) -> dict:
    """{file name: jitted call} of each build's paged handler, registered as ``target(i)``:
    ``call(q, k_pages, v_pages, table, starts, num_real, lengths, k_scales=, v_scales=)``
    (the scales for int8 pages)."""
    calls = {}
    for i, path in enumerate(paths):
        name = target(i)
        handler = ctypes.CDLL(os.path.abspath(path)).JattnCpuPagedAttention
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")

        def call(q, k_pages, v_pages, table, starts, num_real, lengths, k_scales=None,
                 v_scales=None, name=name):  # fmt: skip
            out = jax.ShapeDtypeStruct((*q.shape[:3], v_pages.shape[-1]), jnp.float32)
            unused = jnp.zeros((1,), jnp.float32)  # no int8 scales
            return jax.ffi.ffi_call(name, out)(
                q, k_pages, v_pages,
                unused if k_scales is None else k_scales, unused if v_scales is None else v_scales,
                table, starts, num_real, lengths,
                scale=np.float32(q.shape[-1] ** -0.5), causal=np.int64(1),
                max_threads=np.int64(0),
            )  # fmt: skip

        calls[os.path.basename(path)] = jax.jit(call)
    return calls


def via_float32(call):
    """``call`` on the pools converted to float32 inside the jitted call (as jattn passed
    16-bit pools before the kernel read them in place)."""

    def converted(q, k_pages, v_pages, *rest):
        return call(q, k_pages.astype(jnp.float32), v_pages.astype(jnp.float32), *rest)

    return jax.jit(converted)


def random_call(rng: np.random.Generator) -> tuple:
    """The arguments of one random paged call: 1-8 rows, 1-12 kv heads, GQA groups 1-4,
    chunks of 1-5 queries (some rows with fewer real ones), head_dim 32 or 20, float32 or
    int8 pages (with scales), lengths up to 1100 (key splits), pages in a random order and
    one unallocated."""
    rows, kv_heads, group = rng.choice([1, 3, 8]), rng.choice([1, 2, 4, 12]), rng.integers(1, 5)
    chunk, dim, int8 = rng.choice([1, 2, 5]), rng.choice([32, 20]), bool(rng.integers(2))
    longest = rng.choice([5, 70, 1100])
    width = -(-(longest + chunk) // PAGE)
    pages = rows * width + 3
    shape = (pages, PAGE, kv_heads, dim)
    if int8:
        k, v = (rng.integers(-127, 128, size=shape).astype(np.int8) for _ in "kv")
        scales = [rng.random(pages * PAGE * kv_heads).astype(np.float32) / 50 for _ in "kv"]
    else:
        k, v = (rng.normal(size=shape).astype(np.float32) for _ in "kv")
        scales = [None, None]
    table = rng.permutation(pages)[: rows * width].reshape(rows, width).astype(np.int32)
    table[0, -1] = -1
    q = rng.normal(size=(rows, chunk, kv_heads * group, dim)).astype(np.float32)
    lengths = rng.integers(1, longest + 1, size=rows).astype(np.int32)
    lengths[0] = longest
    starts = np.maximum(lengths - chunk, 0).astype(np.int32)
    num_real = rng.integers(1, chunk + 1, size=rows).astype(np.int32)
    return (q, k, v, table, starts, num_real, lengths, *scales)


def check_same_bits(calls: dict, n: int) -> None:
    """Every build gives the first one's bits on ``n`` random calls (:func:`random_call`):
    for a change that must not touch the arithmetic (the order of reads, the threads)."""
    rng = np.random.default_rng(0)
    for i in range(n):
        args = random_call(rng)
        outs = [np.asarray(call(*args)) for call in calls.values()]
        for name, out in zip(calls, outs[1:], strict=False):
            np.testing.assert_array_equal(out, outs[0], err_msg=f"call {i}: {name} differs")
    print(f"same bits on {n} random calls: {', '.join(calls)}")


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """The largest CPU cache's size, from Linux's sysfs (``default`` where it is not there)."""
    units, sizes = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}, []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip()
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=default)


def step_ab(builds: list[str], fills: list[float], repeats: int) -> None:
    """Prints ``--step``'s table: the decoding step with each build's kernel (its target
    patched in while the step is traced)."""
    import bench_serving as bs  # beside this script; imports the models

    _library.library()  # jattn's own targets registered before the patch
    variants = {
        os.path.basename(path): partial(mock.patch.object, _library, "PAGED_TARGET", target(i))
        for i, path in enumerate(builds)
    }
    cases = [("one page", 0.0), *((f"{f:.0%}", f) for f in fills)]
    steps, texts = bs.step_candidates(variants, cases)
    for i, (name, text) in enumerate(texts.items()):
        assert target(i) in text, f"{name}'s step does not call its build"
    medians = bs.checked_medians(steps, repeats)
    print(f"scaled GPT-2's decoding step, 16 rows, capacity 743: ms per step (medians of "
          f"{repeats}; {bs.MODE_TITLES})\n")  # fmt: skip
    print(bs.step_table("build", medians, cases))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("builds", nargs="+", help="kernel library files (.so) to compare")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--queries", type=int, default=1, help="new tokens per row (a chunk)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--capacity", type=int, default=743)
    p.add_argument("--fill", type=float, nargs="+", default=[0.1, 0.5, 1.0])
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument(
        "--same-bits", type=int, default=0, metavar="N",
        help="first require every build to give the same bits on N random calls",
    )  # fmt: skip
    p.add_argument("--pages", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--convert", action="store_true", help="also the pools as float32 in the call")
    p.add_argument("--step", action="store_true", help="time the model's whole decoding step")
    args = p.parse_args(argv)
    calls = register(args.builds)
    if args.same_bits:
        check_same_bits(calls, args.same_bits)
    if args.step:
        return step_ab(args.builds, args.fill, args.repeats)
    if args.convert:
        calls.update({f"{name} via float32": via_float32(call) for name, call in calls.items()})
    rows, heads, dim = args.rows, args.heads, args.head_dim
    width = -(-args.capacity // PAGE)
    rng = np.random.default_rng(0)
    shape = (rows * width, PAGE, heads, dim)
    pools = [tuple(jnp.asarray(rng.normal(size=shape), args.pages) for _ in "kv") for _ in range(4)]
    q = jnp.asarray(rng.normal(size=(rows, args.queries, heads, dim)), jnp.float32)
    table = jnp.arange(rows * width, dtype=jnp.int32).reshape(rows, width)
    evict = np.ones(2 * last_level_cache_bytes() // 4, np.float32)  # read before cold calls
    print(
        f"{rows} rows of {args.queries} queries, {heads} kv heads of {dim}, capacity "
        f"{args.capacity}; microseconds "
        f"per call (medians of {args.repeats}); {args.pages} pages; builds: {', '.join(calls)}"
    )
    for fill in args.fill:
        length = max(args.queries, round(fill * args.capacity))
        ints = (
            table,
            jnp.full((rows,), length - args.queries, jnp.int32),  # starts
            jnp.full((rows,), args.queries, jnp.int32),  # the new tokens
            jnp.full((rows,), length, jnp.int32),  # lengths
        )
        outs = []
        for name, call in list(calls.items()):
            try:
                outs.append(np.asarray(call(q, *pools[0], *ints)))
            except jax.errors.JaxRuntimeError as e:  # a build from before reads no 16-bit pools
                print(f"{name}: left out ({str(e).splitlines()[0][:90]})")
                del calls[name]
        for out in outs[1:]:
            np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-6)
        for mode in ("warm", "cold"):
            times = {name: [] for name in calls}
            for i in range(args.repeats):
                for c, (name, call) in enumerate(calls.items()):
                    k_pages, v_pages = pools[(i * len(calls) + c) % 4 if mode == "cold" else 0]
                    if mode == "cold":
                        evict.sum()
                    start = time.perf_counter()
                    call(q, k_pages, v_pages, *ints).block_until_ready()
                    times[name].append(time.perf_counter() - start)
            cells = "  ".join(f"{n} {statistics.median(t) * 1e6:.0f}" for n, t in times.items())
            print(f"fill {fill:.2f} {mode}: {cells}")


if __name__ == "__main__":
    main()
