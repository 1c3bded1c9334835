"""The training demo on 1x1, 4x1 and 2x2 meshes, run by tests/test_scale.py in a subprocess.

Needs 4 fake CPU devices (the flag must be set before JAX starts), so it runs alone and
prints one JSON object of measurements: per-step losses of each mesh, how the 2x2
state is sharded, how often the train step compiled, a split (checkpoint, resume) run
against an uninterrupted one, and ``train_toy.py --model-parallel 2`` itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
from pathlib import Path

from _fake_devices import force_cpu_devices

force_cpu_devices(4)

import jax
import numpy as np
from _cli import load_train_toy

from jattn.toy import CopyTask, TinyGPT, TinyGPTConfig, TrainConfig, parallel
from jattn.toy.train import Checkpointer, init_state, state_shardings, train

STEPS, STOP_AT = 16, 10
TASK = dict(num_symbols=4, prefix_len=4, batch_size=16, seed=3)
MODEL = dict(d_model=16, num_layers=1, num_heads=2, dropout=0.1)
# The same run through the command line (its TrainConfig equals _configs()'s).
FLAGS = [
    "--num-symbols", "4", "--prefix-len", "4", "--batch-size", "16", "--seed", "3",
    "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--dropout", "0.1",
    "--steps", str(STEPS), "--checkpoint-every", str(STOP_AT), "--eval-every", "8",
    "--runs", "causal", "--no-progress",
]  # fmt: skip


def _configs():
    task = CopyTask(**TASK)
    model = TinyGPTConfig(task.vocab_size, task.context_length, **MODEL)
    cfg = TrainConfig(steps=STEPS, seed=TASK["seed"], checkpoint_every=STOP_AT, eval_every=8)
    return task, model, cfg


class _CompileCounter(logging.Handler):
    """Counts XLA compilations of the train step (``jax.log_compiles`` messages)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Finished XLA compilation of jit(step_fn)"):
            self.count += 1


@contextlib.contextmanager
def _counting_compiles():
    counter = _CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    try:
        with jax.log_compiles():
            yield counter
    finally:
        logger.removeHandler(counter)


def _layout(tree) -> dict:
    """``{path: [shape, shard_shape]}`` of the array leaves of ``tree``."""
    return {
        jax.tree_util.keystr(path): [leaf.shape, leaf.sharding.shard_shape(leaf.shape)]
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def _run(mesh, *, until=None, state=None, ckpt=None):
    task, model_cfg, cfg = _configs()
    losses = []
    state = init_state(model_cfg, cfg, mesh) if state is None else state
    state, _ = train(
        TinyGPT(model_cfg),
        task,
        cfg,
        state,
        until=until,
        mesh=mesh,
        on_log=lambda records: losses.extend((r["step"], r["loss"]) for r in records),
        on_checkpoint=None if ckpt is None else lambda s, timing: ckpt.save(s, timing),
    )
    return state, losses


def check_meshes() -> tuple[dict, object]:
    """Per-step losses and step compilations on each mesh; the 2x2 state's layout.

    Also returns the final 2x2 state (on the host), the uninterrupted run for check_resume.
    """
    results = {"losses": {}, "compiles": {}}
    for data, model in ((1, 1), (4, 1), (2, 2)):
        mesh = parallel.make_mesh(model, jax.devices()[: data * model])
        with _counting_compiles() as compiles:
            state, losses = _run(mesh)
        name = f"{data}x{model}"
        results["losses"][name] = losses
        results["compiles"][name] = compiles.count
        if name == "2x2":
            results["layout_2x2"] = {
                "params": _layout(state.params),
                "adam_mu": _layout(state.opt_state[1][0].mu),
            }
            full_2x2 = parallel.to_host(state)
    return results, full_2x2


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _sharded_as(tree, shardings) -> bool:
    return all(
        a.sharding == s
        for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    )


def check_resume(tmp: Path, full) -> dict:
    """A 2x2 run checkpointed at STOP_AT and resumed == the uninterrupted run ``full``.

    Also restores the same checkpoint onto a 4x1 mesh: orbax reshards it.
    """
    _, model_cfg, cfg = _configs()
    mesh = parallel.make_mesh(2, jax.devices())
    mesh_41 = parallel.make_mesh(1, jax.devices())
    ckpt = Checkpointer(tmp / "ckpt")
    _run(mesh, until=STOP_AT, ckpt=ckpt)
    with _counting_compiles() as compiles:
        restored, _ = ckpt.restore(init_state(model_cfg, cfg, mesh))
        restored_sharded = _sharded_as(restored, state_shardings(model_cfg, cfg, mesh))
        restored_host = parallel.to_host(restored)  # (the resumed run donates `restored`)
        resumed, _ = _run(mesh, state=restored)
    elsewhere, _ = ckpt.restore(init_state(model_cfg, cfg, mesh_41))
    ckpt.close()
    return {
        "resume_diff": _max_diff(full, parallel.to_host(resumed)),
        "resume_restored_sharded": restored_sharded,
        "resume_compiles": compiles.count,
        "reshard_diff": _max_diff(restored_host, parallel.to_host(elsewhere)),
        "reshard_sharded": _sharded_as(elsewhere, state_shardings(model_cfg, cfg, mesh_41)),
        "reshard_step": int(elsewhere.step),
    }


def check_cli(tmp: Path) -> dict:
    """``train_toy.py --model-parallel 2`` on the 4 devices, and its errors."""
    cli = load_train_toy()
    out = tmp / "cli"
    with contextlib.redirect_stdout(io.StringIO()):
        status = cli.main([*FLAGS, "--model-parallel", "2", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    errors = {}
    for name, extra in (
        ("model_parallel_3", ["--model-parallel", "3", "--num-heads", "3", "--d-model", "15"]),
        ("batch_indivisible", ["--batch-size", "6"]),
    ):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                cli.main([*FLAGS, *extra, "--out", str(tmp / name)])
                code = 0
            except SystemExit as e:
                code = e.code
        errors[name] = [code, stderr.getvalue().strip()]
    return {
        "cli_status": status,
        "cli_summary": {k: summary[k] for k in ("devices", "mesh", "processes")},
        "cli_train_loss": summary["runs"]["causal"]["train_loss"],
        "cli_errors": errors,
    }


def main() -> None:
    if len(jax.devices()) != 4:
        sys.exit(f"expected 4 fake CPU devices, got {jax.devices()}")
    tmp = Path(sys.argv[1])
    results, full_2x2 = check_meshes()
    results.update(check_resume(tmp, full_2x2))
    results.update(check_cli(tmp))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
