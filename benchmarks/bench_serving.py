"""Serving many requests: continuous batching over a paged KV cache against static batches.

Workload: ``--requests`` requests (64) from a fixed seed, prompts of 16-512 tokens and
``max_new_tokens`` of 16-256 (uniform), on the book's GPT-2 configuration scaled down to
fit a shared 2-core CPU (``GPT_CONFIG_124M`` with 4 layers of width 128, 4 heads, a
vocabulary of 8192; context 1024). About one request in eight stops early on ``eos_id``:
the eos ids are tokens those requests produce a third of the way into their output
(found by an untimed first run; a second untimed run, with them, compiles the step shapes
their schedule adds). ``--quick``: 24
requests through 12 slots, prompts 16-256 and outputs 16-128.

Figures, all from one process:

* **tokens/s, continuous vs static.** ``jattn.models.generate_many(..., slots=)``
  against padding every request into one static batch: ``jattn.models.generate`` of all
  prompts right-padded to the longest, ``max(max_new_tokens)`` steps for every row (the
  cache ``batch x capacity``). Both are credited with the same useful tokens (each
  request's continuation up to its eos or ``max_new_tokens``); wall-clock seconds,
  medians of ``--rounds`` timed runs of each, alternating, after a warm-up.
* **KV memory.** The most pages held at once (``ServingStats.peak_pages``) and the pool
  allocated (``--pool``, 0.5: the most pages within half of ``slots x capacity``
  positions), in positions, against ``slots x capacity`` (the contiguous cache of the same
  slots) and ``requests x capacity`` (the static batch's cache).
* **decode step at 10% vs 100% filled.** One decoding step of ``slots`` rows through the
  model on paged caches whose page tables are 10% and 100% of the capacity wide, rows filled
  to match, each row's next token picked as ``generate_many``'s greedy step picks it (the
  output head at the last position only, then ``generate.sample_next``); and the contiguous
  ``KVCache`` step (on CPU with the kernel, read in place up to each row's length too;
  elsewhere over its whole capacity); and the paged step with one page per row, the part of
  a step that does not follow the tokens held (over the 100% step: the least the 10% / 100%
  ratio can be with that step as it is; a faster attention raises it). Medians of
  ``--step-repeats`` calls, the candidates in turn: once one call at a time (each call
  follows another candidate's, with its weights and pages often out of the caches), once in
  runs of ``BURST`` consecutive calls (the first of each run left out), as a serving loop
  runs one step after another, and once in runs of ``STEADY`` (the first ``STEADY_SKIP``
  left out): on a CPU whose caches take several passes to hold a step's weights again
  after another candidate's pages went through them, the short runs still pay for the
  candidate before; the long ones time a step in a loop at its own fill.
* **vs the book.** ``llms_from_scratch.kv_cache_batched`` (Qwen3, PyTorch) generating
  for the same prompts (it takes one ``[batch, T]`` tensor: prompts right-padded to the
  longest, every row ``max(max_new_tokens)`` tokens; ``--book-batch`` rows at a time),
  against ``generate_many`` on ``jattn.models.Qwen3Model`` with the book model's weights
  (``from_book``), the same scaled config. Same useful-token credit.
* **compilations** (``jax.monitoring`` backend-compile events) during the first, the
  second (with the eos ids) and the timed ``generate_many`` runs: bounded by the step
  shapes, not the number of requests.

The load average is recorded before and after (the run's own work included), with the CPU
and an sgemm rate from the same run: figures from a shared machine are preliminary.

Usage (from the repository root):

    PYTHONPATH=$PWD python benchmarks/bench_serving.py            # 64 requests, writes the table
    PYTHONPATH=$PWD python benchmarks/bench_serving.py --quick    # 16 shorter requests
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import cpu_description, settle, sgemm_gflops  # beside this script

from jattn import generate, kvcache, models, paged
from jattn.models.serving import PREFILL_CHUNK

RESULTS = os.path.join(os.path.dirname(__file__), "serving_results.md")
# Consecutive calls per candidate and round in the "runs" decode-step figures.
BURST = 8
# The "steady" decode-step figures: runs of STEADY calls, the first STEADY_SKIP left out.
# After another candidate's pages went through the caches, a small step here (AMD EPYC
# Zen 5, 2 cores) takes 8-10 calls to get back to its speed, not one (the one-page step,
# ms per call of a run after the 100% step: 0.77 0.70 0.67 0.64 0.61 0.59 0.55 0.52 0.51
# 0.48 0.47 ...0.45; after a plain 64 MB read alike; reading its weights 8 times first
# takes most of it away): a cache's residency builds over passes, so calls 2-8 of a run
# still measure the candidate before. From call 17 on, a run times the step in a loop of
# its own, as a serving loop at that fill runs it.
STEADY, STEADY_SKIP = 32, 16
# The decode-step timing modes: (title, consecutive calls per candidate and round, the
# calls left out at the start of each run).
MODES = (
    ("one call at a time", 1, 0),
    (f"in runs of {BURST}", BURST, 1),
    (f"calls {STEADY_SKIP + 1}-{STEADY} of runs of {STEADY}", STEADY, STEADY_SKIP),
)
MODE_TITLES = " / ".join(title for title, _, _ in MODES)


def gpt2_cfg(vocab: int) -> dict:
    """``GPT_CONFIG_124M`` scaled down (widths, depth, vocabulary; the context kept)."""
    return dict(
        vocab_size=vocab, context_length=1024, emb_dim=128, n_heads=4, n_layers=4,
        drop_rate=0.0, qkv_bias=False,
    )  # fmt: skip


def qwen3_cfg(vocab: int) -> dict:
    """``QWEN_CONFIG_06_B`` scaled down the same way (float32, as the book's CPU runs)."""
    import torch

    return dict(
        vocab_size=vocab, context_length=1024, emb_dim=128, n_heads=4, n_layers=4,
        hidden_dim=384, head_dim=32, qk_norm=True, n_kv_groups=2, rope_base=1_000_000.0,
        dtype=torch.float32,
    )  # fmt: skip


def workload(n: int, prompt_range, out_range, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    max_new = rng.integers(out_range[0], out_range[1] + 1, size=n).tolist()
    prompts = [rng.integers(0, vocab, size=int(t)).astype(np.int32) for t in lengths]
    return prompts, max_new


def pool_pages(fraction: float, slots: int, capacity: int, page_size: int) -> int:
    """The most pages that hold at most ``fraction`` of ``slots x capacity`` positions (at
    least one row's worth)."""
    row = paged.pages_needed(capacity, page_size)
    return max(row, int(fraction * slots * capacity) // page_size)


def pick_eos(outputs, every: int = 4, max_shared: int = 1) -> list[int]:
    """For every ``every``-th request, the first token new to its output from a third of
    the way in (else from its second token) that at most ``max_shared`` other outputs
    hold: eos ids that end those requests early and leave most of the others alone (an
    untrained model's greedy outputs share many tokens)."""
    held = [set(o.tolist()) for o in outputs]
    eos = set()
    for i in range(0, len(outputs), every):
        out = outputs[i].tolist()
        for start in (len(out) // 3, 1):
            k = next(
                (
                    k
                    for k in range(start, len(out))
                    if out[k] not in out[:k]
                    and sum(out[k] in h for j, h in enumerate(held) if j != i) <= max_shared
                ),
                None,
            )
            if k is not None:
                eos.add(out[k])
                break
    return sorted(eos)


@contextlib.contextmanager
def compile_events():
    events = []

    def listener(event, *_a, **_k):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------


def continuous(model, prompts, max_new, args, eos=None):
    with compile_events() as events:
        t = time.perf_counter()
        outs, stats = models.generate_many(
            model, prompts, max_new, slots=args.slots, eos_id=eos or None,
            page_size=args.page_size, num_pages=args.num_pages, prefill_chunk=args.chunk,
            return_stats=True,
        )  # fmt: skip
        seconds = time.perf_counter() - t
    return seconds, outs, stats, len(events)


def static_batch(model, prompts, max_new):
    """Every request padded into one batch: generate runs max(max_new) steps for all rows.

    Returns ``run() -> (seconds, tokens [requests, max(max_new)])``, compiled and warmed up.
    """
    padded = np.zeros((len(prompts), max(p.size for p in prompts)), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : p.size] = p
    lengths = jnp.asarray([p.size for p in prompts], jnp.int32)

    def run():
        t = time.perf_counter()
        out = np.asarray(models.generate(model, padded, max(max_new), prompt_lengths=lengths))
        return time.perf_counter() - t, out

    run()  # compile (and warm up)
    return run


def greedy_next(model, tokens):
    """Each row's next token ``[B]`` as ``generate_many``'s greedy step picks it: the output
    head at the last position only, then ``generate.sample_next``."""
    last = jnp.full(tokens.shape[:1], tokens.shape[1] - 1)
    return generate.sample_next(model(tokens, deterministic=True, decode=True, logits_at=last))


def paged_step(graphdef, state, pools, table, lengths, tokens, blocks=None, pick=False):
    """``(out, pools)`` of a chunk through paged caches (int8 ones with scales), over the
    work list ``blocks`` (``paged.block_list``) or, None, the whole page table. ``out``: the
    logits ``[B, T, V]``; with ``pick``, each row's next token ``[B]`` (:func:`greedy_next`)."""
    model = nnx.merge(graphdef, state)
    for block, (k, v, *scales) in zip(model.trf_blocks, pools, strict=True):
        cache = paged.PagedKVCache(k, v, table, lengths, *scales, blocks=blocks)
        block.att.cache = nnx.Cache(cache)
    out = greedy_next(model, tokens) if pick else model(tokens, deterministic=True, decode=True)
    caches = [b.att.cache.get_value() for b in model.trf_blocks]
    return out, [tuple(x for x in (*c[:2], *c[4:6]) if x is not None) for c in caches]


def int8_logit_error(
    model, page_size: int, rows: int = 4, prompt: int = 128
) -> tuple[float, float]:
    """Logits through int8 pages against float32 pages: a prefill chunk, then one step.

    Returns ``(max |error| / std(logits), share of rows whose greedy token agrees)``.
    """
    graphdef, state = nnx.split(model)
    att = model.trf_blocks[0].att
    pages = paged.pages_needed(prompt + 1, page_size)
    tokens = jnp.asarray(
        np.random.default_rng(1).integers(0, model.cfg.vocab_size, (rows, prompt + 1))
    )
    table = jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages)
    step = jax.jit(paged_step, static_argnums=0)
    logits = {}
    for quantized in (False, True):
        c = paged.init_paged_cache(
            1, rows * pages, page_size, 1, att.kv_heads, att.head_dim, quantized=quantized
        )
        pools = [tuple(x for x in (*c[:2], *c[4:6]) if x is not None) for _ in model.trf_blocks]
        lengths = jnp.zeros((rows,), jnp.int32)
        first, pools = step(graphdef, state, pools, table, lengths, tokens[:, :prompt])
        last, _ = step(graphdef, state, pools, table, lengths + prompt, tokens[:, prompt:])
        logits[quantized] = np.concatenate([np.asarray(first), np.asarray(last)], axis=1)
    exact, approx = logits[False], logits[True]
    error = float(np.abs(approx - exact).max() / exact.std())
    agree = float(np.mean(approx[:, -1].argmax(-1) == exact[:, -1].argmax(-1)))
    return error, agree


def contiguous_step(graphdef, state, caches, tokens):
    model = nnx.merge(graphdef, state)
    for block, cache in zip(model.trf_blocks, caches, strict=True):
        block.att.cache = nnx.Cache(cache)
    return greedy_next(model, tokens), [b.att.cache.get_value() for b in model.trf_blocks]


def from_leaves(step, graphdef, treedef, leaves, *args):
    """``step(graphdef, state, *args)`` with the state passed as its flat leaves, as
    ``generate_many`` passes it (flattening an ``nnx.State`` on every call costs about
    0.2 ms, as much as a small step's attention)."""
    return step(graphdef, jax.tree.unflatten(treedef, leaves), *args)


def greedy_paged_fn(graphdef, treedef):
    """``fn(state leaves, pools, table, lengths, tokens[, blocks]) -> (tokens, pools)``:
    :func:`paged_step` with the greedy pick, jitted with the pools donated and the state
    passed as flat leaves (:func:`from_leaves`), as ``generate_many`` runs its step."""
    step = partial(from_leaves, partial(paged_step, pick=True), graphdef, treedef)
    return jax.jit(step, donate_argnums=1)


def interleaved_medians(steps: dict, repeats: int, burst: int = 1, skip: int = 0) -> dict:
    """Median seconds of each ``state = step(state)`` in ``steps`` ({name: (step, state)}),
    the candidates called in turn every round so that background load hits them alike.

    ``burst`` 1: one call per candidate a round (every call follows another candidate's,
    its weights and pages often out of the caches); more: ``burst`` consecutive calls per
    candidate a round, the first ``skip`` left out, as a serving loop runs one step after
    another. Returns the medians, the last states (the steps donate theirs) and every timed
    call's seconds, in round order.
    """
    states = {k: step(state) for k, (step, state) in steps.items()}  # compile, warm up
    jax.block_until_ready(states)
    times = {k: [] for k in steps}
    for _ in range(repeats):
        for k, (step, _) in steps.items():
            for i in range(burst):
                t = time.perf_counter()
                states[k] = step(states[k])
                jax.block_until_ready(states[k])
                if i >= skip:
                    times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}, states, times


def timed_modes(steps: dict, repeats: int) -> tuple[list, list]:
    """``(medians, times)``: per mode of MODES, :func:`interleaved_medians`' medians and
    every timed call's seconds for ``steps``, each mode starting from the states the one
    before left."""
    medians, times = [], []
    for _, burst, skip in MODES:
        median, states, seconds = interleaved_medians(steps, repeats, burst, skip)
        steps = {k: (step, states[k]) for k, (step, _) in steps.items()}
        medians.append(median)
        times.append(seconds)
    return medians, times


def checked_medians(steps: dict, repeats: int) -> list:
    """Per mode of MODES, the median seconds of each step in ``steps`` ({(candidate, case):
    (step, state)}, ``step(state) -> (tokens, state)``, :func:`timed_modes`), once every
    candidate is checked to pick the same greedy tokens in each case."""
    picked, states = {}, {}
    for key, (step, state) in steps.items():
        picked[key], states[key] = step(state)
    for (_, case), tokens in picked.items():
        first = next(t for (_, c), t in picked.items() if c == case)
        np.testing.assert_array_equal(tokens, first)
    steps = {k: (lambda c, f=f: f(c)[1], states[k]) for k, (f, _) in steps.items()}
    return timed_modes(steps, repeats)[0]


def _compiled_step(rows: int, table, page_size: int):
    """``(compiled, state leaves, pools)``: the scaled GPT-2's greedy :func:`paged_step` on
    ``rows`` rows of one new token, compiled for page table ``table``; ``pools()`` makes
    zeroed pools for it."""
    model = models.GPTModel(gpt2_cfg(8192), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    state, treedef = jax.tree.flatten(state)
    att, layers = model.trf_blocks[0].att, len(model.trf_blocks)
    pool = (table.size, page_size, att.kv_heads, att.head_dim)

    def pools():
        return [tuple(jnp.zeros(pool, jnp.float32) for _ in "kv") for _ in range(layers)]

    ints = (table, jnp.zeros((rows,), jnp.int32), jnp.zeros((rows, 1), jnp.int32))
    return greedy_paged_fn(graphdef, treedef).lower(state, pools(), *ints).compile(), state, pools


def step_candidates(variants: dict, fills, rows=16, capacity=743, page_size=16):
    """The decoding step ``generate_many`` runs (:func:`paged_step` with the greedy pick)
    on the scaled GPT-2, one candidate per variant and fill, for the one-process A/B scripts.

    ``variants``: ``{name: a function returning a context manager}``, entered while the
    model is built and its step compiled (it patches what the variant changes). ``fills``:
    ``(name, fraction)`` pairs, rows :func:`fill_width` pages wide (0: one page) and filled
    to one position short of that. Returns ``({(variant, fill name): (step, pools)},
    {variant: the compiled step's text})``, ``step(pools) -> (tokens, pools)``, for
    :func:`checked_medians`.
    """
    max_pages = paged.pages_needed(capacity, page_size)
    table = jnp.arange(rows * max_pages, dtype=jnp.int32).reshape(rows, max_pages)
    tokens = jnp.zeros((rows, 1), jnp.int32)
    steps, texts = {}, {}
    for name, variant in variants.items():
        with variant():
            compiled, state, pools = _compiled_step(rows, table, page_size)
        texts[name] = compiled.as_text()
        for fill_name, fill in fills:
            width = fill_width(fill, max_pages) if fill else 1
            lengths = jnp.full((rows,), width * page_size - 1, jnp.int32)  # room for one

            def call(pools, compiled=compiled, state=state, lengths=lengths):
                return compiled(state, pools, table, lengths, tokens)

            steps[(name, fill_name)] = (call, pools())
    return steps, texts


def step_table(label: str, medians: list, fills, columns=None) -> str:
    """A markdown table of :func:`checked_medians`' ms per step, one row per variant: the
    modes' (MODE_TITLES) per fill, the ``columns`` ({title: {variant: cell}}) before them
    and the 10% / 100% ratios (fills named "10%" and "100%") after."""
    columns = columns or {}
    variants = list(dict.fromkeys(v for v, _ in medians[0]))
    head = [label, *columns, *(n for n, _ in fills), "10% / 100%"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        cells = [str(columns[c][v]) for c in columns]
        cells += [" / ".join(f"{d[(v, n)] * 1e3:.2f}" for d in medians) for n, _ in fills]
        ratio = " / ".join(f"{d[(v, '10%')] / d[(v, '100%')]:.2f}x" for d in medians)
        lines.append("| " + " | ".join([v, *cells, ratio]) + " |")
    return "\n".join(lines)


def _ratio_quartiles(times: dict, a, b, repeats: int) -> tuple[float, float]:
    """The quartiles over rounds of candidate ``a``'s seconds / ``b``'s (each round's calls
    averaged): how much the ratio of the medians moves from round to round."""
    ta, tb = (np.asarray(times[k]).reshape(repeats, -1).mean(axis=1) for k in (a, b))
    low, high = np.percentile(ta / tb, [25, 75])
    return float(low), float(high)


def paged_ratio(medians: dict, quartiles, ms_digits: int) -> str:
    """The goal cell of one timing mode: the paged step's 10% / 100% ratio (bold), both
    steps' ms and the rounds' quartiles of the ratio (:func:`decode_steps`)."""
    low, high = (medians[("paged", f)] for f in (0.1, 1.0))
    return (f"**{low / high:.2f}x** ({low * 1e3:.{ms_digits}f} / {high * 1e3:.{ms_digits}f} ms; "
            f"rounds' quartiles {quartiles[0]:.2f}-{quartiles[1]:.2f}x)")  # fmt: skip


def decode_steps(model, slots: int, capacity: int, page_size: int, repeats: int):
    """Seconds of one decoding step at 10% and 100% filled, ``(medians, spread)``: per mode
    of MODES (:func:`timed_modes`), the medians and the quartiles over rounds of the paged
    10% / 100% ratio.

    Four candidates per fill: the whole model (picking each row's next token, greedy, with
    the output head at the last position only) on paged caches as ``generate_many``'s
    decoding step runs it (``"paged"``: through the fused CPU paged kernel where it runs,
    else over the work list of the key blocks the rows hold; rows filled to 10% or 100% of
    the capacity) and over a page table 10% or 100% of the capacity wide (``"table"``), the
    model on contiguous ``KVCache``s (through the same fused kernel, which reads each row's
    filled positions in place; elsewhere over the whole capacity), and one attention layer
    alone (``jattn.paged.update_and_attend`` over the page table, the model's head layout);
    and the ``"paged"`` step with one page per row, the part of a step that does not follow
    the tokens held (after the 100% one in each round). The lengths stay put between calls
    (each call rewrites the same position), so every call costs the same. The model's
    structure is bound once (``partial``) and its state passed as flat leaves, as
    ``generate_many`` does: a static ``GraphDef`` argument would be hashed on every call,
    and an ``nnx.State`` flattened.
    """
    graphdef, state = nnx.split(model)
    state, treedef = jax.tree.flatten(state)
    att = model.trf_blocks[0].att
    max_pages = paged.pages_needed(capacity, page_size)
    tokens = jnp.zeros((slots, 1), jnp.int32)
    full_table = jnp.arange(slots * max_pages, dtype=jnp.int32).reshape(slots, max_pages)
    paged_fn = greedy_paged_fn(graphdef, treedef)
    contiguous_fn = jax.jit(
        partial(from_leaves, contiguous_step, graphdef, treedef), donate_argnums=1
    )
    layer_fn = jax.jit(paged.update_and_attend, donate_argnums=0)
    rng = np.random.default_rng(2)
    q, kv = (
        jnp.asarray(rng.normal(size=(slots, 1, h, att.head_dim)), jnp.float32)
        for h in (att.num_heads, att.kv_heads)
    )
    steps = {}
    for fill in (0.1, 1.0):
        width = fill_width(fill, max_pages)
        lengths = jnp.full((slots,), width * page_size - 1, jnp.int32)  # room for one token
        table = jnp.arange(slots * max_pages, dtype=jnp.int32).reshape(slots, max_pages)[:, :width]
        empty = paged.init_paged_cache(
            slots, slots * max_pages, page_size, width, att.kv_heads, att.head_dim
        )._replace(page_table=jnp.copy(table), lengths=jnp.copy(lengths))  # its own buffers
        # generate_many's step: the fused paged kernel where it runs (no work list), else
        # the work list of the key blocks the rows hold
        blocks = None
        if not paged.fused(empty):
            blocks = jnp.asarray(paged.block_list(np.asarray(lengths) + 1, page_size))

        def pools(pool=empty.k_pages):
            return [tuple(jnp.zeros_like(pool) for _ in "kv") for _ in model.trf_blocks]

        def paged_call(p, blocks=blocks, lengths=lengths):
            return paged_fn(state, p, full_table, lengths, tokens, blocks)[1]

        def table_call(p, table=table, lengths=lengths):
            return paged_fn(state, p, table, lengths, tokens)[1]

        def layer_call(c, lengths=lengths):
            return layer_fn(c, q, kv, kv)[1]._replace(lengths=jnp.copy(lengths))

        filled = jnp.full((slots,), round(fill * capacity) - 1, jnp.int32)
        caches = [
            kvcache.init_cache(slots, capacity, att.kv_heads, att.head_dim)._replace(
                lengths=jnp.copy(filled)
            )
            for _ in model.trf_blocks
        ]

        def contiguous(c, filled=filled):
            c = contiguous_fn(state, c, tokens)[1]
            # a copy per layer: one buffer donated twice is an error
            return [x._replace(lengths=jnp.copy(filled)) for x in c]

        steps[("paged", fill)] = (paged_call, pools())
        if fill == 1.0:
            # the same step with one page per row: what a step costs whatever the tokens
            # held (the weights, the matmuls, dispatch). Placed after the 100% step, so
            # the other candidates keep the neighbours they had before this row was added.
            floor = jnp.full((slots,), page_size - 1, jnp.int32)
            floor_blocks = None
            if blocks is not None:
                floor_blocks = jnp.asarray(paged.block_list(np.asarray(floor) + 1, page_size))
            steps[("one page", 0.0)] = (
                partial(paged_call, blocks=floor_blocks, lengths=floor),
                pools(),
            )
        steps[("table", fill)] = (table_call, pools())
        steps[("contiguous", fill)] = (contiguous, caches)
        steps[("layer", fill)] = (layer_call, empty)
    medians, times = timed_modes(steps, repeats)
    pair = ("paged", 0.1), ("paged", 1.0)
    return medians, [_ratio_quartiles(t, *pair, repeats) for t in times]


def fill_width(fill: float, max_pages: int) -> int:
    """Pages per row of the decode-step candidates filled to ``fill`` of the capacity."""
    return max(1, round(fill * max_pages))


def step_bytes(model, rows: int, filled: int) -> tuple[int, int]:
    """``(weights, kv)``: the bytes one decoding step of ``rows`` rows reads, each row
    holding ``filled`` positions: every weight but the embedding tables (it gathers a row
    of each per token) and every layer's keys and values of those positions."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    tables = [
        m.embedding.get_value() for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Embed)
    ]
    weights = sum(x.nbytes for x in params) - sum(x.nbytes for x in tables)
    att = model.trf_blocks[0].att
    per_position = 2 * att.kv_heads * att.head_dim * jnp.dtype(model.dtype).itemsize
    return weights, rows * filled * len(model.trf_blocks) * per_position


def greedy_pick(slots: int, vocab: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the greedy pick of ``[slots, vocab]`` float32 logits: jattn's
    (``generate.sample_next``, on CPU the kernel ``jattn.kernels.cpu.argmax``) and
    ``jnp.argmax``'s, jitted and called in turn (:func:`interleaved_medians`)."""
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(slots, vocab)), jnp.float32)
    ours, peer = jax.jit(generate.sample_next), jax.jit(partial(jnp.argmax, axis=-1))
    medians, _, _ = interleaved_medians(
        {"ours": (lambda _: ours(logits), None), "peer": (lambda _: peer(logits), None)}, repeats
    )
    return medians["ours"], medians["peer"]


def book_qwen3(cfg, prompts, max_new, batch: int):
    """The book's batched KV-cache generation; seconds, and the torch model (for weights)."""
    import torch
    from llms_from_scratch.kv_cache_batched.generate import generate_text_simple
    from llms_from_scratch.kv_cache_batched.qwen3 import Qwen3Model

    torch.manual_seed(123)
    model = Qwen3Model(cfg).eval()
    padded = np.zeros((len(prompts), max(p.size for p in prompts)), np.int64)
    for i, p in enumerate(prompts):
        padded[i, : p.size] = p
    idx = torch.from_numpy(padded)
    generate_text_simple(model, idx[:2, :16], 2)  # warm-up
    t = time.perf_counter()
    for lo in range(0, len(prompts), batch):
        generate_text_simple(model, idx[lo : lo + batch], max(max_new))
    return time.perf_counter() - t, model


# ----------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="16 requests, prompts 16-256, outputs 16-128"
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--chunk",
        type=int,
        default=PREFILL_CHUNK,
        help="prefill chunk (tokens); generate_many's default",
    )
    p.add_argument(
        "--pool", type=float, default=0.5, help="pool size, fraction of slots x capacity"
    )
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--book-batch", type=int, default=64)
    p.add_argument("--step-repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5, help="timed continuous/static rounds")
    p.add_argument("--no-book", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    prompt_range, out_range = ((16, 256), (16, 128)) if args.quick else ((16, 512), (16, 256))
    if args.quick:
        args.requests, args.slots = 24, 12
    load_before, started = load(), datetime.now(UTC)
    gflops = sgemm_gflops()
    prompts, max_new = workload(args.requests, prompt_range, out_range, args.vocab)
    capacity = max(p.size + m - 1 for p, m in zip(prompts, max_new, strict=True))
    args.num_pages = pool_pages(args.pool, args.slots, capacity, args.page_size)

    gpt = models.GPTModel(gpt2_cfg(args.vocab), rngs=nnx.Rngs(0))
    _, first, _, compiles_first = continuous(gpt, prompts, max_new, args)
    eos = pick_eos(first)
    # the run with eos ids schedules differently: its step shapes compile here, untimed
    compiles_eos = continuous(gpt, prompts, max_new, args, eos)[3]
    static_run = static_batch(gpt, prompts, max_new)
    # continuous and static in turn, --rounds times: background load hits both alike
    timed_c, timed_s, compiles_timed = [], [], 0
    for _ in range(args.rounds):
        settle()  # neither run pays for the other's buffers being released
        seconds, outs, stats, compiles = continuous(gpt, prompts, max_new, args, eos)
        timed_c.append(seconds)
        compiles_timed += compiles
        settle()
        seconds, static = static_run()
        timed_s.append(seconds)
    seconds_c, seconds_s = statistics.median(timed_c), statistics.median(timed_s)
    useful = sum(len(o) for o in outs)
    stopped = sum(len(o) < m for o, m in zip(outs, max_new, strict=True))
    agree = np.mean([o.tolist() == static[i, : len(o)].tolist() for i, o in enumerate(outs)])
    (steps, runs, steady), spread = decode_steps(
        gpt, args.slots, capacity, args.page_size, args.step_repeats
    )
    int8_error, int8_agree = int8_logit_error(gpt, args.page_size)
    pick, peer_pick = greedy_pick(args.slots, args.vocab, 10 * args.step_repeats)

    rows = [
        ("tokens/s, continuous batching (`generate_many`, "
         f"{args.slots} slots)", f"{useful / seconds_c:.0f}", ""),
        (f"tokens/s, one static batch of {args.requests} (`generate`)", f"{useful / seconds_s:.0f}", ""),
        ("continuous / static (medians of "
         f"{args.rounds} alternating rounds; range {min(timed_s) / max(timed_c):.2f}-"
         f"{max(timed_s) / min(timed_c):.2f}x)", f"**{seconds_s / seconds_c:.2f}x**", ">= 1.5x"),
    ]  # fmt: skip
    held, pool = stats.peak_pages * args.page_size, args.num_pages * args.page_size
    floor = steps[("one page", 0.0)]  # the step's cost that does not follow the tokens held
    max_pages = paged.pages_needed(capacity, args.page_size)
    weights, _ = step_bytes(gpt, args.slots, 0)
    kv = {  # the rows' lengths in decode_steps' candidates, the new token included
        f: step_bytes(gpt, args.slots, fill_width(f, max_pages) * args.page_size)[1]
        for f in (0.1, 1.0)
    }
    rows += [
        (f"KV positions held at peak / `slots x capacity` ({args.slots} x {capacity})",
         f"**{held / (args.slots * capacity):.3f}x**", "<= 0.5x"),
        ("KV positions allocated (the pool) / `slots x capacity`",
         f"{pool / (args.slots * capacity):.3f}x", ""),
        (f"KV positions held at peak / static `batch x capacity` ({args.requests} x {capacity})",
         f"{held / (args.requests * capacity):.2f}x", ""),
        ("decode step (whole model, greedy pick), paged (`generate_many`'s: the fused paged "
         "kernel, else over the key blocks held), 10% / 100% filled",
         paged_ratio(steps, spread[0], 1), "<= 0.3x"),
        (f"the same step in runs of {BURST} consecutive steps (as `generate_many` runs them; "
         "the first of each run left out), 10% / 100% filled",
         paged_ratio(runs, spread[1], 1), "<= 0.3x"),
        (f"the same step in runs of {STEADY} consecutive steps, the first {STEADY_SKIP} "
         "left out (once the caches hold what a step at that fill reuses), 10% / 100% filled",
         paged_ratio(steady, spread[2], 2), "<= 0.3x"),
        ("the same step (one call at a time) with one page per row: the part of a step that "
         "does not follow the tokens held",
         f"{floor * 1e3:.1f} ms", ""),
        ("the part above it, 10% / 100% filled",
         f"{(steps[('paged', 0.1)] - floor) / (steps[('paged', 1.0)] - floor):.2f}x", ""),
        ("the one-page step / the 100% step: the least the 10% / 100% ratio can be (the 10% "
         "step runs the same program on more keys; a faster attention, shortening the 100% "
         "step, raises it)",
         f"{floor / steps[('paged', 1.0)]:.2f}x", ""),
        ("bytes a step reads, 10% / 100% filled: the weights (all but the embedding tables) "
         "and the KV positions held; (weights + KV 10%) / (weights + KV 100%) is the ratio of "
         "a step bound by memory traffic alone",
         f"{(weights + kv[0.1]) / (weights + kv[1.0]):.2f}x ({weights / 1e6:.1f} MB weights; "
         f"KV {kv[0.1] / 1e6:.1f} / {kv[1.0] / 1e6:.1f} MB)", ""),
        (f"the one-page step, calls {STEADY_SKIP + 1}-{STEADY} of a run: the floor with a "
         "step's weights in the caches; over the 100% step alike; and calls "
         f"2-{BURST} / calls {STEADY_SKIP + 1}-{STEADY}: what the candidate before still costs",
         f"{steady[('one page', 0.0)] * 1e3:.2f} ms; "
         f"{steady[('one page', 0.0)] / steady[('paged', 1.0)]:.2f}x; "
         f"{runs[('one page', 0.0)] / steady[('one page', 0.0)]:.2f}x", ""),
        ("decode step, paged over a page table 10% / 100% of the capacity wide",
         f"{steps[('table', 0.1)] / steps[('table', 1.0)]:.2f}x "
         f"({steps[('table', 0.1)] * 1e3:.1f} / {steps[('table', 1.0)] * 1e3:.1f} ms)", ""),
        ("one attention layer's step (`paged.update_and_attend`), 10% / 100% filled",
         f"{steps[('layer', 0.1)] / steps[('layer', 1.0)]:.2f}x "
         f"({steps[('layer', 0.1)] * 1e3:.2f} / {steps[('layer', 1.0)] * 1e3:.2f} ms)", ""),
        ("decode step, contiguous `KVCache`, 10% / 100% filled",
         f"{steps[('contiguous', 0.1)] / steps[('contiguous', 1.0)]:.2f}x "
         f"({steps[('contiguous', 0.1)] * 1e3:.1f} / {steps[('contiguous', 1.0)] * 1e3:.1f} ms)", ""),
    ]  # fmt: skip
    rows.append(
        (f"greedy pick of [{args.slots}, {args.vocab}] logits (`sample_next`: on CPU "
         "`jattn.kernels.cpu.argmax`) / `jnp.argmax`",
         f"{pick / peer_pick:.2f}x ({pick * 1e6:.0f} / {peer_pick * 1e6:.0f} us)", ""),
    )  # fmt: skip
    rows.append(
        ("int8 KV pages: max logit error / logit std (prefill 128 + 1 step; greedy agreement)",
         f"{int8_error:.3f} ({int8_agree:.0%})", "reported"),
    )  # fmt: skip
    if not args.no_book:
        cfg = qwen3_cfg(args.vocab)
        seconds_b, torch_model = book_qwen3(cfg, prompts, max_new, args.book_batch)
        qwen = models.from_book("qwen3", cfg, torch_model.state_dict())
        continuous(qwen, prompts, max_new, args)  # compile
        seconds_q, outs_q, _, _ = continuous(qwen, prompts, max_new, args)
        useful_q = sum(len(o) for o in outs_q)
        rows += [
            ("tokens/s, book `kv_cache_batched` Qwen3 (PyTorch)", f"{useful_q / seconds_b:.0f}", ""),
            ("tokens/s, `generate_many` on `Qwen3Model` (same weights)", f"{useful_q / seconds_q:.0f}", ""),
            ("`generate_many` / book", f"**{seconds_b / seconds_q:.2f}x**", ">= 1.5x"),
        ]  # fmt: skip
    rows += [
        ("compilations, first run / its run with the eos ids (untimed) / all timed runs",
         f"{compiles_first} / {compiles_eos} / {compiles_timed}",
         "constant in requests"),
        ("step shapes compiled (rows, tokens, pages or key blocks)", f"{len(stats.programs)}", ""),
    ]  # fmt: skip
    command = "PYTHONPATH=$PWD python benchmarks/bench_serving.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{command.strip()}`, {started:%Y-%m-%d %H:%M} UTC. CPU: {cpu_description()}; "
        f"XLA sgemm {gflops:.0f} GFLOP/s (1024^3, this run); jax {jax.__version__}. Load "
        f"average (1/5/15 min) {load_before} before, {load()} after (this run's own work "
        "included: it keeps both cores busy).",
        "",
        f"Workload: {args.requests} requests, prompts {prompt_range[0]}-{prompt_range[1]} "
        f"tokens, max_new_tokens {out_range[0]}-{out_range[1]} (seed 0); {stopped} stopped "
        f"early on eos_id {eos}; {useful} useful tokens. GPT-2 scaled: 4 layers x 128, 4 "
        f"heads, vocabulary {args.vocab}, context 1024; page size {args.page_size}, prefill "
        f"chunk {args.chunk}, pool {args.num_pages} pages ({args.pool:.0%} of slots x "
        f"capacity). Static-batch rows equal to the continuous ones: {agree:.0%}.",
        "",
        "| figure | measured | goal |",
        "|---|---|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        with open(RESULTS, "w") as f:
            f.write("# Serving: continuous batching and the paged KV cache\n\n" + text)


if __name__ == "__main__":
    main()
