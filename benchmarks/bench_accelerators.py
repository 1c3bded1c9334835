"""Accelerator benchmark: every jattn implementation against jax.nn's XLA and cuDNN attention.

Causal self-attention, ``B=4, H=16, D=128``, ``T = 1k ... 32k``, float32 and bfloat16,
forward and forward+backward (the gradient of ``out.sum()`` w.r.t. q, k and v). The
candidates:

* ``jattn.dot_product_attention(..., implementation=NAME)`` for NAME in ``None``
  (automatic: on a GPU, cuDNN where it honours the call), ``'dense'``, ``'blockwise'``,
  ``'cudnn'``, ``'pallas_triton'``, ``'splash'``; a call the implementation refuses is
  listed with the reason, never timed;
* ``jax.nn.dot_product_attention`` with ``implementation='xla'`` and ``'cudnn'``;
* on a GPU, bfloat16 forward only: jax's Pallas Mosaic GPU (Hopper) kernel, raw (it has
  no causal backward, so it cannot serve jattn's training calls; listed for reference).

Each configuration compiles every candidate (lower + compile, timed apart), records the
compiled executable's temporary memory (``memory_analysis().temp_size_in_bytes``), runs it
once to warm up, then runs interleaved rounds in a fresh random order (so drift hits all
candidates alike) and reports medians. Paths that build the ``[T, T]`` logits are skipped
where those alone would pass ``--dense-limit-gib``. A time budget (``--budget-s``) stops
the sweep between configurations and the table says what was not run; configurations run
in order of importance (bfloat16 forward+backward at T=4096, the issue's goal, first).

Usage::

    python benchmarks/bench_accelerators.py                 # GPU/TPU: full sweep, writes the table
    python benchmarks/bench_accelerators.py --small --out /tmp/acc.md   # tiny smoke run (any machine)

``--small`` runs B=1, H=2, D=32, T=128/256 and turns on Pallas interpret mode
(``JATTN_PALLAS_INTERPRET=1``) so that the Pallas kernels run on CPU too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from anywhere: import this checkout's jattn

import jattn  # noqa: E402
from jattn import _routing, kernels  # noqa: E402

JATTN_NAMES = (None, "dense", "blockwise", "cudnn", "pallas_triton", "splash", "pallas")
DENSE_LIKE = ("jattn dense", "jax.nn xla")  # build the [T, T] logits
MODES = ("fwd+bwd", "fwd")
GOAL = ("bfloat16", "fwd+bwd", 4096)  # the goal configuration


@dataclasses.dataclass
class Row:
    """One candidate in one configuration: its timings or why it has none."""

    dtype: str
    mode: str
    t: int
    name: str
    times: list[float] = dataclasses.field(default_factory=list)
    compile_s: float | None = None
    warmup_s: float | None = None
    temp_bytes: int | None = None
    note: str = ""

    @property
    def median_ms(self) -> float | None:
        return 1e3 * statistics.median(self.times) if self.times else None


# ----------------------------------------------------------------------------------------
# Candidates
# ----------------------------------------------------------------------------------------


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def routed_to(fn: Callable, q, k, v) -> list[str]:
    """The implementations jattn's routing table picks while tracing ``fn`` (no computation)."""
    chosen, real = [], _routing.choose

    def spy(*args):
        chosen.append(real(*args))
        return chosen[-1]

    _routing.choose = spy
    try:
        jax.eval_shape(fn, q, k, v)
    finally:
        _routing.choose = real
    return chosen


def jattn_candidate(name: str | None, q, k, v) -> tuple[str, Callable | None, str]:
    """``(label, fn or None, note)`` for ``jattn.dot_product_attention(implementation=name)``."""
    label = f"jattn {name if name is not None else 'auto'}"

    def fn(q, k, v):
        return jattn.dot_product_attention(q, k, v, is_causal=True, implementation=name)

    try:
        chosen = routed_to(fn, q, k, v)  # argument checks and routing, no computation
    except (ValueError, TypeError, NotImplementedError) as error:
        return label, None, f"refused: {_short(error)}"
    note = "" if name is not None else f"routed to {', '.join(chosen)}"
    if name in ("pallas_triton", "splash") and kernels.interpret_requested():
        module = kernels.adapter(name)
        if not module.available(jax.default_backend()):
            note = "interpret mode"
    return label, fn, note


def peer_candidates(q, mode: str) -> list[tuple[str, Callable | None, str]]:
    """jax.nn's XLA and cuDNN attention, and (GPU, bfloat16, forward) the Mosaic GPU kernel."""
    out = []
    for impl in ("xla", "cudnn"):

        def fn(q, k, v, impl=impl):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

        out.append((f"jax.nn {impl}", fn, ""))
    if jax.default_backend() == "gpu" and q.dtype == jnp.bfloat16 and mode == "fwd":
        out.append(mosaic_candidate(q))
    return out


def mosaic_candidate(q) -> tuple[str, Callable | None, str]:
    label = "jax Pallas Mosaic GPU (raw)"
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except Exception as error:  # any import failure is a note, not a crash
        return label, None, f"unavailable: {_short(error)}"
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2, causal=True
    )
    note = "forward only: no causal backward, lengths or segments; not routed by jattn"
    return label, lambda q, k, v: attention_mgpu.attention(q, k, v, config), note


def with_mode(fn: Callable, mode: str) -> Callable:
    if mode == "fwd":
        return fn

    def loss(q, k, v):
        return fn(q, k, v).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


# ----------------------------------------------------------------------------------------
# Measuring one configuration
# ----------------------------------------------------------------------------------------


def inputs(batch: int, t: int, heads: int, dim: int, dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(key, (batch, t, heads, dim), dtype) for key in keys)


def prepare(row: Row, fn: Callable, args) -> Callable[[], object] | None:
    """Compiles (timed), records temp memory and warms up; returns a runner or None on failure."""
    try:
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        row.compile_s = time.perf_counter() - start
        memory = compiled.memory_analysis()
        row.temp_bytes = None if memory is None else int(memory.temp_size_in_bytes)

        def run():
            return jax.block_until_ready(compiled(*args))

        start = time.perf_counter()
        run()
        row.warmup_s = time.perf_counter() - start
        return run
    except Exception as error:  # a failing candidate is reported, not fatal
        row.note = (row.note + "; " if row.note else "") + f"failed: {_short(error)}"
        return None


def measure_config(
    args, dtype_name: str, mode: str, t: int, slow: dict[str, tuple[int, str]]
) -> list[Row]:
    """Times every candidate at one (dtype, mode, T); ``slow`` carries skips to longer T.

    A candidate whose warm-up took longer than ``--slow-s`` is not run at any longer T
    (of any dtype or mode): the XLA paths at 32k would otherwise eat the time budget.
    """
    dtype = jnp.dtype(dtype_name)
    q, k, v = inputs(args.batch, t, args.heads, args.dim, dtype)
    candidates = [jattn_candidate(name, q, k, v) for name in JATTN_NAMES]
    candidates += peer_candidates(q, mode)
    logits_gib = args.batch * args.heads * t * t * 4 * (3 if mode == "fwd+bwd" else 1) / 2**30
    rows, runners = [], []
    for label, fn, note in candidates:
        row = Row(dtype_name, mode, t, label, note=note)
        rows.append(row)
        if fn is None:
            continue
        if label in DENSE_LIKE and logits_gib > args.dense_limit_gib:
            row.note = f"skipped: its [T, T] logits need ~{logits_gib:.0f} GiB"
            continue
        if label in slow and slow[label][0] < t:
            row.note = f"skipped: {slow[label][1]}"
            continue
        run = prepare(row, with_mode(fn, mode), (q, k, v))
        if run is not None:
            runners.append((row, run))
            if row.warmup_s > args.slow_s:
                why = f"one call took {row.warmup_s:.1f} s at T={t} ({dtype_name} {mode})"
                slow[label] = (t, why)
    order = random.Random(t)
    start = time.perf_counter()
    for _ in range(args.rounds):
        for row, run in order.sample(runners, len(runners)):
            begin = time.perf_counter()
            run()
            row.times.append(time.perf_counter() - begin)
        if time.perf_counter() - start > args.config_cap_s:
            break  # slow candidates: fewer rounds rather than a blown budget
    return rows


# ----------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------


def _fmt_ms(row: Row) -> str:
    return "-" if row.median_ms is None else f"{row.median_ms:.3g}"


def _fmt_mib(row: Row) -> str:
    return "-" if row.temp_bytes is None else f"{row.temp_bytes / 2**20:.0f}"


def goal_lines(rows: list[Row]) -> list[str]:
    """The issue's goals, read off the table (or why they cannot be)."""
    dtype, mode, t = GOAL
    at = {r.name: r for r in rows if (r.dtype, r.mode, r.t) == (dtype, mode, t)}
    auto, cudnn = at.get("jattn auto"), at.get("jax.nn cudnn")
    lines = [f"Goal configuration: {dtype} causal {mode}, B=4 H=16 D=128 T={t}."]
    if auto is None or auto.median_ms is None or cudnn is None or cudnn.median_ms is None:
        lines.append("- not measured here (needs an NVIDIA GPU and this configuration run).")
        return lines
    lines.append(
        f"- jattn auto / jax.nn cuDNN = {auto.median_ms / cudnn.median_ms:.2f}x (goal <= 1.05x)."
    )
    xla = [at[n] for n in ("jattn dense", "jattn blockwise") if n in at and at[n].median_ms]
    for row in xla:
        lines.append(
            f"- {row.name} / jattn auto = {row.median_ms / auto.median_ms:.1f}x (goal >= 5x)."
        )
    mem = sorted(
        (r.t, r.temp_bytes) for r in rows
        if (r.name, r.dtype, r.mode) == ("jattn auto", dtype, mode) and r.temp_bytes
    )  # fmt: skip
    if len(mem) >= 2:
        (t0, m0), (t1, m1) = mem[0], mem[-1]
        lines.append(
            f"- jattn auto {mode} temp memory: {m0 / 2**20:.0f} MiB at T={t0}, "
            f"{m1 / 2**20:.0f} MiB at T={t1} ({m1 / m0:.1f}x for {t1 / t0:.0f}x T; "
            "O(T) means about the same factor)."
        )
    return lines


def note_lines(block: list[Row]) -> list[str]:
    """One line per (candidate, note), listing the lengths it applies to."""
    grouped: dict[tuple[str, str], list[int]] = {}
    for row in block:
        if row.note:
            grouped.setdefault((row.name, row.note), []).append(row.t)
    return [
        f"- {name} (T={', '.join(map(str, ts))}): {note}" for (name, note), ts in grouped.items()
    ]


def render(rows: list[Row], args, lengths: list[int], not_run: list[str], wall: float) -> str:
    device = jax.devices()[0]
    out = [
        "# Accelerator attention benchmark",
        "",
        f"Written by `benchmarks/bench_accelerators.py {' '.join(sys.argv[1:])}` on "
        f"{datetime.date.today()}: {device.platform} {device.device_kind} (x{jax.device_count()}), "
        f"jax {jax.__version__}, Python {platform.python_version()}. Causal self-attention, "
        f"B={args.batch} H={args.heads} D={args.dim}; times are medians (ms) over interleaved "
        "rounds after a warm-up, memory is the compiled executable's temporary buffers (MiB). "
        f"Total {wall:.0f} s.",
        "",
        *goal_lines(rows),
        "",
    ]
    for dtype in ("bfloat16", "float32"):
        for mode in MODES:
            block = [r for r in rows if (r.dtype, r.mode) == (dtype, mode)]
            if not block:
                continue
            ts = [t for t in lengths if any(r.t == t for r in block)]
            names = list(dict.fromkeys(r.name for r in block))
            out += [f"## {dtype}, {mode}", ""]
            out.append("| candidate | " + " | ".join(f"T={t} ms / MiB" for t in ts) + " |")
            out.append("|---" * (len(ts) + 1) + "|")
            for name in names:
                cells = []
                for t in ts:
                    row = next((r for r in block if r.name == name and r.t == t), None)
                    cells.append("" if row is None else f"{_fmt_ms(row)} / {_fmt_mib(row)}")
                out.append(f"| {name} | " + " | ".join(cells) + " |")
            out += ["", *note_lines(block), ""]
    if not_run:
        out += ["Not run (time budget): " + ", ".join(not_run) + ".", ""]
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny sizes, interpret mode: smoke run")
    p.add_argument("--lengths", default=None, help="comma-separated T (default 1k..32k)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop the sweep after this")
    p.add_argument("--config-cap-s", type=float, default=20.0, help="rounds stop past this")
    p.add_argument("--dense-limit-gib", type=float, default=48.0)
    p.add_argument("--slow-s", type=float, default=8.0, help="no longer T past a call this slow")
    p.add_argument(
        "--out", default=None, help="markdown output (default benchmarks/accelerators.md)"
    )
    args = p.parse_args(argv)
    if args.small:
        os.environ.setdefault(kernels.INTERPRET_ENV, "1")
        args.batch, args.heads, args.dim = 1, 2, 32
        default_lengths, args.rounds = "128,256", min(args.rounds, 2)
    else:
        args.batch, args.heads, args.dim = 4, 16, 128
        # The goal's T=4096 first, then the ends of the range, then the middle.
        default_lengths = "4096,1024,16384,32768,2048,8192"
    args.lengths = [int(x) for x in (args.lengths or default_lengths).split(",")]
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    if args.out is None:
        args.out = os.path.join(HERE, "accelerators_small.md" if args.small else "accelerators.md")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    # bfloat16 before float32 and forward+backward before forward (cuDNN takes no float32,
    # and training is what the goal measures); within each, the lengths in --lengths order.
    configs = [(t, d, m) for d in args.dtypes for m in MODES for t in args.lengths]
    slow: dict[str, tuple[int, str]] = {}  # too slow for longer T: name -> (T, why)
    rows: list[Row] = []
    not_run: list[str] = []
    for t, dtype, mode in configs:
        if time.perf_counter() - start > args.budget_s:
            not_run.append(f"{dtype} {mode} T={t}")
            continue
        print(f"[{time.perf_counter() - start:6.0f} s] {dtype} {mode} T={t}", flush=True)
        for row in measure_config(args, dtype, mode, t, slow):
            rows.append(row)
            extra = "" if row.compile_s is None else f"compile {row.compile_s:.1f} s, "
            extra += "" if row.warmup_s is None else f"warm-up {row.warmup_s:.2f} s  "
            print(
                f"    {row.name:28s} {_fmt_ms(row):>9} ms {_fmt_mib(row):>8} MiB  {extra}{row.note}"
            )
        # Rewritten after every configuration: a run stopped from outside keeps its table.
        write(args, rows, not_run, time.perf_counter() - start)
    write(args, rows, not_run, time.perf_counter() - start)
    print(f"wrote {args.out}")
    return 0


def write(args, rows: list[Row], not_run: list[str], wall: float) -> None:
    text = render(rows, args, sorted(args.lengths), not_run, wall)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
