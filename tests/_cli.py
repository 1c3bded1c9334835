"""Command-line helpers of the tests: ``train_toy.py`` as a module, and ``--help`` parsing."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

TRAIN_TOY = Path(__file__).resolve().parents[1] / "train_toy.py"


@functools.cache
def load_train_toy():
    """The ``train_toy.py`` script as a module (loaded once per process)."""
    spec = importlib.util.spec_from_file_location("train_toy", TRAIN_TOY)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def help_entries(help_text: str) -> dict[str, str]:
    """``{'--flag': 'its help, on one line'}`` for every option of an argparse ``--help``.

    An entry starts on a line indented by two spaces and a dash (``  --steps N  optimizer
    ...``) and continues on the lines indented deeper; group titles, group descriptions
    (two spaces, no dash) and blank lines end it. ``-h, --help`` is keyed ``--help``.
    """
    entries: dict[str, list[str]] = {}
    current = None
    for line in help_text.splitlines():
        start = re.match(r"^  (-\S.*?)(?:  |$)", line)  # "-h, --help", "--steps N", ...
        if start:
            current = re.findall(r"--?[\w-]+", start.group(1))[-1]
            entries[current] = [line]
        elif current is not None and line.startswith("   "):
            entries[current].append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}
