"""Causality, seen: the Jacobian of every output position with respect to every input position.

``jax.jacrev`` of a self-attention module gives ``d output[i] / d input[j]`` for all
positions at once. Reduced to ``D[i, j] = max |d output[i, :] / d input[j, :]|``
(``jattn.causality.dependence_matrix``), it is a map of who can see whom:

* the causal ``MultiHeadAttention`` gives a lower-triangular map: every entry above the
  diagonal is *exactly* zero (not merely small), so no output can depend on a later token;
* the same module and weights with ``is_causal=False`` give a full map: every output depends
  on the future, which is what would let a language model read the token it must predict.

Module: ``jattn.linen.MultiHeadAttention(d_out=4, context_length=6, dropout=0.0,
num_heads=2)`` on the book's sentence (a Jacobian shows the effect of a change in the input,
so it sees through the weights, unlike a plot of the attention weights).

    python examples/04_causality_seen.py --d-out 8 --heads 4

Writes ``04_causality_seen.png`` into ``--out`` (default: ``runs/examples/`` under the
current folder, git-ignored). The picture committed as
``docs/examples/04_causality_seen.png`` (shown in the examples guide) is regenerated, from the
repository root, by::

    python examples/04_causality_seen.py --out docs/examples
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import _common
import jax
import jax.numpy as jnp
import numpy as np

from jattn import causality, linen, viz

PICTURE = "04_causality_seen.png"  # written into --out


@dataclass
class Result:
    causal: np.ndarray  # [T, T] D[i, j] for the causal module
    leaky: np.ndarray  # [T, T] the same with is_causal=False
    causal_future_max: float  # max over j > i of the causal map (0.0 exactly)
    causal_past_min: float  # min over j <= i of the causal map (> 0: the past is seen)
    leaky_future_min: float  # min over j > i of the leaky map (> 0: the future is seen)
    zeros_above_diagonal: int  # exact zeros above the diagonal of the causal map
    entries_above_diagonal: int  # T (T - 1) / 2


def dependence_maps(d_out: int = 4, num_heads: int = 2, seed: int = 0):
    """``(causal, leaky)`` dependence maps ``[T, T]`` of one set of weights on the book's sentence."""
    x = jnp.asarray(_common.BOOK_INPUTS)
    t = x.shape[0]
    causal = linen.MultiHeadAttention(d_out, t, 0.0, num_heads)
    leaky = linen.MultiHeadAttention(d_out, t, 0.0, num_heads, is_causal=False)
    variables = causal.init(jax.random.key(seed), x)  # the same parameters for both
    return tuple(
        causality.dependence_matrix(lambda x, m=module: m.apply(variables, x), x)
        for module in (causal, leaky)
    )


def measure(d_out: int = 4, num_heads: int = 2, seed: int = 0) -> Result:
    """Dependence maps of the causal and the leaky module, and where they are zero."""
    causal, leaky = dependence_maps(d_out, num_heads, seed)
    future = np.triu(np.ones(causal.shape, bool), k=1)
    return Result(
        causal=causal,
        leaky=leaky,
        causal_future_max=float(causal[future].max()),
        causal_past_min=float(causal[~future].min()),
        leaky_future_min=float(leaky[future].min()),
        zeros_above_diagonal=int(np.sum(causal[future] == 0.0)),
        entries_above_diagonal=int(future.sum()),
    )


def plot(result: Result, path) -> None:
    """The two dependence maps side by side, on one colour scale."""
    tokens = _common.BOOK_TOKENS
    fig, axes = viz.new_figure(ncols=2)
    vmax = float(max(result.causal.max(), result.leaky.max()))
    common = dict(xlabel="input token j", ylabel="output token i", vmax=vmax, fmt=".2g")
    viz.attention_heatmap(
        result.causal,
        tokens,
        ax=axes[0],
        **common,
        title=f"causal: {result.zeros_above_diagonal}/"
        f"{result.entries_above_diagonal} exact zeros above diagonal",
    )
    viz.attention_heatmap(
        result.leaky, tokens, ax=axes[1], **common, title="is_causal=False: outputs see the future"
    )
    fig.suptitle("max |d output[i] / d input[j]|, by jax.jacrev")
    viz.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared ``--out`` and this example's sizes and seed."""
    p = _common.parser(__doc__, PICTURE)
    p.add_argument("--d-out", type=int, default=4, help="MultiHeadAttention width")
    p.add_argument("--heads", type=int, default=2, help="number of heads (divides --d-out)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed of the weights")
    return p


def main(argv=None) -> Result:
    args = build_parser().parse_args(argv)
    r = measure(args.d_out, args.heads, args.seed)
    for name, dep in (("causal", r.causal), ("is_causal=False", r.leaky)):
        print(f"{name}: D[i, j] = max |d out[i] / d in[j]|")
        print(np.array2string(dep, precision=3, suppress_small=False))
    print(
        f"causal: max above the diagonal = {r.causal_future_max!r} "
        f"({r.zeros_above_diagonal}/{r.entries_above_diagonal} exact zeros); "
        f"min on and below it = {r.causal_past_min:.3g}"
    )
    print(f"is_causal=False: min above the diagonal = {r.leaky_future_min:.3g}")
    path = args.out / PICTURE
    plot(r, path)
    print(f"saved {path}")
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
