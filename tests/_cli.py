"""``train_toy.py`` loaded as a module, so tests call its ``main(argv)`` in-process."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

TRAIN_TOY = Path(__file__).resolve().parents[1] / "train_toy.py"


@functools.cache
def load_train_toy():
    """The ``train_toy.py`` script as a module (loaded once per process)."""
    spec = importlib.util.spec_from_file_location("train_toy", TRAIN_TOY)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli
