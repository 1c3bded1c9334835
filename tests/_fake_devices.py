"""Multi-device checks on one CPU: XLA's fake host devices, in a process of their own.

``--xla_force_host_platform_device_count`` must be set before JAX starts, which pytest's
process has already done with one device. So each ``tests/_*_checks.py`` script calls
:func:`force_cpu_devices` before importing jax, computes its comparisons and prints one
JSON object; the test files run it with :func:`run_checks` and assert on the result.
This module imports no jax.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def force_cpu_devices(count: int) -> None:
    """Gives this process ``count`` fake CPU devices; call it before ``import jax``."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run_checks(script: Path, *args) -> dict:
    """Runs ``script`` (a clean XLA_FLAGS) and returns the JSON object it printed last."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
