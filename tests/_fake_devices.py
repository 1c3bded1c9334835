"""Multi-device checks on one CPU: XLA's fake host devices, in a process of their own.

``--xla_force_host_platform_device_count`` must be set before JAX starts, which pytest's
process has already done with one device. So each ``tests/_*_checks.py`` script calls
:func:`force_cpu_devices` before importing jax, computes its comparisons and prints one
JSON object; the test files run it with :func:`run_checks` and assert on the result.
This module imports no jax.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: each worker runs its own checks
    fcntl = None


def force_cpu_devices(count: int) -> None:
    """Gives this process ``count`` fake CPU devices; call it before ``import jax``."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run_checks(script: Path, *args) -> dict:
    """Runs ``script`` (a clean XLA_FLAGS) and returns the JSON object it printed last.

    Under pytest-xdist the workers of one run share the result (``JATTN_CHECKS_DIR``, set
    by tests/conftest.py): the first to ask runs the script, the others wait for its file
    instead of running it again on the same cores."""
    shared = os.environ.get("JATTN_CHECKS_DIR")
    if shared is None or fcntl is None:
        return _run_checks(script, *args)
    name = hashlib.sha256(repr((str(script), *map(str, args))).encode()).hexdigest()[:16]
    result = Path(shared) / f"{script.stem}-{name}.json"
    with open(result.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result.exists():
            result.write_text(json.dumps(_run_checks(script, *args)))
        return json.loads(result.read_text())


def _run_checks(script: Path, *args) -> dict:
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
