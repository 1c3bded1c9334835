"""The training demo behind ``train_toy.py``: a tiny GPT learns next-token prediction with
and without the causal mask.

Pieces, each replaceable on its own:

* :mod:`jattn.toy.data` -- tasks generated in code (:class:`CopyTask` with an exact
  entropy floor, :class:`TextTask` for a text file); the batch of step ``s`` is a pure
  function of ``(seed, s)``.
* :mod:`jattn.toy.model` -- :class:`TinyGPT`, built from :class:`jattn.linen.MultiHeadAttention`.
* :mod:`jattn.toy.train` -- AdamW with warmup and cosine decay, the jitted donated train
  step, orbax checkpoints.
* :mod:`jattn.toy.generate` -- greedy generation (fixed window, or through the KV cache) and its accuracy.
* :mod:`jattn.toy.plots` -- loss curves and attention heatmaps.
* :mod:`jattn.toy.parallel` -- the ``('data', 'model')`` device mesh every run trains on
  (a 1x1 mesh on one device), batch placement, ``jax.distributed`` for several hosts.
* :mod:`jattn.toy.experiment` -- :func:`run_experiment`: the causal and leaky runs, measured
  and written to disk.
"""

from jattn.toy.data import CopyTask, TextTask
from jattn.toy.experiment import RUNS, evaluate, run_experiment
from jattn.toy.generate import generation_accuracy, greedy_generate
from jattn.toy.model import GPTConfig, TinyGPT, init_variables
from jattn.toy.train import Checkpointer, TrainConfig, TrainState, init_state, make_train_step

__all__ = [
    "RUNS",
    "Checkpointer",
    "CopyTask",
    "GPTConfig",
    "TextTask",
    "TinyGPT",
    "TrainConfig",
    "TrainState",
    "evaluate",
    "generation_accuracy",
    "greedy_generate",
    "init_state",
    "init_variables",
    "make_train_step",
    "run_experiment",
]
