"""Generation speed: KV-cache decoding against recomputing the sequence for every token.

All generators produce the same greedy tokens (checked here on every run) from the same
jattn.toy.TinyGPT weights; the only difference is how each new token is computed:

* cached (jattn.generate.generate): one prefill pass over the prompt, then one token per
  step through the model's KV caches, all in one jitted ``lax.scan``. Its cache is sized
  two ways: to what the run needs (prompt + new tokens, as a user who knows the run would)
  and, where that differs, to the model's full context (flax's convention: the input
  given to ``init``). On CPU with jattn's kernel a cached step's attention reads the
  filled positions only; the rest of the step (and elsewhere the whole step) works over
  the capacity, so the smaller cache is still the faster one; the headline uses it.
* book loop (:func:`book_generate`, in this file): chapter 4's ``generate_text_simple``
  as a user would port it to JAX. A Python loop feeds the growing sequence (the prompt and
  the tokens so far) to a jitted forward pass and takes the argmax of the logits at the
  last real position. To avoid one compilation per length, the sequence is right-padded
  to a power-of-two bucket (capped at the model's context), so the loop compiles once per
  bucket (16, 32, ..., 512 for a 16-token prompt and 256 new tokens) and each step costs a
  forward pass over at most twice the real length. The tokens stay on the device between
  steps (no host round-trip per token).
* fixed window (jattn.generate.generate_recompute): the model reruns on a fixed window of
  prompt + new tokens - 1 positions for every new token, inside one jitted loop: one
  compilation, but every step pays for the longest sequence.

Two models: the toy model of train_toy.py (its widths, with a context long enough for the
run) and a GPT-2-small-sized TinyGPT (12 layers, 768 wide, 12 heads, context 1024,
vocabulary 50257; TinyGPT's output head is untied, so it has 163M parameters against
GPT-2's 124M). Batch 1, float32, as the book's generate.

Timing. Every program is compiled ahead of time (``jax.jit(...).lower(...).compile()``),
so its compile time is measured on its own and excluded from tokens/s; the book loop's
buckets are then each run once before any timing. The generators alternate in rounds
(cached, book, cached at full context, fixed window, ...) so background load hits them
alike. The cached generators run once untimed before the rounds; a baseline's first run
is a warm-up whose time is dropped, unless it is longer than ``--long-run-s`` (a one-time
start cost of milliseconds is nothing against it). Each generator gets ``--repeats``
timed runs, except that a recompute baseline stops after its first run longer than
``--long-run-s`` (one such run already averages over its 256 steps, and the GPT-2-sized
baselines take minutes per run). Tokens/s are medians; the ranges
are the extremes over the runs (for a speed-up: slowest baseline run over the fastest
cached run, and the reverse).

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_generate.py                 # both models, writes the table
    .venv/bin/python benchmarks/bench_generate.py --models toy --repeats 5 --no-write
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from timing import cpu_description, sgemm_gflops  # benchmarks/timing.py, beside this script

from jattn import generate as gen
from jattn.toy.model import TinyGPT, TinyGPTConfig

# How to read the tables; true of any run, so it is written with every table.
READING = [
    "Reading the numbers:",
    "",
    "* The machine is shared: a long baseline run (one past `--long-run-s` runs once) can "
    "meet more or less load from other jobs than the cached runs around it, so the "
    "wall-clock and CPU-time speed-ups can differ; quote the lower of the two.",
    "* Batch-1 cached decoding of the GPT-2-sized model is bound by memory traffic, not "
    "arithmetic: every token reads each float32 weight once (a bullet above gives the "
    "implied bandwidth). Smaller weights (bfloat16) or a larger batch would raise tokens/s; "
    "neither is measured here.",
    "* On CPU with jattn's fused kernel a cached step's attention reads each row's filled "
    "positions only (`jattn.kvcache.fused`); the rest of the step (and, elsewhere, the "
    "whole step) works over the cache's capacity: the two GPT-2-sized rows give what a "
    "cache sized to the full context costs against one sized to the run.",
]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate_results.md")


def model_configs(new_tokens: int, prompt_len: int) -> dict[str, TinyGPTConfig]:
    # The toy widths of train_toy.py's defaults; only the context grows to fit the run.
    toy_context = max(64, prompt_len + new_tokens)
    return {
        "toy": TinyGPTConfig(
            vocab_size=17, context_length=toy_context, d_model=64, num_layers=2, num_heads=4,
            dropout=0.0,
        ),
        "gpt2-small": TinyGPTConfig(
            vocab_size=50257, context_length=1024, d_model=768, num_layers=12, num_heads=12,
            dropout=0.0,
        ),
    }  # fmt: skip


# ----------------------------------------------------------------------------------------
# The book's loop, in JAX
# ----------------------------------------------------------------------------------------


def bucket_length(n: int, context_length: int) -> int:
    """The padded length the book loop runs for a sequence of ``n`` real tokens."""
    return min(1 << (n - 1).bit_length(), context_length)


def _book_step(forward_fn, params, buffer, n, *, bucket):
    # [1, bucket] -> [1, bucket, V]: the sequence so far, right-padded; causal, so the
    # padding after position n - 1 changes nothing before it.
    logits = forward_fn(params, buffer[:, :bucket])
    # [1, V] at the last real position -> [1]: greedy, as generate_text_simple.
    token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, n - 1, 1, keepdims=False), -1)
    return buffer.at[:, n].set(token.astype(buffer.dtype))


class BookLoop:
    """Chapter 4's ``generate_text_simple`` in JAX: one jitted forward per new token.

    Compiles one step per bucket length ahead of time (:meth:`compile`), then
    :meth:`__call__` runs the Python loop over the growing sequence.
    """

    def __init__(self, forward_fn, params, prompt, *, max_new_tokens: int, context_length: int):
        self.params, self.prompt, self.max_new = params, prompt, max_new_tokens
        batch, prompt_len = prompt.shape
        total = prompt_len + max_new_tokens
        # Sequence lengths fed to the model: the prompt, then one more per generated token
        # (the last token is never fed back). The book would crop to the last
        # context_length tokens; this benchmark stays within the context, so it never does.
        self.lengths = list(range(prompt_len, total))
        self.buckets = sorted({bucket_length(n, context_length) for n in self.lengths})
        # [1, room]: the prompt, then room for every new token and for the largest bucket.
        room = max(total, self.buckets[-1])
        self.empty = jnp.zeros((batch, room), jnp.int32).at[:, :prompt_len].set(prompt)
        self.forward_fn, self.context_length = forward_fn, context_length
        self.steps: dict[int, object] = {}

    def compile(self) -> float:
        """Compiles every bucket's step; returns the seconds spent."""
        start = time.perf_counter()
        for b in self.buckets:
            step = jax.jit(partial(_book_step, self.forward_fn, bucket=b))
            self.steps[b] = step.lower(self.params, self.empty, np.int32(b)).compile()
        return time.perf_counter() - start

    def warm_up(self) -> None:
        """Runs each bucket's compiled step once (its first execution is not timed)."""
        for b in self.buckets:
            jax.block_until_ready(self.steps[b](self.params, self.empty, np.int32(b)))

    def __call__(self) -> jax.Array:
        buffer = self.empty
        for n in self.lengths:
            buffer = self.steps[bucket_length(n, self.context_length)](
                self.params, buffer, np.int32(n)
            )
        # [1, N]: the new tokens.
        start = self.lengths[0]
        return buffer[:, start : start + self.max_new]


# ----------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------


def _timed(fn) -> tuple[float, float, np.ndarray]:
    """Runs ``fn``; returns its wall-clock seconds, the process's CPU seconds, the output."""
    start, start_cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, time.process_time() - start_cpu, np.asarray(out)


def _compiled_call(fn, *args) -> tuple[float, object]:
    """Compiles ``jax.jit(fn)`` for ``args`` ahead of time; returns (seconds, a call)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - start, lambda: compiled(*args)


def bench_model(
    name: str,
    config: TinyGPTConfig,
    *,
    new_tokens: int,
    prompt_len: int,
    repeats: int,
    long_run_s: float,
):
    """Times every generator on one model; returns a result row."""
    need = prompt_len + new_tokens  # cache slots a user would give the run (one spare)
    if need - 1 > config.context_length:
        raise SystemExit(
            f"{name}: prompt ({prompt_len}) + new tokens ({new_tokens}) - 1 exceeds the context "
            f"({config.context_length})."
        )
    key = jax.random.key(0)
    model, decoder = TinyGPT(config), TinyGPT(config, decode=True)
    params = jax.jit(model.init)(key, jnp.zeros((1, prompt_len), jnp.int32))["params"]
    prompt = jax.random.randint(jax.random.key(1), (1, prompt_len), 0, config.vocab_size)
    decode_fn, forward_fn = gen.LinenDecodeFn(decoder), gen.LinenForwardFn(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))

    def empty_cache(capacity):
        # The cache is sized by the input given to init; jit drops the unused params init.
        tokens = jnp.zeros((1, capacity), jnp.int32)
        return jax.jit(lambda t: decoder.init(key, t)["cache"])(tokens)

    def cached(p, cache, x):
        return gen.generate(decode_fn, p, cache, x, max_new_tokens=new_tokens)

    def fixed(p, x):
        return gen.generate_recompute(forward_fn, p, x, max_new_tokens=new_tokens)

    capacities = sorted({need, config.context_length})
    runs, compile_s = {}, {}
    for cap in capacities:
        k = f"cached {cap}"
        compile_s[k], runs[k] = _compiled_call(cached, params, empty_cache(cap), prompt)
    book = BookLoop(
        forward_fn, params, prompt, max_new_tokens=new_tokens, context_length=config.context_length
    )
    compile_s["book"], runs["book"] = book.compile(), book
    book.warm_up()
    compile_s["fixed"], runs["fixed"] = _compiled_call(fixed, params, prompt)
    for k, s in compile_s.items():
        print(f"  {name} {k}: compiled in {s:.1f} s", flush=True)
    # Rounds alternate cached and recompute runs: cached, book, cached (full context), fixed.
    order = [f"cached {need}", "book", f"cached {config.context_length}", "fixed"]
    order = list(dict.fromkeys(order))  # the toy's two capacities coincide
    baselines = ("book", "fixed")

    times, cpu, outputs, seen = {k: [] for k in order}, {k: [] for k in order}, {}, set()

    def done(k):  # one long run is enough for a recompute baseline
        long = k in baselines and times[k] and times[k][-1] > long_run_s
        return long or len(times[k]) == repeats

    for k in order:
        if k not in baselines:  # cheap: warm the cached programs up before any timing
            _timed(runs[k])
    r = 0
    while not all(done(k) for k in order):
        r += 1
        for k in order:
            if done(k):
                continue
            t, t_cpu, outputs[k] = _timed(runs[k])
            # A baseline's first run is a warm-up unless it is long: a one-time start cost
            # of a few milliseconds is nothing against it, and a second run takes minutes.
            warm_up = k in baselines and k not in seen and t <= long_run_s
            seen.add(k)
            if not warm_up:
                times[k].append(t)
                cpu[k].append(t_cpu)
            print(
                f"  {name} {k} round {r}{' (warm-up)' if warm_up else ''}: {t:.3f} s "
                f"(CPU {t_cpu:.3f} s)",
                flush=True,
            )
    reference = outputs[order[0]]
    for k in order[1:]:
        if not np.array_equal(outputs[k], reference):
            raise SystemExit(f"{name}: '{k}' and '{order[0]}' generated different tokens.")

    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    speedups = {}
    for cap in capacities:
        c = times[f"cached {cap}"]
        for b in baselines:
            speedups[(cap, b)] = (
                med[b] / med[f"cached {cap}"],
                min(times[b]) / max(c),
                max(times[b]) / min(c),
                med_cpu[b] / med_cpu[f"cached {cap}"],
            )
    return {
        "model": name,
        "config": config,
        "params": n_params,
        "capacities": capacities,
        "headline_capacity": need,
        "tok_s": {k: new_tokens / v for k, v in med.items()},
        "tok_s_range": {k: (new_tokens / max(v), new_tokens / min(v)) for k, v in times.items()},
        "runs": {k: len(v) for k, v in times.items()},
        "cpu_ms_per_token": {k: 1e3 * v / new_tokens for k, v in med_cpu.items()},
        "compile_s": compile_s,
        "buckets": book.buckets,
        "speedups": speedups,
    }


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _rate(row, k) -> str:
    lo, hi = row["tok_s_range"][k]
    n = row["runs"][k]
    spread = f" ({_num(lo)}-{_num(hi)})" if n > 1 else ""
    return f"{_num(row['tok_s'][k])}{spread} [{n}]"


def _speedup(row, cap, baseline, bold) -> str:
    mid, lo, hi, _ = row["speedups"][(cap, baseline)]
    text = f"{mid:.1f}x"
    return f"**{text}** ({lo:.1f}-{hi:.1f})" if bold else f"{text} ({lo:.1f}-{hi:.1f})"


def _describe(row) -> str:
    c = row["config"]
    return (
        f"{row['model']} ({c.num_layers} layers, {c.d_model} wide, {c.num_heads} heads, "
        f"context {c.context_length}, vocab {c.vocab_size})"
    )


def to_markdown(rows, args, command: str, gflops: float) -> str:
    lines = [
        "# Generation with a KV cache vs recomputing the sequence",
        "",
        f"Command: `{command}`",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on "
        f"{jax.default_backend()}: {cpu_description()}, shared with other jobs; XLA sgemm "
        f"(1024^3, float32) {gflops:.0f} GFLOP/s in this run; jax {jax.__version__}. Batch "
        f"1, float32, prompt of {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy: "
        "every generator gives identical tokens (checked on each run).",
        "",
        "Tokens/s (wall clock): median (min-max over runs) [number of runs]. Speed-up: ratio of "
        "medians (range: slowest baseline run / fastest cached run, and the reverse). The "
        "headline (bold) is the cached generator with a run-sized KV cache against the book's "
        "loop. Compile times are measured apart and excluded from tokens/s.",
        "",
        "| model | params | KV cache | cached tok/s | book loop tok/s | fixed window tok/s "
        "| speed-up vs book loop | speed-up vs fixed window | compile cached / book / fixed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for cap in r["capacities"]:
            k = f"cached {cap}"
            head = cap == r["headline_capacity"]
            cs = r["compile_s"]
            lines.append(
                f"| {_describe(r)} | {r['params'] / 1e6:.2f}M | {cap} | {_rate(r, k)} | "
                f"{_rate(r, 'book')} | {_rate(r, 'fixed')} | {_speedup(r, cap, 'book', head)} | "
                f"{_speedup(r, cap, 'fixed', False)} | {cs[k]:.1f} s / {cs['book']:.1f} s "
                f"({len(r['buckets'])} buckets) / {cs['fixed']:.1f} s |"
            )
    lines += [
        "",
        "The same runs in CPU time of this process (all its threads; median per token), which "
        "other jobs on the shared cores disturb less than the wall clock:",
        "",
        "| model | KV cache | cached CPU ms/token | book loop CPU ms/token "
        "| fixed window CPU ms/token | speed-up vs book loop | speed-up vs fixed window |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["cpu_ms_per_token"]
        for cap in r["capacities"]:
            lines.append(
                f"| {r['model']} | {cap} | {_num(ms[f'cached {cap}'])} | {_num(ms['book'])} | "
                f"{_num(ms['fixed'])} | {r['speedups'][(cap, 'book')][3]:.1f}x | "
                f"{r['speedups'][(cap, 'fixed')][3]:.1f}x |"
            )
    buckets = "; ".join(f"{r['model']}: {', '.join(map(str, r['buckets']))}" for r in rows)
    lines += [
        "",
        "* **cached**: `jattn.generate.generate`, prefill then one token per step through the KV "
        "caches, in one jitted `lax.scan`. KV cache = its capacity in positions: prompt + new "
        "tokens (what the run needs, as a user would size it) or the model's full context "
        "(flax's convention: the input given to `init`). On CPU with jattn's kernel each step "
        "attends over the filled positions only; elsewhere over the whole cache.",
        "* **book loop**: chapter 4's `generate_text_simple` ported to JAX as a user would: a "
        "Python loop feeding the growing sequence to a jitted forward pass, argmax at the last "
        "real position. The sequence is right-padded to power-of-two buckets capped at the "
        f"context ({buckets}), so it compiles once per bucket and runs over at most twice the "
        "real length; the tokens stay on the device.",
        "* **fixed window**: `jattn.generate.generate_recompute`, a full forward pass over "
        "prompt + new tokens - 1 positions for every token, in one jitted loop.",
    ]
    for r in rows:
        mb = 4 * r["params"] / 1e6
        k = f"cached {r['headline_capacity']}"
        if mb < 64:  # a model that fits the CPU caches is not bound by reading its weights
            continue
        lines.append(
            f"* {r['model']}: each cached step reads all {r['params'] / 1e6:.2f}M float32 "
            f"parameters ({mb:.0f} MB); at {_num(r['tok_s'][k])} tok/s that is "
            f"{mb * r['tok_s'][k] / 1e3:.1f} GB/s."
        )
    lines += ["", *READING, ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="toy,gpt2-small", help="comma-separated: toy, gpt2-small")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per generator and model")
    p.add_argument(
        "--long-run-s",
        type=float,
        default=60.0,
        help="a recompute baseline is not repeated after a run longer than this",
    )
    p.add_argument("--no-write", action="store_true", help=f"do not write {RESULTS}")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 1 or args.prompt_len < 1:
        p.error("--repeats, --new-tokens and --prompt-len must be >= 1")
    configs = model_configs(args.new_tokens, args.prompt_len)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in configs]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {sorted(configs)}")
    gflops = sgemm_gflops()  # the machine's rate in this run, beside its figures
    print(f"{cpu_description()}; XLA sgemm {gflops:.0f} GFLOP/s", flush=True)
    rows = []
    for name in names:
        print(f"{name}:", flush=True)
        rows.append(
            bench_model(
                name,
                configs[name],
                new_tokens=args.new_tokens,
                prompt_len=args.prompt_len,
                repeats=args.repeats,
                long_run_s=args.long_run_s,
            )
        )
    command = "python benchmarks/bench_generate.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    table = to_markdown(rows, args, command.strip(), gflops)
    print(table)
    if not args.no_write:
        with open(RESULTS, "w", encoding="utf-8") as f:
            f.write(table)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
