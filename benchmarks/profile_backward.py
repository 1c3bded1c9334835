"""Where the blockwise backward pass spends its time on CPU: a thunk profile by category.

Compiles the backward pass of causal blockwise attention (B=1, H=8, D=64 by default),
runs it under ``jax.profiler`` with XLA:CPU's per-thunk trace events, and sorts each
thunk into a category read from the compiled HLO: the tile products (the S / dP
recompute, dV / dK, dQ^T), the exp of the recomputed probabilities, the dS elementwise
work, the dQ accumulation, and slices / layout copies (the bookkeeping between tiles).

Usage::

    python benchmarks/profile_backward.py --length 4096
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax

import jattn


def categories(hlo: str, head_dim: int) -> dict[str, str]:
    """Thunk (instruction) name -> category, from the compiled HLO text."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = re.match(r"^%?(\S+) .*\{$", line)
        if m and not line.startswith(" "):
            current = m.group(1)
            bodies[current] = []
        elif current:
            bodies[current].append(line)
    kinds = "fusion|copy|transpose|dynamic-slice|dynamic-update-slice|custom-call"
    found = {}
    for line in hlo.splitlines():
        m = re.match(rf"\s+(?:ROOT )?%(\S+) = \S+ ({kinds})\(", line)
        if not m:
            continue
        called = re.search(r"calls=%([\w.\-]+)", line)
        body = "\n".join(bodies.get(called.group(1), [])) if called else line
        found[m.group(1)] = _category(body, m.group(2), head_dim)
    return found


def _category(body: str, op: str, head_dim: int) -> str:
    dot = re.search(r" = f(?:32|64)\[(\d+),(\d+),(\d+)\]\{[^}]*\} dot\(", body)
    if dot:
        _, rows, cols = map(int, dot.groups())
        if cols == head_dim:
            return "products: dV, dK"
        return "products: dQ^T" if rows == head_dim else "products: S, dP (recompute)"
    if "exponential(" in body:
        return "exp: P = exp(S - lse)"
    if "dynamic-update-slice" in body:
        return "dQ accumulate"
    if "multiply(" in body and "subtract(" in body:
        return "dS elementwise"
    if "dynamic-slice" in body or "transpose(" in body or op in ("copy", "transpose"):
        return "slices / layout copies"
    return "other"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (1, args.length, args.heads, args.head_dim)
    q, k, v, ct = (jax.random.normal(key, shape) for key in keys)

    def attend(q, k, v):
        return jattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise")

    _, vjp = jax.vjp(attend, q, k, v)
    compiled = (
        jax.jit(vjp).lower(ct).compile(compiler_options={"xla_cpu_enable_xprof_traceme": True})
    )
    names = categories(compiled.as_text(), args.head_dim)
    jax.block_until_ready(compiled(ct))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(args.runs):
            jax.block_until_ready(compiled(ct))
        jax.profiler.stop_trace()
        path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spent: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["name"] in names:
            spent[names[e["name"]]] += e["dur"] / args.runs / 1e3
    total = sum(spent.values())
    print(
        f"backward, causal, T={args.length} H={args.heads} D={args.head_dim}: "
        f"{total:.0f} ms of thunk time per run"
    )
    for category, ms in spent.most_common():
        print(f"  {category:32s} {ms:8.1f} ms  {100 * ms / total:5.1f}%")


if __name__ == "__main__":
    main()
