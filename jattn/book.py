"""The chapter's running example, so readers can reproduce the book's printed numbers.

``INPUTS`` are the 3-d embeddings of "Your journey starts with one step" from chapter 3
(section 3.3.1); ``TOKENS`` are the words, for labelling plots.
"""

import numpy as np

__all__ = ["INPUTS", "TOKENS"]

TOKENS = ("Your", "journey", "starts", "with", "one", "step")

INPUTS = np.array(
    [
        [0.43, 0.15, 0.89],  # Your     (x^1)
        [0.55, 0.87, 0.66],  # journey  (x^2)
        [0.57, 0.85, 0.64],  # starts   (x^3)
        [0.22, 0.58, 0.33],  # with     (x^4)
        [0.77, 0.25, 0.10],  # one      (x^5)
        [0.05, 0.80, 0.55],  # step     (x^6)
    ],
    dtype=np.float32,
)
INPUTS.flags.writeable = False  # a shared constant: copy it before changing it
