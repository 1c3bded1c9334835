"""Timing and machine helpers the benchmark scripts share: the CPU a table is from and
its matrix-product rate in the same run, and a wait for this process to go idle."""

from __future__ import annotations

import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

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


def cpu_info() -> dict:
    """This machine's CPU (Linux ``/proc/cpuinfo``): ``model`` (name, with family and model
    numbers where given), ``avx512``, ``avx2``, ``kind`` ("AVX-512", "AVX2" or the
    architecture) and ``cores`` (logical cores this process may run on)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info and "model" in info:
        model += f" (family {info['cpu family']}, model {info['model']})"
    flags = set((info.get("flags") or info.get("Features") or "").split())
    avx512, avx2 = "avx512f" in flags, "avx2" in flags
    kind = "AVX-512" if avx512 else "AVX2" if avx2 else (platform.machine() or "other")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "avx512": avx512, "avx2": avx2, "kind": kind, "cores": cores}


def cpu_description() -> str:
    """One line for a results table: the CPU, AVX-512 or not, logical cores."""
    cpu = cpu_info()
    simd = "AVX-512" if cpu["avx512"] else "AVX2, no AVX-512" if cpu["avx2"] else "no AVX2"
    return f"{cpu['model']}, {simd}, {cpu['cores']} logical cores"


def sgemm_gflops(n: int = 1024, repeats: int = 10) -> float:
    """XLA's float32 ``[n, n] @ [n, n]`` rate on this machine now, GFLOP/s (the median of
    ``repeats`` calls after a warm-up): the yardstick a results table quotes beside its
    figures, measured in the same run."""
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.float32) for i in (0, 1))
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(dot(a, b))
        times.append(time.perf_counter() - start)
    return 2.0 * n**3 / statistics.median(times) / 1e9
