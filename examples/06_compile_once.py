"""Compile once: pad to a few bucket lengths and mask the padding, instead of retracing per length.

``jax.jit`` specialises on shapes: every new sequence length is a new trace and a new XLA
compilation. A stream of requests with many different lengths therefore compiles again and
again. Padding each sequence up to the next bucket (powers of two here) and hiding the
padding with a mask (``jattn.masks.padding_mask_from_lengths`` combined with the causal
mask) leaves one trace per bucket, and the outputs on the real tokens are unchanged: a
hidden key gets exactly zero weight.

Traces are counted by a Python counter inside the jitted function (Python runs only while
tracing); time is wall-clock for the whole stream, compilations included, measured in this
one process, so compare the two numbers as a ratio.

    python examples/06_compile_once.py --requests 64 --max-len 256

Writes ``06_compile_once.png`` into ``--out`` (default: ``runs/examples/`` under the current
folder, git-ignored). The picture committed as ``docs/examples/06_compile_once.png`` (shown
in the examples guide) is regenerated, from the repository root, by::

    python examples/06_compile_once.py --out docs/examples
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import _common
import jax
import numpy as np

import jattn
from jattn import viz

PICTURE = "06_compile_once.png"  # written into --out


def bucket_length(length: int, min_bucket: int = 8) -> int:
    """The smallest power of two >= ``length`` (and >= ``min_bucket``)."""
    return max(min_bucket, 1 << (int(length) - 1).bit_length())


def make_attention(w_qkv, counter: list):
    """A jitted causal self-attention layer ``[T, d_model] -> [T, d_model]`` that counts its traces.

    Args:
      w_qkv: ``[3, d_model, d_model]`` query, key and value projections.
      counter: a one-element list; ``counter[0]`` is incremented on every trace.

    Returns:
      ``fn(x, length=None)``: ``length`` (a traced int) marks positions past it as padding.
    """

    @jax.jit
    def attend(x, length=None):
        counter[0] += 1  # Python side effect: runs once per trace, never on a cached call
        # [T, 1 head, d_model] each
        q, k, v = ((x @ w)[:, None, :] for w in w_qkv)
        t = x.shape[0]
        mask = jattn.causal_mask(t)[None]  # [1, T, T]: the padding mask's rank
        if length is not None:
            # [1, T, T]: padding queries see nothing (zero output), padding keys are hidden
            padding = jattn.padding_mask_from_lengths(length, length, q_len=t, kv_len=t)
            mask = jattn.combine_masks(mask, padding)
        return jattn.dot_product_attention(q, k, v, mask=mask)[:, 0, :]

    return attend


@dataclass
class Result:
    lengths: list  # the request stream's sequence lengths
    traces_raw: list  # traces so far, after each request
    traces_bucketed: list
    distinct_lengths: int
    distinct_buckets: int
    seconds_raw: list  # wall-clock seconds so far (compilations included), after each request
    seconds_bucketed: list
    max_abs_diff: float  # max |raw - bucketed| on the real tokens
    padded_rows_zero: bool  # outputs at padding positions are exactly zero


def _run(fn, counter, inputs, pad_to=None):
    """Feeds the stream through ``fn``; returns outputs, trace count and elapsed time after each."""
    outputs, traces, seconds = [], [], []
    start = time.perf_counter()
    for x in inputs:
        if pad_to is None:
            out = fn(x)
        else:
            n = x.shape[0]
            # [bucket, d_model]: real tokens first, zeros after (numpy: no per-shape compile)
            padded = np.zeros((pad_to(n), x.shape[1]), x.dtype)
            padded[:n] = x
            out = fn(padded, np.int32(n))
        outputs.append(np.asarray(out))  # waits for the result
        traces.append(counter[0])
        seconds.append(time.perf_counter() - start)
    return outputs, traces, seconds


def measure(num_requests: int = 12, max_len: int = 64, d_model: int = 16, seed: int = 0):
    """Runs one stream of random-length sequences raw and bucketed; counts traces and time."""
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(1, max_len + 1, size=num_requests)]
    w_qkv = rng.standard_normal((3, d_model, d_model), np.float32) / np.sqrt(d_model)
    # numpy inputs: drawing them with jax.random would itself compile once per length
    inputs = [rng.standard_normal((n, d_model), np.float32) for n in lengths]

    raw_count, bucket_count = [0], [0]
    raw, traces_raw, seconds_raw = _run(make_attention(w_qkv, raw_count), raw_count, inputs)
    padded, traces_bucketed, seconds_bucketed = _run(
        make_attention(w_qkv, bucket_count), bucket_count, inputs, bucket_length
    )
    pairs = list(zip(raw, padded, strict=True))
    diff = max(float(np.abs(r - p[: len(r)]).max()) for r, p in pairs)
    return Result(
        lengths=lengths,
        traces_raw=traces_raw,
        traces_bucketed=traces_bucketed,
        distinct_lengths=len(set(lengths)),
        distinct_buckets=len({bucket_length(n) for n in lengths}),
        seconds_raw=seconds_raw,
        seconds_bucketed=seconds_bucketed,
        max_abs_diff=diff,
        padded_rows_zero=all(bool(np.all(p[len(r) :] == 0)) for r, p in pairs),
    )


def plot(result: Result, path) -> None:
    """Traces and elapsed time along the request stream, raw lengths against buckets."""
    fig, axes = viz.new_figure(ncols=2)
    x = np.arange(1, len(result.lengths) + 1)
    names = ("raw lengths", "padded to buckets")
    traces = dict(zip(names, (result.traces_raw, result.traces_bucketed), strict=True))
    seconds = dict(zip(names, (result.seconds_raw, result.seconds_bucketed), strict=True))
    viz.line_plot(
        x,
        traces,
        ax=axes[0],
        xlabel="request",
        ylabel="jit traces so far",
        title=f"{result.traces_raw[-1]} traces raw, {result.traces_bucketed[-1]} bucketed",
    )
    viz.line_plot(
        x,
        seconds,
        ax=axes[1],
        xlabel="request",
        ylabel="seconds so far",
        title="time, compilations included",
    )
    viz.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared ``--out`` and this example's sizes and seed."""
    p = _common.parser(__doc__, PICTURE)
    p.add_argument("--requests", type=int, default=12, help="sequences in the stream")
    p.add_argument("--max-len", type=int, default=64, help="longest sequence")
    p.add_argument("--d-model", type=int, default=16, help="embedding width")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed")
    return p


def main(argv=None) -> Result:
    args = build_parser().parse_args(argv)
    r = measure(args.requests, args.max_len, args.d_model, args.seed)
    print(
        f"{len(r.lengths)} requests, {r.distinct_lengths} distinct lengths, "
        f"{r.distinct_buckets} buckets"
    )
    print(f"traces: raw {r.traces_raw[-1]}, bucketed {r.traces_bucketed[-1]}")
    raw_s, bucketed_s = r.seconds_raw[-1], r.seconds_bucketed[-1]
    print(
        f"time for the stream: raw {raw_s:.3f} s, bucketed {bucketed_s:.3f} s "
        f"(raw / bucketed = {raw_s / bucketed_s:.1f}x)"
    )
    print(
        f"max |raw - bucketed| on real tokens: {r.max_abs_diff:.2e}; "
        f"padding rows exactly zero: {r.padded_rows_zero}"
    )
    path = args.out / PICTURE
    plot(r, path)
    print(f"saved {path}")
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
