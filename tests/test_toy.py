"""Tests of the training demo (jattn.toy and train_toy.py).

The end-to-end tests run the real code path with a tiny model and few steps: once through
the command line (a subprocess, as a user runs it) and once in-process split into two
sessions (stop, then --resume), which must end bit-exactly where the single run ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import math
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli import help_entries, load_train_toy
from flax import nnx

import jattn.nnx
from jattn import convert
from jattn.toy import (
    Checkpointer,
    CopyTask,
    TextTask,
    TinyGPT,
    TinyGPTConfig,
    TrainConfig,
    greedy_generate,
    init_state,
    make_train_step,
    plots,
    run_experiment,
)
from jattn.toy.experiment import OutputFolderError
from jattn.toy.plots import trailing_geometric_mean
from jattn.toy.train import make_optimizer, next_token_loss, train

ROOT = Path(__file__).resolve().parents[1]

# A tiny setting that still learns something in a few dozen steps.
TINY = dict(num_symbols=4, prefix_len=4, batch_size=16, seed=3)
TINY_MODEL = dict(d_model=16, num_layers=1, num_heads=2, dropout=0.1)
STEPS, STOP_AT = 40, 25
TINY_FLAGS = [
    "--num-symbols", "4", "--prefix-len", "4", "--batch-size", "16", "--seed", "3",
    "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--dropout", "0.1",
    "--steps", str(STEPS), "--checkpoint-every", "10", "--eval-every", "10", "--no-progress",
]  # fmt: skip


def _tiny_configs():
    task = CopyTask(**TINY)
    model = TinyGPTConfig(task.vocab_size, task.context_length, **TINY_MODEL)
    train = TrainConfig(steps=STEPS, seed=TINY["seed"], checkpoint_every=10, eval_every=10)
    return task, model, train


def _cli(*args, cwd=ROOT, timeout=300):
    return subprocess.run(
        [sys.executable, str(ROOT / "train_toy.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ----------------------------------------------------------------------------------------
# End to end: the command line, and resume == uninterrupted
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """``train_toy.py`` with tiny settings, run in-process (its ``main``) to share compilations."""
    out = tmp_path_factory.mktemp("toy") / "cli"
    cli = load_train_toy()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli.main([*TINY_FLAGS, "--out", str(out)]) == 0
    return out, stdout.getvalue(), cli


def test_cli_run_outputs(cli_run):
    out, stdout, cli = cli_run
    summary = json.loads((out / "summary.json").read_text())
    assert isinstance(summary["task"], str) and summary["task"] == "copy"
    assert summary["entropy_floor"] == pytest.approx(3 * math.log(4) / 8, abs=1e-15)
    assert summary["platform"] == jax.default_backend()
    assert isinstance(summary["devices"], int) and summary["devices"] >= 1
    assert set(summary["runs"]) == {"causal", "leaky"}
    types = {
        "train_loss": float,
        "eval_loss": float,
        "future_leak": float,
        "generation_accuracy": float,
        "cached_generation_accuracy": float,
        "steps": int,
        "seconds": float,
        "tokens_per_second": float,
    }
    for run in summary["runs"].values():
        assert {k: type(run[k]) for k in types} == types
        assert run["steps"] == STEPS and 0.0 <= run["generation_accuracy"] <= 1.0
        assert run["seconds"] > 0 and run["tokens_per_second"] > 0
    # The causal model cannot see the future at all; the leaky one does.
    assert summary["runs"]["causal"]["future_leak"] == 0.0
    assert summary["runs"]["leaky"]["future_leak"] > 1e-3
    # A causal model generates the same tokens with and without the KV cache.
    causal = summary["runs"]["causal"]
    assert causal["cached_generation_accuracy"] == causal["generation_accuracy"]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for name in ("causal", "leaky"):
        losses = [r["loss"] for r in records if r["run"] == name and "loss" in r]
        assert [r["step"] for r in records if r["run"] == name and "loss" in r] == list(
            range(1, STEPS + 1)
        )
        # The loss decreases.
        assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5])
        evals = [r["step"] for r in records if r["run"] == name and "eval_loss" in r]
        assert evals == [10, 20, 30, 40]
    for name in ("loss.png", "attention.png", "config.json"):
        assert (out / name).stat().st_size > 0
    assert Checkpointer(out / "checkpoints" / "causal").latest_step() == STEPS
    # The printed table has a row per run with the summary's numbers.
    rows = {line.split()[0]: line.split() for line in stdout.splitlines() if line.strip()}
    for name, run in summary["runs"].items():
        assert rows[name][1] == cli._loss(run["train_loss"])
        assert rows[name][5] == f"{run['generation_accuracy']:.3f}"
        assert rows[name][6] == f"{run['cached_generation_accuracy']:.3f}"


def test_cli_says_what_it_is_doing(cli_run):
    """Each slow stage is announced before it starts and timed after it ends, in order."""
    _, stdout, _ = cli_run
    lines = stdout.splitlines()

    def index(start: str) -> int:
        found = [i for i, line in enumerate(lines) if line.startswith(start)]
        assert len(found) == 1, f"expected one line starting {start!r} in:\n{stdout}"
        return found[0]

    order = [index("making 256 held-out windows..."), index("made 256 held-out windows in ")]
    for run in ("causal", "leaky"):
        order += [
            index(f"{run}: compiling: initial state, held-out loss, training step..."),
            index(f"{run}: compiled in "),
            index(f"{run}: measuring: "),
            index(f"{run}: measured in "),
        ]
    order += [index("writing summary.json, plotting loss.png and attention.png..."),
              index("written in ")]  # fmt: skip
    assert order == sorted(order)
    compiled = lines[index("causal: compiled in ")]
    # The first update (it compiles the step) is timed and kept out of the throughput.
    assert "training step with update 1 " in compiled and compiled.endswith("left out of tok/s")
    for stage in ("held-out loss", "future leak", "generation", "KV-cache generation"):
        assert f"{stage} " in lines[index("causal: measured in ")]
    assert any(line.startswith("tok/s: ") for line in lines)  # the table says what it counts


def test_cli_lists_every_file_it_wrote(cli_run):
    out, stdout, _ = cli_run
    prefix = f"; wrote {out}/: "
    (line,) = [line for line in stdout.splitlines() if prefix in line]
    listed = line.split(prefix, 1)[1].split(", ")
    on_disk = sorted(p.name for p in out.iterdir() if p.is_file())
    runs = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert listed == on_disk + [f"checkpoints/{run}/" for run in runs]
    for name in ("config.json", "metrics.jsonl", "summary.json", "loss.png", "attention.png",
                 "checkpoints/causal/", "checkpoints/leaky/"):  # fmt: skip
        assert name in listed


def test_cli_help_shows_every_default(capsys):
    cli = load_train_toy()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    parsed = vars(cli.build_parser().parse_args([]))
    assert len(entries) == len(parsed) + 1  # every flag, and --help
    for flag, entry in entries.items():
        if flag == "--help":
            continue
        default = parsed[flag.lstrip("-").replace("-", "_")]
        if default is False:  # a switch
            assert entry.endswith("(default: off)"), entry
        elif default is None:  # worked out later: said in words
            assert "(default: " in entry and "(default: None)" not in entry, entry
        else:  # the value the script really uses
            assert entry.endswith(f"(default: {default})"), entry
    assert entries["--seed"].endswith("(default: 0)")


def test_resume_equals_uninterrupted(cli_run, tmp_path):
    """Stop at step 25 (not a checkpoint multiple), resume: the same params, losses, numbers."""
    full_out, _, _ = cli_run
    task, model_cfg, train_cfg = _tiny_configs()
    out = tmp_path / "split"
    kwargs = dict(out_dir=out, progress=False, echo=lambda _: None)
    assert run_experiment(task, model_cfg, train_cfg, until=STOP_AT, **kwargs) is None
    assert Checkpointer(out / "checkpoints" / "leaky").latest_step() == STOP_AT
    resumed = run_experiment(task, model_cfg, train_cfg, resume=True, **kwargs)
    full = json.loads((full_out / "summary.json").read_text())
    for name in ("causal", "leaky"):
        like = init_state(dataclasses.replace(model_cfg, causal=name == "causal"), train_cfg)
        a, _ = Checkpointer(full_out / "checkpoints" / name).restore(like)
        b, _ = Checkpointer(out / "checkpoints" / name).restore(like)
        chex.assert_trees_all_equal(a, b)  # bit-exact: params, optimizer state, step, key
        for key in ("train_loss", "eval_loss", "future_leak", "generation_accuracy",
                    "cached_generation_accuracy", "steps"):  # fmt: skip
            assert resumed["runs"][name][key] == full["runs"][name][key], key

    def losses(path):
        lines = (path / "metrics.jsonl").read_text().splitlines()
        return sorted(
            (r["run"], r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r
        )

    assert losses(out) == losses(full_out)


def test_output_folder_errors(tmp_path):
    task, model_cfg, train_cfg = _tiny_configs()
    kwargs = dict(out_dir=tmp_path, progress=False)
    with pytest.raises(OutputFolderError, match="holds no run"):
        run_experiment(task, model_cfg, train_cfg, resume=True, **kwargs)
    run_experiment(task, model_cfg, train_cfg, until=1, runs=("causal",), **kwargs)
    with pytest.raises(OutputFolderError, match="already holds a run"):
        run_experiment(task, model_cfg, train_cfg, runs=("causal",), **kwargs)
    other = dataclasses.replace(train_cfg, learning_rate=1e-2)
    with pytest.raises(OutputFolderError, match=r"settings differ.*learning_rate: 0.003 -> 0.01"):
        run_experiment(task, model_cfg, other, resume=True, runs=("causal",), **kwargs)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "-5"], "--steps: must be >= 1, got -5"),
        (["--text", "/no/such/file.txt"], "--text: no such file: /no/such/file.txt"),
        (["--platform", "abacus"], "--platform: invalid choice: 'abacus'"),
        (["--runs", "causal,sideways"], "--runs: expected distinct names"),
        (["--d-model", "10", "--num-heads", "4"], "must be a multiple of --num-heads"),
        (["--dropout", "1.5"], "--dropout: must be in [0.0, 1.0), got 1.5"),
        (["--resume"], "--resume needs --out"),
    ],
)
def test_cli_errors_are_one_line(args, message):
    proc = _cli(*args, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("train_toy.py: error: ") and message in proc.stderr


def test_cli_unusable_platform(tmp_path):
    try:
        jax.devices("tpu")
        pytest.skip("this machine has a TPU")
    except RuntimeError:
        pass
    proc = _cli("--platform", "tpu", "--out", str(tmp_path / "x"), timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("train_toy.py: error: --platform tpu: no usable tpu backend")


# ----------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------


def test_entropy_floor_by_hand():
    # V = 4, L = 3: targets x2, x3 (ln 4 each), SEP, x1, x2, x3 (0 each): 2 ln 4 / 6.
    assert CopyTask(num_symbols=4, prefix_len=3).entropy_floor == pytest.approx(
        2 * math.log(4) / 6, abs=1e-15
    )
    # V = 16, L = 16 (the demo's default): 15 ln 16 / 32.
    assert CopyTask().entropy_floor == pytest.approx(15 * math.log(16) / 32, abs=1e-15)
    # L = 1: the only random token is never a target.
    assert CopyTask(num_symbols=7, prefix_len=1).entropy_floor == 0.0


@pytest.mark.parametrize("num_symbols,prefix_len", [(2, 3), (3, 2), (3, 3)])
def test_entropy_floor_by_enumeration(num_symbols, prefix_len):
    """H(target_t | inputs_<=t) from counting every window of the task, position by position."""
    task = CopyTask(num_symbols=num_symbols, prefix_len=prefix_len)
    sep = num_symbols
    windows = [
        (*p, sep, *p) for p in itertools.product(range(num_symbols), repeat=prefix_len)
    ]  # all equally likely
    entropies = []
    for t in range(2 * prefix_len):  # the model reads window[: t + 1] and predicts window[t + 1]
        by_context = defaultdict(Counter)
        for w in windows:
            by_context[w[: t + 1]][w[t + 1]] += 1
        h = 0.0
        for counts in by_context.values():
            n = sum(counts.values())
            h += n / len(windows) * -sum(c / n * math.log(c / n) for c in counts.values())
        entropies.append(h)
    np.testing.assert_allclose(task.target_entropies(), entropies, atol=1e-12)
    assert task.entropy_floor == pytest.approx(np.mean(entropies), abs=1e-12)


def test_copy_windows():
    task = CopyTask(num_symbols=5, prefix_len=6, batch_size=64, seed=1)
    w = np.asarray(task.train_batch(7))
    assert w.shape == (64, 13) and w.dtype == np.int32
    np.testing.assert_array_equal(w[:, 7:], w[:, :6])  # the copy
    assert (w[:, 6] == task.sep_id).all() and task.sep_id == 5 == task.vocab_size - 1
    assert w[:, :6].min() == 0 and w[:, :6].max() == 4  # every symbol, no separator
    # The batch of a step depends on (seed, step) only.
    np.testing.assert_array_equal(task.train_batch(7), CopyTask(5, 6, 64, 1).train_batch(7))
    assert not np.array_equal(task.train_batch(7), task.train_batch(8))
    assert not np.array_equal(task.train_batch(7), CopyTask(5, 6, 64, 2).train_batch(7))
    # Held-out windows come from another stream than every training step.
    held_out = np.asarray(task.eval_set(64))
    assert not any(np.array_equal(held_out, task.train_batch(s)) for s in range(3))


def test_text_windows():
    text = "the quick brown fox jumps over the lazy dog. " * 12
    task = TextTask(text, context_length=8, batch_size=5, seed=0, eval_fraction=0.25)
    assert task.vocab_size == len(set(text)) and task.entropy_floor is None
    split = round(len(text) * 0.75)
    for windows, part in ((task.train_batch(3), text[:split]), (task.eval_set(20), text[split:])):
        windows = np.asarray(windows)
        assert windows.shape[1] == 9
        for row in windows:
            assert task.decode(row) in part  # a window of the right split, in order
    with pytest.raises(ValueError, match="needs at least"):
        TextTask("too short", context_length=8)


def test_text_run_end_to_end(cli_run, tmp_path):
    # train_toy.py --text on a generated file (no download): a character model that learns,
    # stays causal, and records which file it read.
    _, _, cli = cli_run
    words = "the quick brown fox jumps over a lazy dog while cats sleep".split()
    pick = np.random.default_rng(0).integers(0, len(words), size=3000)
    text = " ".join(words[i] for i in pick)
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    flags = [
        "--text", str(path), "--context-length", "16", "--batch-size", "8", "--d-model", "16",
        "--num-layers", "1", "--num-heads", "2", "--steps", "40", "--eval-every", "10",
        "--checkpoint-every", "20", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(flags) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "text" and summary["entropy_floor"] is None
    task_config = summary["task_config"]
    assert task_config["vocab_size"] == len(set(text))
    assert task_config["characters"] == len(text)
    assert task_config["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    causal, leaky = summary["runs"]["causal"], summary["runs"]["leaky"]
    assert causal["future_leak"] == 0.0 and leaky["future_leak"] > 1e-3
    for run in (causal, leaky):
        # Better than guessing uniformly over the alphabet after 40 steps.
        assert run["eval_loss"] < 0.95 * math.log(len(set(text)))
    assert (out / "loss.png").stat().st_size > 0


# ----------------------------------------------------------------------------------------
# Model, step, generation
# ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _compile_events():
    """The jaxpr traces and backend compilations that happen inside the block (names).

    (Counted from jax.monitoring events rather than the jit's C++ cache size, which stays
    0 when a call takes the Python dispatch path.)
    """
    watched = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/backend_compile_duration",
    )
    events: list[str] = []

    def listener(event, *_args, **_kwargs):
        if event in watched:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_train_step_compiles_once_donates_and_uses_dropout():
    task, model_cfg, train_cfg = _tiny_configs()
    model = TinyGPT(model_cfg)
    step = make_train_step(model, train_cfg)
    state = init_state(model_cfg, train_cfg)
    first_params = jax.tree.map(jnp.copy, state.params)
    state, metrics = step(state, task.train_batch(0))  # traced and compiled here, once
    with _compile_events() as events:
        for s in range(1, 3):
            old = state
            state, metrics = step(state, task.train_batch(s))
            assert jax.tree.leaves(old.params)[0].is_deleted()  # donated: buffers reused
    assert events == [], events  # no later step traces or compiles again
    assert int(state.step) == 3 and np.isfinite(float(metrics["loss"]))

    # Dropout is on in training: the same state and batch with another dropout key give
    # another loss (through the same compiled step).
    def loss_with(key_seed):
        key = jax.random.key_data(jax.random.key(key_seed))
        # Placed like the rest of the state (its mesh sharding), so no new compilation.
        st = init_state(model_cfg, train_cfg)
        st = st.replace(dropout_key=jax.device_put(key, st.dropout_key.sharding))
        return float(step(st, task.train_batch(0))[1]["loss"])

    loss_with(1)  # compiles the state and batch helpers once
    with _compile_events() as events:
        assert loss_with(1) != loss_with(2)
    assert events == [], events
    # The initial parameters do not depend on the mask.
    leaky = init_state(dataclasses.replace(model_cfg, causal=False), train_cfg)
    chex.assert_trees_all_equal(leaky.params, first_params)


@pytest.mark.parametrize("cached", [False, True], ids=["fixed-window", "kv-cache"])
def test_greedy_generate_picks_the_argmax_given_the_past(cached):
    """Each generated token is the argmax of the model's logits given everything before it."""
    task, model_cfg, train_cfg = _tiny_configs()
    model = TinyGPT(model_cfg)
    # The demo's shapes and (committed) arrays, so its compilation is reused.
    variables = {"params": init_state(model_cfg, train_cfg).params}
    windows = task.eval_set(256)
    prompt_len = task.prompt_len
    out = greedy_generate(
        model, variables, windows[:, :prompt_len], num_new_tokens=task.prefix_len, cached=cached
    )
    assert out.shape == windows.shape
    np.testing.assert_array_equal(out[:, :prompt_len], windows[:, :prompt_len])
    # One teacher-forced call on the finished sequences: logits at position p - 1 see
    # tokens 0 .. p - 1 only (causal), exactly what generation saw when it wrote token p.
    logits = jax.jit(model.apply)(variables, out[:, :-1])  # [B, T, V]
    np.testing.assert_array_equal(jnp.argmax(logits[:, prompt_len - 1 :], -1), out[:, prompt_len:])


def test_leaky_generation_reads_the_placeholders():
    """The fixed-window generator is the book's loop over a fixed window, placeholders zero.

    So a leaky model (whose logits at position p read position p + 1) sees the placeholders
    where it learned to find the answer; a causal model never reads them (test above).
    """
    task, model_cfg, train_cfg = _tiny_configs()
    model = TinyGPT(dataclasses.replace(model_cfg, causal=False))
    variables = {"params": init_state(model.config, train_cfg).params}
    prompt = task.eval_set(64)[:, : task.prompt_len]
    out = greedy_generate(model, variables, prompt, num_new_tokens=task.prefix_len)
    # Reference: the same loop written out, the window's placeholders zero as documented.
    window = task.prompt_len + task.prefix_len - 1
    buffer = (
        jnp.zeros((prompt.shape[0], window + 1), jnp.int32).at[:, : task.prompt_len].set(prompt)
    )
    for pos in range(task.prompt_len, window + 1):
        logits = model.apply(variables, buffer[:, :window], deterministic=True)
        buffer = buffer.at[:, pos].set(jnp.argmax(logits[:, pos - 1], -1))
    np.testing.assert_array_equal(out, buffer)


# ----------------------------------------------------------------------------------------
# The other Flax API: the same GPT in NNX, from jattn.nnx.MultiHeadAttention
# ----------------------------------------------------------------------------------------


class NNXBlock(nnx.Module):
    def __init__(self, cfg: TinyGPTConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.ln_attn = nnx.LayerNorm(d, rngs=rngs)
        self.attn = jattn.nnx.MultiHeadAttention(
            d, d, cfg.context_length, cfg.dropout, cfg.num_heads, is_causal=cfg.causal, rngs=rngs
        )
        self.ln_mlp = nnx.LayerNorm(d, rngs=rngs)
        self.mlp_in = nnx.Linear(d, cfg.mlp_ratio * d, rngs=rngs)
        self.mlp_out = nnx.Linear(cfg.mlp_ratio * d, d, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x, *, deterministic):
        x = x + self.drop(self.attn(self.ln_attn(x), deterministic=deterministic), deterministic=deterministic)  # fmt: skip
        h = self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln_mlp(x))))
        return x + self.drop(h, deterministic=deterministic)


class NNXTinyGPT(nnx.Module):
    """jattn.toy.TinyGPT written in NNX, with the same parameter names."""

    def __init__(self, cfg: TinyGPTConfig, *, rngs: nnx.Rngs):
        self.tok_emb = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.pos_emb = nnx.Embed(cfg.context_length, cfg.d_model, rngs=rngs)
        for i in range(cfg.num_layers):
            setattr(self, f"blocks_{i}", NNXBlock(cfg, rngs=rngs))
        self.num_layers = cfg.num_layers
        self.ln_final = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, tokens, *, deterministic=True):
        x = self.tok_emb(tokens) + self.pos_emb(jnp.arange(tokens.shape[-1])[None])  # [1, T, D]
        x = self.drop(x, deterministic=deterministic)
        for i in range(self.num_layers):
            x = getattr(self, f"blocks_{i}")(x, deterministic=deterministic)
        return self.head(self.ln_final(x))


def test_nnx_gpt_trains_like_the_linen_gpt():
    """The NNX GPT, loaded with the Linen GPT's weights, takes the same two AdamW steps."""
    task, model_cfg, train_cfg = _tiny_configs()
    cfg = dataclasses.replace(model_cfg, dropout=0.0)
    state = init_state(cfg, train_cfg)
    linen_model = TinyGPT(cfg)
    params = jax.tree.map(jnp.copy, state.params)  # the Linen step donates state.params
    nnx_model = convert.linen_to_nnx({"params": params}, NNXTinyGPT(cfg, rngs=nnx.Rngs(9)))
    windows = task.train_batch(0)
    optimizer = nnx.Optimizer(nnx_model, make_optimizer(train_cfg), wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer, windows):
        def loss_of(model):
            logits = model(windows[:, :-1], deterministic=False)
            return next_token_loss(logits, windows[:, 1:])

        loss, grads = nnx.value_and_grad(loss_of)(model)
        optimizer.update(model, grads)
        return loss

    # Two steps each (the first has learning rate 0: warmup starts at 0).
    linen_step = make_train_step(linen_model, train_cfg)
    state, _ = linen_step(state, windows)
    nnx_step(nnx_model, optimizer, windows)
    nnx_loss = nnx_step(nnx_model, optimizer, task.train_batch(1))
    state, metrics = linen_step(state, task.train_batch(1))
    assert float(nnx_loss) == pytest.approx(float(metrics["loss"]), rel=1e-5)
    chex.assert_trees_all_close(
        convert.nnx_to_linen(nnx_model)["params"], state.params, rtol=1e-5, atol=1e-6
    )


# ----------------------------------------------------------------------------------------
# The timing train() reports, the pictures, the package
# ----------------------------------------------------------------------------------------


def test_train_reports_its_first_step_and_evaluation_time():
    """on_first_step comes once, before any log, with the first update's time; evals are timed."""
    task, model_cfg, train_cfg = _tiny_configs()
    cfg = dataclasses.replace(train_cfg, eval_every=2, log_every=2)
    events = []
    state, timing = train(
        TinyGPT(model_cfg), task, cfg, init_state(model_cfg, cfg), until=4,
        on_first_step=lambda seconds: events.append(("first", seconds)),
        on_log=lambda records: events.append(("log", [r["step"] for r in records])),
        on_eval=lambda step, state: events.append(("eval", step)),
    )  # fmt: skip
    assert events[0] == ("first", timing["first_step_seconds"])
    assert [e for e in events if e[0] != "first"] == [
        ("log", [1, 2]), ("eval", 2), ("log", [3, 4]), ("eval", 4)
    ]  # fmt: skip
    assert timing["steps"] == 4 and int(state.step) == 4
    assert 0 < timing["first_step_seconds"] < timing["seconds"]
    assert 0 < timing["eval_seconds"] < timing["seconds"]


def test_trailing_geometric_mean():
    values = np.array([1.0, 100.0, 1e-4, 10.0, 1e-2])
    # By hand: exp(mean(log(window))) over the last (up to) 3 values.
    expected = [1.0, 10.0, (1.0 * 100.0 * 1e-4) ** (1 / 3), (100.0 * 1e-4 * 10.0) ** (1 / 3),
                (1e-4 * 10.0 * 1e-2) ** (1 / 3)]  # fmt: skip
    np.testing.assert_allclose(trailing_geometric_mean(values, 3), expected, rtol=1e-12)
    np.testing.assert_allclose(trailing_geometric_mean(values, 1), values, rtol=1e-12)


def _figure_of(plot, monkeypatch, *args, **kwargs):
    """Calls ``plot`` and returns the matplotlib figure it saved."""
    saved = []
    monkeypatch.setattr(plots.viz, "save_figure", lambda fig, path: saved.append(fig) or path)
    plot(*args, **kwargs)
    (fig,) = saved
    return fig


def test_attention_plot_has_a_title_and_a_labelled_colour_bar(monkeypatch):
    rng = np.random.default_rng(0)
    weights = rng.random((2, 4, 4))
    weights /= weights.sum(-1, keepdims=True)
    fig = _figure_of(
        plots.plot_attention, monkeypatch, {"causal": [weights], "leaky": [weights]},
        list("abcd"), "unused.png", title="copy task: attention",
    )  # fmt: skip
    title = fig.get_suptitle()
    assert (
        title.startswith("copy task: attention")
        and "blank in the causal panels: hidden by the causal mask" in title
    )
    panels = [ax for ax in fig.axes if ax.images]
    bars = [ax for ax in fig.axes if not ax.images]
    assert len(panels) == 4 and len(bars) == 1  # one shared colour bar for the 2 x 2 panels
    assert bars[0].get_ylabel() == "attention weight (each query row sums to 1)"
    assert all(ax.images[0].get_clim() == (0.0, 1.0) for ax in panels)  # the bar's scale


def test_loss_plot_says_which_curves_are_smoothed_and_how(monkeypatch):
    records = [{"run": "causal", "step": s, "loss": 2.0 / s} for s in range(1, 31)]
    records += [{"run": "causal", "step": 30, "eval_loss": 0.1}]
    fig = _figure_of(plots.plot_losses, monkeypatch, records, 0.05, "unused.png", window=7)
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [
        "causal: train, each step (dropout on)",
        "causal: train, smoothed: geometric mean of the last 7 steps",
        "causal: held-out (dropout off)",
        "entropy floor 0.050 nats",
    ]
    smoothed = ax.get_lines()[1].get_ydata()
    np.testing.assert_allclose(smoothed, trailing_geometric_mean(2.0 / np.arange(1, 31), 7))


def _python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_jattn_toy_is_a_lazy_attribute_of_jattn():
    proc = _python(
        "import sys, jattn\n"
        "assert 'jattn.toy' not in sys.modules and 'optax' not in sys.modules\n"
        "print(jattn.toy.TinyGPT.__module__, jattn.toy.run_experiment.__module__)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["jattn.toy.model", "jattn.toy.experiment"]


def test_a_missing_toy_dependency_is_named_with_the_fix():
    """Without optax (orbax, tqdm, matplotlib), `import jattn.toy` names it and the extra."""
    proc = _python(
        "import sys\n"
        "for name in ['optax', 'orbax.checkpoint', 'tqdm', 'matplotlib']:\n"
        "    saved, sys.modules[name] = sys.modules.get(name), None  # None: import fails\n"
        "    try:\n"
        "        import jattn.toy\n"
        "        print('imported')\n"
        "    except ModuleNotFoundError as e:\n"
        "        print(repr(e.name), '|', e)\n"
        "    if saved is None:\n"
        "        del sys.modules[name]\n"
        "    else:\n"
        "        sys.modules[name] = saved\n"
        "import jattn.toy  # every package back: it imports\n"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    packages = {"optax": "optax", "orbax.checkpoint": "orbax-checkpoint", "tqdm": "tqdm",
                "matplotlib": "matplotlib"}  # fmt: skip
    assert len(lines) == len(packages)
    for line, (module, package) in zip(lines, packages.items(), strict=True):
        assert line == (
            f"{module!r} | jattn.toy (the training demo) needs {package}, not installed. "
            f"Install the toy extra: pip install 'jattn[toy]' (or: pip install {package})."
        )


def test_train_toy_without_the_extra_fails_in_one_line(tmp_path):
    proc = _python(
        "import runpy, sys\n"
        "sys.modules['tqdm'] = None\n"
        f"sys.argv = ['train_toy.py', '--steps', '1', '--out', {str(tmp_path / 'x')!r}]\n"
        "runpy.run_path('train_toy.py', run_name='__main__')\n"
    )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("train_toy.py: error: jattn.toy (the training demo) needs tqdm")
    assert "pip install 'jattn[toy]'" in proc.stderr
    assert not (tmp_path / "x").exists()
