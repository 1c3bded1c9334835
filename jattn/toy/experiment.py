"""One experiment: the same model, data and seed trained with and without the causal mask.

:func:`run_experiment` is what ``train_toy.py`` calls: it trains each run (resuming from
its checkpoints if asked), measures the four numbers of the demo, and writes
``config.json``, ``metrics.jsonl``, ``summary.json``, ``loss.png``, ``attention.png`` and
``checkpoints/<run>/`` under the output folder. It says what it is doing as it goes: each
slow stage (compiling, measuring, plotting) is announced before it starts and timed after.

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
           "tokens_per_second": float}    # predicted tokens/s of the training steps: each
                                 # session's first step (compiling) and the held-out
                                 # evaluations left out
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import causality
from jattn.toy import parallel
from jattn.toy.data import stream_key
from jattn.toy.generate import generation_accuracy
from jattn.toy.model import TinyGPT, TinyGPTConfig
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
    "Stopwatch",
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
      causal model), plus ``generated``: the fixed-window continuations ``[N, M]``, and
      ``timings``: the seconds each measurement took (compiling included), by name.
    """
    watch = Stopwatch()
    with watch.lap("held-out loss"):
        eval_loss = float(mean_loss(model, variables, eval_windows))
    with watch.lap("future leak"):
        leak = future_leak(
            model,
            variables,
            eval_windows[:8, :-1],  # [8, T]: the probe changes one position at a time
            vocab_size=task.vocab_size,
            key=stream_key(seed, "probe"),
        )
    with watch.lap("generation"):
        accuracy, generated = generation_accuracy(model, variables, eval_windows, task.prompt_len)
    with watch.lap("KV-cache generation"):
        cached, _ = generation_accuracy(
            model, variables, eval_windows, task.prompt_len, cached=True
        )
    return {
        "eval_loss": eval_loss,
        "future_leak": float(leak),
        "generation_accuracy": accuracy,
        "cached_generation_accuracy": cached,
        "generated": np.asarray(generated),
        "timings": watch.laps,
    }


class Stopwatch:
    """Seconds of named phases: ``with watch.lap('name'): ...``; ``str(watch)`` lists them."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def lap(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.laps[name] = self.laps.get(name, 0.0) + time.perf_counter() - start

    def total(self) -> float:
        """Seconds since the stopwatch was made."""
        return time.perf_counter() - self._start

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.laps.items())


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
    model_config: TinyGPTConfig,
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
      echo: where one-line messages go: what each stage is doing before it starts
        (compiling, measuring, plotting), and its time after.
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
    record = {
        "task": task.describe(),
        "model": {k: v for k, v in dataclasses.asdict(model_config).items() if k != "causal"},
        "train": dataclasses.asdict(train_config),
        "runs": list(runs),
    }
    mesh = parallel.default_mesh() if mesh is None else mesh
    primary = jax.process_index() == 0
    _check_config(out, record, resume, write=primary)
    log = MetricsLog(out / "metrics.jsonl" if primary else None)
    echo(f"making {num_eval} held-out windows...")
    watch = Stopwatch()
    eval_windows = jax.block_until_ready(task.eval_set(num_eval))
    echo(f"made {num_eval} held-out windows in {watch.total():.1f} s")
    measured = {}
    for name in runs:
        model = TinyGPT(dataclasses.replace(model_config, causal=RUNS[name]))
        state, clock = _train_run(
            name, model, task, train_config, out, log, eval_windows=eval_windows, resume=resume,
            until=until, progress=progress, echo=echo, mesh=mesh,
        )  # fmt: skip
        steps = int(state.step)
        if steps < train_config.steps:  # stopped early by `until`: measure when finished
            echo(f"{name}: stopped at step {steps} of {train_config.steps}; resume to finish")
            continue
        # Measured on one device, from a whole copy of the parameters (gathering it is a
        # collective: every process takes part), by the process that writes the results.
        variables = {"params": parallel.to_host(state.params)}
        if primary:
            measured[name] = _measure_run(
                name, model, variables, task, eval_windows, log=log, clock=clock, steps=steps,
                seed=train_config.seed, echo=echo,
            )  # fmt: skip
    if len(measured) < len(runs) or not primary:
        return None
    return _write_results(out, task, record, mesh, measured, eval_windows, log, echo)


class _Measured(NamedTuple):
    """What :func:`run_experiment` keeps of a finished run."""

    result: dict  # the run's entry of summary.json
    sample: np.ndarray  # its fixed-window continuation of held-out window 0, [M]
    attention: list[np.ndarray]  # its attention weights on that window, per layer [H, T, T]


def _measure_run(
    name, model, variables, task, eval_windows, *, log, clock, steps, seed, echo
) -> _Measured:
    """Measures a trained run (:func:`evaluate`, attention weights), saying what and how long."""
    echo(
        f"{name}: measuring: held-out loss, future leak, generation (fixed window, KV cache), "
        "attention weights..."
    )
    watch = Stopwatch()
    measured = evaluate(model, variables, task, eval_windows, seed=seed)
    watch.laps.update(measured.pop("timings"))
    with watch.lap("attention weights"):
        attention = attention_weights(model, variables, eval_windows[0, :-1])
    echo(f"{name}: measured in {watch.total():.1f} s ({watch})")
    generated = measured.pop("generated")
    # Training throughput: each session's first step (it compiles) and the held-out
    # evaluations are left out, unless no other step was timed.
    steady = clock["steady_steps"] > 0
    result = {
        "train_loss": recent_train_loss(log.read(), name, steps),
        **measured,
        "steps": steps,
        "seconds": clock["seconds"],
        "tokens_per_second": _tokens_per_step(task)
        * (clock["steady_steps"] if steady else steps)
        / (clock["steady_seconds"] if steady else clock["seconds"]),
    }
    return _Measured(result, generated[0], attention)


def _write_results(out, task, record, mesh, measured, eval_windows, log, echo) -> dict:
    """Writes summary.json, loss.png and attention.png; returns the summary."""
    echo("writing summary.json, plotting loss.png and attention.png...")
    watch = Stopwatch()
    window = eval_windows[0]
    summary = {
        "task": task.name,
        "entropy_floor": task.entropy_floor,
        "platform": jax.default_backend(),
        "devices": mesh.size,
        "mesh": parallel.mesh_shape(mesh),
        "processes": jax.process_count(),
        "task_config": record["task"],
        "model": record["model"],
        "train": record["train"],
        "runs": {name: m.result for name, m in measured.items()},
        "sample": {
            "prompt": " ".join(_labels(task, window[: task.prompt_len])),
            "reference": " ".join(_labels(task, window[task.prompt_len :])),
            **{name: " ".join(_labels(task, m.sample)) for name, m in measured.items()},
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    runs = " vs ".join(measured)
    title = f"{task.name} task: one model, data and seed; {runs} attention"
    plot_losses(log.read(), task.entropy_floor, out / "loss.png", title=title)
    plot_attention(
        {name: m.attention for name, m in measured.items()},
        _labels(task, window[:-1]),
        out / "attention.png",
        title=f"{task.name} task: attention weights of the trained models ({runs}) "
        "on held-out window 0",
    )
    echo(f"written in {watch.total():.1f} s")
    return summary


def _tokens_per_step(task) -> int:
    """Predicted tokens per training step: every position of every window."""
    return task.batch_size * task.context_length


def _train_run(
    name, model, task, cfg, out, log, *, eval_windows, resume, until, progress, echo, mesh
) -> tuple:
    """One run: its state (fresh, or its latest checkpoint), compiled, then trained.

    Says before it starts compiling, and how long the compiling took once the first
    update is done (it includes compiling the step); training throughput leaves it out.

    Returns:
      ``(state, clock)``: as :func:`_train_one`.
    """
    echo(f"{name}: compiling: initial state, held-out loss, training step...")
    watch = Stopwatch()
    ckpt = Checkpointer(out / "checkpoints" / name)
    try:
        with watch.lap("initial state"):
            state = init_state(model.config, cfg, mesh)
            before = {"seconds": 0.0, "steady_seconds": 0.0, "steady_steps": 0}
            if resume and ckpt.latest_step() is not None:
                state, before = ckpt.restore(state)
                echo(f"{name}: resuming from the checkpoint at step {int(state.step)}")
        log.truncate(name, int(state.step))
        eval_on_mesh = parallel.replicate(eval_windows, mesh)  # next to the sharded params
        if int(state.step) < (cfg.steps if until is None else until):
            with watch.lap("held-out loss"):  # compiled now, not at the first evaluation
                mean_loss(model, {"params": state.params}, eval_on_mesh).block_until_ready()
        try:
            return _train_one(
                name, model, task, cfg, state, ckpt, log, eval_on_mesh=eval_on_mesh,
                before=before, until=until, progress=progress, mesh=mesh,
                on_compiled=lambda: echo(
                    f"{name}: compiled in {watch.total():.1f} s ({watch}); left out of tok/s"
                ),
                watch=watch,
            )  # fmt: skip
        except (TrainingDiverged, TrainingInterrupted) as e:
            e.run = name  # for the command line's message
            raise
    finally:
        ckpt.close()


class _Progress:
    """A run's tqdm bar, shown from the end of its first update (which compiles the step).

    Its ``tok_s`` is the training throughput since the previous refresh, leaving out the
    time spent in held-out evaluations and checkpoint writes (:meth:`pause`).
    """

    def __init__(self, name: str, total: int, tokens_per_step: int, enabled: bool):
        self.name, self.total, self.tokens_per_step = name, total, tokens_per_step
        self.enabled = enabled
        self.bar = None

    def start(self, done: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=self.total, initial=done, desc=f"{self.name:>6}", disable=not self.enabled,
            leave=True,
        )  # fmt: skip
        self.last_time, self.last_step, self.paused = time.perf_counter(), done, 0.0

    def pause(self, seconds: float) -> None:
        self.paused += seconds

    def update(self, records: Sequence[dict]) -> None:
        now, done = time.perf_counter(), records[-1]["step"]
        seconds = max(now - self.last_time - self.paused, 1e-9)
        rate = (done - self.last_step) * self.tokens_per_step / seconds
        self.last_time, self.last_step, self.paused = now, done, 0.0
        self.bar.update(done - self.bar.n)
        postfix = {"loss": f"{records[-1]['loss']:.4f}", "tok_s": f"{rate:,.0f}"}
        self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _train_one(
    name, model, task, cfg, state, ckpt, log, *, eval_on_mesh, before, until, progress, mesh,
    on_compiled, watch,
) -> tuple:  # fmt: skip
    """Trains one run from ``state`` with a progress bar, logging and checkpoints.

    Args:
      eval_on_mesh: the held-out windows, replicated on ``mesh``.
      before: the clock of earlier sessions (from the checkpoint): ``seconds``, and
        ``steady_seconds`` / ``steady_steps`` without each session's first step and
        held-out evaluations.
      on_compiled: called once the first update is done, after its time is added to
        ``watch`` (a :class:`Stopwatch`).

    Returns:
      ``(state, clock)``: the final state and the clock of all sessions so far.
    """
    start = int(state.step)
    bar = _Progress(name, cfg.steps, _tokens_per_step(task), progress)

    def on_first_step(seconds):
        watch.laps[f"training step with update {start + 1}"] = seconds
        on_compiled()
        bar.start(start + 1)

    def on_log(records):
        log.append(name, records)
        bar.update(records)

    def on_eval(step, state):
        t = time.perf_counter()
        loss = mean_loss(model, {"params": state.params}, eval_on_mesh)
        log.append(name, [{"step": step, "eval_loss": float(loss)}])
        bar.pause(time.perf_counter() - t)

    def clock(timing):
        # Tokens/s leave out each session's first step (it compiles the step function)
        # and the held-out evaluations.
        steady = timing["steps"] > 1
        steady_seconds = timing["seconds"] - timing["first_step_seconds"] - timing["eval_seconds"]
        return {
            "seconds": before["seconds"] + timing["seconds"],
            "steady_seconds": before["steady_seconds"] + (steady_seconds if steady else 0.0),
            "steady_steps": before["steady_steps"] + (timing["steps"] - 1 if steady else 0),
        }

    def on_checkpoint(state, timing):
        t = time.perf_counter()
        ckpt.save(state, clock(timing))
        bar.pause(time.perf_counter() - t)

    try:
        state, timing = train(
            model, task, cfg, state, until=until, on_log=on_log, on_eval=on_eval,
            on_checkpoint=on_checkpoint, on_first_step=on_first_step, mesh=mesh,
        )  # fmt: skip
    finally:
        bar.close()
    return state, clock(timing)
