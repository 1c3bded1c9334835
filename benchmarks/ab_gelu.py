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
turn (``bench_serving.timed_modes``), one call at a time, in runs of 8 and of 32. It
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving as bs
from timing import cpu_description, sgemm_gflops

from jattn.models import layers

FORMS = {"jattn": layers.gelu, "jax.nn.gelu": partial(jax.nn.gelu, approximate=True)}
FILLS = (("one page", 0.0), ("10%", 0.1), ("100%", 1.0))


def split_fusions(compiled_text: str) -> int:
    """Loop fusions the compiled step runs split over threads."""
    return sum(
        "kind=kLoop" in line and 'outer_dimension_partitions":["' in line
        for line in compiled_text.splitlines()
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--capacity", type=int, default=743)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    print(f"CPU: {cpu_description()}; XLA sgemm {sgemm_gflops():.0f} GFLOP/s; "
          f"jax {jax.__version__}; load {bs.load()}")  # fmt: skip
    # FeedForward holds its GELU when built: each variant builds the model under its patch
    variants = {f: partial(mock.patch.object, layers, "gelu", g) for f, g in FORMS.items()}
    steps, texts = bs.step_candidates(variants, FILLS, args.rows, args.capacity, args.page_size)
    split = {form: split_fusions(text) for form, text in texts.items()}
    medians = bs.checked_medians(steps, args.repeats)
    print(f"\nscaled GPT-2, {args.rows} rows, capacity {args.capacity}: ms per step "
          f"(medians; {bs.MODE_TITLES})\n")  # fmt: skip
    print(bs.step_table("GELU", medians, FILLS, {"fusions split over threads": split}))


if __name__ == "__main__":
    main()
