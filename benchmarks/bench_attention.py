"""Side-by-side attention benchmark: jattn (dense and blockwise) against its peers.

One process, interleaved rounds: every round runs each candidate once (in a random
order, each once the process is idle again: the previous candidate's buffers are released
on a runtime thread after it returns), so load from other processes hits all of them
alike; times are medians over rounds and each ratio is the median of the per-round ratios. Compile time (lower +
compile) is reported separately and never counted in a run time. Memory is the compiled
executable's temporary buffer size (``compiled.memory_analysis().temp_size_in_bytes``).

Sections (all float32, causal):

* core: ``[B=1, T, H=8, D=64]`` at T = 256 ... 8192, forward and forward+backward
  (gradient of ``out.sum()`` w.r.t. q, k, v) of jattn dense, jattn blockwise,
  ``jax.nn.dot_product_attention`` (XLA), ``flax.linen.dot_product_attention``, jattn's
  fused CPU kernel (``implementation='cpu_fused'``, where it was built) and PyTorch
  ``scaled_dot_product_attention`` (when torch is importable);
* long: jattn blockwise forward+backward at T = 32768, once;
* module: B=4, T=1024, C=768, H=12 multi-head attention with projections, forward and
  forward+backward (gradients w.r.t. the parameters), of ``jattn.linen`` / ``jattn.nnx``
  ``MultiHeadAttention`` (automatic, and linen's with ``cpu_fused``), a hand-written
  fused-QKV variant, flax's ``linen.MultiHeadDotProductAttention`` /
  ``nnx.MultiHeadAttention`` and a PyTorch module built on ``scaled_dot_product_attention``;
* dropout: the cost of a dropout mask from each ``jax.random`` key implementation and
  from jattn's Philox counters, and a training step with dropout 0.1 against one without;
* fused dropout: ``cpu_fused`` forward+backward with dropout 0.1 against without (B=1,
  T=1024, H=8, D=64);
* packed: ``cpu_fused`` forward+backward over 4 packed documents (segment ids, causal
  within each) against plain causal, B=1, T=8192, H=8, D=64;
* batched: more work than cores, B=8, H=16, T=2048, D=64 causal forward+backward,
  ``cpu_fused`` against PyTorch SDPA;
* decode: one decoding step, 1 query against an 8192-token cache (B=1, H=32, D=128, not
  causal), forward: jattn's fused CPU kernel (split-KV) with key lengths and with the
  KV cache's boolean ``mask=`` array, jattn dense, and PyTorch SDPA.

The CPU is recorded (model, AVX-512 or not, cores) and a float32 matrix product
(``[2048, 2048] @ [2048, 2048]`` in jax, "sgemm") is timed in every round of the core and
module sections, so each attention timing is also given as a fraction of the sgemm rate
measured beside it (attention FLOPs count the causal half only: forward
``4 B H T^2 D / 2``, forward+backward 3.5 times that, i.e. the 2 + 5 matrix products of
FlashAttention-2). The share of the machine used by other processes during the timed runs
is recorded too (Linux), since a loaded machine skews the absolute times.

The report opens with issue 25's goal table (one row per row of the issue's "Measure"
table: measured, goal, met; a row no section measured says so), then the earlier issues'.

``results.md`` keeps one report per kind of CPU (AVX-512, AVX2, ...): a run replaces the
block of its own kind and leaves the others.

Usage::

    python benchmarks/bench_attention.py            # full run, writes results.md + .png
    python benchmarks/bench_attention.py --quick --out /tmp/r.md   # tiny smoke run
    python benchmarks/bench_attention.py --skip-module --skip-dropout --lengths 1024,4096
    python benchmarks/bench_attention.py --skip-core --skip-module --skip-dropout \
        --skip-fused-dropout --skip-batched --skip-decode --out /tmp/r.md  # packed only
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from timing import cpu_info, settle  # benchmarks/timing.py, beside this script

import jattn
import jattn.linen
import jattn.nnx
from jattn import _prng, kernels

try:  # optional peer; never a dependency of jattn
    import torch
except ImportError:  # pragma: no cover - depends on the environment
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCKWISE = "jattn blockwise"
FUSED = "jattn cpu_fused"  # jattn's fused CPU kernel (issue 25), where it was built
FUSED_MHA = "jattn.linen MHA, cpu_fused"


def fused_available() -> bool:
    """True when jattn's fused CPU kernel was built and this run is on CPU."""
    return jax.default_backend() == "cpu" and kernels.adapter("cpu_fused").available("cpu")


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Candidate:
    """One thing to time: ``run()`` executes it once and blocks until it is done."""

    name: str
    run: Callable[[], object]
    compile_s: float | None = None
    temp_bytes: int | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    foreign: list[float] = dataclasses.field(default_factory=list)  # see machine_busy()

    @property
    def median_s(self) -> float:
        return statistics.median(self.times) if self.times else math.nan


def machine_busy() -> tuple[int, int] | None:
    """``(total, idle)`` CPU jiffies of the whole machine from ``/proc/stat`` (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[3] + fields[4]  # idle + iowait


def foreign_share(before, after, own_cpu_s: float) -> float:
    """Share of the machine's CPU time used by other processes between two snapshots."""
    if before is None or after is None or after[0] <= before[0]:
        return math.nan
    tick = os.sysconf("SC_CLK_TCK")
    total = (after[0] - before[0]) / tick
    busy = total - (after[1] - before[1]) / tick
    return min(1.0, max(0.0, busy - own_cpu_s) / total)


def jax_candidate(name: str, fn: Callable, *args) -> Candidate:
    """Jits ``fn``, compiles it (timed), records its temp memory, runs it once to warm up."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    temp = None if memory is None else int(memory.temp_size_in_bytes)

    def run():
        return jax.block_until_ready(compiled(*args))

    run()
    return Candidate(name, run, compile_s, temp)


def memory_only(fn: Callable, *args) -> int | None:
    """Temp memory of ``fn`` compiled for ``args`` (compiled, never run)."""
    memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    return None if memory is None else int(memory.temp_size_in_bytes)


QUIET_WAIT_S = 0.0  # --wait-quiet: before each round, wait up to this long for an idle machine


def wait_quiet(max_wait_s: float, busy_max: float = 0.1) -> bool:
    """Waits until the machine was less than ``busy_max`` busy over half a second (Linux)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = machine_busy()
        time.sleep(0.5)
        after = machine_busy()
        if before is None or after is None:
            return False
        if after[0] > before[0] and 1 - (after[1] - before[1]) / (after[0] - before[0]) < busy_max:
            return True
    return False


def interleave(candidates: list[Candidate], rounds: int) -> None:
    """Runs every candidate once per round, in a fresh random order, and records the times.

    A random order per round (fixed seed) means no candidate always runs right after the
    same neighbour (a rotation keeps neighbours: whatever follows PyTorch would always pay
    for its worker threads winding down), and each one starts once the process is idle
    (:func:`settle`).
    """
    order = random.Random(0)
    for _ in range(rounds):
        if QUIET_WAIT_S > 0:
            wait_quiet(QUIET_WAIT_S)
        for cand in order.sample(candidates, len(candidates)):
            settle()
            snap, cpu = machine_busy(), time.process_time()
            start = time.perf_counter()
            cand.run()
            cand.times.append(time.perf_counter() - start)
            cand.foreign.append(foreign_share(snap, machine_busy(), time.process_time() - cpu))


def paired_ratio(a: Candidate, b: Candidate) -> float:
    """Median over rounds of ``time(a) / time(b)`` in the same round."""
    if not a.times or not b.times:
        return math.nan
    return statistics.median(x / y for x, y in zip(a.times, b.times, strict=True))


# ----------------------------------------------------------------------------------------
# The CPU and its matrix-product rate
# ----------------------------------------------------------------------------------------

SGEMM_N = 2048
SGEMM = f"sgemm {SGEMM_N}^3 (jax)"


def sgemm_candidate() -> Candidate:
    """A float32 ``[n, n] @ [n, n]`` product in jax: the machine's matrix-product rate."""
    a, b = (jax.random.normal(jax.random.key(i), (SGEMM_N, SGEMM_N), jnp.float32) for i in (8, 9))
    return jax_candidate(SGEMM, jnp.matmul, a, b)


def sgemm_gflops(sgemm: Candidate) -> float:
    return 2 * SGEMM_N**3 / sgemm.median_s / 1e9


def attention_flops(t: int, *, batch: int, heads: int, head_dim: int, backward: bool) -> float:
    """Causal attention FLOPs: ``4 B H T^2 D / 2`` forward, 3.5 times that with the backward."""
    forward = 4 * batch * heads * t * t * head_dim / 2
    return forward * (3.5 if backward else 1.0)


def sgemm_fraction(cand: Candidate, sgemm: Candidate, flops: float) -> float:
    """Median over rounds of (cand's GFLOP/s) / (sgemm's GFLOP/s) in the same round."""
    if not cand.times or not sgemm.times:
        return math.nan
    per_round = zip(cand.times, sgemm.times, strict=True)
    return statistics.median((flops / x) / (2 * SGEMM_N**3 / y) for x, y in per_round)


def load_note(cands: list[Candidate]) -> str:
    shares = [x for c in cands for x in c.foreign if not math.isnan(x)]
    if not shares:
        return "load from other processes: not measured"
    return (
        f"load from other processes during the timed runs: median {100 * statistics.median(shares):.0f}%, "
        f"max {100 * max(shares):.0f}% of the machine's CPU time"
    )


# ----------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------


def fmt_ms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "—"
    return f"{seconds * 1e3:,.1f}"


def fmt_mb(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / 2**20:,.1f}"


def fmt_ratio(x: float) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Core attention: [B, T, H, D]
# ----------------------------------------------------------------------------------------


def core_functions() -> dict[str, Callable]:
    """``name -> f(q, k, v)``: causal attention on ``[B, T, H, D]`` inputs."""

    def flax_linen(q, k, v):
        mask = nn.make_causal_mask(jnp.ones(q.shape[:2]), dtype=jnp.bool_)
        return nn.dot_product_attention(q, k, v, mask=mask)

    fns = {
        "jattn dense": functools.partial(
            jattn.dot_product_attention, is_causal=True, implementation="dense"
        ),
        BLOCKWISE: functools.partial(
            jattn.dot_product_attention, is_causal=True, implementation="blockwise"
        ),
        "jax.nn (xla)": functools.partial(
            jax.nn.dot_product_attention, is_causal=True, implementation="xla"
        ),
        "flax.linen": flax_linen,
    }
    if fused_available():
        fns[FUSED] = functools.partial(
            jattn.dot_product_attention, is_causal=True, implementation="cpu_fused"
        )
    if jax.default_backend() == "gpu":
        # cuDNN's fused kernel takes float16/bfloat16 only: cast in, cast the result back.
        def cudnn(q, k, v):
            q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            return out.astype(jnp.float32)

        fns["jax.nn (cudnn, bf16)"] = cudnn
    return fns


def grad_of_sum(fn: Callable) -> Callable:
    """``(q, k, v) -> d sum(fn(q, k, v)) / d(q, k, v)``: one forward+backward."""
    return jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))


def torch_core(shape, backward: bool) -> Candidate:
    b, t, h, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=gen, requires_grad=backward) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        if backward:
            for x in (q, k, v):
                x.grad = None
            sdpa(q, k, v, is_causal=True).sum().backward()
        else:
            with torch.no_grad():
                sdpa(q, k, v, is_causal=True)

    run()
    return Candidate("torch sdpa", run)


def bench_core(lengths, *, batch, heads, head_dim, rounds, dense_max_len, log):
    """Returns ``{(mode, T): [Candidate...]}`` and memory ``{(mode, T, name): bytes}``.

    Each ``(mode, T)`` list ends with the sgemm candidate, timed in the same rounds.
    """
    results, memory = {}, {}
    fns = core_functions()
    sgemm = sgemm_candidate()
    for t in lengths:
        shape = (batch, t, heads, head_dim)
        keys = jax.random.split(jax.random.key(t), 3)
        q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in keys)
        for mode in ("fwd", "fwd+bwd"):
            cands = []
            for name, fn in fns.items():
                f = fn if mode == "fwd" else grad_of_sum(fn)
                if name not in (BLOCKWISE, FUSED) and t > dense_max_len:
                    memory[(mode, t, name)] = memory_only(f, q, k, v)  # too slow to time here
                    continue
                cand = jax_candidate(name, f, q, k, v)
                memory[(mode, t, name)] = cand.temp_bytes
                cands.append(cand)
            if torch is not None:
                cands.append(torch_core(shape, backward=mode == "fwd+bwd"))
            sgemm = dataclasses.replace(sgemm, times=[], foreign=[])
            cands.append(sgemm)
            interleave(cands, rounds)
            results[(mode, t)] = cands
            log(
                f"core T={t} {mode}: "
                + ", ".join(f"{c.name} {fmt_ms(c.median_s)} ms" for c in cands)
            )
    return results, memory


def bench_long(t, *, batch, heads, head_dim, log):
    """One blockwise forward+backward at a long T: (seconds, temp bytes, compile seconds)."""
    shape = (batch, t, heads, head_dim)
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    cand = jax_candidate(BLOCKWISE, grad_of_sum(core_functions()[BLOCKWISE]), q, k, v)
    interleave([cand], 1)
    log(f"long T={t} fwd+bwd: {fmt_ms(cand.median_s)} ms, temp {fmt_mb(cand.temp_bytes)} MB")
    return cand


# ----------------------------------------------------------------------------------------
# Modules: x [B, T, C] -> multi-head causal self-attention with projections
# ----------------------------------------------------------------------------------------


def fused_qkv_attention(params, x, num_heads):
    """A hand-written MHA with one fused [C, 3C] QKV projection (for the fusion question)."""
    *batch, t, c = x.shape
    qkv = x @ params["W_qkv"]  # [B, T, 3C]: one matmul instead of three
    q, k, v = (y.reshape(*batch, t, num_heads, c // num_heads) for y in jnp.split(qkv, 3, -1))
    out = jattn.dot_product_attention(q, k, v, is_causal=True)
    return out.reshape(*batch, t, c) @ params["out_kernel"] + params["out_bias"]


def module_candidates(b, t, c, h, backward: bool) -> list[Candidate]:
    x = jax.random.normal(jax.random.key(0), (b, t, c), jnp.float32)
    causal = nn.make_causal_mask(jnp.ones((b, t)), dtype=jnp.bool_)
    cands = []

    def add_linen(name, module, **call_kw):
        params = module.init(jax.random.key(1), x, **call_kw)
        if backward:
            fn = jax.grad(lambda p, x: module.apply(p, x, **call_kw).sum())
        else:
            fn = functools.partial(module.apply, **call_kw)
        cands.append(jax_candidate(name, fn, params, x))

    def add_nnx(name, model, **call_kw):
        graphdef, state = nnx.split(model)

        def forward(state, x):
            return nnx.merge(graphdef, state)(x, **call_kw)

        fn = jax.grad(lambda s, x: forward(s, x).sum()) if backward else forward
        cands.append(jax_candidate(name, fn, state, x))

    add_linen("jattn.linen MHA", jattn.linen.MultiHeadAttention(c, t, 0.0, h), deterministic=True)
    if fused_available():  # issue 25's figure: the fused kernel asked for by name
        module = jattn.linen.MultiHeadAttention(c, t, 0.0, h, attention_implementation="cpu_fused")
        add_linen(FUSED_MHA, module, deterministic=True)
    add_nnx(
        "jattn.nnx MHA",
        jattn.nnx.MultiHeadAttention(c, c, t, 0.0, h, rngs=nnx.Rngs(0)),
        deterministic=True,
    )
    keys = jax.random.split(jax.random.key(2), 2)
    fused = {
        "W_qkv": jax.random.normal(keys[0], (c, 3 * c)) / math.sqrt(c),
        "out_kernel": jax.random.normal(keys[1], (c, c)) / math.sqrt(c),
        "out_bias": jnp.zeros((c,)),
    }
    fused_fn = functools.partial(fused_qkv_attention, num_heads=h)
    if backward:
        fused_fn = jax.grad(lambda p, x: fused_qkv_attention(p, x, h).sum())
    cands.append(jax_candidate("jattn fused-QKV", fused_fn, fused, x))
    add_linen(
        "flax.linen MHDPA",
        nn.MultiHeadDotProductAttention(num_heads=h, qkv_features=c, out_features=c),
        mask=causal,
        deterministic=True,
    )
    add_nnx(
        "flax.nnx MHA",
        nnx.MultiHeadAttention(h, c, c, decode=False, rngs=nnx.Rngs(0)),
        mask=causal,
        deterministic=True,
    )
    if torch is not None:
        cands.append(torch_module(b, t, c, h, backward))
    return cands


def torch_module(b, t, c, h, backward: bool) -> Candidate:
    """The book's MultiHeadAttention in PyTorch, with the attention on SDPA."""

    class TorchMHA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W_query = torch.nn.Linear(c, c, bias=False)
            self.W_key = torch.nn.Linear(c, c, bias=False)
            self.W_value = torch.nn.Linear(c, c, bias=False)
            self.out_proj = torch.nn.Linear(c, c)

        def forward(self, x):
            def split(y):
                return y.view(b, t, h, c // h).transpose(1, 2)

            ctx = torch.nn.functional.scaled_dot_product_attention(
                split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x)), is_causal=True
            )
            return self.out_proj(ctx.transpose(1, 2).reshape(b, t, c))

    torch.manual_seed(0)
    model, x = TorchMHA(), torch.randn(b, t, c)

    def run():
        if backward:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
        else:
            with torch.no_grad():
                model(x)

    run()
    return Candidate("torch SDPA MHA", run)


def bench_module(*, b, t, c, h, rounds, log):
    """``{mode: [Candidate...]}``; each list ends with the sgemm candidate of its rounds."""
    results = {}
    for mode in ("fwd", "fwd+bwd"):
        cands = [*module_candidates(b, t, c, h, backward=mode == "fwd+bwd"), sgemm_candidate()]
        interleave(cands, rounds)
        results[mode] = cands
        log(f"module {mode}: " + ", ".join(f"{x.name} {fmt_ms(x.median_s)} ms" for x in cands))
    return results


# ----------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------


def bench_dropout_masks(shape, *, rate, rounds, log):
    """Cost of a keep-mask applied to weights: each jax.random impl vs jattn's Philox counters."""
    weights = jnp.ones(shape, jnp.float32)
    keep = 1.0 - rate
    cands = []
    for impl in ("threefry2x32", "rbg", "unsafe_rbg", "philox4x32"):
        key = jax.random.key(0, impl=impl)
        fn = lambda key, w: jnp.where(jax.random.bernoulli(key, keep, w.shape), w / keep, 0.0)  # noqa: E731
        cands.append(jax_candidate(f"jax.random.bernoulli ({impl})", fn, key, weights))
    jattn_fn = lambda key, w: jnp.where(_prng.keep_mask(key, keep, w.shape), w / keep, 0.0)  # noqa: E731
    cands.append(
        jax_candidate("jattn (Philox row keys + lowbias32)", jattn_fn, jax.random.key(0), weights)
    )
    cands.append(jax_candidate("no dropout (w / keep only)", lambda key, w: w / keep, 0, weights))
    interleave(cands, rounds)
    log("dropout masks: " + ", ".join(f"{x.name} {fmt_ms(x.median_s)} ms" for x in cands))
    return cands


def train_step_candidates(*, b, t, c, h, rate) -> list[Candidate]:
    """SGD steps (loss, grads, update) of jattn.linen MHA with and without dropout."""
    x = jax.random.normal(jax.random.key(0), (b, t, c), jnp.float32)
    cands = []
    for name, r in (("no dropout", 0.0), (f"dropout {rate}", rate)):
        module = jattn.linen.MultiHeadAttention(c, t, r, h)
        params = module.init(jax.random.key(1), x, deterministic=True)

        def step(params, x, key, module=module):
            def loss(p):
                y = module.apply(p, x, deterministic=False, rngs={"dropout": key})
                return jnp.mean(y**2)

            grads = jax.grad(loss)(params)
            return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

        cands.append(jax_candidate(f"MHA step, {name}", step, params, x, jax.random.key(2)))
    return cands


def core_dropout_candidates(
    *, t, heads, head_dim, rate, implementation=None, label="core"
) -> list[Candidate]:
    """Core forward+backward without and with dropout (``implementation`` None: automatic)."""
    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (1, t, heads, head_dim)) for key in keys)
    cands = []
    for name, r in (("no dropout", 0.0), (f"dropout {rate}", rate)):

        def loss(q, k, v, key, r=r):
            out = jattn.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                dropout_rate=r,
                dropout_rng=key,
                implementation=implementation,
            )
            return out.sum()

        fn = jax.grad(loss, argnums=(0, 1, 2))
        cands.append(jax_candidate(f"{label} fwd+bwd, {name}", fn, q, k, v, jax.random.key(4)))
    return cands


def accuracy(t, *, batch, heads, head_dim):
    """Max |blockwise - dense| of outputs and of q/k/v gradients (float32, causal)."""
    keys = jax.random.split(jax.random.key(5), 4)
    q, k, v = (jax.random.normal(key, (batch, t, heads, head_dim)) for key in keys[:3])
    ct = jax.random.normal(keys[3], q.shape)

    def out_and_grads(name, q, k, v, ct):
        out, vjp = jax.vjp(core_functions()[name], q, k, v)
        return out, vjp(ct)

    # The arrays are arguments, not closed-over constants (XLA would constant-fold them).
    (out_b, grads_b), (out_d, grads_d) = jax.jit(
        lambda *a: (out_and_grads(BLOCKWISE, *a), out_and_grads("jattn dense", *a))
    )(q, k, v, ct)
    out_err = float(jnp.abs(out_b - out_d).max())
    grad_err = max(float(jnp.abs(a - b).max()) for a, b in zip(grads_b, grads_d, strict=True))
    return out_err, grad_err


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Goal:
    text: str
    figure: str
    met: bool | None  # None: not measured in this run
    key: str | None = None  # a row of issue25_spec() (issue 25's table), None: an earlier issue's


GOAL_LENGTHS = (1024, 2048, 4096, 8192)  # issues 15 and 25: the lengths of the torch ratios
MEMORY_T, SGEMM_T = 8192, 4096  # issue 25: the memory row's length, the sgemm-share row's


def issue25_spec(lengths=GOAL_LENGTHS) -> dict[str, tuple[str, str]]:
    """Issue 25's "Measure" table in its order: ``key -> (figure, goal)`` (never loosened)."""
    spec = {}
    for mode, name in (("fwd", "forward"), ("fwd+bwd", "forward+backward")):
        for t in lengths:
            spec[f"{mode} {t}"] = (
                f"cpu_fused / torch SDPA, {name}, T={t}",
                "<= 1.0x (stretch 0.8x)",
            )
    spec |= {
        "sgemm": (f"cpu_fused forward at T={SGEMM_T}, share of the run's sgemm rate", ">= 80%"),
        "mha torch": ("MHA fwd+bwd (B=4 T=1024 C=768 H=12), cpu_fused / torch SDPA MHA", "<= 1.0x"),
        "mha flax": ("MHA fwd+bwd (B=4 T=1024 C=768 H=12), cpu_fused / flax.linen", "<= 0.6x"),
        "dropout": ("dropout 0.1 fwd+bwd (T=1024), cpu_fused / cpu_fused without", "<= 1.10x"),
        "packed": ("4 packed documents (segment ids) at T=8192 fwd+bwd / plain causal", "<= 0.35x"),
        "decode": ("decode step, 1 query vs 8192 keys, B=1 H=32 D=128, / torch SDPA", "<= 1.0x"),
        "memory": (f"memory at T={MEMORY_T} fwd+bwd, cpu_fused / jax.nn", "<= 5%"),
        "batched": ("B=8 H=16 T=2048 fwd+bwd, cpu_fused / torch SDPA", "<= 1.0x"),
    }
    return spec


def verdict(met: bool | None) -> str:
    return "—" if met is None else ("met" if met else "**missed**")


def issue25_report(goals: list[Goal], *, quick: bool, lengths) -> list[str]:
    """One row per row of issue 25's table; a row no section measured says so."""
    by = {g.key: g for g in goals if g.key is not None}
    rows = []
    for key, (figure, bound) in issue25_spec(lengths).items():
        g = by.get(key)
        measured = g.figure if g is not None else "not measured in this run"
        rows.append([figure, measured, bound, "—" if quick or g is None else verdict(g.met)])
    note = (
        "--quick: measured at tiny sizes, not the sizes the rows name, so no verdict"
        if quick
        else "B=1 H=8 D=64 float32 causal unless said; jattn's entry is the fused CPU kernel, "
        "`implementation='cpu_fused'`. Memory is the compiled temporary size, which leaves "
        "out the kernel's own per-worker tile scratch (about 0.9 MB a worker at D=64, kept "
        "between calls)"
    )
    kernel = f"The fused kernel: {kernels.adapter('cpu_fused').status()}."
    return [
        "## Goals (issue 25)",
        "",
        f"{note}. {kernel}",
        "",
        table(["figure", "measured", "goal", ""], rows),
        "",
    ]


def goals_report(goals: list[Goal]) -> list[str]:
    rows = [[g.text, g.figure, verdict(g.met)] for g in goals if g.key is None]
    if not rows:  # only issue 25's sections ran
        return []
    return ["## Goals (issues 5 and 15)", "", table(["goal", "measured", ""], rows), ""]


def core_rates_report(results, lengths, core_dims) -> list[str]:
    """Blockwise and torch GFLOP/s beside the sgemm rate measured in the same rounds."""
    header = [
        "T",
        "mode",
        "sgemm GFLOP/s",
        "blockwise GFLOP/s",
        "blockwise / sgemm",
        "cpu_fused GFLOP/s",
        "cpu_fused / sgemm",
        "torch sdpa GFLOP/s",
        "torch / sgemm",
    ]
    rows = []
    for t in lengths:
        for mode in ("fwd", "fwd+bwd"):
            by = {c.name: c for c in results[(mode, t)]}
            flops = attention_flops(t, backward=mode == "fwd+bwd", **core_dims)
            row = [str(t), mode, f"{sgemm_gflops(by[SGEMM]):.0f}"]
            for name in (BLOCKWISE, FUSED, "torch sdpa"):
                if name in by:
                    frac = sgemm_fraction(by[name], by[SGEMM], flops)
                    row += [f"{flops / by[name].median_s / 1e9:.0f}", f"{100 * frac:.0f}%"]
                else:
                    row += ["—", "—"]
            rows.append(row)
    return [
        "### Core: rates (causal-halved FLOPs) against the sgemm rate of the same rounds",
        "",
        table(header, rows),
        "",
    ]


def core_report(results, memory, lengths) -> list[str]:
    out = []
    for mode in ("fwd", "fwd+bwd"):
        names = list(core_functions()) + (["torch sdpa"] if torch is not None else [])
        header = ["T"] + [f"{n} ms" for n in names]
        header += [f"blockwise / {n}" for n in names if n != BLOCKWISE]
        rows = []
        for t in lengths:
            by = {c.name: c for c in results[(mode, t)]}
            ours = by[BLOCKWISE]
            row = [str(t)] + [fmt_ms(by[n].median_s) if n in by else "—" for n in names]
            row += [
                fmt_ratio(paired_ratio(ours, by[n])) if n in by else "—"
                for n in names
                if n != BLOCKWISE
            ]
            rows.append(row)
        out += [f"### Core {mode}: time (median ms) and ratio", "", table(header, rows), ""]
        jax_names = list(core_functions())
        header = ["T"] + [f"{n} MB" for n in jax_names] + ["blockwise / jax.nn"]
        rows = []
        for t in lengths:
            mem = [memory.get((mode, t, n)) for n in jax_names]
            ref = memory.get((mode, t, "jax.nn (xla)"))
            ours = memory.get((mode, t, BLOCKWISE))
            ratio = ours / ref if ours is not None and ref else math.nan
            rows.append([str(t)] + [fmt_mb(m) for m in mem] + [f"{100 * ratio:.1f}%"])
        out += [f"### Core {mode}: compiled temporary memory", "", table(header, rows), ""]
        header = ["T"] + [f"{n} compile s" for n in jax_names]
        rows = []
        for t in lengths:
            by = {c.name: c for c in results[(mode, t)]}
            rows.append(
                [str(t)]
                + [
                    f"{by[n].compile_s:.2f}" if n in by and by[n].compile_s else "—"
                    for n in jax_names
                ]
            )
        out += [
            f"### Core {mode}: compile time (lower + compile, seconds)",
            "",
            table(header, rows),
            "",
        ]
    return out


def module_report(results) -> list[str]:
    out = []
    for mode in ("fwd", "fwd+bwd"):
        cands = results[mode]
        ours = cands[0]
        header = ["implementation", "median ms", "jattn.linen MHA / this", "compile s", "temp MB"]
        rows = [
            [
                c.name,
                fmt_ms(c.median_s),
                fmt_ratio(paired_ratio(ours, c)),
                "—" if c.compile_s is None else f"{c.compile_s:.2f}",
                fmt_mb(c.temp_bytes),
            ]
            for c in cands
        ]
        out += [f"### Module {mode}", "", table(header, rows), ""]
    return out


def plot(results, memory, lengths, path, dims: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    names = list(core_functions()) + (["torch sdpa"] if torch is not None else [])
    for ax, mode in zip(axes[:2], ("fwd", "fwd+bwd"), strict=True):
        for name in names:
            pts = [
                (t, c.median_s * 1e3)
                for t in lengths
                for c in results[(mode, t)]
                if c.name == name and c.times
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="T", ylabel="ms (median)")
        ax.set_title(f"causal attention {mode}, {dims}")
    for name in core_functions():
        pts = [
            (t, memory[("fwd+bwd", t, name)] / 2**20)
            for t in lengths
            if memory.get(("fwd+bwd", t, name))
        ]
        if pts:
            axes[2].plot(*zip(*pts, strict=True), marker="o", label=name)
    axes[2].set(xscale="log", yscale="log", xlabel="T", ylabel="MB")
    axes[2].set_title("fwd+bwd compiled temporary memory (jax.nn = flax)")
    for ax in axes:
        # one labelled tick per measured T (log-scale minor labels would overlap)
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(cpu: dict) -> str:
    torch_v = torch.__version__ if torch is not None else "not installed"
    text = (
        f"{datetime.date.today()}, {cpu['model']} ({cpu['kind']}), {cpu['cores']} CPU cores, "
        f"backend {jax.default_backend()}; jax {jax.__version__}, "
        f"flax {flax.__version__}, torch {torch_v}, python {platform.python_version()}"
    )
    if jax.default_backend() != "gpu":
        text += " (no GPU in this run: the cuDNN comparison was not made)"
    return text


# ----------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------


def core_goals(results, memory, lengths, *, quick, core_dims) -> tuple[list[Goal], list[str]]:
    """Goals of the core section (issues 5 and 15) and a line of text on memory growth."""
    goals: list[Goal] = []
    for t in [t for t in lengths if quick or t in GOAL_LENGTHS]:
        for mode in ("fwd", "fwd+bwd"):
            by = {c.name: c for c in results[(mode, t)]}
            if "torch sdpa" in by:
                r = paired_ratio(by[BLOCKWISE], by["torch sdpa"])
                text = f"core T={t} {mode} <= 1.0x torch sdpa (issue 15; stretch 0.8x)"
                goals.append(Goal(text, fmt_ratio(r), r <= 1.0))
    goal_t = 4096 if not quick else lengths[-1]
    if ("fwd", goal_t) in results:
        by = {c.name: c for c in results[("fwd", goal_t)]}
        flops = attention_flops(goal_t, backward=False, **core_dims)
        frac = sgemm_fraction(by[BLOCKWISE], by[SGEMM], flops)
        text = f"core T={goal_t} fwd >= 55% of the sgemm rate (issue 15)"
        goals.append(Goal(text, f"{100 * frac:.0f}%", frac >= 0.55))
        for mode, bound in (("fwd", 0.6), ("fwd+bwd", 0.8)):
            by = {c.name: c for c in results[(mode, goal_t)]}
            if "jax.nn (xla)" in by:
                r = paired_ratio(by[BLOCKWISE], by["jax.nn (xla)"])
                text = f"core T={goal_t} {mode} <= {bound}x jax.nn (issue 5)"
                goals.append(Goal(text, fmt_ratio(r), r <= bound))
    lines: list[str] = []
    big = [t for t in lengths if ("fwd+bwd", t, BLOCKWISE) in memory]
    if len(big) >= 2:
        a, b = big[-2], big[-1]
        ours_b = memory[("fwd+bwd", b, BLOCKWISE)]
        ratio = ours_b / memory[("fwd+bwd", a, BLOCKWISE)]
        lines = [f"Blockwise fwd+bwd memory({b}) / memory({a}) = {ratio:.2f}.", ""]
        text = f"memory({b}) / memory({a}) <= 2.5 (blockwise fwd+bwd; issue 5)"
        goals.append(Goal(text, f"{ratio:.2f}", ratio <= 2.5))
        ref = memory.get(("fwd+bwd", b, "jax.nn (xla)"))
        if ref:
            text = f"fwd+bwd memory at T={b} <= 5% of jax.nn (issue 15)"
            figure = f"{100 * ours_b / ref:.1f}% ({fmt_mb(ours_b)} / {fmt_mb(ref)} MB)"
            goals.append(Goal(text, figure, ours_b <= 0.05 * ref))
    return goals + core_goals25(results, memory, lengths, quick=quick, core_dims=core_dims), lines


def core_goals25(results, memory, lengths, *, quick, core_dims) -> list[Goal]:
    """Issue 25's rows from the core section: the fused kernel against torch, sgemm, jax.nn."""
    goals = []
    for t in [t for t in lengths if quick or t in GOAL_LENGTHS]:
        for mode in ("fwd", "fwd+bwd"):
            by = {c.name: c for c in results[(mode, t)]}
            if "torch sdpa" in by and FUSED in by:
                r = paired_ratio(by[FUSED], by["torch sdpa"])
                goals.append(Goal("", fmt_ratio(r), r <= 1.0, key=f"{mode} {t}"))
    goal_t = lengths[-1] if quick else SGEMM_T
    by = {c.name: c for c in results.get(("fwd", goal_t), [])}
    if FUSED in by:
        flops = attention_flops(goal_t, backward=False, **core_dims)
        frac = sgemm_fraction(by[FUSED], by[SGEMM], flops)
        figure = f"{100 * frac:.0f}% ({sgemm_gflops(by[SGEMM]):.0f} GFLOP/s sgemm)"
        goals.append(Goal("", figure, frac >= 0.80, key="sgemm"))
    mem_t = lengths[-1] if quick else MEMORY_T
    ours, ref = (
        memory.get(("fwd+bwd", mem_t, FUSED)),
        memory.get(("fwd+bwd", mem_t, "jax.nn (xla)")),
    )
    if ours is not None and ref:
        figure = f"{100 * ours / ref:.1f}% ({fmt_mb(ours)} / {fmt_mb(ref)} MB)"
        goals.append(Goal("", figure, ours <= 0.05 * ref, key="memory"))
    return goals


def core_section(args, *, lengths, rounds, quick, long_len, core_dims, log):
    """Core timings, memory, long run and accuracy: ``(markdown, goals, results, memory)``."""
    body: list[str] = []
    results, memory = bench_core(
        lengths, rounds=rounds, dense_max_len=args.dense_max_len, log=log, **core_dims
    )
    cands = [c for key in results for c in results[key]]
    body += [f"## Core: B=1, H={core_dims['heads']}, D={core_dims['head_dim']}", ""]
    body += [f"Machine {load_note(cands)}.", ""]
    body += core_report(results, memory, lengths)
    body += core_rates_report(results, lengths, core_dims)
    goals, lines = core_goals(results, memory, lengths, quick=quick, core_dims=core_dims)
    body += lines
    long = bench_long(long_len, log=log, **core_dims)
    body += [
        f"Long sequence: blockwise forward+backward at T={long_len} ran in "
        f"{fmt_ms(long.median_s)} ms (one run; compile {long.compile_s:.1f} s), "
        f"temporary memory {fmt_mb(long.temp_bytes)} MB.",
        "",
    ]
    goals.append(
        Goal(
            f"fwd+bwd at T={long_len} runs (issue 5)",
            f"{fmt_ms(long.median_s)} ms, {fmt_mb(long.temp_bytes)} MB temp",
            True,
        )
    )
    out_err, grad_err = accuracy(1024 if not quick else lengths[0], **core_dims)
    body += [
        f"Accuracy (T={1024 if not quick else lengths[0]}, float32): max |blockwise - dense| "
        f"= {out_err:.1e} (outputs), {grad_err:.1e} (q/k/v gradients).",
        "",
    ]
    goals.append(
        Goal(
            "outputs within 1e-5, gradients within 1e-4 of dense float32 (issue 5)",
            f"{out_err:.1e} / {grad_err:.1e}",
            out_err <= 1e-5 and grad_err <= 1e-4,
        )
    )
    return body, goals, results, memory


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds: a smoke test")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
    p.add_argument("--lengths", default=None, help="core sequence lengths, comma-separated")
    p.add_argument(
        "--dense-max-len",
        type=int,
        default=4096,
        help="time the dense peers up to this T (memory is still compiled beyond)",
    )
    p.add_argument("--long-len", type=int, default=None, help="blockwise-only long run T")
    p.add_argument(
        "--module-rounds",
        type=int,
        default=None,
        help="rounds for the module section (default: max(rounds, 9); its ratios are close calls)",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="on a shared machine: before each round wait up to this many seconds for the "
        "other processes to go idle (the load seen during the runs is reported either way)",
    )
    p.add_argument("--skip-core", action="store_true", help="no core / long / accuracy section")
    p.add_argument("--skip-module", action="store_true")
    p.add_argument("--skip-dropout", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument(
        "--skip-fused-dropout", action="store_true", help="no cpu_fused dropout-vs-none section"
    )
    p.add_argument("--skip-packed", action="store_true", help="no packed-documents section")
    p.add_argument("--skip-batched", action="store_true", help="no B=8 H=16 T=2048 section")
    p.add_argument("--out", default=os.path.join(HERE, "results.md"))
    p.add_argument("--png", default=None, help="plot path (default: --out with -<cpu kind>.png)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    global QUIET_WAIT_S
    args = parse_args(argv)
    QUIET_WAIT_S = args.wait_quiet
    quick = args.quick
    rounds = args.rounds or (2 if quick else 5)
    lengths = (
        [int(x) for x in args.lengths.split(",")]
        if args.lengths
        else ([64, 128] if quick else [256, 512, 1024, 2048, 4096, 8192])
    )
    long_len = args.long_len or (256 if quick else 32768)
    core_dims = dict(batch=1, heads=2 if quick else 8, head_dim=16 if quick else 64)
    mod = dict(b=1, t=64, c=32, h=2) if quick else dict(b=4, t=1024, c=768, h=12)
    cpu = cpu_info()
    png = args.png or f"{os.path.splitext(args.out)[0]}-{kind_slug(cpu['kind'])}.png"
    if torch is not None:
        torch.set_num_threads(os.cpu_count() or 1)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    command = "python benchmarks/bench_attention.py" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:])
        if (argv if argv is not None else sys.argv[1:])
        else ""
    )
    lines = [
        f"# Attention benchmark: {cpu['kind']} CPU",
        "",
        f"Command: `{command}`  ",
        f"Environment: {environment(cpu)}  ",
        f"Rounds: {rounds} interleaved (median times; ratios are medians of per-round ratios; "
        "each run starts once the process is idle). All causal, float32. Compile time is "
        "excluded from run times and listed apart; memory is the compiled temporary buffer "
        "size (`memory_analysis().temp_size_in_bytes`).",
        "",
    ]

    goals: list[Goal] = []
    body: list[str] = []
    results = memory = None
    if not args.skip_core:
        body, goals, results, memory = core_section(
            args,
            lengths=lengths,
            rounds=rounds,
            quick=quick,
            long_len=long_len,
            core_dims=core_dims,
            log=log,
        )

    text, more = other_sections(
        args, rounds=rounds, quick=quick, mod=mod, core_dims=core_dims, log=log
    )
    body, goals = body + text, goals + more
    if results is not None:
        dims = f"B={core_dims['batch']} H={core_dims['heads']} D={core_dims['head_dim']}"
        plot(results, memory, lengths, png, dims)
        body += [f"![core timings and memory]({os.path.basename(png)})", ""]
    # --quick sizes are not the goals' sizes: issue 25's table without verdicts, no other.
    table25 = issue25_report(goals, quick=quick, lengths=lengths if quick else GOAL_LENGTHS)
    report = "\n".join(lines + table25 + ([] if quick else goals_report(goals)) + body)
    write_report(args.out, cpu["kind"], report)
    log(f"wrote the {cpu['kind']} block of {args.out}, and {png}")
    return 0


def other_sections(args, *, rounds, quick, mod, core_dims, log) -> tuple[list[str], list[Goal]]:
    """Every section after the core one that its ``--skip-...`` flag leaves in."""
    body: list[str] = []
    goals: list[Goal] = []
    sections = [  # (skip flag, the section: markdown and goals)
        (
            args.skip_module,
            lambda: module_section(args, rounds=rounds, quick=quick, mod=mod, log=log),
        ),
        (
            args.skip_dropout,
            lambda: dropout_section(rounds=rounds, mod=mod, core_dims=core_dims, log=log),
        ),
        (
            args.skip_fused_dropout,
            lambda: fused_dropout_section(rounds=rounds, quick=quick, core_dims=core_dims, log=log),
        ),
        (args.skip_packed, lambda: packed_section(rounds=rounds, quick=quick, log=log)),
        (args.skip_batched, lambda: batched_section(rounds=rounds, quick=quick, log=log)),
        (args.skip_decode, lambda: decode_section(rounds=rounds, quick=quick, log=log)),
    ]
    for skip, section in sections:
        if not skip:
            text, more = section()
            body += text
            goals += more
    return body, goals


def module_section(args, *, rounds, quick, mod, log) -> tuple[list[str], list[Goal]]:
    """Module timings and their goals (issue 15)."""
    module_rounds = args.module_rounds or (rounds if quick else max(rounds, 9))
    body = [
        f"## Module: B={mod['b']}, T={mod['t']}, C={mod['c']}, H={mod['h']} "
        "(projections + causal attention)",
        "",
        f"Rounds: {module_rounds}.",
        "",
    ]
    module_results = bench_module(rounds=module_rounds, log=log, **mod)
    sgemm = {m: module_results[m][-1] for m in module_results}
    cands = [c for m in module_results for c in module_results[m]]
    body += [
        f"sgemm in these rounds: {sgemm_gflops(sgemm['fwd']):.0f} GFLOP/s (fwd rounds), "
        f"{sgemm_gflops(sgemm['fwd+bwd']):.0f} GFLOP/s (fwd+bwd rounds); machine "
        f"{load_note(cands)}.",
        "",
    ]
    body += module_report({m: module_results[m][:-1] for m in module_results})
    by = {c.name: c for c in module_results["fwd+bwd"]}
    ours = by["jattn.linen MHA"]
    goals = []
    for peer, bound, key in (
        ("flax.linen MHDPA", 0.6, "mha flax"),
        ("torch SDPA MHA", 1.0, "mha torch"),
    ):
        if peer in by:
            r = paired_ratio(ours, by[peer])
            goals.append(
                Goal(f"MHA fwd+bwd <= {bound}x {peer} (issue 15)", fmt_ratio(r), r <= bound)
            )
        if peer in by and FUSED_MHA in by:
            r = paired_ratio(by[FUSED_MHA], by[peer])
            goals.append(Goal("", fmt_ratio(r), r <= bound, key=key))
    return body, goals


def dropout_section(*, rounds, mod, core_dims, log) -> tuple[list[str], list[Goal]]:
    """Dropout mask generators and training steps with dropout against without."""
    shape = (mod["b"], mod["h"], mod["t"], mod["t"])
    masks = bench_dropout_masks(shape, rate=0.1, rounds=rounds, log=log)
    n = math.prod(shape)
    base = masks[-1]
    rows = [
        [
            c.name,
            fmt_ms(c.median_s),
            f"{c.median_s / n * 1e9:.2f}",
            fmt_ratio(paired_ratio(c, base)),
        ]
        for c in masks
    ]
    body = [
        f"## Dropout masks: keep-mask applied to weights {list(shape)} (rate 0.1)",
        "",
        table(["generator", "median ms", "ns / element", "vs no dropout"], rows),
        "",
    ]
    steps = train_step_candidates(rate=0.1, **mod)
    core_steps = core_dropout_candidates(
        t=mod["t"], heads=core_dims["heads"], head_dim=core_dims["head_dim"], rate=0.1
    )
    interleave(steps + core_steps, rounds)
    rows, goals = [], []
    for off, on in (steps, core_steps):
        r = paired_ratio(on, off)
        rows.append([on.name, fmt_ms(off.median_s), fmt_ms(on.median_s), fmt_ratio(r)])
        goals.append(Goal(f"{on.name} <= 1.15x without (issue 15)", fmt_ratio(r), r <= 1.15))
    body += [
        f"## Training step with dropout 0.1 vs without (T={mod['t']})",
        "",
        table(["step", "no dropout ms", "dropout ms", "ratio"], rows),
        "",
    ]
    log("train steps: " + ", ".join(f"{r[0]} {r[3]}" for r in rows))
    return body, goals


def decode_candidates(b, t, h, d) -> list[Candidate]:
    """One query ``[b, 1, h, d]`` against ``t`` cached keys: jattn's paths, then torch's."""
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (b, 1, h, d), jnp.float32)
    k, v = (jax.random.normal(key, (b, t, h, d), jnp.float32) for key in keys[1:])
    lengths = jnp.full((b,), t, jnp.int32)
    mask = jnp.ones((b, 1, 1, t), bool)  # the shape of jattn.kvcache's decode mask
    attend = jattn.dot_product_attention
    fns = {}
    if fused_available():
        fns[f"{FUSED} (lengths)"] = lambda q, k, v: attend(
            q, k, v, key_value_seq_lengths=lengths, implementation="cpu_fused"
        )
        fns[f"{FUSED} (mask=)"] = lambda q, k, v: attend(
            q, k, v, mask=mask, implementation="cpu_fused"
        )
    fns["jattn dense (mask=)"] = lambda q, k, v: attend(q, k, v, mask=mask, implementation="dense")
    cands = [jax_candidate(name, fn, q, k, v) for name, fn in fns.items()]
    if torch is not None:
        gen = torch.Generator().manual_seed(0)
        tq, tk, tv = (torch.randn(b, h, n, d, generator=gen) for n in (1, t, t))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run():
            with torch.no_grad():
                sdpa(tq, tk, tv)

        run()
        cands.append(Candidate("torch sdpa", run))
    return cands


def decode_section(*, rounds, quick, log) -> tuple[list[str], list[Goal]]:
    """One decoding step against a long cache, forward (issue 25)."""
    dims = dict(b=1, t=1024, h=2, d=16) if quick else dict(b=1, t=8192, h=32, d=128)
    sgemm = sgemm_candidate()
    cands = decode_candidates(**dims)
    interleave([*cands, sgemm], max(rounds, 9))
    log("decode: " + ", ".join(f"{c.name} {fmt_ms(c.median_s)} ms" for c in cands))
    ours = cands[0]
    rows = [[c.name, fmt_ms(c.median_s), fmt_ratio(paired_ratio(ours, c))] for c in cands]
    body = [
        f"## Decode step: 1 query vs a {dims['t']}-token cache, B={dims['b']} H={dims['h']} "
        f"D={dims['d']} (forward, not causal)",
        "",
        f"sgemm in these rounds: {sgemm_gflops(sgemm):.0f} GFLOP/s; machine {load_note(cands)}.",
        "",
        table(["implementation", "median ms", f"{ours.name} / this"], rows),
        "",
    ]
    goals = []
    by = {c.name: c for c in cands}
    if ours.name.startswith(FUSED) and "torch sdpa" in by:
        r = paired_ratio(ours, by["torch sdpa"])
        goals.append(Goal("", fmt_ratio(r), r <= 1.0, key="decode"))
    return body, goals


# ----------------------------------------------------------------------------------------
# Issue 25's own sections: the fused CPU kernel with dropout, packed documents, wide batches
# ----------------------------------------------------------------------------------------

NOT_BUILT = "The fused CPU kernel is not available in this run (`jattn.kernels`): not measured."


def random_qkv(shape, seed: int):
    """Three float32 ``[B, T, H, D]`` arrays from ``jax.random.key(seed)``."""
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, shape, jnp.float32) for key in keys)


def fused_dropout_section(*, rounds, quick, core_dims, log) -> tuple[list[str], list[Goal]]:
    """cpu_fused forward+backward with dropout 0.1 against without (issue 25)."""
    t, h, d = 64 if quick else 1024, core_dims["heads"], core_dims["head_dim"]
    body = [f"## cpu_fused fwd+bwd with dropout 0.1 vs without (B=1 T={t} H={h} D={d})", ""]
    if not fused_available():
        return [*body, NOT_BUILT, ""], []
    off, on = core_dropout_candidates(
        t=t, heads=h, head_dim=d, rate=0.1, implementation="cpu_fused", label="cpu_fused"
    )
    rounds = rounds if quick else max(rounds, 9)  # a close ratio: more rounds, as the module's
    interleave([off, on], rounds)
    r = paired_ratio(on, off)
    log(f"cpu_fused dropout: {fmt_ms(off.median_s)} ms without, {fmt_ms(on.median_s)} ms with")
    rows = [[fmt_ms(off.median_s), fmt_ms(on.median_s), fmt_ratio(r)]]
    body += [
        f"Rounds: {rounds}; machine {load_note([off, on])}.",
        "",
        table(["no dropout ms", "dropout 0.1 ms", "ratio"], rows),
        "",
    ]
    return body, [Goal("", fmt_ratio(r), r <= 1.10, key="dropout")]


def packed_candidates(t, *, heads, head_dim, docs) -> list[Candidate]:
    """cpu_fused causal forward+backward, plain and over ``docs`` packed documents."""
    q, k, v = random_qkv((1, t, heads, head_dim), seed=6)
    # [1, T]: equal documents side by side, causal within each (their ids as an argument,
    # not a constant XLA could fold)
    segments = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), t // docs)[None]

    def loss(q, k, v, segments=None):
        out = jattn.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=segments, implementation="cpu_fused"
        )
        return out.sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return [
        jax_candidate(f"{FUSED} causal", grad, q, k, v),
        jax_candidate(f"{FUSED} causal, {docs} documents", grad, q, k, v, segments),
    ]


def packed_section(*, rounds, quick, log) -> tuple[list[str], list[Goal]]:
    """Packed documents (segment ids) against plain causal, both fused, fwd+bwd (issue 25)."""
    t, h, d, docs = (256, 2, 16, 4) if quick else (8192, 8, 64, 4)
    body = [f"## {docs} packed documents vs plain causal, fwd+bwd (B=1 T={t} H={h} D={d})", ""]
    if not fused_available():
        return [*body, NOT_BUILT, ""], []
    plain, packed = packed_candidates(t, heads=h, head_dim=d, docs=docs)
    interleave([plain, packed], rounds)
    r = paired_ratio(packed, plain)
    log(f"packed: {fmt_ms(plain.median_s)} ms plain, {fmt_ms(packed.median_s)} ms {docs} docs")
    rows = [
        [c.name, fmt_ms(c.median_s), fmt_ratio(paired_ratio(c, plain)), f"{c.compile_s:.2f}"]
        for c in (plain, packed)
    ]
    body += [
        f"Segment ids, causal within each of {docs} equal documents: the kernel skips the "
        f"tiles between documents (ideal 1/{docs} of the causal work). Machine "
        f"{load_note([plain, packed])}.",
        "",
        table(["implementation", "median ms", "/ plain causal", "compile s"], rows),
        "",
    ]
    return body, [Goal("", fmt_ratio(r), r <= 0.35, key="packed")]


def batched_section(*, rounds, quick, log) -> tuple[list[str], list[Goal]]:
    """More work than cores: B=8 H=16 T=2048 causal fwd+bwd, cpu_fused vs torch (issue 25)."""
    b, t, h, d = (2, 128, 2, 16) if quick else (8, 2048, 16, 64)
    body = [f"## Wide batch: B={b} H={h} T={t} D={d}, causal fwd+bwd", ""]
    if not fused_available():
        return [*body, NOT_BUILT, ""], []
    q, k, v = random_qkv((b, t, h, d), seed=7)
    cands = [jax_candidate(FUSED, grad_of_sum(core_functions()[FUSED]), q, k, v)]
    if torch is not None:
        cands.append(torch_core((b, t, h, d), backward=True))
    sgemm = sgemm_candidate()
    interleave([*cands, sgemm], rounds)
    log("batched: " + ", ".join(f"{c.name} {fmt_ms(c.median_s)} ms" for c in cands))
    flops = attention_flops(t, batch=b, heads=h, head_dim=d, backward=True)
    rows = [
        [
            c.name,
            fmt_ms(c.median_s),
            fmt_ratio(paired_ratio(cands[0], c)),
            f"{flops / c.median_s / 1e9:.0f}",
            f"{100 * sgemm_fraction(c, sgemm, flops):.0f}%",
        ]
        for c in cands
    ]
    body += [
        f"sgemm in these rounds: {sgemm_gflops(sgemm):.0f} GFLOP/s; machine {load_note(cands)}.",
        "",
        table(["implementation", "median ms", f"{FUSED} / this", "GFLOP/s", "/ sgemm"], rows),
        "",
    ]
    by = {c.name: c for c in cands}
    if "torch sdpa" not in by:
        return body, []
    r = paired_ratio(by[FUSED], by["torch sdpa"])
    return body, [Goal("", fmt_ratio(r), r <= 1.0, key="batched")]


def kind_slug(kind: str) -> str:
    return "".join(ch for ch in kind.lower() if ch.isalnum())


def write_report(path: str, kind: str, report: str) -> None:
    """Writes ``report`` as the block of CPU ``kind`` in ``path``, keeping other kinds' blocks.

    A file without blocks (a report from before there were several) becomes the block of
    the kind its environment line names (AVX2 when it names none: the first machine).
    """
    begin, end = f"<!-- cpu: {kind} -->", f"<!-- end cpu: {kind} -->"
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    if old and "<!-- cpu: " not in old:
        old_kind = "AVX-512" if "AVX-512" in old.split("\n\n")[0] else "AVX2"
        old = f"<!-- cpu: {old_kind} -->\n{old.strip()}\n<!-- end cpu: {old_kind} -->\n"
    block = f"{begin}\n{report.strip()}\n{end}\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        new = head + block + ("\n" + tail if tail else "")
    else:
        new = block + ("\n" + old if old else "")
    with open(path, "w") as f:
        f.write(new)


if __name__ == "__main__":
    sys.exit(main())
