"""Shared fixtures and settings for the jattn test suite."""

import os
import tempfile
from pathlib import Path

# XLA compiles the suite's programs at backend (LLVM) optimisation level 0 (issue 24): they
# are small and most run once, so compiling is most of the suite's time, and level 0
# compiles them in about 60% of the time; results differ from the default level only in the
# last bits (which multiply-adds fuse, how reductions vectorise). Set before jax starts its backend. JATTN_TEST_XLA_OPTIMIZE=1, or a level in
# XLA_FLAGS, keeps XLA's default; CI's slow leg runs that way (.ci/run).
if os.environ.get("JATTN_TEST_XLA_OPTIMIZE") != "1" and "backend_optimization_level" not in (
    os.environ.get("XLA_FLAGS", "")
):
    os.environ["XLA_FLAGS"] = " ".join(
        (os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0")
    ).strip()

import jax
import numpy as np
import pytest
from hypothesis import settings

from jattn import book

# The suite runs as strictly as jax's own test harness: implicit rank promotion is an error
# (every jattn code path must work for users who set it), and so are deprecations
# (pyproject.toml's filterwarnings).
jax.config.update("jax_numpy_rank_promotion", "raise")

# The CI leg with the optional references installed (.ci/run) must not skip their tests.
if os.environ.get("JATTN_REQUIRE_REFERENCES") == "1":
    import llms_from_scratch  # noqa: F401
    import torch  # noqa: F401


def pytest_configure(config):
    """pytest-xdist workers of one run share the multi-device checks' results
    (tests/_fake_devices.run_checks) through a directory named after the run."""
    run = getattr(config, "workerinput", {}).get("testrunuid")
    if run is not None:
        shared = Path(tempfile.gettempdir()) / f"jattn-checks-{run}"
        shared.mkdir(exist_ok=True)
        os.environ["JATTN_CHECKS_DIR"] = str(shared)


# Deterministic property tests: 10 examples in the default run, 25 in CI's thorough leg
# (`HYPOTHESIS_PROFILE=thorough pytest -m hypothesis`); `HYPOTHESIS_PROFILE=dev` explores more.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=10, print_blob=True)
settings.register_profile(
    "thorough", derandomize=True, deadline=None, max_examples=25, print_blob=True
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The cases marked slow from a measured list (tests/slow_cases.txt, see its header): the
# default run keeps at least one case of every test function but the few listed whole.
SLOW_CASES = Path(__file__).with_name("slow_cases.txt")


def _slow_entries() -> set[str]:
    lines = (line.strip() for line in SLOW_CASES.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marks
def pytest_collection_modifyitems(config, items):
    """Marks the listed cases slow; an entry naming a function its file lacks is an error,
    and so is one naming a case its function lacks when whole files were collected (a case
    renamed, or a docs block moved by an edit above it, silently put it back in the
    default run)."""
    entries = _slow_entries()
    modules = {}
    for item in items:
        path, _, name = item.nodeid.partition("::")
        modules.setdefault(path, item.module)
        if item.nodeid in entries or f"{path}::{name.split('[')[0]}" in entries:
            item.add_marker(pytest.mark.slow)
    whole_files = not any("::" in str(arg) for arg in config.args)
    collected = {item.nodeid for item in items}
    stale = []
    for entry in entries:
        path, _, name = entry.partition("::")
        if path not in modules:
            continue
        if not hasattr(modules[path], name.split("[")[0]) or (
            whole_files and "[" in name and entry not in collected
        ):
            stale.append(entry)
    if stale:
        raise pytest.UsageError(f"{SLOW_CASES.name} names tests that do not exist: {sorted(stale)}")


def pytest_itemcollected(item):
    """``@pytest.mark.top_left``: the test's CausalAlignmentWarning is expected, so ignored
    (any other test's still shows in the summary)."""
    if item.get_closest_marker("top_left"):
        item.add_marker(pytest.mark.filterwarnings("ignore::jattn.CausalAlignmentWarning"))


def pytest_report_header(config):
    """The versions this run tests (docs/versions.md, "Versions tested"), at the top of the log."""
    import sys
    from importlib import metadata

    def installed(name):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            return f"{name} not installed"

    names = ("jax", "jaxlib", "flax", "optax", "chex", "orbax-checkpoint", "numpy", "torch")
    found = ", ".join(installed(n) for n in names)
    return (
        f"jattn versions: Python {sys.version.split()[0]}, {found}; backend {jax.default_backend()}"
    )


# The book's running example: "Your journey starts with one step", 3-d embeddings.
BOOK_INPUTS = book.INPUTS
BOOK_TOKENS = list(book.TOKENS)


@pytest.fixture
def book_inputs():
    """The chapter's 6 x 3 input embeddings (numpy float32)."""
    return BOOK_INPUTS.copy()


@pytest.fixture
def rng():
    """A fresh numpy Generator with a fixed seed."""
    return np.random.default_rng(0)


@pytest.fixture
def key():
    """A fixed JAX key."""
    return jax.random.key(0)
