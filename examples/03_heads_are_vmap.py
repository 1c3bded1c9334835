"""Stacking heads is vmap: the book's wrapper is jax.vmap of one causal head over its weights.

The chapter first builds multi-head attention as a ``MultiHeadAttentionWrapper``: a Python
list of ``CausalAttention`` heads whose outputs are concatenated. In JAX, running the same
module once per head is exactly what ``jax.vmap`` does when the per-head parameters are
stacked along a new leading axis. The chapter then fuses the heads into one
``MultiHeadAttention`` with weight splits; ``jattn.convert.wrapper_to_split`` turns the
wrapper's weights into that module's (fused Q/K/V kernels, identity ``out_proj``).

Three forms, one set of weights, equal outputs and attention weights:

* **loop**: ``MultiHeadAttentionWrapper.apply`` (one head after another);
* **vmap**: ``jax.vmap(CausalAttention.apply)`` over the stacked per-head parameters;
* **split**: ``MultiHeadAttention.apply`` with ``wrapper_to_split`` weights.

Checked on the book's sentence (2 heads of width 2, as in the chapter) and on a larger
random batch, which is also timed under ``jax.jit`` (best of ``--repeats`` calls; the
ratios are what to read, not the absolute times).

    python examples/03_heads_are_vmap.py --batch 16 --tokens 256 --heads 12 --head-dim 64

Writes ``03_heads_are_vmap.png`` into ``--out`` (default: ``runs/examples/`` under the
current folder, git-ignored). The picture committed as
``docs/examples/03_heads_are_vmap.png`` (shown in the examples guide) is regenerated, from the
repository root, by::

    python examples/03_heads_are_vmap.py --out docs/examples
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import _common
import jax
import jax.numpy as jnp
import numpy as np

from jattn import convert, linen, viz

PICTURE = "03_heads_are_vmap.png"  # written into --out


def stack_heads(wrapper_params, num_heads: int):
    """The wrapper's per-head params ``heads_0 ... heads_{H-1}`` stacked on a new axis 0."""
    heads = [wrapper_params[f"heads_{i}"] for i in range(num_heads)]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *heads)  # each leaf [H, ...]


def three_forms(head_dim: int, num_heads: int, context_length: int):
    """``(loop, vmapped, split)`` functions of ``(wrapper_params, x)``.

    Each returns ``(output [batch..., T, H * head_dim], weights [batch..., H, T, T])``.
    """
    wrapper = linen.MultiHeadAttentionWrapper(head_dim, context_length, 0.0, num_heads)
    head = linen.CausalAttention(head_dim, context_length, 0.0)
    split = linen.MultiHeadAttention(head_dim * num_heads, context_length, 0.0, num_heads)

    def loop(params, x):
        return wrapper.apply({"params": params}, x, return_weights=True)

    def vmapped(params, x):
        def one_head(p):
            return head.apply({"params": p}, x, return_weights=True)

        # out [H, batch..., T, head_dim], weights [H, batch..., 1, T, T]
        out, weights = jax.vmap(one_head)(stack_heads(params, num_heads))
        # [batch..., T, H, head_dim] -> [batch..., T, H * head_dim]: heads side by side
        out = jnp.moveaxis(out, 0, -2).reshape(*out.shape[1:-1], num_heads * head_dim)
        return out, jnp.moveaxis(weights[..., 0, :, :], 0, -3)  # [batch..., H, T, T]

    def fused(params, x):
        return split.apply(convert.wrapper_to_split({"params": params}), x, return_weights=True)

    return wrapper, (loop, vmapped, fused)


def _best_time(fn, *args, repeats: int) -> float:
    """Best wall-clock seconds of ``repeats`` calls (after one warm-up call that compiles)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


FORMS = ("loop", "vmap", "split")


@dataclass
class Result:
    book_weights: np.ndarray  # [H, T, T] the vmapped heads' weights on the book's sentence
    max_diff_book: float  # max |difference| of outputs and weights between the forms, book
    max_diff_random: float  # the same on the timed random batch
    seconds: dict  # {form: best seconds per jitted call} on the random batch
    size: tuple  # (batch, tokens, d_in, heads, head_dim) of the random batch


def _max_diff(results) -> float:
    """Largest |difference| between the first form's (output, weights) and the others'."""
    ref = results[0]
    return max(
        float(jnp.abs(a - b).max())
        for other in results[1:]
        for a, b in zip(ref, other, strict=True)
    )


def measure(batch=4, tokens=64, d_in=32, heads=4, head_dim=16, repeats=20, seed=0) -> Result:
    """Compares the three forms on the book's sentence and on a random batch, and times them."""
    key_book, key_big, key_x = jax.random.split(jax.random.key(seed), 3)

    # The chapter's example: d_in = 3, two heads of width 2.
    x_book = jnp.asarray(_common.BOOK_INPUTS)
    wrapper, forms = three_forms(2, 2, x_book.shape[0])
    params = wrapper.init(key_book, x_book)["params"]
    book = [jax.jit(f)(params, x_book) for f in forms]

    wrapper, forms = three_forms(head_dim, heads, tokens)
    x = jax.random.normal(key_x, (batch, tokens, d_in))
    params = wrapper.init(key_big, x)["params"]
    jitted = [jax.jit(f) for f in forms]
    big = [f(params, x) for f in jitted]
    seconds = {
        name: _best_time(f, params, x, repeats=repeats)
        for name, f in zip(FORMS, jitted, strict=True)
    }
    return Result(
        book_weights=np.asarray(book[1][1]),
        max_diff_book=_max_diff(book),
        max_diff_random=_max_diff(big),
        seconds=seconds,
        size=(batch, tokens, d_in, heads, head_dim),
    )


def plot(result: Result, path) -> None:
    """The book's two heads (vmap form) and the jitted time of each form."""
    num_heads = result.book_weights.shape[0]
    fig, axes = viz.new_figure(ncols=num_heads + 1)
    for h in range(num_heads):
        viz.attention_heatmap(
            result.book_weights[h],
            _common.BOOK_TOKENS,
            ax=axes[h],
            title=f"head {h} (vmap == loop == split)",
        )
    ms = {name: 1e3 * s for name, s in result.seconds.items()}
    b, t, d, h, hd = result.size
    viz.bar_plot(
        ms,
        ax=axes[-1],
        ylabel="ms per jitted call (best)",
        title=f"batch {b}, T {t}, d_in {d}, {h} heads x {hd}",
    )
    fig.suptitle(
        f"Stacking heads is vmap: max |difference| {result.max_diff_book:.1e} (book), "
        f"{result.max_diff_random:.1e} (random batch)"
    )
    viz.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared ``--out`` and this example's sizes and seed."""
    p = _common.parser(__doc__, PICTURE)
    p.add_argument("--batch", type=int, default=4, help="batch size of the timed input")
    p.add_argument("--tokens", type=int, default=64, help="sequence length of the timed input")
    p.add_argument("--d-in", type=int, default=32, help="input width of the timed input")
    p.add_argument("--heads", type=int, default=4, help="number of heads")
    p.add_argument("--head-dim", type=int, default=16, help="width of each head")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per form (best kept)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed")
    return p


def main(argv=None) -> Result:
    a = build_parser().parse_args(argv)
    r = measure(a.batch, a.tokens, a.d_in, a.heads, a.head_dim, a.repeats, a.seed)
    print(
        f"max |difference| between loop, vmap and split: book sentence {r.max_diff_book:.2e}, "
        f"random batch {r.max_diff_random:.2e}"
    )
    print("best seconds per jitted call (batch, tokens, d_in, heads, head_dim) = " + str(r.size))
    for name, s in r.seconds.items():
        print(f"  {name:>5}: {s * 1e3:8.3f} ms  ({s / r.seconds['split']:.2f}x split)")
    path = a.out / PICTURE
    plot(r, path)
    print(f"saved {path}")
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
