"""What every example shares: the chapter's inputs, the ``--out`` flag, the book's weight init.

The examples are scripts (``python examples/01_two_ways_to_mask.py``); Python puts this
folder on ``sys.path`` when it runs one, so they import this module as ``_common``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np

# Where the default runs write their pictures (committed, and shown in the README).
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "examples"

# The chapter's running example, "Your journey starts with one step": 6 tokens, 3-d embeddings.
BOOK_TOKENS = ["Your", "journey", "starts", "with", "one", "step"]
BOOK_INPUTS = np.array(
    [
        [0.43, 0.15, 0.89],  # Your
        [0.55, 0.87, 0.66],  # journey
        [0.57, 0.85, 0.64],  # starts
        [0.22, 0.58, 0.33],  # with
        [0.77, 0.25, 0.10],  # one
        [0.05, 0.80, 0.55],  # step
    ],
    dtype=np.float32,
)


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
