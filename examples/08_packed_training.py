"""Packed training: several documents per row, segment ids keep them apart, the loss is unchanged.

Documents of different lengths padded one per row waste the padding: here a batch of
``--docs`` documents of 3 to ``--max-doc-len`` tokens. ``jattn.pack`` puts them back to
back into rows of ``--row-length`` tokens (fixed ``num_rows``, so one compilation), with
segment ids and per-document positions; the book's GPT-2 (``jattn.models.GPTModel``,
small) takes ``segment_ids=``, so no token attends across a document boundary and each
document's positions start at 0.

The same model is trained twice from the same initialization on the same documents per
step, once on padded rows (one document each) and once on packed rows, with Adam. A
document's loss does not depend on its neighbours, so the two runs compute the same loss
and the same gradients at every step: their curves coincide (up to float32 rounding),
while the packed run feeds the model fewer token slots (rows x row length: with
the defaults 384 instead of 512, for about 310 real tokens a step).

The task: each document counts up from a random start (``s, s+1, s+2, ...`` modulo the
vocabulary), so the next token follows from the previous one, except the first.

    python examples/08_packed_training.py --steps 60 --docs 64

Writes ``08_packed_training.png`` into ``--out`` (default: ``runs/examples/`` under the
current folder, git-ignored). The picture committed as ``docs/examples/08_packed_training.png``
is regenerated, from the repository root, by::

    python examples/08_packed_training.py --out docs/examples
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import _common
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jattn
from jattn import models, viz

PICTURE = "08_packed_training.png"  # written into --out


def make_documents(rng: np.random.Generator, n: int, max_len: int, vocab: int) -> list:
    """``n`` counting documents ``s, s+1, ...`` (mod ``vocab``) of 3 to ``max_len`` tokens."""
    lengths = rng.integers(3, max_len + 1, n)
    starts = rng.integers(0, vocab, n)
    return [
        ((s + np.arange(m)) % vocab).astype(np.int32) for s, m in zip(starts, lengths, strict=True)
    ]


def pad_rows(docs: list, row_length: int) -> jattn.Packed:
    """One document per row, as a ``Packed`` too (each row holds a single segment)."""
    packed = [jattn.pack([d], row_length) for d in docs]
    stack = [
        np.concatenate([getattr(p, f) for p in packed])
        for f in ("tokens", "segment_ids", "positions")
    ]
    n = len(docs)
    return jattn.Packed(
        *stack,
        np.arange(n, dtype=np.int32),
        np.zeros(n, np.int32),
        np.array([len(d) for d in docs], np.int32),
    )


def mean_loss(model, tokens, segment_ids):
    """Mean next-token cross-entropy over the targets inside documents."""
    logits = model(tokens, segment_ids=segment_ids)  # [rows, L, vocab]
    # A target counts where the next token is in the same (real) document.
    valid = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
    return jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.sum(valid)


@nnx.jit
def train_step(model, optimizer, tokens, segment_ids):
    loss, grads = nnx.value_and_grad(mean_loss)(model, tokens, segment_ids)
    optimizer.update(model, grads)
    return loss


@dataclass
class Result:
    steps: np.ndarray  # 1 ... steps
    loss_padded: np.ndarray  # training loss per step, one document per row
    loss_packed: np.ndarray  # the same documents, packed
    max_loss_diff: float  # largest |padded - packed| over the steps
    slots_padded: int  # token slots per step fed to the model (rows x row length)
    slots_packed: int
    real_tokens: float  # mean real tokens per step


def train(args) -> Result:
    cfg = dict(vocab_size=args.vocab, context_length=args.row_length, emb_dim=args.emb_dim,
               n_heads=2, n_layers=args.layers, drop_rate=0.0, qkv_bias=False)  # fmt: skip
    rng = np.random.default_rng(args.seed)
    batches = [
        make_documents(rng, args.docs, args.max_doc_len, args.vocab) for _ in range(args.steps)
    ]
    # One row count for every step (one compilation): the most any batch needs.
    num_rows = max(len(jattn.pack(docs, args.row_length).tokens) for docs in batches)
    losses = {}
    for layout in ("padded", "packed"):
        model = models.GPTModel(cfg, rngs=nnx.Rngs(args.seed))  # the same init for both
        optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
        out = []
        for docs in batches:
            if layout == "padded":
                rows = pad_rows(docs, args.max_doc_len)
            else:
                rows = jattn.pack(docs, args.row_length, num_rows=num_rows)
            loss = train_step(
                model, optimizer, jnp.asarray(rows.tokens), jnp.asarray(rows.segment_ids)
            )
            out.append(float(loss))
        losses[layout] = np.array(out)
    return Result(
        steps=np.arange(1, args.steps + 1),
        loss_padded=losses["padded"],
        loss_packed=losses["packed"],
        max_loss_diff=float(np.max(np.abs(losses["padded"] - losses["packed"]))),
        slots_padded=args.docs * args.max_doc_len,
        slots_packed=num_rows * args.row_length,
        real_tokens=float(np.mean([sum(len(d) for d in docs) for docs in batches])),
    )


def plot(result: Result, path) -> None:
    """The two loss curves, and the token slots per step each layout feeds the model."""
    fig, axes = viz.new_figure(ncols=2)
    viz.line_plot(
        result.steps,
        {"one document per row": result.loss_padded, "packed": result.loss_packed},
        ax=axes[0],
        xlabel="step",
        ylabel="training loss",
        title=f"same curve (max diff {result.max_loss_diff:.1e})",
        styles={"one document per row": "o-", "packed": "k.--"},
    )
    viz.bar_plot(
        {
            "padded": result.slots_padded,
            "packed": result.slots_packed,
            "real tokens": result.real_tokens,
        },
        ax=axes[1],
        ylabel="token slots per step",
        title="what the model is fed",
        fmt=".0f",
    )
    viz.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared ``--out`` and this example's sizes and seed."""
    p = _common.parser(__doc__, PICTURE)
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--docs", type=int, default=32, help="documents per step")
    p.add_argument("--max-doc-len", type=int, default=16, help="longest document")
    p.add_argument("--row-length", type=int, default=32, help="tokens per packed row")
    p.add_argument("--vocab", type=int, default=32, help="vocabulary size")
    p.add_argument("--emb-dim", type=int, default=32, help="embedding width")
    p.add_argument("--layers", type=int, default=1, help="transformer blocks")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed")
    return p


def main(argv=None) -> Result:
    args = build_parser().parse_args(argv)
    r = train(args)
    print(
        f"{args.docs} documents per step, {r.real_tokens:.0f} real tokens: padded "
        f"{r.slots_padded} token slots, packed {r.slots_packed} "
        f"({r.slots_packed / r.slots_padded:.2f}x)"
    )
    print(
        f"loss: step 1 {r.loss_packed[0]:.3f}, step {len(r.steps)} {r.loss_packed[-1]:.3f}; "
        f"max |padded - packed| over the steps {r.max_loss_diff:.2e}"
    )
    path = args.out / PICTURE
    plot(r, path)
    print(f"saved {path}")
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
