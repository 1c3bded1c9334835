"""``generate_many`` of this tree against its scheduler at another git revision, one process.

Loads ``jattn/models/serving.py`` as it is at ``REV`` (``git show``) beside the working
tree's, and runs both on ``bench_serving.py``'s workload (64 requests, 16 slots, pages of
16, each revision's default prefill chunk unless ``--chunk``, a pool of half of ``slots x
capacity``, its eos ids): the outputs are checked equal first (greedy), then the two run in
turn ``--rounds`` times (wall-clock seconds, medians). Both use this tree's model, kernels
and paged cache: only the scheduler differs. Also printed: each one's decoding and prefill
steps, pages held and preemptions (``ServingStats``), the CPU and an sgemm rate from the
same run.

Usage (from the repository root)::

    PYTHONPATH=$PWD python benchmarks/ab_serving.py REV     # e.g. HEAD, or a commit
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving as bs
from timing import cpu_description, settle, sgemm_gflops

from jattn import models
from jattn.models import serving


def serving_at(rev: str):
    """``jattn/models/serving.py`` at ``rev``, imported as its own module."""
    source = subprocess.run(
        ["git", "show", f"{rev}:jattn/models/serving.py"], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    path = os.path.join(tempfile.mkdtemp(), f"serving_{rev.replace('/', '_')}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"serving_at_{abs(hash(rev))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rev", help="the git revision whose serving.py is the baseline")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--chunk", type=int, default=None, help="prefill chunk (default: each revision's own)"
    )
    args = p.parse_args(argv)
    print(f"CPU: {cpu_description()}; sgemm {sgemm_gflops():.0f} GFLOP/s (this run)")
    prompts, max_new = bs.workload(64, (16, 512), (16, 256), 8192)
    capacity = max(q.size + m - 1 for q, m in zip(prompts, max_new, strict=True))
    pool = bs.pool_pages(0.5, 16, capacity, 16)
    kw = dict(slots=16, page_size=16, num_pages=pool)
    if args.chunk is not None:
        kw["prefill_chunk"] = args.chunk
    gpt = models.GPTModel(bs.gpt2_cfg(8192), rngs=nnx.Rngs(0))
    kw["eos_id"] = bs.pick_eos(models.generate_many(gpt, prompts, max_new, **kw))
    candidates = {args.rev: serving_at(args.rev), "this tree": serving}
    outputs = {}
    for name, module in candidates.items():  # compile, warm up, and check the outputs
        outputs[name], stats = module.generate_many(gpt, prompts, max_new, return_stats=True, **kw)
        print(
            f"{name}: {stats.decode_steps} decoding steps, {stats.prefill_steps} prefill "
            f"steps, peak {stats.peak_pages} / mean {stats.mean_pages:.0f} of "
            f"{stats.num_pages} pages, preemptions {getattr(stats, 'preemptions', 0)}"
        )
    same = all(
        a.tolist() == b.tolist() for a, b in zip(*outputs.values(), strict=True)
    )  # fmt: skip
    if not same:
        raise SystemExit("the two schedulers' greedy outputs differ")
    tokens = sum(o.size for o in outputs["this tree"])
    times = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, module in candidates.items():
            settle()
            t = time.perf_counter()
            module.generate_many(gpt, prompts, max_new, **kw)
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name}: median {median:.3f} s ({tokens / median:.0f} tokens/s), "
              f"range {min(ts):.3f}-{max(ts):.3f}")  # fmt: skip
    ratio = statistics.median(times[args.rev]) / statistics.median(times["this tree"])
    per_round = np.asarray(times[args.rev]) / np.asarray(times["this tree"])
    print(f"{args.rev} / this tree: {ratio:.2f}x (rounds {per_round.min():.2f}-"
          f"{per_round.max():.2f}x); the same {tokens} tokens")  # fmt: skip


if __name__ == "__main__":
    main()
