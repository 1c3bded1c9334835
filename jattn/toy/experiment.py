"""One experiment: the same model, data and seed trained with and without the causal mask.

:func:`run_experiment` is what ``train_toy.py`` calls: it trains each run (resuming from
its checkpoints if asked), measures the four numbers of the demo, and writes
``config.json``, ``metrics.jsonl``, ``summary.json``, ``loss.png`` and ``attention.png``
under the output folder.

``summary.json``::

    {"task": "copy" | "text", "entropy_floor": float | null (nats per predicted token),
     "platform": "cpu" | "gpu" | "tpu" ..., "devices": int (in the mesh),
     "mesh": {"data": int, "model": int}, "processes": int,
     "runs": {"causal": RUN, "leaky": RUN},
     "task_config": {...}, "model": {...}, "train": {...},
     "sample": {"prompt", "reference", "causal", "leaky"}}   # one held-out generation

    RUN = {"train_loss": float,  # last 10% of steps (<= 50), dropout on, as in the curves
           "eval_loss": float,   # final model, dropout off, on held-out windows
           "future_leak": float, # max logit change at positions < j when token j changes
           "generation_accuracy": float,  # greedy continuation of held-out prompts,
                                          # fixed window (jattn.toy.generate)
           "cached_generation_accuracy": float,  # the same through the KV cache
           "steps": int,         # updates done
           "seconds": float,     # training wall time of every session: compiling and
                                 # held-out evaluation included, checkpoint writes not
           "tokens_per_second": float}    # predicted tokens/s, first step (compiling) excluded
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jattn import causality
from jattn.toy import parallel
from jattn.toy.data import stream_key
from jattn.toy.generate import generation_accuracy
from jattn.toy.model import GPTConfig, TinyGPT
from jattn.toy.plots import plot_attention, plot_losses
from jattn.toy.train import (
    Checkpointer,
    TrainConfig,
    TrainingDiverged,
    TrainingInterrupted,
    init_state,
    mean_loss,
    train,
)

__all__ = [
    "RUNS",
    "MetricsLog",
    "OutputFolderError",
    "attention_weights",
    "evaluate",
    "run_experiment",
]

RUNS = {"causal": True, "leaky": False}
"""Run name -> ``causal`` flag of the model; nothing else differs between runs."""


class OutputFolderError(ValueError):
    """The output folder does not fit the request: occupied, or no matching run to resume."""


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, tagged with its run.

    ``path=None`` writes and keeps nothing (processes other than the first of a multi-host
    run, which neither write files nor measure).
    """

    def __init__(self, path):
        self.path = None if path is None else Path(path)

    def read(self) -> list[dict]:
        if self.path is None or not self.path.exists():
            return []
        with self.path.open() as f:
            return [json.loads(line) for line in f if line.strip()]

    def truncate(self, run: str, step: int) -> None:
        """Drops ``run``'s records after ``step`` (a resumed run rewrites them)."""
        if self.path is None:
            return
        kept = [r for r in self.read() if r["run"] != run or r["step"] <= step]
        with self.path.open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def append(self, run: str, records: Sequence[dict]) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.writelines(json.dumps({"run": run, **r}) + "\n" for r in records)


def recent_train_loss(records: Sequence[dict], run: str, steps: int) -> float:
    """Mean training loss of ``run``'s last ``max(1, min(50, steps // 10))`` steps.

    Each step's loss is taken on a batch the model has not been updated on yet (the
    data stream never repeats), with dropout on, as the curves show it.
    """
    window = max(1, min(50, steps // 10))
    losses = [
        r["loss"] for r in records if r["run"] == run and "loss" in r and r["step"] > steps - window
    ]
    if not losses:
        raise ValueError(f"metrics.jsonl has no training losses of run {run!r}.")
    return float(np.mean(losses))


def future_leak(model: TinyGPT, variables, tokens_BxT, *, vocab_size: int, key) -> float:
    """Largest change of the logits at any position ``< j`` when token ``j`` changes, over ``j``.

    Runs :func:`jattn.causality.future_leak` (method ``'perturbation'``) on a pair
    ``[2, B, T]``: the original windows and a copy in which the probe replaces token ``j``
    by another token. The function measured returns ``logits(copy) - logits(original)``
    from *one* batched call, so both sides come from the same compiled program: comparing
    against a separately compiled call (which XLA may round differently, ~1e-6) would
    blur the exact zero of a causal model.

    Args:
      model: the model; ``variables`` its ``{'params': ...}``.
      tokens_BxT: int ``[B, T]`` held-out inputs.
      vocab_size: replacement tokens are drawn from ``[0, vocab_size)``, never equal to
        the token they replace.
      key: random key of the replacements.

    Returns:
      ``max_{i < j} |logits(x with token j changed)[i] - logits(x)[i]|``; exactly 0.0
      for a causal model.
    """
    batch, length = tokens_BxT.shape

    def logits_diff(pair_2xBxT):
        # [2B, T] -> [2, B, T, V]: both halves in one call
        logits = model.apply(variables, pair_2xBxT.reshape(2 * batch, length), deterministic=True)
        logits = logits.reshape(2, batch, length, -1)
        return logits[1] - logits[0]  # [B, T, V]

    def change_copy(pair_Tx2xB, j):
        # A shift in [1, vocab_size) guarantees a different token in every window.
        shift = jax.random.randint(jax.random.fold_in(key, j), (batch,), 1, vocab_size)
        changed = (pair_Tx2xB[j, 1] + shift.astype(pair_Tx2xB.dtype)) % vocab_size
        return pair_Tx2xB.at[j, 1].set(changed)

    pair = jnp.stack([tokens_BxT, tokens_BxT])  # [2, B, T]
    return causality.future_leak(
        jax.jit(logits_diff),
        pair,
        method="perturbation",
        in_axis=-1,
        out_axis=-2,
        perturb=change_copy,
    )


def evaluate(model: TinyGPT, variables, task, eval_windows, *, seed: int) -> dict:
    """The demo's measurements of a trained model (dropout off everywhere).

    Args:
      model: the trained model.
      variables: its ``{'params': ...}``.
      task: the data task.
      eval_windows: held-out windows ``[N, T+1]``.
      seed: the run's seed (for the perturbation probe's key).

    Returns:
      ``eval_loss`` (held-out),
      ``future_leak`` (largest change of the logits at positions ``< j`` when token ``j``
      of a held-out window changes; exactly 0 for a causal model) and
      ``generation_accuracy`` (greedy generation after the prompt, rerunning the fixed
      window), ``cached_generation_accuracy`` (the same through the KV cache; equal for a
      causal model), plus ``generated``: the fixed-window continuations ``[N, M]``.
    """
    eval_loss = mean_loss(model, variables, eval_windows)
    leak = future_leak(
        model,
        variables,
        eval_windows[:8, :-1],  # [8, T]: the probe changes one position at a time
        vocab_size=task.vocab_size,
        key=stream_key(seed, "probe"),
    )
    accuracy, generated = generation_accuracy(model, variables, eval_windows, task.prompt_len)
    cached, _ = generation_accuracy(model, variables, eval_windows, task.prompt_len, cached=True)
    return {
        "eval_loss": float(eval_loss),
        "future_leak": float(leak),
        "generation_accuracy": accuracy,
        "cached_generation_accuracy": cached,
        "generated": np.asarray(generated),
    }


def attention_weights(model: TinyGPT, variables, tokens_T) -> list[np.ndarray]:
    """Every block's attention weights ``[num_heads, T, T]`` for one sequence ``tokens [T]``."""
    sown = _sown_weights(model, variables, tokens_T)
    return [
        np.asarray(sown[f"blocks_{i}"]["attn"]["attention_weights"][0][0])
        for i in range(model.config.num_layers)
    ]


@partial(jax.jit, static_argnums=0)
def _sown_weights(model: TinyGPT, variables, tokens_T):
    _, state = model.apply(
        variables, tokens_T[None], deterministic=True, sow_attention=True, mutable=["intermediates"]
    )
    return state["intermediates"]


def _differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """``'key: old -> new'`` for every (nested) setting that differs."""
    out = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k), current.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def _check_config(out: Path, record: dict, resume: bool, *, write: bool = True) -> None:
    path = out / "config.json"
    if resume:
        if not path.exists():
            raise OutputFolderError(
                f"--resume: {out} holds no run (no config.json); drop --resume."
            )
        changed = _differences(json.loads(path.read_text()), record)
        if changed:
            raise OutputFolderError(
                f"--resume: the settings differ from the run in {out} ({'; '.join(changed)}); "
                "resume with the original flags."
            )
        return
    if path.exists() or (out / "checkpoints").exists():
        raise OutputFolderError(
            f"{out} already holds a run; pass --resume to continue it or choose another --out."
        )
    # Several processes: every one checks the folder before the first one writes to it.
    parallel.sync("jattn.toy: output folder checked")
    if write:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")


def _labels(task, tokens) -> list[str]:
    names = task.token_labels()
    return [names[int(t)] for t in np.asarray(tokens)]


def run_experiment(
    task,
    model_config: GPTConfig,
    train_config: TrainConfig,
    *,
    out_dir,
    runs: Sequence[str] = ("causal", "leaky"),
    resume: bool = False,
    progress: bool = True,
    until: int | None = None,
    num_eval: int = 256,
    echo: Callable[[str], None] = print,
    mesh=None,
) -> dict | None:
    """Trains and measures each run; writes the results under ``out_dir``.

    Args:
      task: a :mod:`jattn.toy.data` task.
      model_config: the model sizes (its ``causal`` flag is set per run).
      train_config: optimization settings (the same for every run).
      out_dir: output folder (created).
      runs: names from :data:`RUNS`, trained in this order.
      resume: continue from the checkpoints in ``out_dir`` (the settings must match).
      progress: show a tqdm progress bar per run.
      until: stop every run after this many updates (a later ``resume=True`` call
        finishes it, ending exactly where an uninterrupted run ends).
      num_eval: held-out windows for the measurements.
      echo: where one-line messages go.
      mesh: the ``('data', 'model')`` device mesh to train on
        (:func:`jattn.toy.parallel.make_mesh`; default: the 1x1 mesh of the default
        device). The results do not depend on it beyond float rounding. With several
        processes, each calls this function alike; only process 0 writes files (and
        gets the summary), and all take part in the checkpoints (a folder every host
        can reach).

    Returns:
      The summary written to ``summary.json``, or None when ``until`` stopped the runs
      before ``train_config.steps`` (then only checkpoints and metrics are written), and
      on processes other than process 0.

    Raises:
      jattn.toy.train.TrainingDiverged: a run's loss became NaN or Inf (its last good
        checkpoint is kept); the exception's ``run`` attribute names the run.
      jattn.toy.train.TrainingInterrupted: Ctrl-C; the run's state at the step it
        stopped after is checkpointed, and ``resume=True`` continues from it.
    """
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs or len(set(runs)) != len(runs):
        raise ValueError(f"runs must be distinct names from {sorted(RUNS)}, got {list(runs)}.")
    out = Path(out_dir)
    model_record = {k: v for k, v in dataclasses.asdict(model_config).items() if k != "causal"}
    record = {
        "task": task.describe(),
        "model": model_record,
        "train": dataclasses.asdict(train_config),
        "runs": list(runs),
    }
    mesh = parallel.default_mesh() if mesh is None else mesh
    primary = jax.process_index() == 0
    _check_config(out, record, resume, write=primary)
    log = MetricsLog(out / "metrics.jsonl" if primary else None)
    eval_windows = task.eval_set(num_eval)
    tokens_per_step = task.batch_size * (eval_windows.shape[1] - 1)
    results, attention, samples = {}, {}, {}
    for name in runs:
        model = TinyGPT(dataclasses.replace(model_config, causal=RUNS[name]))
        ckpt = Checkpointer(out / "checkpoints" / name)
        state = init_state(model.config, train_config, mesh)
        before = {"seconds": 0.0, "steady_seconds": 0.0, "steady_steps": 0}
        if resume and ckpt.latest_step() is not None:
            state, before = ckpt.restore(state)
            echo(f"{name}: resuming from the checkpoint at step {int(state.step)}")
        log.truncate(name, int(state.step))
        try:
            state, clock = _train_one(
                name, model, task, train_config, state, ckpt, log, eval_windows=eval_windows,
                before=before, tokens_per_step=tokens_per_step, until=until, progress=progress,
                mesh=mesh,
            )  # fmt: skip
        except (TrainingDiverged, TrainingInterrupted) as e:
            e.run = name  # for the command line's message
            raise
        finally:
            ckpt.close()
        steps = int(state.step)
        if steps < train_config.steps:  # stopped early by `until`: measure when finished
            echo(f"{name}: stopped at step {steps} of {train_config.steps}; resume to finish")
            continue
        # Measured on one device, from a whole copy of the parameters (gathering it is a
        # collective: every process takes part), by the process that writes the results.
        variables = {"params": parallel.to_host(state.params)}
        if not primary:
            continue
        measured = evaluate(model, variables, task, eval_windows, seed=train_config.seed)
        samples[name] = measured.pop("generated")[0]
        steady = clock["steady_steps"] > 0
        results[name] = {
            "train_loss": recent_train_loss(log.read(), name, steps),
            **measured,
            "steps": steps,
            "seconds": clock["seconds"],
            "tokens_per_second": tokens_per_step
            * (clock["steady_steps"] if steady else steps)
            / (clock["steady_seconds"] if steady else clock["seconds"]),
        }
        attention[name] = attention_weights(model, variables, eval_windows[0, :-1])
    if len(results) < len(runs) or not primary:
        return None

    summary = {
        "task": task.name,
        "entropy_floor": task.entropy_floor,
        "platform": jax.default_backend(),
        "devices": mesh.size,
        "mesh": parallel.mesh_shape(mesh),
        "processes": jax.process_count(),
        "task_config": record["task"],
        "model": model_record,
        "train": record["train"],
        "runs": results,
        "sample": {
            "prompt": " ".join(_labels(task, eval_windows[0, : task.prompt_len])),
            "reference": " ".join(_labels(task, eval_windows[0, task.prompt_len :])),
            **{name: " ".join(_labels(task, s)) for name, s in samples.items()},
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = f"{task.name} task: one model, data and seed; {' vs '.join(runs)} attention"
    plot_losses(log.read(), task.entropy_floor, out / "loss.png", title=title)
    plot_attention(attention, _labels(task, eval_windows[0, :-1]), out / "attention.png")
    return summary


def _train_one(
    name, model, task, cfg, state, ckpt, log, *, eval_windows, before, tokens_per_step, until,
    progress, mesh,
) -> tuple:  # fmt: skip
    """Trains one run from ``state`` with a progress bar, logging and checkpoints.

    Args:
      before: the clock of earlier sessions (from the checkpoint): ``seconds``, and
        ``steady_seconds`` / ``steady_steps`` without each session's first step.

    Returns:
      ``(state, clock)``: the final state and the clock of all sessions so far.
    """
    from tqdm.auto import tqdm

    start = int(state.step)
    bar = tqdm(total=cfg.steps, initial=start, desc=f"{name:>6}", disable=not progress, leave=True)
    last = [time.perf_counter(), start]

    def on_log(records):
        log.append(name, records)
        now, done = time.perf_counter(), records[-1]["step"]
        rate = (done - last[1]) * tokens_per_step / max(now - last[0], 1e-9)
        last[:] = [now, done]
        bar.update(len(records))
        bar.set_postfix(loss=f"{records[-1]['loss']:.4f}", tok_s=f"{rate:,.0f}", refresh=False)

    eval_on_mesh = parallel.replicate(eval_windows, mesh)  # next to the sharded params

    def on_eval(step, state):
        loss = mean_loss(model, {"params": state.params}, eval_on_mesh)
        log.append(name, [{"step": step, "eval_loss": float(loss)}])

    def clock(timing):
        # Tokens/s leave out each session's first step: it compiles the step function.
        steady = timing["steps"] > 1
        return {
            "seconds": before["seconds"] + timing["seconds"],
            "steady_seconds": before["steady_seconds"]
            + (timing["seconds"] - timing["first_step_seconds"] if steady else 0.0),
            "steady_steps": before["steady_steps"] + (timing["steps"] - 1 if steady else 0),
        }

    def on_checkpoint(state, timing):
        ckpt.save(state, clock(timing))

    try:
        state, timing = train(
            model, task, cfg, state, until=until, on_log=on_log, on_eval=on_eval,
            on_checkpoint=on_checkpoint, mesh=mesh,
        )  # fmt: skip
    finally:
        bar.close()
    return state, clock(timing)
