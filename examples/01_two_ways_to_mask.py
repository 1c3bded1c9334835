"""Two ways to mask give the same causal attention weights.

The chapter masks attention twice over. First: softmax the scores, zero everything above
the diagonal, renormalise each row to sum 1. Then the shortcut: put -inf above the
diagonal *before* the softmax. Softmax of a row whose hidden entries are -inf equals the
renormalised row restricted to the visible entries, so the two agree exactly in exact
arithmetic; in float32 they agree to rounding. jattn uses the shortcut with a large
*finite* negative instead of -inf (so a fully hidden row never turns into NaN).

Scores: queries and keys from trainable weights W_query, W_key [3, 2] drawn uniform in
[0, 1) (the book's ``torch.rand``) from a fixed seed, scaled by 1/sqrt(d_k). The claim is
checked on the book's sentence for one draw (the one plotted), and for many draws at once
with ``jax.jit(jax.vmap(...))``.

    python examples/01_two_ways_to_mask.py --seeds 1000

Writes ``01_two_ways_to_mask.png`` into ``--out`` (default: ``runs/examples/`` under the
current folder, git-ignored). The picture committed as
``docs/examples/01_two_ways_to_mask.png`` (shown in the examples guide) is regenerated, from the
repository root, by::

    python examples/01_two_ways_to_mask.py --out docs/examples
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

PICTURE = "01_two_ways_to_mask.png"  # written into --out


def renormalised_weights(x, w_query, w_key):
    """The book's first way: softmax, zero above the diagonal, renormalise rows. ``[T, T]``."""
    # [T, d_k]
    queries, keys = x @ w_query, x @ w_key
    scores = queries @ keys.T  # [T, T]
    weights = jax.nn.softmax(scores / jnp.sqrt(keys.shape[-1]), axis=-1)
    masked = weights * jnp.tril(jnp.ones_like(weights))
    return masked / masked.sum(axis=-1, keepdims=True)


def neg_inf_weights(x, w_query, w_key):
    """The book's second way: -inf above the diagonal, then softmax. ``[T, T]``."""
    queries, keys = x @ w_query, x @ w_key
    scores = queries @ keys.T  # [T, T]
    above = jnp.triu(jnp.ones(scores.shape, bool), k=1)
    return jax.nn.softmax(jnp.where(above, -jnp.inf, scores) / jnp.sqrt(keys.shape[-1]), axis=-1)


def jattn_weights(x, w_query, w_key):
    """jattn's way: a large finite negative where ``jattn.causal_mask`` is False. ``[T, T]``."""
    # [T, 1 head, d_k]
    queries, keys = (x @ w_query)[:, None, :], (x @ w_key)[:, None, :]
    return jattn.dot_product_attention_weights(queries, keys, is_causal=True)[0]


@dataclass
class Result:
    w_query: np.ndarray  # [d_in, d_out] the weights used for the book's sentence
    w_key: np.ndarray  # [d_in, d_out]
    renormalised: np.ndarray  # [T, T] the book's sentence, first way
    neg_inf: np.ndarray  # [T, T] the book's sentence, second way
    max_diff_book: float  # max |first - second| on the book's sentence
    max_diff_jattn_book: float  # max |first - jattn| on the book's sentence
    max_diff_seeds: float  # max |first - second| and |first - jattn| over every seed
    num_seeds: int


def measure(num_seeds: int = 256, seed: int = 789, d_out: int = 2) -> Result:
    """Compares the masks on the book's sentence for ``num_seeds`` random weight draws."""
    x = jnp.asarray(_common.BOOK_INPUTS)
    d_in = x.shape[-1]
    k_q, k_k = jax.random.split(jax.random.key(seed))
    # [num_seeds, d_in, d_out]; draw 0 is the one shown for the book's sentence.
    w_qs = _common.book_weights(k_q, d_in, d_out, n=num_seeds)
    w_ks = _common.book_weights(k_k, d_in, d_out, n=num_seeds)

    def three_ways(w_q, w_k):
        return tuple(f(x, w_q, w_k) for f in (renormalised_weights, neg_inf_weights, jattn_weights))

    # Every draw in one jitted, vmapped call: [num_seeds, T, T] each.
    a, b, c = (np.asarray(w) for w in jax.jit(jax.vmap(three_ways))(w_qs, w_ks))
    return Result(
        w_query=np.asarray(w_qs[0]),
        w_key=np.asarray(w_ks[0]),
        renormalised=a[0],
        neg_inf=b[0],
        max_diff_book=float(np.abs(a[0] - b[0]).max()),
        max_diff_jattn_book=float(np.abs(a[0] - c[0]).max()),
        max_diff_seeds=float(max(np.abs(a - b).max(), np.abs(a - c).max())),
        num_seeds=num_seeds,
    )


def plot(result: Result, path) -> None:
    """Three panels: the causal mask, the first way's weights, the second way's weights."""
    tokens = _common.BOOK_TOKENS
    fig, axes = viz.new_figure(ncols=3)
    viz.mask_heatmap(
        np.asarray(jattn.causal_mask(len(tokens))),
        tokens,
        ax=axes[0],
        title="causal mask (True = attend)",
    )
    viz.attention_heatmap(
        result.renormalised, tokens, ax=axes[1], title="softmax → zero above diagonal → renormalise"
    )
    viz.attention_heatmap(result.neg_inf, tokens, ax=axes[2], title="-inf above diagonal → softmax")
    fig.suptitle(f"Two ways to mask: max |difference| = {result.max_diff_book:.1e}")
    viz.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared ``--out`` and this example's sizes and seed."""
    p = _common.parser(__doc__, PICTURE)
    p.add_argument(
        "--seeds", type=int, default=256, help="random (W_query, W_key) draws to compare"
    )
    p.add_argument("--seed", type=int, default=789, help="PRNG seed")
    return p


def main(argv=None) -> Result:
    args = build_parser().parse_args(argv)
    result = measure(num_seeds=args.seeds, seed=args.seed)
    print("weights, softmax -> zero upper triangle -> renormalise rows:")
    print(np.array2string(result.renormalised, precision=4, suppress_small=True))
    print(f"max |renormalised - (-inf then softmax)|, book sentence: {result.max_diff_book:.2e}")
    print(
        f"max |renormalised - jattn (finite negative)|, book sentence: "
        f"{result.max_diff_jattn_book:.2e}"
    )
    print(f"max over {result.num_seeds} random weight draws: {result.max_diff_seeds:.2e}")
    path = args.out / PICTURE
    plot(result, path)
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
