"""A decoding step with jattn's GELU against ``jax.nn.gelu``'s arrangement, in one process.

:func:`jattn.models.layers.gelu` computes chapter 4's formula as ``h + h tanh(x (c + c'
x^2))`` with ``h = x / 2``; ``jax.nn.gelu(x, approximate=True)`` as ``x * 0.5 (1 + tanh(c
(x + 0.044715 x^3)))``, two more operations an element. XLA's CPU compiler splits an
elementwise fusion over threads when its count of arithmetic exceeds its bytes moved, and
the second arrangement, fused with the bias add before it, does; on a decoding step's
``[rows, 4 emb]`` the threads' hand-off costs more than the work. This script builds
``bench_serving.py``'s scaled GPT-2 twice, once with each GELU, and times
``generate_many``'s decoding step (the whole model on paged caches, greedy pick) with one
page a row and rows filled to 10% and 100% of ``--capacity``, the candidates called in
turn (``bench_serving.interleaved_medians``), one call at a time and in runs of 8. It
checks their greedy tokens equal first, and counts the compiled step's loop fusions split
over threads.

Usage (from the repository root)::

    PYTHONPATH=$PWD python benchmarks/ab_gelu.py
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving as bs
from timing import cpu_description, sgemm_gflops

from jattn import paged
from jattn.models import GPTModel, layers

FORMS = {"jattn": layers.gelu, "jax.nn.gelu": partial(jax.nn.gelu, approximate=True)}
FILLS = (("one page", 0.0), ("10%", 0.1), ("100%", 1.0))


def split_fusions(compiled_text: str) -> int:
    """Loop fusions the compiled step runs split over threads."""
    return sum(
        "kind=kLoop" in line and 'outer_dimension_partitions":["' in line
        for line in compiled_text.splitlines()
    )


def candidates(rows: int, capacity: int, page_size: int) -> tuple[dict, dict]:
    """``({(form, fill): (step, pools)}, {form: split fusions})``: ``pools = step(pools)``
    runs one decoding step; ``bs.fill_width`` pages a row (one page for "one page")."""
    max_pages = paged.pages_needed(capacity, page_size)
    tokens = jnp.zeros((rows, 1), jnp.int32)
    table = jnp.arange(rows * max_pages, dtype=jnp.int32).reshape(rows, max_pages)
    steps, split = {}, {}
    for form, gelu in FORMS.items():
        with mock.patch.object(layers, "gelu", gelu):  # FeedForward holds it when built
            model = GPTModel(bs.gpt2_cfg(8192), rngs=nnx.Rngs(0))
        att = model.trf_blocks[0].att
        graphdef, state = nnx.split(model)
        state, treedef = jax.tree.flatten(state)
        step = partial(bs.paged_step, pick=True)
        fn = jax.jit(partial(bs.from_leaves, step, graphdef, treedef), donate_argnums=1)
        pool = (rows * max_pages, page_size, att.kv_heads, att.head_dim)

        def pools(pool=pool, blocks=model.trf_blocks):
            return [tuple(jnp.zeros(pool, jnp.float32) for _ in "kv") for _ in blocks]

        lengths = jnp.zeros((rows,), jnp.int32)
        compiled = fn.lower(state, pools(), table, lengths, tokens).compile()  # every fill's
        split[form] = split_fusions(compiled.as_text())
        for name, fill in FILLS:
            width = bs.fill_width(fill, max_pages) if fill else 1
            lengths = jnp.full((rows,), width * page_size - 1, jnp.int32)  # room for one

            def call(pools, compiled=compiled, state=state, lengths=lengths):
                return compiled(state, pools, table, lengths, tokens)

            steps[(form, name)] = (call, pools())
    return steps, split


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--capacity", type=int, default=743)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    print(f"CPU: {cpu_description()}; XLA sgemm {sgemm_gflops():.0f} GFLOP/s; "
          f"jax {jax.__version__}; load {bs.load()}")  # fmt: skip
    steps, split = candidates(args.rows, args.capacity, args.page_size)
    single, runs = bs.checked_medians(steps, args.repeats)
    print(f"\nscaled GPT-2, {args.rows} rows, capacity {args.capacity}: ms per step "
          "(medians; one call at a time / in runs of 8)\n")  # fmt: skip
    print("| GELU | fusions split over threads | " + " | ".join(n for n, _ in FILLS)
          + " | 10% / 100% |")  # fmt: skip
    print("|---|---|" + "---|" * (len(FILLS) + 1))
    for form in FORMS:
        cells = [f"{single[(form, n)] * 1e3:.2f} / {runs[(form, n)] * 1e3:.2f}" for n, _ in FILLS]
        ratio = [d[(form, "10%")] / d[(form, "100%")] for d in (single, runs)]
        print(f"| {form} | {split[form]} | " + " | ".join(cells)
              + f" | {ratio[0]:.2f}x / {ratio[1]:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
