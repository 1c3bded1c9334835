"""Timing helpers the benchmark scripts share."""

from __future__ import annotations

import time

SETTLE_MAX_S = 0.5  # the longest settle() waits


def settle(max_wait_s: float = SETTLE_MAX_S, window_s: float = 0.01) -> None:
    """Waits until this process's threads are idle (under 10% of one core over ``window_s``).

    jax releases a program's buffers on a runtime thread after the call returns: after the
    dense attention paths' 0.5 GB at T=4096, about 80 ms of page unmapping on one of the
    two cores, which slowed whatever ran next (cpu_fused's forward from ~52 to ~72 ms on
    the AVX-512 EPYC). A benchmark that starts each timed run after this wait makes none
    pay for another.
    """
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        cpu = time.process_time()
        time.sleep(window_s)
        if time.process_time() - cpu < 0.1 * window_s:
            return
