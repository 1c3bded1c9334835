"""Training pieces of the toy demo: optimizer, state, the jitted step, losses, checkpoints.

Kept apart from the model (:mod:`jattn.toy.model`) and the data (:mod:`jattn.toy.data`)
so each can change alone: :func:`train` feeds the step whatever batches the task makes.

Every state lives on a ``('data', 'model')`` device mesh (:mod:`jattn.toy.parallel`;
default: the 1x1 mesh of the default device): :func:`state_shardings` says how each
array is split, :func:`init_state` creates it so and :func:`make_train_step` compiles one
SPMD step for it.

Reproducibility: everything random comes from the run's seed (see
:data:`jattn.toy.data.STREAMS`). The batch of step ``s`` is ``task.train_batch(s)`` and
its dropout key is ``fold_in(dropout_key, s)``, so a run resumed from a checkpoint at
step ``k`` computes exactly the steps ``k, k+1, ...`` an uninterrupted run would.

Robustness (:func:`train`): a NaN or Inf training loss or gradient norm stops the run with
:class:`TrainingDiverged` before anything non-finite is checkpointed, so the last
checkpoint stays good; the first Ctrl-C (SIGINT) finishes the current step, checkpoints it
and raises :class:`TrainingInterrupted` (a second Ctrl-C interrupts at once). Checkpoints
are written by orbax into a temporary folder that is renamed when complete, so a process
killed while saving leaves the previous checkpoint as the latest. For tests, the
environment variable ``JATTN_TOY_DEBUG_NAN_STEP=n`` makes the parameters NaN just before
step ``n`` (numbered from 1, as in ``metrics.jsonl``), so that step's loss is NaN.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.toy import parallel
from jattn.toy.data import stream_key
from jattn.toy.model import TinyGPT, TinyGPTConfig, init_variables

__all__ = [
    "Checkpointer",
    "TrainConfig",
    "TrainState",
    "TrainingDiverged",
    "TrainingInterrupted",
    "init_state",
    "lr_schedule",
    "make_optimizer",
    "make_train_step",
    "mean_loss",
    "next_token_loss",
    "state_shardings",
    "train",
]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimization settings.

    Attributes:
      steps: number of optimizer updates.
      learning_rate: peak learning rate of AdamW.
      warmup_steps: linear warmup from 0 to the peak (default: 5% of ``steps``); then
        cosine decay to ``end_lr_fraction * learning_rate`` at ``steps``.
      end_lr_fraction: final learning rate as a share of the peak.
      weight_decay: AdamW decoupled weight decay, on matrices only (not on biases and
        LayerNorm scales).
      clip_norm: gradients are clipped to this global norm.
      seed: seeds the initial weights and dropout (the data has its own seed in the task).
      checkpoint_every: save a checkpoint every this many steps (and at the end).
      eval_every: held-out loss every this many steps (and at the end), for the curves.
      log_every: fetch losses to the host every this many steps (progress bar, metrics.jsonl).
    """

    steps: int = 400
    learning_rate: float = 3e-3
    warmup_steps: int | None = None
    end_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    checkpoint_every: int = 200
    eval_every: int = 25
    log_every: int = 10

    def __post_init__(self):
        for name in ("steps", "checkpoint_every", "eval_every", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", self.steps // 20)
        for name in ("warmup_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}.")
        for name in ("learning_rate", "end_lr_fraction", "weight_decay", "clip_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r}.")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(
                f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}."
            )
        if not 0 < self.learning_rate < math.inf:
            raise ValueError(f"learning_rate must be > 0 and finite, got {self.learning_rate}.")
        if not 0 <= self.end_lr_fraction <= 1:
            raise ValueError(f"end_lr_fraction must be in [0, 1], got {self.end_lr_fraction}.")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}.")
        if not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {self.clip_norm}.")


class TrainingDiverged(FloatingPointError):
    """The training loss or gradient norm became NaN or Inf; the run stopped there.

    Nothing after the last finite step was checkpointed. Attributes: ``step`` (the first
    update with a non-finite metric), ``metrics`` (its record) and ``last_checkpoint``
    (the step of the last checkpoint written or resumed from, or None).
    """

    def __init__(self, step: int, metrics: dict, last_checkpoint: int | None):
        self.step, self.metrics, self.last_checkpoint = step, metrics, last_checkpoint
        kept = (
            "no checkpoint was written"
            if last_checkpoint is None
            else f"the last checkpoint (step {last_checkpoint}) is kept"
        )
        super().__init__(
            f"training diverged at step {step}: loss {metrics.get('loss')}, gradient norm "
            f"{metrics.get('grad_norm')}. Stopped; {kept}. Resuming would repeat the same "
            "steps: start a new run with a lower --lr, more --warmup-steps or a smaller "
            "--clip-norm."
        )


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training after update ``step``, whose state was checkpointed."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"training interrupted after step {step}; checkpoint saved there")


# Test hook: the parameters become NaN just before this step (numbered from 1, as logged).
_DEBUG_NAN_STEP = "JATTN_TOY_DEBUG_NAN_STEP"


def _debug_nan_step() -> int | None:
    value = os.environ.get(_DEBUG_NAN_STEP, "")
    return int(value) if value.strip() else None


@contextlib.contextmanager
def _stop_on_sigint():
    """Turns the first Ctrl-C into a request (``bool(requested)``) to stop after the step.

    A second Ctrl-C raises KeyboardInterrupt at once. Signal handlers can only be set in
    the main thread; elsewhere Ctrl-C keeps its usual behaviour.
    """
    requested: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def handler(signum, frame):
        if requested:
            raise KeyboardInterrupt
        requested.append(True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes; a pytree, so it is jitted, donated and saved whole.

    Attributes:
      step: int32 ``[]``, updates done so far (also the data position).
      params: the model parameters.
      opt_state: the optimizer state.
      dropout_key: uint32 key data of the run's dropout stream (raw, so any checkpoint
        format can store it); step ``s`` uses ``fold_in(dropout_key, s)``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    dropout_key: jax.Array


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``cfg.learning_rate``, then cosine decay to the end fraction."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps,
        end_value=cfg.learning_rate * cfg.end_lr_fraction,
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Gradient clipping, then AdamW on :func:`lr_schedule`."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            lr_schedule(cfg),
            b1=0.9,
            b2=0.95,  # GPT-style: adapts faster to the loss drops of small models
            weight_decay=cfg.weight_decay,
            # Decay matrices (kernels, embeddings); leave biases and LayerNorm scales alone.
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )


def _shared(model_cfg: TinyGPTConfig) -> TinyGPTConfig:
    # Neither the mask nor the dropout rate has parameters: runs that differ only in
    # those share one initializer and one set of shardings.
    return dataclasses.replace(model_cfg, causal=True, dropout=0.0)


def _fresh_state(model_cfg: TinyGPTConfig, cfg: TrainConfig) -> TrainState:
    params = init_variables(model_cfg, stream_key(cfg.seed, "init"))["params"]
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=make_optimizer(cfg).init(params),
        dropout_key=jax.random.key_data(stream_key(cfg.seed, "dropout")),
    )


@functools.cache
def state_shardings(model_cfg: TinyGPTConfig, cfg: TrainConfig, mesh: Mesh) -> TrainState:
    """How each array of the :class:`TrainState` is split over ``mesh``.

    Parameters as :class:`jattn.toy.model.TinyGPT` annotates them (the ``model`` axis
    splits attention heads and MLP hidden units), the optimizer's moments like their
    parameters, everything else (step, key, counters) replicated. The ``data`` axis
    splits no state: each data-parallel replica holds all of it.
    """
    model_cfg = _shared(model_cfg)
    tokens = jax.ShapeDtypeStruct((1, model_cfg.context_length), jnp.int32)
    # [the boxed (annotated) parameter tree, shapes only]
    boxed = jax.eval_shape(
        functools.partial(TinyGPT(model_cfg).init, deterministic=True), jax.random.key(0), tokens
    )
    param_specs = nn.get_partition_spec(boxed)["params"]
    abstract = jax.eval_shape(functools.partial(_fresh_state, model_cfg, cfg))
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    opt_specs = optax.tree_map_params(
        make_optimizer(cfg),
        lambda _, spec: spec,
        abstract.opt_state,
        param_specs,
        transform_non_params=lambda _: P(),
        is_leaf=is_spec,
    )
    specs = TrainState(step=P(), params=param_specs, opt_state=opt_specs, dropout_key=P())
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=is_spec)


def init_state(model_cfg: TinyGPTConfig, cfg: TrainConfig, mesh: Mesh | None = None) -> TrainState:
    """Step 0: initial parameters from the seed's ``init`` stream and a fresh optimizer.

    Created directly in its shardings on ``mesh`` (default: the 1x1 mesh of the default
    device), as restored checkpoints are, so a fresh and a resumed state hit the same
    compiled train step. The values do not depend on the mesh.
    """
    mesh = parallel.default_mesh() if mesh is None else mesh
    return _initializer(_shared(model_cfg), cfg, mesh)()


@functools.cache
def _initializer(
    model_cfg: TinyGPTConfig, cfg: TrainConfig, mesh: Mesh
) -> Callable[[], TrainState]:
    # Jitted: one compilation instead of one per initializer op; every process computes
    # the same values and keeps the shards of its own devices.
    return jax.jit(
        functools.partial(_fresh_state, model_cfg, cfg),
        out_shardings=state_shardings(model_cfg, cfg, mesh),
    )


def next_token_loss(logits_BxTxV, targets_BxT) -> jax.Array:
    """Mean cross-entropy (nats) of ``logits [B, T, V]`` against int ``targets [B, T]``."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BxTxV.astype(jnp.float32), targets_BxT
    ).mean()


def make_train_step(model: nn.Module, cfg: TrainConfig, mesh: Mesh | None = None) -> Callable:
    """The jitted update ``(state, windows [B, T+1]) -> (state, metrics)`` on ``mesh``.

    The state is donated (its buffers are reused for the new state), so the caller must
    not touch the old state after the call. Cached per ``(model, cfg, mesh)``, so a resumed
    session in the same process reuses the compiled step. ``metrics`` holds the step's
    training loss (dropout on), the gradient norm before clipping and the learning rate.

    One SPMD program: the state in and out in :func:`state_shardings` (so every step
    reuses the compilation), the windows split by rows over ``data``, the metrics
    replicated. ``mesh`` defaults to the 1x1 mesh of the default device.
    """
    return _train_step(model, cfg, parallel.default_mesh() if mesh is None else mesh)


@functools.cache
def _train_step(model: nn.Module, cfg: TrainConfig, mesh: Mesh) -> Callable:
    tx, schedule = make_optimizer(cfg), lr_schedule(cfg)

    def step_fn(state: TrainState, windows_BxT1):
        inputs_BxT, targets_BxT = windows_BxT1[:, :-1], windows_BxT1[:, 1:]
        key = jax.random.fold_in(jax.random.wrap_key_data(state.dropout_key), state.step)

        def loss_of(params):
            logits = model.apply(
                {"params": params}, inputs_BxT, deterministic=False, rngs={"dropout": key}
            )
            return next_token_loss(logits, targets_BxT)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
        )
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "lr": schedule(state.step),
        }
        return new_state, metrics

    state_sharding = state_shardings(model.config, cfg, mesh)
    return jax.jit(
        step_fn,
        donate_argnums=0,
        in_shardings=(state_sharding, NamedSharding(mesh, P(parallel.DATA_AXIS))),
        out_shardings=(state_sharding, NamedSharding(mesh, P())),
    )


@functools.partial(jax.jit, static_argnames="model")
def mean_loss(model: nn.Module, variables, windows_BxT1) -> jax.Array:
    """Mean next-token loss of ``windows [B, T+1]`` with dropout off."""
    logits = model.apply(variables, windows_BxT1[:, :-1], deterministic=True)
    return next_token_loss(logits, windows_BxT1[:, 1:])


class Checkpointer:
    """Orbax checkpoints of a :class:`TrainState` (plus a small JSON record) in one folder.

    Writes are synchronous: the next train step donates the state's buffers, so a save
    must be finished with them before it returns.
    """

    def __init__(self, directory, *, keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
            item_names=("state", "record"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state: TrainState, record: dict) -> None:
        ocp = self._ocp
        self._manager.save(
            int(state.step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, like: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """The checkpoint at ``step`` (default: the latest), shaped like ``like``."""
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["record"])

    def close(self) -> None:
        self._manager.close()


def train(
    model: nn.Module,
    task,
    cfg: TrainConfig,
    state: TrainState,
    *,
    until: int | None = None,
    on_log: Callable[[list[dict]], None] | None = None,
    on_eval: Callable[[int, TrainState], None] | None = None,
    on_checkpoint: Callable[[TrainState, dict], None] | None = None,
    on_first_step: Callable[[float], None] | None = None,
    mesh: Mesh | None = None,
) -> tuple[TrainState, dict]:
    """Runs the updates ``state.step .. until - 1`` (default: to ``cfg.steps``).

    Args:
      model: the :class:`TinyGPT` to train.
      task: a data task (``train_batch(step)``).
      cfg: the training settings.
      state: the state to start from (consumed: its buffers are donated).
      until: stop after this many updates in total (``<= cfg.steps``); a later call
        with the returned state continues exactly where this one stopped.
      on_log: gets the per-step records ``{'step', 'loss', 'grad_norm', 'lr'}`` every
        ``cfg.log_every`` steps (and at the end).
      on_eval: called as ``on_eval(step, state)`` every ``cfg.eval_every`` steps and at
        ``cfg.steps``.
      on_checkpoint: called as ``on_checkpoint(state, timing)`` every
        ``cfg.checkpoint_every`` steps, at ``until`` and when Ctrl-C stops the run, with
        the timing so far. Never called with a state whose step had a non-finite metric.
      on_first_step: called with the seconds of this call's first update, once it is
        done (it includes compiling the step, unless this process compiled it before).
      mesh: the device mesh of ``state`` (default: the 1x1 mesh of the default device);
        each batch is split over its ``data`` axis (:func:`jattn.toy.parallel.shard_batch`).

    Raises:
      TrainingDiverged: a step's loss or gradient norm is NaN or Inf (found when the
        metrics are fetched: every ``log_every`` steps and before each evaluation and
        checkpoint). The records before it are logged; no later checkpoint is written.
      TrainingInterrupted: Ctrl-C (SIGINT); raised after the current step was logged and
        checkpointed (a subclass of KeyboardInterrupt).

    Returns:
      ``(state, timing)``: the final state, and ``timing`` with ``seconds`` (wall time of
      the loop, evaluations included, checkpoint writes not), ``first_step_seconds`` (the
      first update, which includes compiling the step), ``eval_seconds`` (spent in
      ``on_eval``) and ``steps`` (updates done by this call).
    """
    until = cfg.steps if until is None else until
    mesh = parallel.default_mesh() if mesh is None else mesh
    train_step = make_train_step(model, cfg, mesh)
    start = int(state.step)
    last_checkpoint = start if start > 0 else None  # a resumed state came from a checkpoint
    pending: list[tuple[int, dict]] = []
    t0 = time.perf_counter()
    first_step_seconds = 0.0
    saving = 0.0  # seconds spent writing checkpoints: not training time
    evaluating = 0.0  # seconds spent in on_eval
    nan_step = _debug_nan_step()

    def timing(done: int) -> dict:
        return {
            "seconds": time.perf_counter() - t0 - saving,
            "first_step_seconds": first_step_seconds,
            "eval_seconds": evaluating,
            "steps": done - start,
        }

    def flush() -> None:
        """Fetches the pending metrics; stops at the first non-finite one; logs the rest."""
        host = jax.device_get([m for _, m in pending])
        records = [
            {"step": d, **{k: float(v) for k, v in m.items()}}
            for (d, _), m in zip(pending, host, strict=True)
        ]
        pending.clear()
        bad = next((r for r in records if not all(map(math.isfinite, r.values()))), None)
        if bad is not None:
            records = records[: records.index(bad)]
        if on_log is not None and records:
            on_log(records)
        if bad is not None:
            raise TrainingDiverged(bad["step"], bad, last_checkpoint)

    with _stop_on_sigint() as stop_requested:
        for s in range(start, until):
            if s + 1 == nan_step:
                state = state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params))
            state, metrics = train_step(state, parallel.shard_batch(task.train_batch(s), mesh))
            done = s + 1
            if s == start:
                jax.block_until_ready(metrics)
                first_step_seconds = time.perf_counter() - t0
                if on_first_step is not None:
                    on_first_step(first_step_seconds)
            pending.append((done, metrics))
            stopping = bool(stop_requested)
            due_eval = on_eval is not None and (done % cfg.eval_every == 0 or done == cfg.steps)
            due_checkpoint = on_checkpoint is not None and (
                done % cfg.checkpoint_every == 0 or done == until or stopping
            )
            # Every metric is checked before an evaluation or a checkpoint sees the state.
            if done % cfg.log_every == 0 or done == until or due_eval or due_checkpoint:
                flush()
            if due_eval:
                t_eval = time.perf_counter()
                on_eval(done, state)
                evaluating += time.perf_counter() - t_eval
            if due_checkpoint:
                t_save = time.perf_counter()
                on_checkpoint(state, timing(done))
                saving += time.perf_counter() - t_save
                last_checkpoint = done
            if stopping:
                if pending:
                    flush()
                jax.block_until_ready(state)
                raise TrainingInterrupted(done)
    jax.block_until_ready(state)
    return state, timing(max(start, until))
