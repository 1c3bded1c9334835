"""Cost of score and mask modifiers (issue 17): jattn with modifiers against jattn without.

float32, causal, ``[B=1, T, H=8, D=64]``; forward and forward+backward (the gradient of
``out.sum()`` w.r.t. q, k, v, and the slopes for ALiBi). In one process, interleaved
rounds (each round runs every candidate once, in a random order; times are medians, each
ratio the median of per-round ratios), against the plain ``is_causal=True`` call:

* ``mask_mod=causal``: ``mask_mod=jattn.mods.causal()`` instead of ``is_causal=True``;
* ``softcap``: ``score_mod=jattn.mods.softcap(30)``;
* ``alibi``: ``score_mod=jattn.mods.alibi(slopes)``, and its forward+backward temporary
  memory at the longest T against ``jax.nn.dot_product_attention``'s (compiled only);
* ``document x4``: ``mask_mod=jattn.mods.document(ids)`` with 4 equal documents (plus
  the causal mask), through ``mask_mod`` and through a prebuilt ``block_mask``.

Beside each, PyTorch's ``torch.compile``-d ``flex_attention`` forward on the same CPU
(flex_attention has no CPU backward), with the same modifier and a ``create_block_mask``
block mask. The header records the CPU (model, AVX-512, cores) and an sgemm rate measured
in the same run.

The goals (issue 17) hold for the *blockwise* path: with ``--implementation dense`` (or
when the blockwise path refuses the modifiers, as before phase 2) the ratios are printed
but not judged.

Usage::

    python benchmarks/bench_mods.py                      # full run -> benchmarks/mods_results.md
    python benchmarks/bench_mods.py --quick --out /tmp/m.md  # tiny smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from timing import cpu_description, sgemm_gflops  # benchmarks/timing.py, beside this script

import jattn
from jattn import mods

try:  # optional peer; never a dependency of jattn
    import torch
    from torch.nn.attention import flex_attention as torch_flex
except ImportError:  # pragma: no cover - depends on the environment
    torch = torch_flex = None

HERE = os.path.dirname(os.path.abspath(__file__))
HEADS, HEAD_DIM, CAP, DOCS = 8, 64, 30.0, 4
PLAIN = "is_causal=True"

# ----------------------------------------------------------------------------------------
# Timing (as benchmarks/bench_attention.py: compile apart, interleaved rounds)
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Candidate:
    name: str
    run: Callable[[], object] | None  # None: not runnable here (see `note`)
    compile_s: float | None = None
    note: str = ""
    times: list[float] = dataclasses.field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times) if self.times else math.nan


def jax_candidate(name: str, fn: Callable, *args) -> Candidate:
    """Jits and compiles ``fn`` (timed apart), runs it once to warm up; a refusal is noted."""
    start = time.perf_counter()
    try:
        compiled = jax.jit(fn).lower(*args).compile()
    except ValueError as e:  # an implementation that cannot honour the call
        return Candidate(name, None, note=str(e).split(": ", 1)[-1].split(". Use")[0])
    compile_s = time.perf_counter() - start

    def run():
        return jax.block_until_ready(compiled(*args))

    run()
    return Candidate(name, run, compile_s)


def temp_bytes(fn: Callable, *args) -> int | None:
    """Temporary memory of ``fn`` compiled for ``args`` (compiled, never run)."""
    try:
        memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    except ValueError:
        return None
    return None if memory is None else int(memory.temp_size_in_bytes)


def interleave(candidates: list[Candidate], rounds: int) -> None:
    order = random.Random(0)
    runnable = [c for c in candidates if c.run is not None]
    for _ in range(rounds):
        for cand in order.sample(runnable, len(runnable)):
            start = time.perf_counter()
            cand.run()
            cand.times.append(time.perf_counter() - start)


def paired_ratio(a: Candidate, b: Candidate) -> float:
    if not a.times or not b.times:
        return math.nan
    return statistics.median(x / y for x, y in zip(a.times, b.times, strict=True))


def fmt_ms(seconds: float) -> str:
    return "—" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:,.1f}"


def fmt_ratio(x: float) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# ----------------------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------------------


def environment(gflops: float) -> str:
    torch_v = torch.__version__ if torch is not None else "not installed"
    return (
        f"{datetime.date.today()}; CPU: {cpu_description()}; sgemm (XLA, 2048^3, float32) "
        f"{gflops:,.0f} GFLOP/s in this run; backend {jax.default_backend()}; jax "
        f"{jax.__version__}, torch {torch_v}, python {platform.python_version()}"
    )


# ----------------------------------------------------------------------------------------
# The variants
# ----------------------------------------------------------------------------------------


def document_ids(t: int):
    return jnp.repeat(jnp.arange(DOCS, dtype=jnp.int32), -(-t // DOCS))[:t][None]


def variants(t: int, implementation: str) -> dict[str, tuple[Callable, tuple]]:
    """``name -> (f(q, k, v, *extra) -> out, extra)``: every call is causal."""
    dpa = jattn.dot_product_attention
    ids = document_ids(t)
    doc_mask = mods.causal() & mods.document(ids)
    bm = jattn.block_mask(doc_mask, q_len=t)  # built once, outside the timed call
    impl = {"implementation": implementation}
    return {
        PLAIN: (lambda q, k, v: dpa(q, k, v, is_causal=True, **impl), ()),
        "mask_mod=causal": (lambda q, k, v: dpa(q, k, v, mask_mod=mods.causal(), **impl), ()),
        "softcap": (
            lambda q, k, v: dpa(q, k, v, is_causal=True, score_mod=mods.softcap(CAP), **impl),
            (),
        ),
        "alibi": (
            lambda q, k, v, s: dpa(q, k, v, is_causal=True, score_mod=mods.alibi(s), **impl),
            (mods.alibi_slopes(HEADS),),
        ),
        "document x4 (mask_mod)": (
            lambda q, k, v, ids: dpa(q, k, v, mask_mod=mods.causal() & mods.document(ids), **impl),
            (ids,),
        ),
        "document x4 (block_mask)": (
            lambda q, k, v, bm: dpa(q, k, v, block_mask=bm, **impl),
            (bm,),
        ),
    }


def forward_backward(fn: Callable) -> Callable:
    """Gradient of ``fn(...).sum()`` w.r.t. q, k, v (and float extras: ALiBi's slopes)."""

    def loss(q, k, v, *extra):
        return fn(q, k, v, *extra).sum()

    def grads(q, k, v, *extra):
        float_extra = [
            i for i, x in enumerate(extra)
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
        ]  # fmt: skip
        return jax.grad(loss, argnums=(0, 1, 2, *(3 + i for i in float_extra)))(q, k, v, *extra)

    return grads


def torch_candidates(t: int) -> list[Candidate]:
    """``torch.compile(flex_attention)`` forward for each variant (no CPU backward in torch)."""
    if torch_flex is None:
        return []
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, t, HEAD_DIM, generator=gen) for _ in range(3))
    slopes = torch.tensor(jax.device_get(mods.alibi_slopes(HEADS)))
    ids = torch.tensor(jax.device_get(document_ids(t)))[0]

    def causal(b, h, qi, ki):
        return qi >= ki

    def document(b, h, qi, ki):
        return (qi >= ki) & (ids[qi] == ids[ki])

    def softcap(s, b, h, qi, ki):
        return CAP * torch.tanh(s / CAP)

    def alibi(s, b, h, qi, ki):
        return s + slopes[h] * (ki - qi)

    flex = torch.compile(torch_flex.flex_attention)
    cands = []
    for name, score_mod, mask_mod in (
        ("torch flex: causal", None, causal),
        ("torch flex: softcap", softcap, causal),
        ("torch flex: alibi", alibi, causal),
        ("torch flex: document x4", None, document),
    ):
        block_mask = torch_flex.create_block_mask(mask_mod, None, None, t, t, device="cpu")

        def run(score_mod=score_mod, block_mask=block_mask):
            with torch.no_grad():
                return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)

        start = time.perf_counter()
        try:
            run()
        except Exception as e:  # torch.compile of flex_attention fails for some shapes
            reason = str(e).strip().splitlines()[0][:80]
            cands.append(Candidate(name, None, note=f"torch.compile failed: {reason}"))
            continue
        cand = Candidate(name, run, time.perf_counter() - start)
        run()
        cands.append(cand)
    return cands


# ----------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Goal:
    text: str
    figure: str
    met: bool | None  # None: not judged in this run


def bench_length(t: int, args, log) -> dict[str, list[Candidate]]:
    keys = jax.random.split(jax.random.key(t), 3)
    q, k, v = (jax.random.normal(key, (1, t, HEADS, HEAD_DIM), jnp.float32) for key in keys)
    out = {}
    for mode in args.modes:
        cands = []
        for name, (fn, extra) in variants(t, args.implementation).items():
            f = fn if mode == "fwd" else forward_backward(fn)
            cands.append(jax_candidate(name, f, q, k, v, *extra))
        if mode == "fwd" and not args.skip_torch:
            cands += torch_candidates(t)
        interleave(cands, args.rounds)
        out[mode] = cands
        log(f"T={t} {mode}: " + ", ".join(f"{c.name} {fmt_ms(c.median_s)} ms" for c in cands))
    return out


def report_rows(results, t):
    rows = []
    for mode, cands in results.items():
        by = {c.name: c for c in cands}
        for c in cands:
            ratio = paired_ratio(c, by[PLAIN]) if not c.name.startswith("torch") else math.nan
            rows.append(
                [str(t), mode, c.name, fmt_ms(c.median_s), fmt_ratio(ratio),
                 "—" if c.compile_s is None else f"{c.compile_s:.1f}", c.note or ""]
            )  # fmt: skip
    return rows


def goals(results_by_t, memory, args) -> list[Goal]:
    judged = args.implementation == "blockwise"
    t = max(results_by_t)
    mode = "fwd+bwd" if "fwd+bwd" in results_by_t[t] else args.modes[-1]
    by = {c.name: c for c in results_by_t[t][mode]}
    out = []
    for name, bound, text in (
        ("mask_mod=causal", 1.1, "mask_mod equal to causal <= 1.1x is_causal=True"),
        ("softcap", 1.25, "soft-capping <= 1.25x plain"),
        ("alibi", 1.3, "ALiBi through score_mod <= 1.3x plain"),
        ("document x4 (block_mask)", 1.0, "4 documents faster than causal alone (block_mask)"),
        ("document x4 (mask_mod)", 1.0, "4 documents faster than causal alone (mask_mod)"),
    ):
        r = paired_ratio(by[name], by[PLAIN])
        met = None if not judged or math.isnan(r) else (r < bound if bound == 1.0 else r <= bound)
        figure = by[name].note if math.isnan(r) and by[name].note else fmt_ratio(r)
        out.append(Goal(f"T={t} {mode}: {text}", figure, met))
    ours, ref = memory
    text = f"ALiBi fwd+bwd temp memory at T={args.memory_len} <= 5% of jax.nn"
    if ours is None or not ref:
        out.append(Goal(text, f"not measured ({args.implementation} refused the call)", None))
    else:
        figure = f"{100 * ours / ref:.1f}% ({ours / 2**20:,.1f} / {ref / 2**20:,.1f} MB)"
        out.append(Goal(text, figure, None if not judged else ours <= 0.05 * ref))
    return out


def alibi_memory(args) -> tuple[int | None, int | None]:
    t = args.memory_len
    q = jax.ShapeDtypeStruct((1, t, HEADS, HEAD_DIM), jnp.float32)
    slopes = jax.ShapeDtypeStruct((HEADS,), jnp.float32)
    fn, _ = variants(min(t, 8), args.implementation)["alibi"]  # the function, any length

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    ours = temp_bytes(forward_backward(fn), q, q, q, slopes)
    return ours, temp_bytes(forward_backward(ref), q, q, q)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds: a smoke test")
    p.add_argument("--lengths", default=None, help="sequence lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
    p.add_argument("--modes", default="fwd,fwd+bwd", help="fwd and/or fwd+bwd")
    p.add_argument(
        "--implementation", default="blockwise", choices=("blockwise", "dense"),
        help="the jattn path measured (the goals hold for blockwise)",
    )  # fmt: skip
    p.add_argument("--memory-len", type=int, default=None, help="T of the memory comparison")
    p.add_argument("--skip-torch", action="store_true", help="no torch flex_attention column")
    p.add_argument("--out", default=os.path.join(HERE, "mods_results.md"))
    args = p.parse_args(argv)
    args.lengths = (
        [int(x) for x in args.lengths.split(",")]
        if args.lengths
        else ([128, 256] if args.quick else [1024, 2048, 4096, 8192])
    )
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.modes = [m for m in args.modes.split(",") if m]
    args.memory_len = args.memory_len or (256 if args.quick else 8192)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    gflops = sgemm_gflops(2048, 5)
    env = environment(gflops)
    print(env, flush=True)
    results = {t: bench_length(t, args, lambda s: print(s, flush=True)) for t in args.lengths}
    memory = alibi_memory(args)
    rows = [row for t in args.lengths for row in report_rows(results[t], t)]
    goal_rows = [
        [g.text, g.figure, "—" if g.met is None else ("met" if g.met else "**missed**")]
        for g in goals(results, memory, args)
    ]
    judged = (
        "judged"
        if args.implementation == "blockwise"
        else "not judged: this run measured the dense path"
    )
    text = "\n".join(
        [
            "# Score and mask modifiers: cost (benchmarks/bench_mods.py)",
            "",
            env,
            "",
            f"jattn implementation: `{args.implementation}`; B=1, H={HEADS}, D={HEAD_DIM}, "
            f"float32, causal; {args.rounds} interleaved rounds; ratio = median per-round "
            f"time / `{PLAIN}` (same mode). Command: "
            f"`{' '.join(['python benchmarks/bench_mods.py', *(argv or sys.argv[1:])])}`.",
            "",
            f"The machine's {os.cpu_count()} cores may be shared with other jobs while this "
            "runs: absolute times are noisy; each ratio is the median of per-round ratios "
            "of candidates interleaved in one process, which cancels most of the load.",
            "",
            table(["T", "mode", "candidate", "ms", "vs plain", "compile s", "note"], rows),
            "",
            f"## Goals (issue 17; {judged})",
            "",
            table(["goal", "measured", ""], goal_rows),
            "",
        ]
    )
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
