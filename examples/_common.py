"""What every example shares: the chapter's inputs, the ``--out`` flag, the book's weight init.

The examples are scripts (``python examples/01_two_ways_to_mask.py``); Python puts this
folder on ``sys.path`` when it runs one, so they import this module as ``_common``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

from jattn import book

# Where the default runs write their pictures (committed, and shown in the README).
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "examples"

# The chapter's running example, "Your journey starts with one step": 6 tokens, 3-d embeddings.
BOOK_TOKENS = list(book.TOKENS)
BOOK_INPUTS = book.INPUTS


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the example's docstring as help and the shared ``--out`` flag."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="folder for the PNG (default: docs/examples in the repository)",
    )
    return p


def book_weights(key: jax.Array, d_in: int, d_out: int, n: int = 1) -> jax.Array:
    """``n`` weight matrices ``[n, d_in, d_out]``, uniform in [0, 1) like the book's ``torch.rand``."""
    return jax.random.uniform(key, (n, d_in, d_out))
