"""Why scale the scores by 1/sqrt(d_k): without it the softmax saturates and its gradient vanishes.

The dot product of two random vectors with unit-variance entries has variance d_k. Unscaled,
the attention logits grow like sqrt(d_k): each softmax row tends to a one-hot step, its
entropy falls towards 0 and the gradient flowing back through it (the softmax Jacobian
``diag(p) - p pᵀ``) vanishes. Dividing by sqrt(d_k) keeps the logits at unit variance,
so entropy and gradient stay put whatever d_k.

Measured with ``jax.grad`` and ``jax.vmap`` over d_k (queries and keys drawn at the
largest d_k and zeroed beyond each d_k, so one compiled function covers every d_k), over
scaled/unscaled and over random seeds:

* entropy (nats) of each attention row, averaged;
* the norm of ``d loss / d logits`` for each row, where ``loss = sum(output * g)`` with a
  random probe ``g``; it is taken as the gradient with respect to an additive ``bias`` at
  zero, which equals the gradient with respect to the softmax input. Reported as the median
  over rows and seeds (a few near-tie rows keep the mean up).

    python examples/02_why_scale.py --max-log2-dk 12 --seeds 128

Writes ``02_why_scale.png`` into ``--out`` (default: ``runs/examples/`` under the current
folder, git-ignored). The picture committed as ``docs/examples/02_why_scale.png`` (shown in
the examples guide) is regenerated, from the repository root, by::

    python examples/02_why_scale.py --out docs/examples
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

PICTURE = "02_why_scale.png"  # written into --out


def row_stats(key, d_k, scale, *, num_tokens: int, max_dk: int, v_dim: int = 8):
    """Entropy ``[T]`` and gradient norm ``[T]`` of each attention row for one draw.

    Args:
      key: PRNG key for q, k, v and the probe.
      d_k: the head dimension in use (int or traced int); entries past it are zero.
      scale: multiplier of the logits (1 for unscaled, 1/sqrt(d_k) for scaled).
      num_tokens: sequence length T (queries and keys).
      max_dk: the array width, >= every d_k.
      v_dim: value width.
    """
    k_q, k_k, k_v, k_g = jax.random.split(key, 4)
    # [1, 1, max_dk]: zero-padding leaves every dot product unchanged
    keep = (jnp.arange(max_dk) < d_k)[None, None, :]
    # [T, 1 head, max_dk]
    query = jax.random.normal(k_q, (num_tokens, 1, max_dk)) * keep
    key_ = jax.random.normal(k_k, (num_tokens, 1, max_dk)) * keep
    # [T, 1 head, v_dim]
    value = jax.random.normal(k_v, (num_tokens, 1, v_dim))
    probe = jax.random.normal(k_g, (num_tokens, 1, v_dim))

    weights = jattn.dot_product_attention_weights(query, key_, scale=scale)[0]  # [T, T]
    entropy = -jnp.sum(jnp.where(weights > 0, weights * jnp.log(weights), 0.0), axis=-1)

    def loss(bias):  # bias [1 head, T, T] is added to the scaled logits
        out = jattn.dot_product_attention(query, key_, value, bias=bias, scale=scale)
        return jnp.sum(out * probe)

    grad_logits = jax.grad(loss)(jnp.zeros((1, num_tokens, num_tokens)))[0]  # [T, T]
    return entropy, jnp.linalg.norm(grad_logits, axis=-1)


@dataclass
class Result:
    d_k: np.ndarray  # [n_dk]
    entropy: dict  # {"scaled"|"unscaled": [n_dk]} mean row entropy
    grad_norm: dict  # {"scaled"|"unscaled": [n_dk]} median row gradient norm
    max_entropy: float  # log(T), a uniform row


def measure(max_log2_dk: int = 10, num_seeds: int = 64, num_tokens: int = 32, seed: int = 0):
    """Row entropy and logit-gradient norm for d_k = 2, 4, ..., 2**max_log2_dk."""
    d_ks = 2 ** jnp.arange(1, max_log2_dk + 1)
    max_dk = int(d_ks[-1])
    scales = {"unscaled": jnp.ones(d_ks.shape), "scaled": 1.0 / jnp.sqrt(d_ks)}
    keys = jax.random.split(jax.random.key(seed), num_seeds)

    def one(key, d_k, scale):
        return row_stats(key, d_k, scale, num_tokens=num_tokens, max_dk=max_dk)

    # vmap over seeds (inner) and over d_k with its scale (outer): one compilation in all.
    stats = jax.jit(jax.vmap(jax.vmap(one, (0, None, None)), (None, 0, 0)))
    entropy, grad_norm = {}, {}
    for name, scale in scales.items():
        ent, grad = stats(keys, d_ks, scale)  # [n_dk, seeds, T] each
        entropy[name] = np.asarray(ent.mean(axis=(1, 2)))
        grad_norm[name] = np.median(np.asarray(grad).reshape(len(d_ks), -1), axis=-1)
    return Result(np.asarray(d_ks), entropy, grad_norm, float(np.log(num_tokens)))


def plot(result: Result, path) -> None:
    """Entropy and gradient norm against d_k, scaled against unscaled."""
    fig, axes = viz.new_figure(ncols=2)
    entropy = dict(
        result.entropy, **{"uniform row (log T)": np.full(result.d_k.shape, result.max_entropy)}
    )
    viz.line_plot(
        result.d_k,
        entropy,
        ax=axes[0],
        logx=True,
        xlabel="d_k",
        ylabel="entropy of an attention row (nats)",
        title="softmax saturates unscaled",
        styles={"uniform row (log T)": "k--"},
    )
    viz.line_plot(
        result.d_k,
        result.grad_norm,
        ax=axes[1],
        logx=True,
        logy=True,
        xlabel="d_k",
        ylabel="median |d loss / d logits| per row",
        title="its gradient vanishes unscaled",
    )
    viz.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared ``--out`` and this example's sizes and seed."""
    p = _common.parser(__doc__, PICTURE)
    p.add_argument("--max-log2-dk", type=int, default=10, help="largest d_k is 2**this")
    p.add_argument("--seeds", type=int, default=64, help="random draws per d_k (vmapped)")
    p.add_argument("--tokens", type=int, default=32, help="sequence length T")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed")
    return p


def main(argv=None) -> Result:
    args = build_parser().parse_args(argv)
    result = measure(args.max_log2_dk, args.seeds, args.tokens, args.seed)
    print(f"{'d_k':>6} | entropy unscaled  scaled | grad unscaled    scaled")
    for i, d in enumerate(result.d_k):
        print(
            f"{d:>6} | {result.entropy['unscaled'][i]:16.3f} {result.entropy['scaled'][i]:7.3f}"
            f" | {result.grad_norm['unscaled'][i]:13.2e} {result.grad_norm['scaled'][i]:9.2e}"
        )
    print(f"(a uniform row has entropy log T = {result.max_entropy:.3f})")
    path = args.out / PICTURE
    plot(result, path)
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
