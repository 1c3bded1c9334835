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

import importlib.util as _importlib_util

# The demo's own dependencies, the ``toy`` extra (module -> pip distribution). Checked
# here, before any submodule imports them, so a missing one is named with the fix
# instead of surfacing as a bare ModuleNotFoundError deep inside a submodule. Only looked
# up (find_spec), not imported: orbax, tqdm and matplotlib stay lazy until used.
_REQUIRED = {
    "optax": "optax",
    "orbax.checkpoint": "orbax-checkpoint",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
}


def _installed(module: str) -> bool:
    try:
        return _importlib_util.find_spec(module) is not None
    except (ImportError, ValueError):  # its parent package is missing, or blocked
        return False


def _check_requirements() -> None:
    """Raises ModuleNotFoundError naming every missing package of the toy extra."""
    missing = [module for module in _REQUIRED if not _installed(module)]
    if missing:
        packages = [_REQUIRED[module] for module in missing]
        raise ModuleNotFoundError(
            f"jattn.toy (the training demo) needs {', '.join(packages)}, not installed. "
            f"Install the toy extra: pip install 'jattn[toy]' (or: pip install "
            f"{' '.join(packages)}).",
            name=missing[0],
        )


_check_requirements()

from jattn.toy.data import CopyTask, TextTask  # noqa: E402
from jattn.toy.experiment import RUNS, evaluate, run_experiment  # noqa: E402
from jattn.toy.generate import generation_accuracy, greedy_generate  # noqa: E402
from jattn.toy.model import TinyGPT, TinyGPTConfig, init_variables  # noqa: E402
from jattn.toy.train import Checkpointer, TrainConfig, TrainState, init_state, make_train_step  # noqa: E402

__all__ = [
    "RUNS",
    "Checkpointer",
    "CopyTask",
    "TextTask",
    "TinyGPT",
    "TinyGPTConfig",
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
