"""train_toy.py across two processes (two "hosts" of 2 CPU devices each, on this machine).

Both processes run the same command with ``--coordinator``, ``--num-processes 2`` and
their ``--process-id``, as a user runs it on each host; JAX connects them through
``jax.distributed.initialize`` and the 2x2 mesh spans both. The losses must be those of
a one-device run, and only process 0 writes the output files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jattn.toy import CopyTask, TinyGPT, TinyGPTConfig, TrainConfig
from jattn.toy.train import init_state, train

pytestmark = pytest.mark.slow  # two training processes and a reference run: about a minute

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
FLAGS = [
    "--num-symbols", "4", "--prefix-len", "4", "--batch-size", "16", "--seed", "3",
    "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--dropout", "0.1",
    "--steps", str(STEPS), "--checkpoint-every", str(STEPS), "--eval-every", str(STEPS),
    "--runs", "causal", "--no-progress", "--model-parallel", "2",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost") / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    address = f"localhost:{_free_port()}"
    multihost = ["--out", str(out), "--coordinator", address, "--num-processes", "2"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "train_toy.py"),
                *FLAGS,
                *multihost,
                "--process-id",
                str(i),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=600)
            outputs.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out, outputs


def test_both_processes_finish(two_hosts):
    _, outputs = two_hosts
    for i, (code, stdout, stderr) in enumerate(outputs):
        assert code == 0, f"process {i}:\n{stderr[-3000:]}"
        assert f"process {i} of 2" in stdout
    # Process 0 prints the results; process 1 only its setup lines.
    assert "train_loss" in outputs[0][1] and "train_loss" not in outputs[1][1]


def test_summary_reports_the_mesh(two_hosts):
    out, _ = two_hosts
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == 4 and summary["processes"] == 2
    assert summary["mesh"] == {"data": 2, "model": 2}


def test_losses_match_one_device(two_hosts):
    out, _ = two_hosts
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]  # written once, by process 0
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    # The same run on this process's one device (a 1x1 mesh).
    task = CopyTask(num_symbols=4, prefix_len=4, batch_size=16, seed=3)
    model_cfg = TinyGPTConfig(
        task.vocab_size, task.context_length, d_model=16, num_layers=1, num_heads=2, dropout=0.1
    )
    cfg = TrainConfig(steps=STEPS, seed=3, checkpoint_every=STEPS, eval_every=STEPS)
    reference = []
    train(
        TinyGPT(model_cfg),
        task,
        cfg,
        init_state(model_cfg, cfg),
        on_log=lambda rs: reference.extend(r["loss"] for r in rs),
    )
    np.testing.assert_allclose(losses, reference, rtol=1e-3, atol=0)
