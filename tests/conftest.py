"""Shared fixtures and settings for the jattn test suite."""

import os

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

# Deterministic property tests in CI (and by default); `HYPOTHESIS_PROFILE=dev` explores more.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=25, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
