"""Every ```python block of README.md and docs/**/*.md runs as written.

Each block is complete (its own imports and inputs) and runs in a fresh namespace, under
the suite's settings (rank promotion 'raise' from conftest.py, warnings as errors from
pyproject.toml), in a temporary working directory. An HTML comment on the line before a
block's fence (blank lines allowed between) says what it needs; it renders as nothing:

* ``<!-- docs-test: requires torch llms_from_scratch -->``: skipped unless the named modules
  import (and marked ``torch``, so the CI leg with the references runs it);
* ``<!-- docs-test: subprocess -->``: run in a new Python process (for a block that sets
  ``XLA_FLAGS`` or other process-wide state before importing jax), with the same settings.

The API pages must name every public name: each module's ``__all__`` appears in its page.
"""

from __future__ import annotations

import importlib
import linecache
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md"]
    files += sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    return files


def python_blocks(path: Path):
    """Yields ``(line_number, source, markers)`` for each ```python fence of ``path``."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, ticks, info = match["indent"], match["ticks"], match["info"].strip()
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        if info == "python":
            body = [line[len(indent) :] for line in lines[i + 1 : end]]
            yield i + 1, "\n".join(body) + "\n", _markers(lines, i)
        i = end + 1


def _markers(lines: list[str], fence: int) -> dict[str, list[str]]:
    """The docs-test comments directly above line ``fence`` (blank lines skipped)."""
    found: dict[str, list[str]] = {}
    j = fence - 1
    while j >= 0 and (not lines[j].strip() or MARKER.match(lines[j])):
        match = MARKER.match(lines[j])
        if match:
            word, *args = match["body"].split()
            if word not in ("requires", "subprocess"):
                raise ValueError(f"unknown docs-test marker {word!r} before line {fence + 1}")
            found[word] = args
        j -= 1
    return found


def _cases():
    cases = []
    for path in markdown_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, source, markers in python_blocks(path):
            marks = [pytest.mark.torch] if "torch" in markers.get("requires", ()) else []
            cases.append(pytest.param(rel, line, source, markers, id=f"{rel}:{line}", marks=marks))
    return cases


CASES = _cases()

# What a subprocess block runs under: the settings conftest.py and pyproject.toml give the
# suite (rank promotion 'raise'; jattn's warnings and every deprecation are errors).
_PROLOGUE = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("error", module="jattn")
    warnings.filterwarnings("error", category=DeprecationWarning)
    warnings.filterwarnings("error", category=FutureWarning)
    source, name = sys.argv[1], sys.argv[2]
    exec(compile(source, name, "exec"), {"__name__": "__main__"})
    """
)


@pytest.mark.parametrize(("path", "line", "source", "markers"), CASES)
def test_block_runs(path, line, source, markers, tmp_path, monkeypatch):
    for module in markers.get("requires", ()):
        pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)  # files a block writes land here
    name = f"{path}:{line}"
    if "subprocess" in markers:
        env = dict(os.environ, JAX_NUMPY_RANK_PROMOTION="raise", MPLBACKEND="Agg")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        result = subprocess.run(
            [sys.executable, "-c", _PROLOGUE, source, name],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
        return
    monkeypatch.setenv("MPLBACKEND", "Agg")
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # tracebacks
    try:
        exec(compile(source, name, "exec"), {"__name__": "__main__"})
    finally:
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")


def test_blocks_found():
    """The extraction sees the blocks (a broken fence pattern would pass vacuously)."""
    files = {case.values[0] for case in CASES}
    assert "README.md" in files
    assert "docs/chapter3.md" in files
    assert len(CASES) >= 30


OPTIONAL_IMPORT = re.compile(r"^\s*(?:import|from)\s+(torch|llms_from_scratch|tiktoken)\b", re.M)


def test_blocks_importing_references_declare_them():
    """A block importing an optional reference says so, or the plain CI leg fails on it."""
    for case in CASES:
        path, line, source, markers = case.values
        needed = set(OPTIONAL_IMPORT.findall(source))
        missing = needed - set(markers.get("requires", ()))
        assert not missing, (
            f"{path}:{line} imports {sorted(missing)}: add <!-- docs-test: requires ... -->"
        )


def test_fences_closed():
    """Every opened fence closes (an unclosed one would swallow the rest of a page)."""
    for path in markdown_files():
        opened = None
        for number, text in enumerate(path.read_text().splitlines(), 1):
            match = FENCE.match(text)
            if not match:
                continue
            if opened is None and match["info"].strip():
                opened = (number, match["ticks"])
            elif opened is not None and text.strip() == opened[1]:
                opened = None
        assert opened is None, f"{path.relative_to(ROOT)}:{opened[0]}: fence never closed"


API_PAGES = {
    "jattn": "jattn",
    "jattn.packing": "jattn",
    "jattn.masks": "masks",
    "jattn.mods": "mods",
    "jattn.block_masks": "block_masks",
    "jattn.linen": "linen",
    "jattn.nnx": "nnx",
    "jattn.convert": "convert",
    "jattn.kvcache": "kvcache",
    "jattn.paged": "paged",
    "jattn.generate": "generate",
    "jattn.ring": "ring",
    "jattn.causality": "causality",
    "jattn.viz": "viz",
    "jattn.rope": "rope",
    "jattn.models": "models",
    "jattn.blockwise": "blockwise",
    "jattn.kernels": "kernels",
    "jattn.toy": "toy",
}


@pytest.mark.parametrize("module", sorted(API_PAGES))
def test_api_page_names_every_public_name(module):
    page = (DOCS / "api" / f"{API_PAGES[module]}.md").read_text()
    names = importlib.import_module(module).__all__
    missing = [n for n in names if not re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", page)]
    assert not missing, f"docs/api/{API_PAGES[module]}.md does not document {missing}"
