"""Continuous batching: many prompts through a fixed number of slots and a paged KV cache.

:func:`generate_many` serves a list of requests (prompts of different lengths, each with
its own ``max_new_tokens``) the way serving engines do (vLLM's scheduler, in small):

* a fixed number of **slots** decode together, one token per slot per step;
* a request that ends (``max_new_tokens`` reached, or its next token is an ``eos_id``)
  frees its slot and its pages at once, and the first waiting request takes the slot;
  requests wait in the order of their ``max_new_tokens``, longest first (the results come
  in the order of the prompts): the last requests to start are short ones, so the end of
  the run, when few slots are busy, is short;
* new requests' prompts are **prefilled in chunks** of ``prefill_chunk`` tokens between
  two decoding steps of the others, so the running requests keep decoding; the next chunk
  of every prompt still prefilling (up to ``prefill_rows``) runs in one ``[rows,
  tokens]`` step, so a burst of new requests costs a few calls, not one per chunk;
* the keys and values live in a :class:`jattn.paged.PagedKVCache` per layer: pages are
  taken from a free list as a request's tokens arrive and given back when it ends, so the
  memory held follows the tokens held; with ``share_prefixes`` a request whose prompt
  starts with full pages another live request already wrote reuses those pages (reference
  counts) and prefills only the rest; a request that could share pages another request
  is still writing waits for them rather than writing its own copy.

**Fixed shapes.** Two programs run: a decoding step on ``[slots, 1]`` tokens and a prefill
step on ``[rows, tokens]``, ``rows`` a power of two or ``prefill_rows`` (the rows past the
prompts prefilling are padding that reads and writes nothing), ``tokens`` the fewest of
16, 32, ..., ``prefill_chunk`` that hold the step's longest piece of prompt (a short
prompt is not padded to the whole chunk). On CPU with jattn's fused kernel
(:func:`jattn.paged.fused`) a decoding step reads each slot's pages in place up to its
length (:func:`jattn.kernels.cpu.paged_attention`) over the whole page table, one shape;
without it, it attends over a work list of key blocks (:func:`jattn.paged.block_list`:
each slot's blocks up to its length, padded to one of a few counts). Either way its cost
follows the tokens the slots hold, not ``slots`` times the longest of them; a prefill
step attends over a page-table width taken from a few buckets (powers of two of pages),
the smallest that holds its longest row. So the number of compilations is bounded by the
number of counts, row counts, token lengths and widths, whatever the number of requests.

**Admission and preemption** (vLLM's policy, recomputing). A waiting request is admitted
when the free pages, less those the running prompts still need and one page of headroom
per running request, hold its prompt; pages are only taken when tokens arrive. When a
request needs a page and none is free, the request admitted last is **preempted**: its
pages are freed and it goes back to the head of the queue, to prefill its prompt and the
tokens it has generated again when it is readmitted (the same logits, so the same next
token as if it had kept its pages, up to the float rounding of a chunked prefill against
a decoding step). The request admitted first is never preempted while others run, so the
run always advances.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn import generate as jgen
from jattn import paged
from jattn.models.base import LanguageModel

__all__ = ["ServingStats", "generate_many"]

Array = jax.Array

# generate_many's default cap on the prompts prefilled together in one step. Measured on
# benchmarks/bench_serving.py (16 slots, one core, 9 rounds in rotated order): the run
# took 0.98x the time of one prompt per step with 4 rows, 1.00x with 16 (within the
# noise); prefilling every prompt to its end before each decoding step was no faster.
# Prefill steps are compute-bound there, so rows share little more than the call; 4 rows
# keep the padding and the number of compiled shapes small.
PREFILL_ROWS = 4

# generate_many's default prefill chunk (capped at the model's context), and the shortest
# token length a prefill step takes: a step runs the fewest of 16, 32, ..., the chunk that
# hold its longest piece of prompt. Measured with benchmarks/ab_serving.py (bench_serving's
# workload, 16 slots, AVX-512 EPYC, 9 alternating rounds in one process): chunks of 256
# with those lengths took 0.89x the time of chunks of 64 padded whole (66 prefill steps
# against 157, 471 decoding steps against 493). Whole chunks of 256 gave 0.94-0.97x; the
# lengths keep prompts shorter than the chunk from paying for it (prompts of 4-40 tokens:
# 0.94x in separate processes, the same compilations). A longer chunk holds the decoding
# rows up for longer in each prefill step (about 3 ms for [4, 64], 7.5 ms for [4, 256]
# there); 256 is also the longest chunk the fused CPU kernel takes in place
# (jattn.paged.fused).
PREFILL_CHUNK = 256
MIN_CHUNK = 16


class ServingStats(NamedTuple):
    """What a :func:`generate_many` run did (from ``return_stats=True``).

    Attributes:
      decode_steps: decoding steps run (each one token for every decoding slot).
      prefill_chunks: prefill chunks run (one prompt's ``prefill_chunk`` tokens each).
      prefill_steps: prefill steps run (calls; each runs the chunks of up to
        ``prefill_rows`` prompts together).
      peak_pages: the most pages held at once.
      mean_pages: pages held, averaged over the steps.
      num_pages: pages in the pool.
      page_size: positions per page.
      shared_pages: page references taken from another request's prompt (prefix sharing).
      preemptions: times a running request gave its pages back to let another go on.
      recomputed: tokens prefilled again after a preemption.
      programs: the step shapes run, ``(rows, tokens, n)`` each: ``(slots, 1, n)`` a
        decoding step over ``n`` key blocks (or ``n`` pages through the fused kernel),
        ``(rows, prefill_chunk, n)`` a prefill step of ``rows`` rows (a power of two or
        ``prefill_rows``) over ``n`` pages; one compilation each.
    """

    decode_steps: int
    prefill_chunks: int
    prefill_steps: int
    peak_pages: int
    mean_pages: float
    num_pages: int
    page_size: int
    shared_pages: int
    preemptions: int
    recomputed: int
    programs: tuple[tuple[int, int, int], ...]


# ----------------------------------------------------------------------------------------
# Checks (once, at the entry)
# ----------------------------------------------------------------------------------------


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    return int(value)


def _check_prompts(model: LanguageModel, prompts) -> list[np.ndarray]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise TypeError(
            "prompts must be a non-empty list of token id sequences (one per request), got "
            f"{type(prompts).__name__}."
        )
    vocab, out = model.cfg.vocab_size, []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.size < 1 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(
                f"prompts[{i}] must be a non-empty 1-D sequence of int token ids, got "
                f"{a.dtype} {a.shape}."
            )
        if a.min() < 0 or a.max() >= vocab:
            raise ValueError(
                f"prompts[{i}] holds ids from {a.min()} to {a.max()}; they must be in [0, {vocab}) "
                "(cfg['vocab_size'])."
            )
        out.append(a.astype(np.int32))
    return out


def _check_max_new(max_new_tokens, n: int) -> list[int]:
    if hasattr(max_new_tokens, "ndim") and hasattr(max_new_tokens, "dtype"):  # an array
        max_new_tokens = np.asarray(max_new_tokens).tolist()  # an int, or a list per prompt
    if isinstance(max_new_tokens, Sequence):
        if len(max_new_tokens) != n:
            raise ValueError(
                f"max_new_tokens must be one int or one per prompt ({n}), got "
                f"{len(max_new_tokens)} values."
            )
        return [_positive_int(m, f"max_new_tokens[{i}]") for i, m in enumerate(max_new_tokens)]
    return [_positive_int(max_new_tokens, "max_new_tokens")] * n


def _buckets(most: int, fine: bool = False) -> tuple[int, ...]:
    """The sizes a step's shape may take: powers of two below ``most`` (with ``fine``, and
    each one and a half times one), and ``most``: a few shapes, each padded at most 2x
    (1.5x)."""
    out, w = [], 1
    while w < most:
        out += [w, w + w // 2] if fine and w > 1 else [w]
        w *= 2
    return (*sorted(x for x in out if x < most), most)


# ----------------------------------------------------------------------------------------
# The compiled step
# ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _step_fn(graphdef, treedef, temperature: float, top_k: int | None):
    """The compiled step of one model structure and sampling mode (see :func:`_step`).

    The model's structure is bound here once rather than passed as a static argument:
    jit would hash the ``GraphDef`` on every call (about a third of a millisecond, as
    much as a small decoding step's attention), and the state travels as its flat leaves.
    """

    def step(leaves, pools, table, lengths, blocks, tokens, num_new, key, ids):
        state = jax.tree.unflatten(treedef, leaves)
        return _step(
            graphdef, state, pools, table, lengths, blocks, tokens, num_new, key, ids,
            temperature=temperature, top_k=top_k,
        )  # fmt: skip

    return jax.jit(step, donate_argnames="pools")


def _step(
    graphdef, state, pools, table, lengths, blocks, tokens, num_new, key, ids, *, temperature, top_k
):
    """Runs a chunk through the model on paged caches and picks each row's next token.

    Args:
      graphdef, state: the model without caches (``nnx.split``).
      pools: per layer ``(k_pages, v_pages)``, and ``(k_scales, v_scales)`` with int8
        pages (donated: written in place).
      table: int32 ``[B, W]``: the rows' page tables, ``W`` pages wide.
      lengths: int32 ``[B]``: tokens each row holds before the chunk.
      blocks: None, or int32 ``[N, 2]``: the key blocks to attend (``paged.block_list``).
      tokens: int32 ``[B, T]``; ``num_new`` int32 ``[B]`` of them are real per row.
      key: the run's ``jax.random`` key, or None (greedy).
      ids: int32 ``[B, 2]``: each row's request index and the index of the token it picks,
        folded into ``key`` (so a request's tokens do not depend on its slot or step).

    Returns:
      ``(next_tokens int32 [B], pools)``.
    """
    model = nnx.merge(graphdef, state)
    for block, (k_pages, v_pages, *scales) in zip(model.trf_blocks, pools, strict=True):
        block.att.cache = nnx.Cache(
            paged.PagedKVCache(k_pages, v_pages, table, lengths, *scales, blocks=blocks)
        )
    # [B, V]: the logits after each row's last real token (the output head runs there only)
    last = model(
        tokens, deterministic=True, decode=True, num_new=num_new,
        logits_at=jnp.maximum(num_new - 1, 0),
    )  # fmt: skip
    if key is None:
        picked = jgen.sample_next(last)
    else:

        def one(row_logits, request_and_index):
            k = jax.random.fold_in(
                jax.random.fold_in(key, request_and_index[0]), request_and_index[1]
            )
            return jgen.sample_next(row_logits, k, temperature=temperature, top_k=top_k)

        picked = jax.vmap(one)(last, ids)
    return picked, [_pool(block.att.cache.get_value()) for block in model.trf_blocks]


def _pool(cache: paged.PagedKVCache) -> tuple[Array, ...]:
    """A layer's pool arrays: ``(k_pages, v_pages)``, and the scales of int8 pages."""
    if cache.k_scales is None:
        return cache.k_pages, cache.v_pages
    return cache.k_pages, cache.v_pages, cache.k_scales, cache.v_scales


def _cache(pool: tuple[Array, ...]) -> paged.PagedKVCache:
    """A layer's pool as a (tableless) paged cache, to ask :func:`jattn.paged.fused`."""
    k_pages, v_pages, *scales = pool
    return paged.PagedKVCache(
        k_pages, v_pages, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), *scales
    )


def _attend_options(att) -> dict:
    """The attention keywords of a layer's cached call that :func:`jattn.paged.fused` reads."""
    return dict(
        implementation=getattr(att, "attention_implementation", None),
        dtype=getattr(att, "dtype", None),
        precision=getattr(att, "precision", None),
    )


# ----------------------------------------------------------------------------------------
# The host side: slots, pages, requests
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Pages:
    """The page pool's bookkeeping: a free list, reference counts, shareable prompt pages."""

    num_pages: int
    size: int
    free: list[int] = dataclasses.field(default_factory=list)
    refs: np.ndarray = None  # int [num_pages]
    prefix: dict = dataclasses.field(default_factory=dict)  # prompt prefix -> page
    prefix_of: dict = dataclasses.field(default_factory=dict)  # page -> prompt prefix

    def __post_init__(self):
        self.free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.refs = np.zeros(self.num_pages, np.int64)

    def take(self) -> int:
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def share(self, page: int) -> None:
        self.refs[page] += 1

    def release(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)
            self.prefix.pop(self.prefix_of.pop(page, None), None)

    def held(self) -> int:
        return self.num_pages - len(self.free)


@dataclasses.dataclass
class _Request:
    index: int
    prompt: np.ndarray
    max_new: int
    out: list[int] = dataclasses.field(default_factory=list)
    feed: np.ndarray = None  # the tokens to prefill: the prompt (+ ``out`` once preempted)
    fed: int = 0  # tokens of ``feed`` already in the cache
    started: bool = False  # its prefill has begun (shared prefix pages looked up)
    pages: int = 0  # pages in its table (owned or shared)
    admitted: int = -1  # admission order (the last admitted is preempted first)

    def __post_init__(self):
        self.feed = self.prompt


def _common_pages(prompt: np.ndarray, other: np.ndarray, size: int) -> int:
    """Leading full pages of ``prompt`` it could share (keeping one token to prefill) that
    hold the same tokens as ``other``'s."""
    n = min(((prompt.size - 1) // size) * size, other.size)
    differ = np.flatnonzero(prompt[:n] != other[:n])
    return (int(differ[0]) if differ.size else n) // size


def _need(req: _Request, size: int) -> int:
    """Pages a request holds when it ends (prompt + new tokens - 1 positions)."""
    return paged.pages_needed(req.prompt.size + req.max_new - 1, size)


def _to_start(req: _Request, size: int) -> int:
    """Pages a waiting request takes to prefill and write its next token."""
    return min(paged.pages_needed(req.feed.size + 1, size), _need(req, size))


class _Server:
    """Runs the requests through the slots; see :func:`generate_many`."""

    def __init__(
        self, model, requests, slots, eos, sampling, page_size, num_pages, chunk, rows, share,
        int8,
    ):  # fmt: skip
        decoder = nnx.merge(*nnx.split(model))  # a copy: the caller's model keeps its caches
        for block in decoder.trf_blocks:
            if hasattr(block.att, "cache"):
                del block.att.cache
        graphdef, state = nnx.split(decoder)
        self.leaves, treedef = jax.tree.flatten(state)
        _, temperature, top_k = sampling
        self.step = _step_fn(graphdef, treedef, temperature, top_k)
        # the longest max_new_tokens first (the longest-processing-time rule): the last to
        # start are short, so the run's tail, with few slots busy, is short
        self.requests, self.waiting = requests, sorted(requests, key=lambda r: -r.max_new)
        self.slots: list[_Request | None] = [None] * slots
        self.eos, self.sampling, self.chunk, self.share = eos, sampling, chunk, share
        # a prefill step's token length: the fewest of these that hold its longest chunk
        # (a short prompt, or a prompt's last piece, is not padded to the whole chunk)
        self.chunk_lengths = tuple(c for c in _buckets(chunk) if c >= min(MIN_CHUNK, chunk))
        self.pages = _Pages(num_pages, page_size)
        self.max_pages = max(_need(r, page_size) for r in requests)
        self.widths = _buckets(self.max_pages)
        # prefill steps run one of these row counts (never more rows than slots)
        self.prefill_rows = _buckets(min(rows, slots))
        # decoding steps attend over key blocks (paged.block_list), at most this many
        span = paged.block_size(page_size)
        self.block_counts = _buckets(slots * -(-self.max_pages * page_size // span), fine=True)
        # one row past the slots stays empty (no pages, length 0): a prefill step's padding
        # rows point at it, so they read nothing and write nothing
        self.table = np.full((slots + 1, self.max_pages), num_pages, np.int32)
        self.lengths = np.zeros(slots + 1, np.int32)
        self.last = np.zeros(slots, np.int32)
        self.pools = [
            _pool(
                paged.init_paged_cache(
                    1, num_pages, page_size, 1, block.att.kv_heads, block.att.head_dim,
                    dtype=model.dtype, quantized=int8,
                )
            )
            for block in decoder.trf_blocks
        ]  # fmt: skip
        # decoding steps through the fused CPU paged kernel read the pages in place, at a
        # cost that follows the tokens held: no work list (host work, a larger program)
        self.fused = all(
            paged.fused(_cache(pool), None, _attend_options(block.att))
            for pool, block in zip(self.pools, decoder.trf_blocks, strict=True)
        )
        self.decode_steps = self.prefill_chunks = self.prefill_steps = self.shared = 0
        self.admissions = self.preemptions = self.recomputed = 0
        self.held: list[int] = []
        self.programs: set[tuple[int, int, int]] = set()

    # -- pages ---------------------------------------------------------------------------

    def _committed(self) -> int:
        """Pages the running requests are about to take: the rest of their prefill, and a
        page of headroom each for the tokens they generate (no more than they may need)."""
        size, total = self.pages.size, 0
        for r in self.slots:
            if r is not None:
                prefill = max(paged.pages_needed(r.feed.size, size) - r.pages, 0)
                total += min(prefill + 1, _need(r, size) - r.pages)
        return total

    def _grow(self, slot: int, upto: int) -> None:
        """Gives the slot's request pages for positions ``< upto``, preempting the request
        admitted last while none is free (which may be the slot's own)."""
        req = self.slots[slot]
        while req.pages * self.pages.size < upto:
            while not self.pages.free:
                victim = max(
                    (s for s, r in enumerate(self.slots) if r is not None),
                    key=lambda s: self.slots[s].admitted,
                )
                self._preempt(victim)
                if victim == slot:
                    return
            self.table[slot, req.pages] = self.pages.take()
            req.pages += 1

    def _seat(self, upto: dict[int, int]) -> list[int]:
        """Gives each slot's request pages for positions ``< upto[slot]`` (:meth:`_grow`),
        in order; the slots whose requests were not preempted meanwhile."""
        seated = {slot: self.slots[slot] for slot in upto}
        for slot, req in seated.items():
            if self.slots[slot] is req:  # not preempted by an earlier slot's pages
                self._grow(slot, upto[slot])
        return [slot for slot, req in seated.items() if self.slots[slot] is req]

    def _share_prefix(self, slot: int, req: _Request) -> None:
        """Points the slot at live pages holding the same prompt prefix (full pages only,
        keeping at least one prompt token to prefill: its logits give the first token)."""
        size = self.pages.size
        for i in range(self._found_pages(req)):
            page = self.pages.prefix[req.feed[: (i + 1) * size].tobytes()]
            self.pages.share(page)
            self.table[slot, i] = page
            req.pages += 1
            self.shared += 1
        req.fed = req.pages * size
        self.lengths[slot] = req.fed

    def _register_prefix(self, slot: int, req: _Request) -> None:
        """Makes the slot's fully written prompt pages findable by later requests."""
        size = self.pages.size
        for i in range(req.fed // size):
            key = req.feed[: (i + 1) * size].tobytes()
            page = int(self.table[slot, i])
            if key not in self.pages.prefix and page not in self.pages.prefix_of:
                self.pages.prefix[key], self.pages.prefix_of[page] = page, key

    def _found_pages(self, req: _Request) -> int:
        """Leading prompt pages of ``req`` that :meth:`_share_prefix` would find now."""
        size, found = self.pages.size, 0
        while found < (req.feed.size - 1) // size:
            if req.feed[: (found + 1) * size].tobytes() not in self.pages.prefix:
                break
            found += 1
        return found

    def _waits_for_prefix(self, req: _Request) -> bool:
        """Whether ``req`` should not start yet: a request still prefilling will write
        prompt pages ``req`` could share beyond those findable now. Started in the same
        step, both would compute (and hold) the same pages; a step later, ``req`` shares
        them. The prefilling request is started, so it advances: the wait ends."""
        if not self.share:
            return False
        found = self._found_pages(req)
        return any(
            other is not None
            and other.started
            and other.fed < other.feed.size
            and _common_pages(req.feed, other.feed, self.pages.size) > found
            for other in self.slots
        )

    # -- requests ------------------------------------------------------------------------

    def _admit(self) -> None:
        for slot, occupant in enumerate(self.slots):
            if occupant is not None or not self.waiting:
                continue
            req = self.waiting[0]
            if len(self.pages.free) - self._committed() < _to_start(req, self.pages.size):
                return  # the pool is committed; wait for a request to end
            self.waiting.pop(0)
            self.slots[slot] = req
            req.admitted, self.admissions = self.admissions, self.admissions + 1

    def _preempt(self, slot: int) -> None:
        """Frees the slot's pages and puts its request back at the head of the queue, to
        prefill its prompt and the tokens it generated again."""
        req = self.slots[slot]
        self.recomputed += int(self.lengths[slot])
        self._finish(slot)
        req.feed = np.concatenate([req.prompt, np.asarray(req.out, np.int32)])
        req.fed, req.started, req.pages = 0, False, 0
        self.waiting.insert(0, req)
        self.preemptions += 1

    def _finish(self, slot: int) -> None:
        req = self.slots[slot]
        for i in range(req.pages):
            self.pages.release(int(self.table[slot, i]))
        self.table[slot] = self.pages.num_pages
        self.lengths[slot] = 0
        self.slots[slot] = None

    def _emit(self, slot: int, token: int) -> None:
        """A request's next token: ends it (eos, not kept; or the last one) or feeds it back."""
        req = self.slots[slot]
        if token in self.eos:
            return self._finish(slot)
        req.out.append(token)
        if len(req.out) == req.max_new:
            return self._finish(slot)
        self.last[slot] = token

    # -- steps ---------------------------------------------------------------------------

    def _run(self, rows, tokens, num_new, picks, blocked=False):
        """One step on ``rows``; ``blocked``: over the key blocks the rows hold (a
        decoding step), else over the narrowest page table that holds the longest row."""
        after = self.lengths[rows] + num_new  # rows with num_new 0 read nothing they use
        if blocked and self.fused:  # the kernel reads each row's pages up to its length
            width = shape = self.max_pages
            blocks = None
        elif blocked:
            attended = np.where(num_new > 0, after, 0)
            blocks = paged.block_list(attended, self.pages.size, self.block_counts)
            width, shape = self.max_pages, len(blocks)
        else:
            longest = int(after[num_new > 0].max())
            width = next(w for w in self.widths if w * self.pages.size >= longest)
            blocks, shape = None, width
        self.programs.add((*tokens.shape, shape))
        ids = np.array([[r.index, len(r.out)] for r in picks], np.int32)
        # numpy arguments go straight to the program (jnp.asarray would compile a copy per shape)
        picked, self.pools = self.step(
            self.leaves, self.pools, self.table[rows, :width], self.lengths[rows], blocks,
            tokens, num_new, self.sampling[0], ids,
        )  # fmt: skip
        self.lengths[rows] += num_new
        self.held.append(self.pages.held())
        return np.asarray(picked)

    def _prefilling(self) -> list[int]:
        """The slots whose next prompt chunk runs in this prefill step: the first requests
        (in admission order) still prefilling, at most the largest row count; a request that
        starts here looks its shared prefix up now, not at admission (an earlier
        request's prefill has run by now), unless it waits for pages another request is
        still writing (:meth:`_waits_for_prefix`)."""
        candidates = sorted(
            (r.admitted, s)
            for s, r in enumerate(self.slots)
            if r is not None and r.fed < r.feed.size
        )
        chosen = []
        for _, slot in candidates:
            if len(chosen) == self.prefill_rows[-1]:
                break
            req = self.slots[slot]
            if not req.started:
                if self._waits_for_prefix(req):
                    continue
                req.started = True
                if self.share:
                    self._share_prefix(slot, req)
            chosen.append(slot)
        return chosen

    def _prefill(self) -> bool:
        """One prompt chunk of each slot :meth:`_prefilling` picks, in one step of the
        fewest rows in ``prefill_rows`` that hold them; False when none is prefilling."""
        upto = {}
        for slot in self._prefilling():
            req = self.slots[slot]
            upto[slot] = min(req.fed + self.chunk, req.feed.size)
        chosen = self._seat(upto)  # a request preempted for another's pages sits this out
        if not chosen:
            return False
        count = next(c for c in self.prefill_rows if c >= len(chosen))
        rows = np.full(count, len(self.slots))  # padding: the empty row past the slots
        num_new = np.zeros(count, np.int32)
        num_new[: len(chosen)] = [upto[slot] - self.slots[slot].fed for slot in chosen]
        length = next(c for c in self.chunk_lengths if c >= num_new.max())
        tokens = np.zeros((count, length), np.int32)
        picks = [self.requests[0]] * count
        for i, slot in enumerate(chosen):
            req = picks[i] = self.slots[slot]
            tokens[i, : num_new[i]] = req.feed[req.fed : upto[slot]]
            rows[i] = slot
        picked = self._run(rows, tokens, num_new, picks)
        self.prefill_steps += 1
        self.prefill_chunks += len(chosen)
        for i, slot in enumerate(chosen):
            req = self.slots[slot]
            req.fed += int(num_new[i])
            if self.share:
                self._register_prefix(slot, req)
            if req.fed == req.feed.size:
                self._emit(slot, int(picked[i]))
        return True

    def _decode(self) -> None:
        live = self._seat(
            {
                s: int(self.lengths[s]) + 1
                for s, r in enumerate(self.slots)
                if r is not None and r.fed == r.feed.size
            }
        )
        if not live:
            return
        num_new = np.zeros(len(self.slots), np.int32)
        num_new[live] = 1
        picks = [r if r is not None else self.requests[0] for r in self.slots]
        picked = self._run(
            np.arange(len(self.slots)), self.last[:, None].copy(), num_new, picks, blocked=True
        )
        self.decode_steps += 1
        for s in live:
            self._emit(s, int(picked[s]))

    def run(self) -> None:
        while self.waiting or any(r is not None for r in self.slots):
            self._admit()
            if all(r is None for r in self.slots):
                # with every slot free the whole pool is; the entry checked it holds a request
                raise RuntimeError("generate_many: a waiting request found no pages.")
            self._prefill()
            self._decode()

    def stats(self) -> ServingStats:
        return ServingStats(
            decode_steps=self.decode_steps,
            prefill_chunks=self.prefill_chunks,
            prefill_steps=self.prefill_steps,
            peak_pages=max(self.held, default=0),
            mean_pages=float(np.mean(self.held)) if self.held else 0.0,
            num_pages=self.pages.num_pages,
            page_size=self.pages.size,
            shared_pages=self.shared,
            preemptions=self.preemptions,
            recomputed=self.recomputed,
            programs=tuple(sorted(self.programs)),
        )


# ----------------------------------------------------------------------------------------
# The entry
# ----------------------------------------------------------------------------------------


def generate_many(
    model: LanguageModel,
    prompts,
    max_new_tokens,
    *,
    slots: int,
    eos_id=None,
    temperature: float = 0.0,
    top_k: int | None = None,
    key: Array | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    prefill_chunk: int | None = None,
    prefill_rows: int = PREFILL_ROWS,
    share_prefixes: bool = True,
    kv_int8: bool = False,
    return_stats: bool = False,
) -> list[np.ndarray] | tuple[list[np.ndarray], ServingStats]:
    """Generates a continuation for each prompt, ``slots`` requests at a time.

    Args:
      model: a :class:`GPTModel`, :class:`Llama3Model` or :class:`Qwen3Model` (not
        modified; dropout is off).
      prompts: a list of token id sequences of any lengths (1-D, ids in
        ``[0, vocab_size)``), one per request.
      max_new_tokens: an int, or one per prompt: the most tokens a request generates;
        ``len(prompt) + max_new_tokens - 1`` must fit ``context_length``.
      slots: requests decoded together (the batch of the decoding step).
      eos_id: None, a token id or a sequence of ids: a request ends when its next token
        is one of them, which is not kept (the book's ``generate(..., eos_id=)``).
      temperature: 0 (default): greedy, each continuation equal to
        :func:`jattn.models.generate` of its prompt alone (in float32; in bfloat16 the
        two paths' roundings may break a tie between logits differently); otherwise the
        book's sampling.
      top_k: sample among the ``top_k`` largest logits (None: all).
      key: ``jax.random`` key, required when ``temperature > 0``; token ``j`` of request
        ``i`` uses ``fold_in(fold_in(key, i), j)``, so the result does not depend on
        ``slots`` or the order requests were scheduled in.
      page_size: positions per page of the paged KV cache.
      num_pages: pages in the pool (per layer); default enough for ``slots`` requests of
        the longest need. Fewer pages hold less memory: requests then wait for pages, and
        a request that needs a page when none is free preempts the request admitted last
        (its tokens are prefilled again when it is readmitted; module docstring).
      prefill_chunk: the most prompt tokens a prompt feeds per prefill step; default
        ``min(PREFILL_CHUNK, context_length)`` (256). A step runs the fewest of 16, 32,
        ..., ``prefill_chunk`` tokens that hold its longest piece; a longer chunk means
        fewer steps, and a longer wait for the decoding requests during each.
      prefill_rows: the most prompts whose next chunks run together in one prefill step
        (capped at ``slots``); 1 prefills one chunk of one prompt per step.
      share_prefixes: a request whose prompt begins with full pages a live request wrote
        reuses them instead of recomputing them.
      kv_int8: int8 KV pages with per-token, per-head scales (a quarter of float32's
        memory; :mod:`jattn.paged`), dequantized for attention: the logits change slightly,
        so greedy tokens may differ from float pages.
      return_stats: also return :class:`ServingStats`.

    Returns:
      A list (in the order of ``prompts``) of int32 numpy arrays: each continuation
      (without the prompt, without the eos token); with ``return_stats``, ``(that,
      stats)``.

    Raises:
      TypeError, ValueError: a model that is not a jattn model, bad prompts (naming the
        request), a request longer than the context, bad sizes or sampling arguments, a
        pool smaller than one request's need.
    """
    if not isinstance(model, LanguageModel):
        raise TypeError(
            f"model must be a jattn.models model (GPTModel, Llama3Model, Qwen3Model), got "
            f"{type(model).__name__}."
        )
    prompts = _check_prompts(model, prompts)
    max_new = _check_max_new(max_new_tokens, len(prompts))
    slots = _positive_int(slots, "slots")
    page_size = _positive_int(page_size, "page_size")
    context = model.cfg.context_length
    prefill_chunk = min(PREFILL_CHUNK, context) if prefill_chunk is None else prefill_chunk
    prefill_chunk = _positive_int(prefill_chunk, "prefill_chunk")
    prefill_rows = _positive_int(prefill_rows, "prefill_rows")
    if prefill_chunk > context:
        raise ValueError(
            f"prefill_chunk ({prefill_chunk}) must be at most cfg['context_length'] ({context})."
        )
    for i, (p, m) in enumerate(zip(prompts, max_new, strict=True)):
        if p.size + m - 1 > context:
            raise ValueError(
                f"request {i}: a prompt of {p.size} tokens and max_new_tokens={m} need "
                f"{p.size + m - 1} positions, more than cfg['context_length'] = {context}."
            )
    eos_ids, _ = jgen.check_stop(eos_id, None, model.cfg.vocab_size)
    eos = frozenset(np.asarray(eos_ids).tolist())
    if not isinstance(share_prefixes, bool) or not isinstance(kv_int8, bool):
        raise TypeError("share_prefixes and kv_int8 must be True or False.")
    temperature, top_k = jgen.check_sampling(temperature, top_k, key)
    requests = [_Request(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_new, strict=True))]
    biggest = max(_need(r, page_size) for r in requests)
    num_pages = slots * biggest if num_pages is None else _positive_int(num_pages, "num_pages")
    if num_pages < biggest:
        raise ValueError(
            f"num_pages ({num_pages}) is less than the {biggest} pages of {page_size} positions "
            "the longest request needs; pass a larger num_pages or page_size."
        )
    server = _Server(
        model, requests, slots, eos, (None if temperature == 0.0 else key, temperature, top_k),
        page_size, num_pages, prefill_chunk, prefill_rows, share_prefixes, kv_int8,
    )  # fmt: skip
    server.run()
    outputs = [np.asarray(r.out, np.int32) for r in requests]
    return (outputs, server.stats()) if return_stats else outputs
