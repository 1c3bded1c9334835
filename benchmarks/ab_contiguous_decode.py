"""A model's decoding step on contiguous KV caches: the fused paged kernel vs the mask path.

On CPU with jattn's kernel built, a plain :func:`jattn.kvcache.update_and_attend` reads
the cache in place through :func:`jattn.kernels.cpu.paged_attention` (one page per row),
up to each row's length (:func:`jattn.kvcache.fused`). Before, every step attended over
the whole capacity through :func:`jattn.dot_product_attention` with the decoding mask (the
dense CPU kernel by the automatic rule). This script times both, in one process: the
*mask* step is traced with :func:`jattn.kvcache.fused` answering False, which is that
path. Both steps are the whole model (``bench_serving.py``'s scaled GPT-2, or its scaled
Qwen3 with ``--model qwen3``: grouped-query attention and RoPE), ``--rows`` rows of one new token, rows
filled to each ``--fills`` fraction of ``--capacity``; the candidates called in turn
(``bench_serving.timed_modes``), one call at a time, in runs of 8 and in runs of 32. Their
greedy tokens are checked equal first.

Usage (from the repository root)::

    PYTHONPATH=$PWD python benchmarks/ab_contiguous_decode.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from functools import partial
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving as bs
from timing import cpu_description, sgemm_gflops

from jattn import kvcache, models

MODELS = {
    "gpt2": lambda: models.GPTModel(bs.gpt2_cfg(8192), rngs=nnx.Rngs(0)),
    "qwen3": lambda: models.Qwen3Model(bs.qwen3_cfg(8192), rngs=nnx.Rngs(0)),
}


def step_candidates(model, rows: int, capacity: int, fills) -> dict:
    """{(path, fill): (step, caches)}: ``state = step(state)`` runs one decoding step."""
    graphdef, state = nnx.split(model)
    state, treedef = jax.tree.flatten(state)
    att = model.trf_blocks[0].att
    tokens = jnp.zeros((rows, 1), jnp.int32)
    rng = np.random.default_rng(0)
    steps = {}
    for fill in fills:
        filled = jnp.full((rows,), max(round(fill * capacity) - 1, 0), jnp.int32)

        shape = (len(model.trf_blocks), 2, rows, capacity, att.kv_heads, att.head_dim)
        kv = rng.normal(size=shape).astype(np.float32)

        def caches(filled=filled, kv=kv):  # fresh buffers (a step donates its own)
            return [
                kvcache.KVCache(jnp.asarray(k), jnp.asarray(v), jnp.copy(filled)) for k, v in kv
            ]

        for path in ("kernel", "mask"):
            off = mock.patch.object(kvcache, "fused", lambda *a, **k: False)
            # a jit of its own per candidate: one with the same function would reuse the trace
            fn = jax.jit(partial(bs.from_leaves, bs.contiguous_step, graphdef, treedef),
                         donate_argnums=1)  # fmt: skip
            with off if path == "mask" else contextlib.nullcontext():
                compiled = fn.lower(state, caches(), tokens).compile()
            runs_kernel = "jattn_cpu_paged_attention" in compiled.as_text()
            assert runs_kernel == (path == "kernel"), "the candidates must differ in their path"

            def step(c, compiled=compiled, filled=filled):
                next_tokens, c = compiled(state, c, tokens)
                return next_tokens, [x._replace(lengths=jnp.copy(filled)) for x in c]

            steps[(path, fill)] = (step, caches())
    return steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--capacity", type=int, default=743)
    p.add_argument("--fills", type=float, nargs="+", default=[0.1, 0.5, 1.0])
    p.add_argument("--repeats", type=int, default=60)
    args = p.parse_args(argv)
    print(f"CPU: {cpu_description()}; XLA sgemm {sgemm_gflops():.0f} GFLOP/s; "
          f"jax {jax.__version__}; load {bs.load()}")  # fmt: skip
    model = MODELS[args.model]()
    steps = step_candidates(model, args.rows, args.capacity, args.fills)
    medians = bs.checked_medians(steps, args.repeats)
    print(f"\n{args.model}, {args.rows} rows, capacity {args.capacity}: ms per step "
          f"(medians; {bs.MODE_TITLES})\n")  # fmt: skip
    print("| filled | fused paged kernel | mask path | mask / kernel |")
    print("|---|---|---|---|")
    for fill in args.fills:
        k, m = ("kernel", fill), ("mask", fill)
        cells = [" / ".join(f"{d[c] * 1e3:.2f}" for d in medians) for c in (k, m)]
        ratio = " / ".join(f"{d[m] / d[k]:.2f}x" for d in medians)
        print(f"| {fill:.0%} | {cells[0]} | {cells[1]} | {ratio} |")


if __name__ == "__main__":
    main()
