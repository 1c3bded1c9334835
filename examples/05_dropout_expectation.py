"""Dropout on the attention weights is unbiased: averaged over keys it gives the deterministic output.

Inverted dropout zeroes each attention weight with probability ``rate`` and scales the
survivors by ``1 / (1 - rate)``, so every weight keeps its expectation and so does the
output. ``jax.vmap`` over many dropout keys measures this directly:

* the mean of n dropped-out outputs approaches the deterministic output, with an error
  that falls like n^(-1/2) (the log-log slope is about -0.5; the error is the RMS over
  ``--repeats`` disjoint groups of n keys);
* the fraction of visible weights that are zeroed matches the rate;
* the same key gives the same mask (no hidden global RNG), another key a different one.

Setup: the book's sentence, trainable W_query, W_key, W_value [3, 2] uniform in [0, 1)
from a fixed seed, causal attention, ``rate = 0.5`` as in the chapter.

    python examples/05_dropout_expectation.py --max-log2-keys 14 --rate 0.1

Writes ``05_dropout_expectation.png`` into ``--out`` (default: ``runs/examples/`` under the
current folder, git-ignored). The picture committed as
``docs/examples/05_dropout_expectation.png`` (shown in the examples guide) is regenerated, from the
repository root, by::

    python examples/05_dropout_expectation.py --out docs/examples
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import _common
import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import viz

PICTURE = "05_dropout_expectation.png"  # written into --out


def book_qkv(seed: int, d_out: int = 2):
    """Queries, keys and values ``[T, 1 head, d_out]`` of the book's sentence."""
    x = jnp.asarray(_common.BOOK_INPUTS)
    w_q, w_k, w_v = _common.book_weights(jax.random.key(seed), x.shape[-1], d_out, n=3)
    return tuple((x @ w)[:, None, :] for w in (w_q, w_k, w_v))


@dataclass
class Result:
    num_keys: np.ndarray  # [n] keys averaged
    rms_error: np.ndarray  # [n] RMS |mean of dropped outputs - deterministic output|
    slope: float  # least-squares slope of log(rms_error) on log(num_keys)
    rate: float
    zero_fraction: float  # zeroed among visible weights, over every key
    zero_fraction_sigma: float  # binomial standard deviation of that fraction
    weights_mean_error: float  # max |mean of dropped weights - weights| over every key
    same_key_same_mask: bool
    other_key_other_mask: bool
    weights: np.ndarray  # [T, T] before dropout
    dropped: np.ndarray  # [T, T] after dropout with one key


def measure(max_log2_keys: int = 10, repeats: int = 32, rate: float = 0.5, seed: int = 123):
    """Error of the dropout average for 1, 2, 4, ..., 2**max_log2_keys keys, and mask statistics."""
    q, k, v = book_qkv(seed)
    exact = jattn.dot_product_attention(q, k, v, is_causal=True, deterministic=True)
    weights = jattn.dot_product_attention_weights(q, k, is_causal=True)[0]  # [T, T]

    def dropped(key):  # one dropout draw: output [T, 1, d] and weights [T, T]
        kw = dict(is_causal=True, dropout_rate=rate, dropout_rng=key)
        out = jattn.dot_product_attention(q, k, v, **kw)
        return out, jattn.dot_product_attention_weights(q, k, **kw)[0]

    n_max = 2**max_log2_keys
    keys = jax.random.split(jax.random.key(seed + 1), repeats * n_max)
    # One extra draw reuses the first key: the same key must give the same mask.
    outs, drops = jax.jit(jax.vmap(dropped))(jnp.concatenate([keys, keys[:1]]))
    same, outs, drops = drops[-1], outs[:-1], drops[:-1]  # [R * n_max, T, 1, d], [R * n_max, T, T]

    num_keys = 2 ** np.arange(max_log2_keys + 1)
    # Running means over each of R disjoint groups of n_max keys: [R, n_max, T, 1, d]
    grouped = outs.reshape(repeats, n_max, *exact.shape)
    running = jnp.cumsum(grouped, axis=1) / jnp.arange(1, n_max + 1)[None, :, None, None, None]
    # [R, len(num_keys), T, 1, d]: the mean of the first n keys of each group, n = 1, 2, 4, ...
    errors = running[:, num_keys - 1] - exact[None, None]
    rms = np.sqrt(np.mean(np.asarray(errors) ** 2, axis=(0, 2, 3, 4)))
    slope = float(np.polyfit(np.log(num_keys), np.log(rms), 1)[0])

    visible = np.asarray(weights) > 0  # the causal mask hides the rest; dropout only acts on these
    zero_fraction = float(jnp.mean(drops[:, visible] == 0))
    sigma = float(np.sqrt(rate * (1 - rate) / drops[:, visible].size))

    return Result(
        num_keys=num_keys,
        rms_error=rms,
        slope=slope,
        rate=rate,
        zero_fraction=zero_fraction,
        zero_fraction_sigma=sigma,
        weights_mean_error=float(jnp.abs(drops.mean(axis=0) - weights).max()),
        same_key_same_mask=bool(jnp.array_equal(same, drops[0])),
        other_key_other_mask=bool(jnp.any((drops[0] == 0) != (drops[1] == 0))),
        weights=np.asarray(weights),
        dropped=np.asarray(drops[0]),
    )


def plot(result: Result, path) -> None:
    """Error against number of keys (log-log, with the n^-1/2 reference) and one dropout mask."""
    fig, axes = viz.new_figure(ncols=2)
    reference = result.rms_error[0] / np.sqrt(result.num_keys)
    viz.line_plot(
        result.num_keys,
        {"measured": result.rms_error, "∝ n^(-1/2)": reference},
        ax=axes[0],
        logx=True,
        logy=True,
        xlabel="number of dropout keys n",
        ylabel="RMS |mean of n outputs - deterministic|",
        title=f"mean converges, slope {result.slope:.3f}",
        styles={"∝ n^(-1/2)": "k--"},
    )
    viz.dropout_heatmap(
        result.weights,
        result.dropped,
        _common.BOOK_TOKENS,
        ax=axes[1],
        title=f"one key, rate {result.rate}: x = dropped, rest x 1/(1-rate)",
    )
    viz.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared ``--out`` and this example's sizes and seed."""
    p = _common.parser(__doc__, PICTURE)
    p.add_argument("--max-log2-keys", type=int, default=10, help="largest n is 2**this")
    p.add_argument("--repeats", type=int, default=32, help="disjoint groups of n keys per point")
    p.add_argument("--rate", type=float, default=0.5, help="dropout rate")
    p.add_argument("--seed", type=int, default=123, help="PRNG seed")
    return p


def main(argv=None) -> Result:
    args = build_parser().parse_args(argv)
    r = measure(args.max_log2_keys, args.repeats, args.rate, args.seed)
    print(f"{'keys':>6}  RMS error")
    for n, e in zip(r.num_keys, r.rms_error, strict=True):
        print(f"{n:>6}  {e:.3e}")
    print(f"log-log slope: {r.slope:.3f} (expected -0.5)")
    print(
        f"zeroed fraction of visible weights: {r.zero_fraction:.4f} (rate {r.rate}, "
        f"sigma {r.zero_fraction_sigma:.1e})"
    )
    print(f"max |mean of dropped weights - weights|: {r.weights_mean_error:.2e}")
    print(
        f"same key -> same mask: {r.same_key_same_mask}; "
        f"another key -> another mask: {r.other_key_other_mask}"
    )
    path = args.out / PICTURE
    plot(r, path)
    print(f"saved {path}")
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
