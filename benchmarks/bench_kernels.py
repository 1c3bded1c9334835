"""jattn's Pallas kernel on a GPU: plain and with each option, against cuDNN and the XLA loop.

Issue 26's shapes, bfloat16, causal: ``B=4 T=4096 H=32 D=128`` and ``B=32 T=4096 H=32/8
(GQA) D=128``; forward and forward+backward (the gradient of ``out.sum()`` w.r.t. q, k, v).
Candidates: cuDNN through ``jax.nn.dot_product_attention(implementation='cudnn')``,
``jattn.dot_product_attention(implementation='pallas')`` plain, soft-capped, with ALiBi,
with a 4-document block mask (``causal() & document(ids)`` and its
:func:`jattn.block_mask`), with dropout 0.1, with sinks, and jattn's XLA blockwise loop
(``implementation='blockwise'``) for reference. TFLOP/s count the causal half of the
products (forward ``2 B H T^2 D``, forward+backward 3.5x that).

Each candidate is compiled (timed apart), run once, then timed over ``--rounds`` rounds
(median). ``--budget-s`` stops the sweep between candidates; the table is rewritten after
each one and says what was not run. ``--small`` runs tiny shapes in interpret mode (any
machine; for ``DRY_RUN=1 bash benchmarks/device_check.sh``).

Usage::

    python benchmarks/bench_kernels.py --out benchmarks/gpu_results.md
    python benchmarks/bench_kernels.py --small --out /tmp/k.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jattn  # noqa: E402
from jattn import mods  # noqa: E402

CANDIDATES = ("cudnn", "plain", "softcap", "alibi", "documents", "dropout", "sinks", "blockwise")


def configs(small: bool):
    if small:
        return [("B=1 T=128 H=2/1 D=32", 1, 128, 2, 1, 32)]
    return [
        ("B=4 T=4096 H=32 D=128", 4, 4096, 32, 32, 128),
        ("B=32 T=4096 H=32/8 D=128", 32, 4096, 32, 8, 128),
    ]


def candidate(name: str, b: int, t: int, h: int):
    """``(fn(q, k, v) -> out)`` for a candidate, causal throughout."""
    if name == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        )
    if name == "blockwise":
        return lambda q, k, v: jattn.dot_product_attention(
            q, k, v, is_causal=True, implementation="blockwise"
        )
    options = {"is_causal": True}
    if name == "softcap":
        options["score_mod"] = mods.softcap(30.0)
    elif name == "alibi":
        options["score_mod"] = mods.alibi(mods.alibi_slopes(h))
    elif name == "dropout":
        options.update(dropout_rate=0.1, dropout_rng=jax.random.key(0))
    elif name == "sinks":
        options["sinks"] = jnp.zeros((h,), jnp.float32)
    elif name == "documents":
        ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4)[None].repeat(b, 0)
        mask_mod = mods.causal() & mods.document(ids)
        options = {
            "mask_mod": mask_mod,
            "block_mask": jattn.block_mask(
                mask_mod, q_len=t, kv_len=t, batch_shape=b, num_heads=h, block_q=64, block_k=64
            ),
        }
    return lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="pallas", **options)


def with_mode(fn, mode: str):
    if mode == "fwd":
        return jax.jit(fn)
    return jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    )


def measure(fn, args, rounds: int) -> tuple[float, float]:
    """``(compile seconds, median milliseconds)``."""
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return compile_s, 1e3 * statistics.median(times)


def header() -> list[str]:
    import jaxlib

    device = jax.devices()[0]
    lines = [
        "# jattn's Pallas kernel on the device",
        "",
        f"`python benchmarks/bench_kernels.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"* device: {device.device_kind} ({device.platform}); host {platform.node()}",
        f"* Python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}",
        *(
            ["* interpret mode (no GPU): the times are XLA's emulation, not kernel times"]
            if os.environ.get("JATTN_PALLAS_INTERPRET")
            else []
        ),
        "",
        "| config | candidate | mode | ms | TFLOP/s | vs plain | compile s |",
        "|---|---|---|---|---|---|---|",
    ]
    try:
        import triton

        lines.insert(6, f"* triton {triton.__version__}")
    except ImportError:
        pass
    return lines


def goal_lines(rows) -> list[str]:
    lines = ["", "## Issue 26's goals (measured here)", ""]
    for config in dict.fromkeys(r[0] for r in rows):
        get = {(r[1], r[2]): r[3] for r in rows if r[0] == config and r[3] is not None}
        plain_f, cudnn_f = get.get(("plain", "fwd")), get.get(("cudnn", "fwd"))
        if plain_f and cudnn_f:
            lines.append(
                f"* {config}: plain forward at {cudnn_f / plain_f:.2f}x cuDNN's throughput (goal >= 0.8x)"
            )
        for name in ("softcap", "alibi", "documents", "dropout", "sinks"):
            for mode in ("fwd", "fwd+bwd"):
                if get.get((name, mode)) and get.get(("plain", mode)):
                    ratio = get[(name, mode)] / get[("plain", mode)]
                    lines.append(
                        f"* {config}: {name} {mode} at {ratio:.2f}x the plain kernel's time (goal <= 1.3x)"
                    )
        for mode in ("fwd", "fwd+bwd"):
            if get.get(("blockwise", mode)) and get.get(("plain", mode)):
                ratio = get[("blockwise", mode)] / get[("plain", mode)]
                lines.append(
                    f"* {config}: {mode} {ratio:.1f}x faster than the XLA blockwise loop (goal >= 5x)"
                )
    return lines


def write(out: str, rows, not_run) -> None:
    lines = header()
    for config, name, mode, ms, tflops, vs, compile_s, note in rows:
        if ms is None:
            lines.append(f"| {config} | {name} | {mode} | - | - | - | {note} |")
        else:
            lines.append(
                f"| {config} | {name} | {mode} | {ms:.2f} | {tflops:.0f} | {vs} | {compile_s:.1f} |"
            )
    lines += goal_lines(rows)
    if not_run:
        lines += ["", f"Not run (budget): {', '.join(not_run)}."]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default="benchmarks/gpu_results.md")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=240.0)
    args = p.parse_args(argv)
    if args.small:
        os.environ["JATTN_PALLAS_INTERPRET"] = "1"
    start = time.perf_counter()
    rows, not_run = [], []
    for config, b, t, h, kvh, d in configs(args.small):
        key = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(key[0], (b, t, h, d), jnp.bfloat16)
        k = jax.random.normal(key[1], (b, t, kvh, d), jnp.bfloat16)
        v = jax.random.normal(key[2], (b, t, kvh, d), jnp.bfloat16)
        flops_fwd = 2.0 * b * h * t * t * d  # causal: half of 4 B H T^2 D
        plain = {}
        for mode in ("fwd", "fwd+bwd"):
            for name in CANDIDATES:
                label = f"{config} {name} {mode}"
                if time.perf_counter() - start > args.budget_s:
                    not_run.append(label)
                    continue
                if name == "cudnn" and jax.default_backend() != "gpu":
                    rows.append((config, name, mode, None, None, None, None, "needs a GPU"))
                    continue
                try:
                    compile_s, ms = measure(
                        with_mode(candidate(name, b, t, h), mode), (q, k, v), args.rounds
                    )
                except Exception as e:  # the table records why a candidate failed
                    rows.append(
                        (
                            config,
                            name,
                            mode,
                            None,
                            None,
                            None,
                            None,
                            f"{type(e).__name__}: {str(e)[:80]}",
                        )
                    )
                    write(args.out, rows, not_run)
                    continue
                flops = flops_fwd * (1.0 if mode == "fwd" else 3.5)
                if name == "plain":
                    plain[mode] = ms
                vs = f"{ms / plain[mode]:.2f}x" if mode in plain else "-"
                rows.append((config, name, mode, ms, flops / ms / 1e9, vs, compile_s, ""))
                print(f"{label}: {ms:.2f} ms", flush=True)
                write(args.out, rows, not_run)
    write(args.out, rows, not_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
