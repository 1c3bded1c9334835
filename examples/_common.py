"""What every example shares: the chapter's inputs, the ``--out`` flag, the book's weight init.

The examples are scripts (``python examples/01_two_ways_to_mask.py``); Python puts this
folder on ``sys.path`` when it runs one, so they import this module as ``_common``.

Each writes its picture to ``--out``, by default ``runs/examples/`` under the current
folder (``runs/`` is git-ignored), so a run never overwrites the pictures committed under
``docs/examples/`` (shown in the examples guide). To regenerate those, from the repository root::

    for f in examples/0*.py; do python "$f" --out docs/examples; done
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

from jattn import book

# Where the pictures go by default: beside train_toy.py's runs/<date-time> (git-ignored),
# relative to the current folder. The committed ones are made with --out docs/examples.
DEFAULT_OUT = Path("runs") / "examples"
COMMITTED_OUT = "docs/examples"

# The chapter's running example, "Your journey starts with one step": 6 tokens, 3-d embeddings.
BOOK_TOKENS = list(book.TOKENS)
BOOK_INPUTS = book.INPUTS


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's help ending with its default."""


def parser(doc: str | None, picture: str) -> argparse.ArgumentParser:
    """An argument parser with the example's docstring as help and the shared ``--out`` flag.

    Args:
      doc: the example's docstring.
      picture: the PNG it writes into ``--out``, e.g. ``'01_two_ways_to_mask.png'``.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=_Formatter)
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        default=DEFAULT_OUT,
        help=f"folder for {picture}, under the current folder unless absolute (runs/ is "
        f"git-ignored; --out {COMMITTED_OUT} replaces the picture committed there)",
    )
    return p


def book_weights(key: jax.Array, d_in: int, d_out: int, n: int = 1) -> jax.Array:
    """``n`` weight matrices ``[n, d_in, d_out]``, uniform in [0, 1) like the book's ``torch.rand``."""
    return jax.random.uniform(key, (n, d_in, d_out))
