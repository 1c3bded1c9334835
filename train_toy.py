"""Train a tiny GPT on next-token prediction with and without the causal mask.

    python train_toy.py                      # copy task, runs "causal" and "leaky"
    python train_toy.py --text notes.txt     # character-level on your own text
    python train_toy.py --out runs/a --resume
    python train_toy.py --model-parallel 2   # all devices: batch over 'data', heads over 'model'

The causal model learns what can be learned from the past and nothing more: its loss
stops at the task's entropy floor and it generates the copy correctly. The leaky model
(the same model without the mask) reads the answer from the future: its training loss
drops far below the floor, and it fails when it must generate. See jattn/toy/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

PLATFORMS = ("cpu", "gpu", "tpu")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default: the value, or "off" for a switch.

    A flag whose default is worked out later (None to argparse) says it in its own help
    text, "(default: ...)" in words, instead of a bare "(default: None)".
    """

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default:" in text or action.default is argparse.SUPPRESS:
            return text
        if action.default is False and action.nargs == 0:  # a store_true switch
            return f"{text} (default: off)"
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def _float_in(low: float, high: float, *, high_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low <= value < high if high_open else low <= value <= high):
            bracket = ")" if high_open else "]"
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}{bracket}, got {value}")
        return value

    parse.__name__ = "number"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="train_toy.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=_Formatter,
        epilog="Writes to --out: config.json (the settings), metrics.jsonl (per-step loss, "
        "held-out loss), summary.json (the final table), loss.png, attention.png and "
        "checkpoints/<run>/ (orbax). Ctrl-C stops after the current step and saves a "
        "checkpoint there (--resume continues; a second Ctrl-C quits at once). Exit status: "
        "0 done, 2 bad flags or text file, 1 other setup errors (platform not available, "
        "output folder in use, the toy extra not installed), 3 training diverged (NaN or "
        "Inf loss; the last good checkpoint is kept), 130 interrupted by Ctrl-C.",
    )
    _data_flags(p.add_argument_group("data"))
    _model_flags(p.add_argument_group("model"))
    _training_flags(p.add_argument_group("training"))
    _output_flags(p.add_argument_group("output"))
    _device_flags(
        p.add_argument_group(
            "devices",
            "Every device JAX finds (of every process) is used: the batch is split over a "
            "'data' mesh axis and, with --model-parallel, the attention heads and MLP units "
            "over a 'model' axis. Several hosts: run the same command on each, with "
            "--coordinator, --num-processes and --process-id (or --distributed on a cluster "
            "JAX detects), and an --out folder every host can reach (checkpoints).",
        )
    )
    return p


def _data_flags(g) -> None:
    g.add_argument("--text", metavar="PATH", help="train character-level on this UTF-8 text "
                   "file, whose entropy floor is unknown (default: none: the copy task)")  # fmt: skip
    g.add_argument("--num-symbols", type=_int_at_least(2), metavar="N", default=16,
                   help="copy task: alphabet size of the random prefix")  # fmt: skip
    g.add_argument("--prefix-len", type=_int_at_least(1), metavar="N", default=16,
                   help="copy task: prefix length L (the model reads 2L tokens)")  # fmt: skip
    g.add_argument("--context-length", type=_int_at_least(2), metavar="N", default=64,
                   help="text task: tokens the model reads")  # fmt: skip
    g.add_argument(
        "--batch-size", type=_int_at_least(1), metavar="N", default=32, help="windows per step"
    )


def _model_flags(g) -> None:
    g.add_argument(
        "--d-model", type=_int_at_least(1), metavar="N", default=64, help="residual width"
    )
    g.add_argument(
        "--num-layers", type=_int_at_least(1), metavar="N", default=2, help="transformer blocks"
    )
    g.add_argument(
        "--num-heads", type=_int_at_least(1), metavar="N", default=4, help="attention heads"
    )
    g.add_argument("--dropout", type=_float_in(0.0, 1.0, high_open=True), metavar="X", default=0.1,
                   help="dropout rate (attention weights, residual, embeddings) in training")  # fmt: skip


def _training_flags(g) -> None:
    g.add_argument("--runs", metavar="NAMES", default="causal,leaky",
                   help="comma-separated runs to train: causal and/or leaky (no causal mask)")  # fmt: skip
    g.add_argument(
        "--steps", type=_int_at_least(1), metavar="N", default=400, help="optimizer steps per run"
    )
    g.add_argument(
        "--lr", type=_positive_float, metavar="X", default=3e-3, help="peak AdamW learning rate"
    )
    g.add_argument("--warmup-steps", type=_int_at_least(0), metavar="N", default=None,
                   help="linear warmup steps (default: 5%% of --steps)")  # fmt: skip
    g.add_argument("--weight-decay", type=_float_in(0.0, float("inf")), metavar="X", default=0.1,
                   help="AdamW weight decay (matrices only)")  # fmt: skip
    g.add_argument(
        "--clip-norm", type=_positive_float, metavar="X", default=1.0, help="gradient clip norm"
    )
    g.add_argument(
        "--seed", type=int, metavar="N", default=0, help="seed of data, weights and dropout"
    )


def _output_flags(g) -> None:
    g.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default: runs/<date-time>)")  # fmt: skip
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoints")  # fmt: skip
    g.add_argument("--checkpoint-every", type=_int_at_least(1), metavar="N", default=200,
                   help="save a checkpoint every N steps (and at the end)")  # fmt: skip
    g.add_argument("--eval-every", type=_int_at_least(1), metavar="N", default=25,
                   help="held-out loss every N steps, for the loss curves")  # fmt: skip
    g.add_argument("--platform", choices=PLATFORMS, default=None,
                   help="JAX platform (default: what JAX finds)")  # fmt: skip
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bars (the stage messages still print)")  # fmt: skip


def _device_flags(g) -> None:
    g.add_argument("--model-parallel", type=_int_at_least(1), metavar="N", default=1,
                   help="tensor-parallel size: devices per 'model' group (must divide the "
                   "number of devices and --num-heads)")  # fmt: skip
    g.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="multi-host: address of process 0, for jax.distributed.initialize "
                   "(default: none: one host, or detected with --distributed)")  # fmt: skip
    g.add_argument("--num-processes", type=_int_at_least(1), metavar="N", default=None,
                   help="multi-host: number of processes, one per host (default: 1, or "
                   "detected with --distributed)")  # fmt: skip
    g.add_argument("--process-id", type=_int_at_least(0), metavar="I", default=None,
                   help="multi-host: this process's index, 0 .. N-1 (default: 0, or detected "
                   "with --distributed)")  # fmt: skip
    g.add_argument("--distributed", action="store_true",
                   help="multi-host on a cluster JAX detects (SLURM, Open MPI, Cloud TPU, ...)")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    """Parses and checks the flags (before JAX is imported, so errors come fast)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in ("causal", "leaky")]
    if not runs or bad or len(set(runs)) != len(runs):
        parser.error(f"--runs: expected distinct names from causal,leaky, got {args.runs!r}")
    args.runs = tuple(runs)
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 20
    if args.warmup_steps > args.steps:
        parser.error(f"--warmup-steps ({args.warmup_steps}) must not exceed --steps ({args.steps})")
    if args.d_model % args.num_heads:
        parser.error(
            f"--d-model ({args.d_model}) must be a multiple of --num-heads ({args.num_heads})"
        )
    if args.num_heads % args.model_parallel:
        parser.error(
            f"--model-parallel ({args.model_parallel}) must divide --num-heads "
            f"({args.num_heads}): each device of a model group holds whole heads"
        )
    multihost = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in multihost) and not all(v is not None for v in multihost):
        parser.error("--coordinator, --num-processes and --process-id go together")
    if args.distributed and args.coordinator is not None:
        parser.error("--distributed detects the cluster: drop --coordinator and its flags")
    if args.process_id is not None and args.process_id >= args.num_processes:
        parser.error(
            f"--process-id ({args.process_id}) must be below --num-processes ({args.num_processes})"
        )
    if args.text is not None:
        if not os.path.isfile(args.text):
            parser.error(f"--text: no such file: {args.text}")
        try:
            with open(args.text, encoding="utf-8") as f:
                args.text_content = f.read()
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"--text: cannot read {args.text} as UTF-8 text ({e})")
    if args.resume and args.out is None:
        parser.error("--resume needs --out DIR (the folder of the run to continue)")
    if args.out is None:
        args.out = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    return args


def _fail(message: str) -> None:
    sys.stderr.write(f"train_toy.py: error: {message}\n")
    sys.exit(1)


def _select_platform(jax, platform: str | None) -> list:
    """Restricts JAX to ``platform`` (before any computation) and returns its devices."""
    if platform is None:
        return jax.devices()
    # "gpu" means CUDA or ROCm. JAX's own "gpu" alias in jax_platforms expands to every GPU
    # platform and fails on the first one not installed, so try them one at a time.
    candidates = ("cuda", "rocm") if platform == "gpu" else (platform,)
    errors = []
    for name in candidates:
        jax.config.update("jax_platforms", name)
        try:
            return jax.devices()
        except (RuntimeError, AssertionError) as e:  # not installed, or no such hardware
            errors.append(str(e).splitlines()[0] if str(e) else f"no {name} device found")
    _fail(f"--platform {platform}: no usable {platform} backend ({errors[0]})")


def _loss(value: float) -> str:
    """4 decimals, or 2 significant digits for losses far below 1 (the leaky run's)."""
    return f"{value:.4f}" if value >= 0.01 else f"{value:.1e}"


def _table(summary: dict) -> str:
    floor = summary["entropy_floor"]
    cols = ["run", "train_loss", "eval_loss", "floor", "future_leak", "gen_acc", "gen_cached",
            "steps", "seconds", "tok/s"]  # fmt: skip
    rows = [
        [
            name,
            _loss(r["train_loss"]),
            _loss(r["eval_loss"]),
            "-" if floor is None else _loss(floor),
            "0.0" if r["future_leak"] == 0 else f"{r['future_leak']:.3g}",
            f"{r['generation_accuracy']:.3f}",
            f"{r['cached_generation_accuracy']:.3f}",
            str(r["steps"]),
            f"{r['seconds']:.1f}",
            f"{r['tokens_per_second']:,.0f}",
        ]
        for name, r in summary["runs"].items()
    ]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, rows)])


def _import_toy():
    """``jattn.toy``, or a one-line error naming the missing package of the toy extra."""
    try:
        import jattn.toy
    except ImportError as e:
        if "jattn[toy]" not in str(e):  # not the extra's check: a real bug, show it whole
            raise
        _fail(str(e))
    return jattn.toy


def _setup_devices(args):
    """JAX's devices and the ``('data', 'model')`` mesh; prints what it found."""
    import jax

    parallel = _import_toy().parallel
    if args.distributed or args.coordinator is not None:  # before anything else touches JAX
        parallel.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    devices = _select_platform(jax, args.platform)
    print(f"JAX {jax.__version__} on {jax.default_backend()}: {len(devices)} device(s): "
          + ", ".join(str(d) for d in devices))  # fmt: skip
    try:
        mesh = parallel.make_mesh(args.model_parallel, devices)
    except ValueError as e:
        _fail(f"--model-parallel: {e}")
    data = mesh.shape[parallel.DATA_AXIS]
    if args.batch_size % data:
        _fail(f"--batch-size ({args.batch_size}) must be a multiple of the data-parallel size "
              f"({data} = {len(devices)} devices / --model-parallel {args.model_parallel})")  # fmt: skip
    print(f"mesh: data {data} x model {args.model_parallel}, "
          f"process {jax.process_index()} of {jax.process_count()}")  # fmt: skip
    return mesh, jax.process_index() == 0


def _configs(args, toy) -> tuple:
    """``(task, model_config, train_config)`` from the flags."""
    try:
        if args.text is not None:
            task = toy.TextTask(args.text_content, context_length=args.context_length,
                                batch_size=args.batch_size, seed=args.seed, source=args.text)  # fmt: skip
        else:
            task = toy.CopyTask(args.num_symbols, args.prefix_len, args.batch_size, args.seed)
        model_config = toy.TinyGPTConfig(
            task.vocab_size, task.context_length, d_model=args.d_model,
            num_layers=args.num_layers, num_heads=args.num_heads, dropout=args.dropout,
        )  # fmt: skip
        train_config = toy.TrainConfig(
            steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup_steps,
            weight_decay=args.weight_decay, clip_norm=args.clip_norm, seed=args.seed,
            checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
        )  # fmt: skip
    except ValueError as e:
        _fail(str(e))
    return task, model_config, train_config


def _written(out: str) -> list[str]:
    """Everything in the output folder: its files, then ``checkpoints/<run>/`` per run."""
    folder = Path(out)
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    checkpoints = folder / "checkpoints"
    runs = (
        sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) if checkpoints.is_dir() else []
    )
    return files + [f"checkpoints/{run}/" for run in runs]


def _report(summary: dict, out: str, seconds: float) -> None:
    """The results table, the sample generation and the files written."""
    print()
    print(_table(summary))
    print("tok/s: training tokens per second without each session's first step (compiling) "
          "and the held-out evaluations; seconds: with them")  # fmt: skip
    sample = summary["sample"]
    print(f"\nsample (held-out) prompt: {sample['prompt']}")
    for name in ["reference", *summary["runs"]]:
        print(f"{name:>24}: {sample[name]}")
    print(f"\nwall time {seconds:.1f} s; wrote {out}/: " + ", ".join(_written(out)))


def main(argv=None) -> int:
    args = parse_args(argv)
    mesh, primary = _setup_devices(args)
    toy = _import_toy()
    from jattn.toy.experiment import OutputFolderError
    from jattn.toy.train import TrainingDiverged, TrainingInterrupted

    task, model_config, train_config = _configs(args, toy)
    floor = task.entropy_floor
    print(f"task: {task.name}, vocab {task.vocab_size}, context {task.context_length}, "
          + ("entropy floor unknown" if floor is None else f"entropy floor {floor:.4f} nats/token")
          + f"; output: {args.out}")  # fmt: skip
    t0 = time.perf_counter()
    try:
        summary = toy.run_experiment(
            task, model_config, train_config, out_dir=args.out, runs=args.runs,
            resume=args.resume, progress=primary and not args.no_progress, mesh=mesh,
        )  # fmt: skip
    except OutputFolderError as e:  # an occupied --out, or settings unlike the run to resume
        _fail(str(e))
    except TrainingDiverged as e:
        sys.stderr.write(f"train_toy.py: error: run {getattr(e, 'run', '?')}: {e}\n")
        return 3
    except KeyboardInterrupt as e:  # TrainingInterrupted: the step's checkpoint is written
        where = (
            f"run {getattr(e, 'run', '?')} stopped after step {e.step}, checkpoint saved"
            if isinstance(e, TrainingInterrupted)
            else "the checkpoints written so far are kept"
        )
        sys.stderr.write(
            f"train_toy.py: interrupted: {where}. Continue with: python train_toy.py <the same "
            f"flags> --out {args.out} --resume\n"
        )
        return 130
    if primary:  # process 0 writes the files and prints the results
        _report(summary, args.out, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
