"""train_toy.py under trouble: a diverging loss, Ctrl-C, and SIGKILL in the middle of a save.

Each trouble is real: the NaN comes from NaN parameters (``JATTN_TOY_DEBUG_NAN_STEP``),
the signals are sent to a ``train_toy.py`` subprocess (tests/_train_driver.py, which only
slows steps down or stalls orbax right before it renames a finished checkpoint folder).
After each, the run must end exactly where an uninterrupted run ends: the same final
checkpoint bit for bit, the same losses, the same summary numbers.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from _cli import load_train_toy

from jattn.toy import Checkpointer, CopyTask, TinyGPT, TinyGPTConfig, TrainConfig, init_state
from jattn.toy.train import TrainingDiverged, train

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).resolve().parent / "_train_driver.py"

STEPS = 30
FLAGS = [
    "--num-symbols", "4", "--prefix-len", "4", "--batch-size", "8", "--seed", "5",
    "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--dropout", "0.1",
    "--steps", str(STEPS), "--checkpoint-every", "10", "--eval-every", "10", "--no-progress",
    "--runs", "causal",
]  # fmt: skip
# The same run as configuration objects (what train_toy.py builds from FLAGS).
TASK = CopyTask(num_symbols=4, prefix_len=4, batch_size=8, seed=5)
MODEL = TinyGPTConfig(TASK.vocab_size, TASK.context_length, d_model=16, num_layers=1, num_heads=2)
TRAIN = TrainConfig(steps=STEPS, seed=5, checkpoint_every=10, eval_every=10)
COMPARED = (
    "train_loss",
    "eval_loss",
    "future_leak",
    "generation_accuracy",
    "cached_generation_accuracy",
    "steps",
)


def _main(*args) -> tuple[int, str, str]:
    """``train_toy.main`` in this process (compilations are shared): (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = load_train_toy().main([*FLAGS, *args])
    return status, out.getvalue(), err.getvalue()


def _driver(out: Path, **hooks) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "JATTN_TOY_DEBUG_NAN_STEP"} | hooks
    return subprocess.Popen(
        [sys.executable, str(DRIVER), *FLAGS, "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {path.name}: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path.name} did not appear within {timeout} s")
        time.sleep(0.02)


def _final_state(out: Path):
    ckpt = Checkpointer(out / "checkpoints" / "causal")
    try:
        return ckpt.restore(init_state(MODEL, TRAIN))[0]
    finally:
        ckpt.close()


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process."""
    out = tmp_path_factory.mktemp("robust") / "reference"
    status, _, err = _main("--out", str(out))
    assert status == 0, err
    return out, json.loads((out / "summary.json").read_text())["runs"]["causal"]


def _assert_ends_like(out: Path, reference) -> None:
    """The finished run in ``out`` equals the uninterrupted one."""
    ref_out, ref_summary = reference
    chex.assert_trees_all_equal(_final_state(out), _final_state(ref_out))
    assert _losses(out) == _losses(ref_out)
    summary = json.loads((out / "summary.json").read_text())["runs"]["causal"]
    assert {k: summary[k] for k in COMPARED} == {k: ref_summary[k] for k in COMPARED}


# ----------------------------------------------------------------------------------------
# A diverging loss
# ----------------------------------------------------------------------------------------


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
    reference, tmp_path, monkeypatch
):
    monkeypatch.setenv("JATTN_TOY_DEBUG_NAN_STEP", "14")
    status, _, err = _main("--out", str(tmp_path / "nan"))
    assert status == 3
    assert re.search(r"run causal: training diverged at step 14: loss nan", err), err
    assert "the last checkpoint (step 10) is kept" in err
    # The checkpoint of step 20 (due after the NaN) was never written; step 10 is finite.
    ckpt_dir = tmp_path / "nan" / "checkpoints" / "causal"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["10"]
    state = _final_state(tmp_path / "nan")
    assert int(state.step) == 10
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(state.params))
    # The log stops before the NaN, and what it holds is what the good run logged.
    losses = _losses(tmp_path / "nan")
    assert sorted(losses) == list(range(1, 14))
    assert losses == {s: v for s, v in _losses(reference[0]).items() if s < 14}
    assert not (tmp_path / "nan" / "summary.json").exists()


def test_train_never_checkpoints_a_state_after_a_nan(monkeypatch):
    """The library loop itself: callbacks see only finite steps, then TrainingDiverged."""
    monkeypatch.setenv("JATTN_TOY_DEBUG_NAN_STEP", "7")
    logged, saved = [], []
    with pytest.raises(TrainingDiverged, match="diverged at step 7") as info:
        train(
            TinyGPT(MODEL),
            TASK,
            TRAIN,
            init_state(MODEL, TRAIN),
            on_log=logged.extend,
            on_checkpoint=lambda state, timing: saved.append(int(state.step)),
        )
    assert info.value.step == 7 and info.value.last_checkpoint is None
    assert math.isnan(info.value.metrics["loss"])
    assert [r["step"] for r in logged] == list(range(1, 7))
    assert all(math.isfinite(v) for r in logged for v in r.values())
    assert saved == []  # the first checkpoint (step 10) would come after the NaN


# ----------------------------------------------------------------------------------------
# Ctrl-C and SIGKILL
# ----------------------------------------------------------------------------------------


def test_ctrl_c_saves_the_step_exits_130_and_resume_ends_like_the_uninterrupted_run(
    reference, tmp_path
):
    out, mark = tmp_path / "sigint", tmp_path / "training"
    proc = _driver(out, DRIVER_STEP_DELAY="0.1", DRIVER_MARK_AT=f"5:{mark}")
    _wait_for(mark, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err
    stopped = re.search(r"interrupted: run causal stopped after step (\d+), checkpoint saved", err)
    assert stopped, err
    step = int(stopped.group(1))
    assert 5 < step < STEPS
    ckpt = Checkpointer(out / "checkpoints" / "causal")
    assert ckpt.latest_step() == step
    ckpt.close()
    # Every step up to the interruption is logged, exactly as in the uninterrupted run.
    ref_losses = _losses(reference[0])
    assert _losses(out) == {s: v for s, v in ref_losses.items() if s <= step}

    status, stdout, err = _main("--out", str(out), "--resume")
    assert status == 0, err
    assert f"causal: resuming from the checkpoint at step {step}" in stdout
    _assert_ends_like(out, reference)


def test_sigkill_while_saving_resumes_from_the_last_complete_checkpoint(reference, tmp_path):
    out, mark = tmp_path / "sigkill", tmp_path / "finalizing"
    proc = _driver(out, DRIVER_STALL_FINALIZE=f"20:{mark}")
    _wait_for(mark, proc)
    proc.kill()  # SIGKILL: no handler runs, nothing is cleaned up
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    ckpt_dir = out / "checkpoints" / "causal"
    # Step 20's files were written to orbax's temporary folder, never renamed into place.
    assert Path(mark.read_text()).parent == ckpt_dir
    assert Path(mark.read_text()).exists()
    ckpt = Checkpointer(ckpt_dir)
    assert ckpt.latest_step() == 10
    ckpt.close()

    status, stdout, err = _main("--out", str(out), "--resume")
    assert status == 0, err
    assert "causal: resuming from the checkpoint at step 10" in stdout
    _assert_ends_like(out, reference)
