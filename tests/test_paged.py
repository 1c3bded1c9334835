"""jattn.paged: pages written where the page table says, attention over pages equal to the
contiguous cache and to the float64 numpy reference, modifiers, RoPE modules, overflow.

Page tables are deliberately shuffled (a row's pages are scattered over the pool, and rows
interleave), so a test passes only if every position goes through its own table entry.
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jattn import kvcache as kv
from jattn import mods, paged
from jattn import nnx as jnnx
from jattn.kernels import cpu as cpu_kernels
from jattn.kernels.cpu import adapter as cpu_adapter
from jattn.rope import RoPE
from tests.reference import np_attention

B, H, K, D, PAGE, WIDTH, POOL = 3, 4, 2, 5, 4, 4, 16

jit_paged = jax.jit(paged.update_and_attend, static_argnames=("local_window_size",))
jit_contiguous = jax.jit(kv.update_and_attend)  # the reference: one program a chunk shape


def qkv(rng, length, batch=B):
    def draw(h):
        return jnp.asarray(rng.normal(size=(batch, length, h, D)), jnp.float32)

    return draw(H), draw(K), draw(K)


def shuffled_cache(rng, batch=B, width=WIDTH, pool=POOL):
    """An empty paged cache whose rows own disjoint, shuffled pages (all allocated)."""
    cache = paged.init_paged_cache(batch, pool, PAGE, width, K, D)
    table = rng.permutation(pool)[: batch * width].reshape(batch, width)
    return cache._replace(page_table=jnp.asarray(table, jnp.int32))


def np_causal_rows(q, k, v, lengths):
    """float64 reference: each row's real tokens, causal, concatenated per row."""
    outs = []
    for b, n in enumerate(lengths):
        mask = np.tril(np.ones((n, n), bool))
        outs.append(np_attention(q[b, :n], k[b, :n], v[b, :n], mask=mask))
    return outs


def test_reexported_from_kvcache():
    assert kv.PagedKVCache is paged.PagedKVCache
    assert kv.init_paged_cache is paged.init_paged_cache


def test_init_shapes_and_unallocated_table():
    c = paged.init_paged_cache((2, 3), 7, 4, 5, 2, 8, v_head_dim=6, dtype=jnp.bfloat16)
    assert c.k_pages.shape == (7, 4, 2, 8) and c.v_pages.shape == (7, 4, 2, 6)
    assert c.k_pages.dtype == jnp.bfloat16
    assert c.page_table.shape == (2, 3, 5) and c.lengths.shape == (2, 3)
    np.testing.assert_array_equal(c.page_table, 7)  # every entry unallocated
    assert paged.page_size(c) == 4 and paged.pages_needed(9, 4) == 3


def test_append_writes_through_the_table_and_gather_reads_in_order():
    rng = np.random.default_rng(0)
    cache = shuffled_cache(rng)
    _, k, v = qkv(rng, 11)
    lengths = np.array([11, 3, 7])
    cache = paged.append(cache, k, v, num_new=jnp.asarray(lengths))
    np.testing.assert_array_equal(cache.lengths, lengths)
    table, pool = np.asarray(cache.page_table), np.asarray(cache.k_pages)
    for b, n in enumerate(lengths):
        for p in range(n):  # numpy: position p of row b sits in page table[b, p // PAGE]
            np.testing.assert_array_equal(pool[table[b, p // PAGE], p % PAGE], k[b, p])
    view = paged.gather(cache)
    assert view.keys.shape == (B, WIDTH * PAGE, K, D)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(view.keys[b, :n], k[b, :n])
        np.testing.assert_array_equal(view.values[b, :n], v[b, :n])
    # pages nobody owns stay zero: padding tokens were never written
    owned = set(table.reshape(-1).tolist())
    used = {table[b, p // PAGE] for b, n in enumerate(lengths) for p in range(n)}
    for page in set(range(POOL)) - owned:
        assert not pool[page].any()
    assert used <= owned


def test_unallocated_pages_are_not_written_and_read_zero():
    rng = np.random.default_rng(1)
    cache = paged.init_paged_cache(1, 4, PAGE, 3, K, D)
    cache = cache._replace(page_table=jnp.asarray([[2, 4, 4]], jnp.int32))  # page 1, 2 missing
    _, k, v = qkv(rng, 6, batch=1)
    cache = jax.jit(paged.append)(cache, k, v)
    pool = np.asarray(cache.k_pages)
    np.testing.assert_array_equal(pool[2], k[0, :PAGE])
    assert not np.delete(pool, 2, axis=0).any()  # positions 4, 5 (unallocated) dropped
    view = paged.gather(cache)
    np.testing.assert_array_equal(view.keys[0, PAGE:], 0.0)


def test_unallocated_entries_below_a_rows_length_read_zeros_on_every_path():
    """Entries -1 and num_pages inside a row's length: gather, the XLA path, the work list
    and the fused kernel all read zero keys and values there (not a page counted from the
    pool's end, nor a clamped one), against numpy."""
    rng = np.random.default_rng(7)
    pool = 6
    table = np.array([[3, -1, 1, 5], [2, pool, 0, 4]], np.int32)
    k_pages, v_pages = (rng.normal(size=(pool, PAGE, K, D)).astype(np.float32) for _ in "kv")
    cache = paged.init_paged_cache(2, pool, PAGE, 4, K, D)._replace(
        k_pages=jnp.asarray(k_pages), v_pages=jnp.asarray(v_pages),
        page_table=jnp.asarray(table), lengths=jnp.asarray([12, 10], jnp.int32),
    )  # fmt: skip

    def rows(pages):  # numpy: each row's pages in order, zeros where unallocated
        zero = np.zeros_like(pages[0])
        return np.stack([np.concatenate([pages[t] if 0 <= t < pool else zero for t in row])
                         for row in table])  # fmt: skip

    view = paged.gather(cache)
    np.testing.assert_array_equal(view.keys, rows(k_pages))
    np.testing.assert_array_equal(view.values, rows(v_pages))
    q, k, v = qkv(rng, 1, batch=2)
    for b, n in enumerate([12, 10]):  # the step's token lands on an allocated page
        t = table[b, n // PAGE]
        k_pages[t, n % PAGE], v_pages[t, n % PAGE] = k[b, 0], v[b, 0]
    keys, values = rows(k_pages), rows(v_pages)
    want = np.stack([np_attention(q[b], keys[b, : n + 1], values[b, : n + 1],
                                  mask=np.ones((1, n + 1), bool))
                     for b, n in enumerate([12, 10])])  # fmt: skip
    blocks = jnp.asarray(paged.block_list([13, 11], PAGE))
    calls = {
        "xla": jit_fused(cache, q, k, v, implementation="xla")[0],
        "work list": jit_fused(cache._replace(blocks=blocks), q, k, v, implementation="xla")[0],
    }
    if paged.fused(cache, q, {}):
        calls["fused kernel"] = jit_fused(cache, q, k, v)[0]
    for name, out in calls.items():
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5, err_msg=name)


def test_a_work_list_is_checked_eagerly_and_not_carried_to_the_next_step():
    rng = np.random.default_rng(8)
    cache = shuffled_cache(rng, width=WIDTH, pool=B * WIDTH)
    q, k, v = qkv(rng, 2 * PAGE)
    blocks = jnp.asarray(paged.block_list([2 * PAGE] * B, PAGE))
    out, after = paged.update_and_attend(
        cache._replace(blocks=blocks), q, k, v, implementation="xla"
    )
    assert after.blocks is None  # the list was for this step's lengths alone
    assert paged.append(cache._replace(blocks=blocks), k, v).blocks is None
    want, _ = paged.update_and_attend(cache, q, k, v, implementation="xla")
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    # a row listed with fewer blocks than it holds: a list kept from an earlier step
    span = paged.block_size(PAGE)
    long = paged.init_paged_cache(2, 80, PAGE, 40, K, D)._replace(
        page_table=jnp.arange(80, dtype=jnp.int32).reshape(2, 40),
        lengths=jnp.asarray([span, 3], jnp.int32), blocks=jnp.asarray([[0, 0], [1, 0]]),
    )  # fmt: skip
    one = [x[:2, :1] for x in (q, k, v)]
    with pytest.raises(ValueError, match=r"cache\.blocks misses blocks of row 0"):
        paged.update_and_attend(long, *one, implementation="xla")


def test_eager_mistakes_the_values_reveal_raise():
    rng = np.random.default_rng(9)
    cache = paged.init_paged_cache(1, 4, PAGE, 3, K, D)
    cache = cache._replace(page_table=jnp.asarray([[2, 4, 1]], jnp.int32))
    q, k, v = qkv(rng, PAGE + 2, batch=1)
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 4 is not an allocated page"):
        paged.update_and_attend(cache, q, k, v)
    with pytest.raises(ValueError, match=r"cache\.lengths must be >= 0"):
        paged.append(cache._replace(lengths=jnp.asarray([-1])), k[:, :1], v[:, :1])
    for implementation in (None, "xla"):
        with pytest.raises(ValueError, match="query must have shape"):
            paged.update_and_attend(
                cache, q[:, :2], k[:, :1], v[:, :1], implementation=implementation
            )
    # under jit the chunk past the allocated page is dropped, as documented
    after = jax.jit(paged.append)(cache, k, v)
    np.testing.assert_array_equal(np.asarray(after.k_pages)[2], k[0, :PAGE])
    assert not np.asarray(after.k_pages)[[0, 1, 3]].any()


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_rows_may_share_a_prefix_page_but_never_write_one_another_holds(implementation):
    """Two rows read one prompt page, written once (as generate_many shares prompt pages),
    then write their own pages: each row attends as if it held its own copy. A chunk that
    would write a slot another position holds raises (eager; under jit the writes race)."""
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, PAGE + 3, batch=2)
    k, v = (x.at[1, :PAGE].set(x[0, :PAGE]) for x in (k, v))  # one prompt page for both rows
    table = jnp.asarray([[5, 0, 7], [5, 6, 1]], jnp.int32)
    pc = paged.init_paged_cache(2, 8, PAGE, 3, K, D)._replace(page_table=table)
    _, pc = paged.update_and_attend(pc, *(x[:, :PAGE] for x in (q, k, v)), num_new=[PAGE, 0])
    pc = pc._replace(lengths=jnp.asarray([PAGE, PAGE], jnp.int32))  # row 1 takes the page
    cc = kv.init_cache(2, 3 * PAGE, K, D)
    _, cc = jit_contiguous(cc, *(x[:, :PAGE] for x in (q, k, v)))
    rest = [x[:, PAGE:] for x in (q, k, v)]
    po, after = paged.update_and_attend(pc, *rest, implementation=implementation)
    co, _ = jit_contiguous(cc, *rest)
    np.testing.assert_allclose(po, co, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(after.k_pages)[5], k[0, :PAGE])  # unchanged
    # row 1 writing row 0's next page, or the rest of a prompt page both rows hold
    overlap = pc._replace(page_table=jnp.asarray([[5, 0, 7], [5, 0, 1]], jnp.int32))
    with pytest.raises(ValueError, match=r"row 0 writes position 4 into page 0, slot 0, which "
                       r"row 1 holds as its position 4"):  # fmt: skip
        paged.update_and_attend(overlap, *rest, implementation=implementation)
    partial = pc._replace(lengths=jnp.asarray([PAGE, PAGE - 1], jnp.int32))
    with pytest.raises(ValueError, match=r"row 1 writes position 3 into page 5.*row 0 holds"):
        paged.append(partial, *rest[1:], num_new=[0, 1])
    # one row whose table names a page twice overwrites its own earlier positions
    twice = pc._replace(page_table=jnp.asarray([[5, 5, 7], [2, 6, 1]], jnp.int32))
    with pytest.raises(ValueError, match=r"row 0 writes position 4 into page 5, slot 0, which "
                       r"row 0 holds as its position 0"):  # fmt: skip
        paged.append(twice, *rest[1:], num_new=[1, 0])


@pytest.mark.parametrize("chunked", [False, True])
def test_prefill_and_decode_equal_contiguous_cache_and_numpy(chunked):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 14)
    prompts, steps = np.array([5, 2, 9]), 5
    pc, cc = shuffled_cache(rng), kv.init_cache(B, WIDTH * PAGE, K, D)
    per_row = [[] for _ in range(B)]
    t0 = int(prompts.max())
    chunks = [(0, 4), (4, t0)] if chunked else [(0, t0)]
    done = np.zeros(B, int)
    for lo, hi in chunks:  # ragged prefill, possibly in two chunks
        n = np.clip(prompts - lo, 0, hi - lo)
        sl = slice(lo, hi)
        po, pc = paged.update_and_attend(pc, q[:, sl], k[:, sl], v[:, sl], num_new=jnp.asarray(n))
        co, cc = jit_contiguous(cc, q[:, sl], k[:, sl], v[:, sl], num_new=jnp.asarray(n))
        np.testing.assert_allclose(po, co, rtol=1e-6, atol=1e-6)
        for b in range(B):
            per_row[b].append(np.asarray(po[b, : n[b]]))
        done += n
    for i in range(steps):  # one token per row, each at its own position
        pos = prompts + i
        rows = np.arange(B)
        step = [x[rows, pos][:, None] for x in (q, k, v)]
        po, pc = jit_paged(pc, *step)
        co, cc = jit_contiguous(cc, *step)
        np.testing.assert_allclose(po, co, rtol=1e-6, atol=1e-6)
        for b in range(B):
            per_row[b].append(np.asarray(po[b]))
    np.testing.assert_array_equal(pc.lengths, prompts + steps)
    want = np_causal_rows(q, k, v, prompts + steps)
    for b in range(B):
        np.testing.assert_allclose(np.concatenate(per_row[b]), want[b], rtol=2e-5, atol=2e-5)


def test_modifiers_window_and_sinks_equal_contiguous_cache():
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, 9)
    sinks = jnp.asarray(rng.normal(size=(H,)), jnp.float32)
    score_mod = mods.compose(mods.softcap(3.0), mods.alibi(mods.alibi_slopes(H)))

    def mask_mod(b, h, q_idx, kv_idx):  # depends on absolute positions: every third key hidden
        return (kv_idx % 3 != 1) | (kv_idx == q_idx)

    opts = dict(score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, local_window_size=(4, 0))
    pc, cc = shuffled_cache(rng), kv.init_cache(B, WIDTH * PAGE, K, D)
    n = jnp.asarray([6, 3, 5])
    po, pc = paged.update_and_attend(pc, q[:, :6], k[:, :6], v[:, :6], num_new=n, **opts)
    co, cc = kv.update_and_attend(cc, q[:, :6], k[:, :6], v[:, :6], num_new=n, **opts)
    np.testing.assert_allclose(po, co, rtol=1e-6, atol=1e-6)
    step = [x[:, 6:7] for x in (q, k, v)]
    po, _ = paged.update_and_attend(pc, *step, **opts)
    co, _ = kv.update_and_attend(cc, *step, **opts)
    np.testing.assert_allclose(po, co, rtol=1e-6, atol=1e-6)


def test_pages_behind_a_sliding_window_can_be_freed_and_reused():
    """A sliding window on pages, as the module's docs say: after each step the pages wholly
    behind every later query's window are freed (entry -1 or num_pages) and handed to the
    other row. A pool of 6 pages serves two rows of 8-page tables; every step equals the
    contiguous cache with the same window, and the last one the float64 reference."""
    window, n, pool = 5, 29, 6  # a prefill chunk of 3, then 26 decoding steps
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, n, batch=2)
    pc = paged.init_paged_cache(2, pool, PAGE, 8, K, D)
    cc = kv.init_cache(2, 8 * PAGE, K, D)
    table, free = np.full((2, 8), pool, np.int32), list(range(pool))
    unallocated = (-1, pool)  # row 0 marks freed entries -1, row 1 num_pages
    opts = dict(local_window_size=(window, 0))
    contiguous = jax.jit(functools.partial(kv.update_and_attend, **opts))
    for lo, hi in [(0, 3)] + [(t, t + 1) for t in range(3, n)]:
        for row in range(2):  # pages for the positions this chunk writes
            for i in range(lo // PAGE, paged.pages_needed(hi, PAGE)):
                if not 0 <= table[row, i] < pool:
                    table[row, i] = free.pop()
        chunk = [x[:, lo:hi] for x in (q, k, v)]
        po, pc = jit_paged(pc._replace(page_table=jnp.asarray(table)), *chunk, **opts)
        co, cc = contiguous(cc, *chunk)
        np.testing.assert_allclose(po, co, rtol=1e-6, atol=1e-6)
        for row, held in enumerate(np.asarray(pc.lengths)):
            for i in range((held - window) // PAGE):  # the next query sees [held - window, held]
                if 0 <= table[row, i] < pool:
                    free.append(int(table[row, i]))
                    table[row, i] = unallocated[row]
    np.testing.assert_array_equal(pc.lengths, [n, n])
    # 2 x 29 positions through 6 x 4 slots: free.pop() would have failed without reuse
    assert len(free) < pool - 1
    visible = np.zeros((1, n), bool)
    visible[0, n - 1 - window :] = True
    for row in range(2):
        want = np_attention(q[row, n - 1 :], np.asarray(k[row]), np.asarray(v[row]), mask=visible)
        np.testing.assert_allclose(po[row], want, rtol=2e-5, atol=2e-5)


def test_block_list_covers_each_row_in_order_and_pads():
    span = paged.block_size(16)
    want = [[0, 0], [0, 1], [2, 0], [3, 0], [3, 1], [3, 2]]
    got = paged.block_list([span + 1, 0, 1, 3 * span], 16, num_blocks=8)
    np.testing.assert_array_equal(got, want + [[4, 0]] * 2)  # padding: a row past the batch
    with pytest.raises(ValueError, match="need 6 blocks"):
        paged.block_list([span + 1, 0, 1, 3 * span], 16, num_blocks=5)


@pytest.mark.parametrize("modified", [False, True])
def test_block_work_list_attends_like_the_contiguous_cache(modified):
    """Prefill and decode over a (row, block) work list, with padding entries, rows of
    several blocks, a row with no tokens; with modifiers the page-table path serves it.
    (implementation='xla': the fused CPU paged kernel, which reads the page table itself,
    would serve a plain call.)"""
    page, width = 32, 12  # blocks of 128 positions: up to 3 per row
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, 300)
    pc = shuffled_cache(rng, width=width, pool=B * width)._replace(
        k_pages=jnp.zeros((B * width, page, K, D)), v_pages=jnp.zeros((B * width, page, K, D))
    )
    cc = kv.init_cache(B, width * page, K, D)
    opts = dict(local_window_size=(150, 0), sinks=jnp.ones((H,))) if modified else {}
    opts["implementation"] = "xla"
    # jitted: one program per chunk shape instead of hundreds of eager operations
    paged_call = jax.jit(functools.partial(paged.update_and_attend, **opts))
    contiguous_call = jax.jit(functools.partial(kv.update_and_attend, **opts))
    for lo, hi, n in ((0, 290, [290, 0, 140]), (290, 291, [1, 1, 1]), (291, 292, [1, 0, 1])):
        n = jnp.asarray(n)
        blocks = paged.block_list(np.asarray(pc.lengths + n), page, num_blocks=9)
        chunk = [x[:, lo:hi] for x in (q, k, v)]
        po, pc = paged_call(pc._replace(blocks=jnp.asarray(blocks)), *chunk, num_new=n)
        co, cc = contiguous_call(cc, *chunk, num_new=n)
        np.testing.assert_allclose(po, co, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pc.lengths, [292, 1, 142])
    if not modified:  # the list is what is attended: a row left out attends nothing
        step = [x[:, 292:293] for x in (q, k, v)]
        blocks = paged.block_list(np.asarray(pc.lengths + 1) * np.array([1, 1, 0]), page)
        po, _ = paged_call(pc._replace(blocks=jnp.asarray(blocks)), *step)
        co, _ = contiguous_call(cc, *step)
        np.testing.assert_allclose(po[:2], co[:2], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(po[2], 0.0)


def test_multihead_attention_with_rope_decodes_through_pages():
    """The NNX module (RoPE, GQA) with a paged cache gives the full-sequence output."""
    rng = np.random.default_rng(4)
    att = jnnx.MultiHeadAttention(
        d_in=16, d_out=16, context_length=32, dropout=0.0, num_heads=4, num_kv_heads=2,
        rope=RoPE(theta_base=10_000.0), rngs=nnx.Rngs(0),
    )  # fmt: skip
    x = jnp.asarray(rng.normal(size=(2, 10, 16)), jnp.float32)
    full = att(x, deterministic=True)
    cache = paged.init_paged_cache(2, 8, PAGE, 3, 2, 4)
    att.cache = nnx.Cache(cache._replace(page_table=jnp.asarray([[5, 0, 7], [2, 6, 1]])))
    out = [att(x[:, :7], deterministic=True, decode=True)]
    for t in range(7, 10):
        out.append(att(x[:, t : t + 1], deterministic=True, decode=True))
    np.testing.assert_allclose(jnp.concatenate(out, axis=1), full, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(att.cache.get_value().lengths, [10, 10])


def test_overflow_eager_raises_and_jit_drops():
    rng = np.random.default_rng(5)
    cache = shuffled_cache(rng, batch=1, width=2)
    q, k, v = qkv(rng, 9, batch=1)
    with pytest.raises(ValueError, match="paged KV cache overflow"):
        paged.update_and_attend(cache, q, k, v)
    out, full = jit_paged(cache, q, k, v)
    np.testing.assert_array_equal(full.lengths, [2 * PAGE])
    np.testing.assert_array_equal(out[0, 2 * PAGE :], 0.0)  # the overflowed query attends nothing


def test_bad_input_is_named():
    cache = paged.init_paged_cache(2, 4, PAGE, 2, K, D)
    with pytest.raises(TypeError, match="PagedKVCache"):
        paged.append(kv.init_cache(2, 8, K, D), jnp.zeros((2, 1, K, D)), jnp.zeros((2, 1, K, D)))
    with pytest.raises(ValueError, match="key must have shape"):
        paged.append(cache, jnp.zeros((2, 1, K + 1, D)), jnp.zeros((2, 1, K, D)))
    with pytest.raises(ValueError, match="num_new must be in"):
        paged.append(cache, jnp.zeros((2, 1, K, D)), jnp.zeros((2, 1, K, D)), num_new=[2, 0])
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        paged.init_paged_cache(2, 4, 0, 2, K, D)


def test_int8_pages_round_trip_within_half_a_step_and_attend_close_to_float():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, 10)
    base = shuffled_cache(rng)
    quant = paged.init_paged_cache(B, POOL, PAGE, WIDTH, K, D, quantized=True)
    quant = quant._replace(page_table=base.page_table)
    assert quant.k_pages.dtype == jnp.int8 and quant.k_scales.shape == (POOL, PAGE, K)
    n = jnp.asarray([10, 4, 7])
    fo, _ = paged.update_and_attend(base, q, k, v, num_new=n)
    qo, quant = jax.jit(paged.update_and_attend)(quant, q, k, v, num_new=n)
    view = paged.gather(quant)
    # numpy: each stored vector is within half a quantization step (max|x| / 254) of x
    for b, m in enumerate(np.asarray(n)):
        for got, x in ((view.keys[b, :m], k[b, :m]), (view.values[b, :m], v[b, :m])):
            x = np.asarray(x, np.float64)
            step = np.abs(x).max(-1, keepdims=True) / 127.0
            assert np.all(np.abs(np.asarray(got) - x) <= step / 2 + 1e-6)
    err = np.abs(np.asarray(qo) - np.asarray(fo)).max() / np.abs(np.asarray(fo)).max()
    assert 0 < err < 0.02, err  # int8 changes the output, by under 2% of its range


# ----------------------------------------------------------------------------------------
# The fused CPU paged kernel (jattn.kernels.cpu.paged_attention), which update_and_attend
# takes for plain calls: it reads the pages in place through the page table.
# ----------------------------------------------------------------------------------------

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available() or jax.default_backend() != "cpu",
    reason="the fused CPU kernel is not built",
)


def filled_cache(rng, starts, num_new, *, page, chunk, heads=(4, 2), dim=16, int8=False):
    """A paged cache holding ``starts`` random tokens per row on shuffled pages; pages are
    allocated up to ``starts + num_new`` and the rest of each table is unallocated
    (``num_pages``, or -1 on row 0). Returns the cache and a chunk ``(q, k, v)``."""
    rows, (h, kh) = len(starts), heads
    need = [paged.pages_needed(s + n, page) for s, n in zip(starts, num_new, strict=True)]
    width = max(max(need), 1) + 1
    pool = sum(need) + 2
    cache = paged.init_paged_cache(rows, pool, page, width, kh, dim, quantized=int8)
    table = np.full((rows, width), pool, np.int32)
    table[0] = -1
    ids = iter(rng.permutation(pool))
    for r, n in enumerate(need):
        table[r, :n] = [next(ids) for _ in range(n)]
    cache = cache._replace(page_table=jnp.asarray(table))
    longest = max(max(starts), 1)

    def normal(t, heads):
        return jnp.asarray(rng.normal(size=(rows, t, heads, dim)), jnp.float32)

    cache = paged.append(
        cache, normal(longest, kh), normal(longest, kh), num_new=jnp.asarray(starts)
    )
    return cache, (normal(chunk, h), normal(chunk, kh), normal(chunk, kh))


def np_paged_reference(cache_after, q, starts, num_new, causal):
    """float64: each row's real queries over its written keys (read back dequantized)."""
    full = paged.gather(cache_after)
    keys, values = (np.asarray(x, np.float64) for x in (full.keys, full.values))
    q = np.asarray(q, np.float64)
    rows, t, h, d = q.shape
    group = h // keys.shape[-2]
    out = np.zeros((rows, t, h, values.shape[-1]))
    for r in range(rows):
        length = int(cache_after.lengths[r])
        for i in range(int(num_new[r])):
            seen = min(length, starts[r] + i + 1) if causal else length
            for j in range(h):
                logits = keys[r, :seen, j // group] @ q[r, i, j] * d**-0.5
                w = np.exp(logits - logits.max())
                out[r, i, j] = w @ values[r, :seen, j // group] / w.sum()
    return out


jit_fused = jax.jit(paged.update_and_attend, static_argnames=("is_causal", "implementation"))

FUSED_CASES = [  # (page, chunk, causal, int8, starts, num_new)
    (16, 1, True, False, [0, 37, 5, 100], [0, 1, 1, 1]),  # decode; a row of length 0
    (1, 1, True, False, [3, 20, 0], [1, 1, 1]),  # page size 1
    (16, 5, True, False, [0, 40, 7], [5, 3, 0]),  # prefill chunk with padding queries
    (16, 5, False, False, [9, 0, 33], [2, 5, 4]),  # not causal
    (16, 64, True, False, [0, 70], [64, 30]),  # a longer chunk (two blocks of queries)
    (4, 40, False, True, [10, 0], [40, 33]),  # not causal, int8, two blocks of queries
    (16, 5, True, True, [0, 40, 18], [5, 2, 1]),  # int8 pages
    (16, 1, True, False, [1100, 30], [1, 1]),  # a row over three key splits (512 each)
    (16, 1, True, False, [600, 512], [1, 1]),  # one item past the split size (no split)
    (16, 24, True, False, [520, 3], [24, 2]),  # a chunk whose keys pass 512, one item
    (16, 5, False, True, [1300, 2], [4, 5]),  # splits, GQA chunk, int8, not causal
    # causal chunks whose queries, taken four at a time, see keys across a vector of keys
    # (8 or 16): the ones seeing fewer must weigh the rest zero
    (16, 24, True, False, [5, 2], [24, 20]),
]


@needs_kernel
@pytest.mark.parametrize("case", FUSED_CASES, ids=str)
def test_fused_paged_kernel_equals_numpy_and_the_xla_path(case):
    page, chunk, causal, int8, starts, num_new = case
    rng = np.random.default_rng(len(starts) * 100 + chunk)
    cache, (q, k, v) = filled_cache(rng, starts, num_new, page=page, chunk=chunk, int8=int8)
    assert paged.fused(cache, q, {}) == (chunk <= paged.FUSED_MAX_QUERIES)
    n = jnp.asarray(num_new)
    out, after = jit_fused(cache, q, k, v, num_new=n, is_causal=causal)
    xla, _ = jit_fused(cache, q, k, v, num_new=n, is_causal=causal, implementation="xla")
    want = np_paged_reference(after, q, starts, num_new, causal)
    assert out.dtype == xla.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out, xla, rtol=2e-5, atol=2e-5)
    # the op itself, whatever the chunk's length
    args = (after.page_table, jnp.asarray(starts), n, after.lengths)
    scales = dict(k_scales=after.k_scales, v_scales=after.v_scales)
    op = jax.jit(functools.partial(cpu_kernels.paged_attention, is_causal=causal, **scales))
    np.testing.assert_allclose(
        op(q, after.k_pages, after.v_pages, *args), want, rtol=2e-5, atol=2e-5
    )
    for r, m in enumerate(num_new):  # padding queries (and rows of length 0) give zeros
        np.testing.assert_array_equal(out[r, m:], 0.0)


@needs_kernel
@pytest.mark.parametrize("dim", [32, 40, 64])
def test_fused_paged_kernel_equals_numpy_past_one_vector_of_head_dim(dim):
    """Head dims of two vectors or more (values accumulated two vectors at a time, then
    one, then by column) and dims no multiple of a vector (logits key by key), decoding
    (one query per kv head) and in a GQA chunk."""
    rng = np.random.default_rng(dim)
    calls = (  # chunk, starts, num_new, (heads, kv heads)
        (1, [37, 100, 5], [1, 1, 1], (4, 4)),
        (6, [5, 30], [6, 4], (4, 2)),
    )
    for chunk, starts, num_new, heads in calls:
        cache, (q, k, v) = filled_cache(
            rng, starts, num_new, page=16, chunk=chunk, heads=heads, dim=dim
        )
        out, after = jit_fused(cache, q, k, v, num_new=jnp.asarray(num_new))
        want = np_paged_reference(after, q, starts, num_new, causal=True)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_fused_paged_kernel_direct_call_and_a_work_list():
    """The public op against the XLA formulation (unallocated entries as -1 too), and
    update_and_attend with a work list takes the fused kernel with the same result."""
    rng = np.random.default_rng(3)
    starts, num_new = [50, 0, 200], [1, 1, 0]
    cache, (q, k, v) = filled_cache(rng, starts, num_new, page=16, chunk=1)
    blocks = paged.block_list(np.asarray(starts) + num_new, 16, num_blocks=8)
    a, _ = jit_fused(
        cache._replace(blocks=jnp.asarray(blocks)), q, k, v, num_new=jnp.asarray(num_new)
    )
    b, after = jit_fused(cache, q, k, v, num_new=jnp.asarray(num_new))
    np.testing.assert_array_equal(a, b)
    args = (after.k_pages, after.v_pages, after.page_table, jnp.asarray(starts),
            jnp.asarray(num_new), after.lengths)  # fmt: skip
    got = jax.jit(cpu_kernels.paged_attention)(q, *args)
    np.testing.assert_array_equal(got, b)


@needs_kernel
@pytest.mark.parametrize("int8", [False, True])
def test_fused_paged_kernel_reads_a_rows_kv_heads_together_with_the_same_bits(int8):
    """A decoding step over several rows takes all kv heads of a row in one work item
    (whole token records); a row alone takes them one item each. Each kv head's sums run
    in the same order either way, so the rows' outputs are the same bits."""
    rng = np.random.default_rng(9)
    starts, num_new = [30, 200, 1100, 70], [1, 1, 1, 1]  # 1100: three key splits
    cache, (q, k, v) = filled_cache(rng, starts, num_new, page=16, chunk=1, heads=(8, 4), int8=int8)
    _, after = jit_fused(cache, q, k, v, num_new=jnp.asarray(num_new))
    scales = dict(k_scales=after.k_scales, v_scales=after.v_scales)
    op = jax.jit(functools.partial(cpu_kernels.paged_attention, **scales))
    pools = (after.k_pages, after.v_pages)
    per_row = (after.page_table, jnp.asarray(starts), jnp.asarray(num_new), after.lengths)
    together = op(q, *pools, *per_row)
    alone = [op(q[r : r + 1], *pools, *(x[r : r + 1] for x in per_row)) for r in range(4)]
    np.testing.assert_array_equal(together, np.concatenate(alone))
    want = np_paged_reference(after, q, starts, num_new, causal=True)
    np.testing.assert_allclose(together, want, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_fused_paged_kernel_in_half_precision_gives_the_xla_paths_dtype():
    rng = np.random.default_rng(4)
    cache, chunk = filled_cache(rng, [30, 3], [1, 1], page=16, chunk=1)
    cache = cache._replace(k_pages=cache.k_pages.astype(jnp.bfloat16),
                           v_pages=cache.v_pages.astype(jnp.bfloat16))  # fmt: skip
    q, k, v = (x.astype(jnp.bfloat16) for x in chunk)
    out, _ = jit_fused(cache, q, k, v)
    xla, _ = jit_fused(cache, q, k, v, implementation="xla")
    assert out.dtype == xla.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(np.float32), xla.astype(np.float32), atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_fused_paged_kernel_reads_half_pages_in_place_as_float32(dtype):
    """16-bit pools go to the kernel as they are (no float32 copy of the pool per call) and
    read as float32 exactly: the result is the pools converted first, to float32 rounding
    (the builds contract multiply-adds as the compiler chooses), and numpy's. Values read
    back bit for bit (float16 subnormals and extremes); head sizes with scalar tails;
    several rows (items of whole token records) and a row over key splits."""
    rng = np.random.default_rng(11)
    rows, chunk, (h, kh), (d, dv), pool, page = 5, 3, (8, 4), (37, 19), 90, 16
    table = rng.permutation(pool)[: rows * 18].reshape(rows, 18).astype(np.int32)
    k_pages, v_pages = (
        rng.normal(size=(pool, page, kh, d)) * 3,
        rng.normal(size=(pool, page, kh, dv)),
    )
    # row 0's first query sees its first key alone: its output is that key's values, read
    # back: float16 subnormals, the smallest normal, the largest finite, a negative zero
    extremes = [6e-8, -3e-5, 6.1e-5, 65504.0, -0.0, 1.5, -(2.0**-20)]
    v_pages[table[0, 0], 0, :, : len(extremes)] = extremes
    k_pages, v_pages, table = (
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(table),
    )
    starts, num_new = jnp.asarray([0, 30, 100, 270, 7]), jnp.asarray([3, 2, 3, 1, 0])
    args = (table, starts, num_new, starts + num_new)
    q = jnp.asarray(rng.normal(size=(rows, chunk, h, d)), jnp.float32)
    op = jax.jit(cpu_kernels.paged_attention)
    assert "convert" not in op.trace(q, k_pages, v_pages, *args).lower().as_text()
    got = op(q, k_pages, v_pages, *args)
    first = op(q, k_pages.astype(jnp.float32), v_pages.astype(jnp.float32), *args)
    np.testing.assert_allclose(got, first, rtol=1e-6, atol=1e-6)
    mixed = op(q, k_pages, v_pages.astype(jnp.float32), *args)  # two types: both as float32
    np.testing.assert_allclose(mixed, first, rtol=1e-6, atol=1e-6)
    stored = np.repeat(np.asarray(v_pages[table[0, 0], 0], np.float32), h // kh, axis=0)
    np.testing.assert_array_equal(got[0, 0], stored)  # bit for bit
    cache = paged.PagedKVCache(k_pages, v_pages, table, starts + num_new)
    want = np_paged_reference(cache, q, np.asarray(starts), np.asarray(num_new), causal=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_fused_paged_kernel_is_bit_identical_with_one_and_two_threads(monkeypatch):
    rng = np.random.default_rng(6)
    cache, (q, k, v) = filled_cache(rng, [1100, 40, 600], [1, 5, 3], page=16, chunk=5)

    def run():  # a fresh trace: the thread cap is read when the call is traced
        return jax.jit(lambda *a: paged.update_and_attend(*a)[0])(cache, q, k, v)

    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv(cpu_adapter.THREADS_ENV, threads)
        results.append(np.asarray(run()))
    np.testing.assert_array_equal(results[0], results[1])


@needs_kernel
@pytest.mark.parametrize("int8", [False, True])
def test_fused_paged_gradient_equals_the_xla_paths(int8):
    rng = np.random.default_rng(7)
    cache, chunk = filled_cache(rng, [20, 0, 9], [3, 2, 0], page=4, chunk=3, int8=int8)
    weights = jnp.asarray(rng.normal(size=(3, 3, 4, 16)), jnp.float32)

    def loss(chunk, **kwargs):
        out, _ = paged.update_and_attend(cache, *chunk, num_new=jnp.asarray([3, 2, 0]), **kwargs)
        return jnp.sum(out * weights)

    fused = jax.jit(jax.grad(loss))(chunk)
    xla = jax.jit(jax.grad(functools.partial(loss, implementation="xla")))(chunk)
    for a, b in zip(fused, xla, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # forward over reverse (jax.hessian) from outside a jit: the XLA formulation's
    # derivative (JAX refused forward mode of the custom VJP this call had before)
    q, k, v = chunk
    second = [
        jax.jacfwd(jax.grad(jax.jit(lambda x, kw=kw: loss((q.at[0, :1].set(x), k, v), **kw))))(
            q[0, :1]
        )
        for kw in ({}, {"implementation": "xla"})
    ]
    np.testing.assert_allclose(*second, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_fused_paged_kernel_lowers_for_cuda_without_the_cpu_target():
    rng = np.random.default_rng(8)
    cache, chunk = filled_cache(rng, [20, 3], [1, 1], page=16, chunk=1)
    f = jax.jit(lambda c, *x: paged.update_and_attend(c, *x)[0])
    traced = f.trace(cache, *chunk)
    assert "jattn_cpu_paged_attention" in traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "jattn_cpu" not in traced.lower(lowering_platforms=("cuda",)).as_text()
    # one program for both (the target carries no serialization guarantee of jax's, as the
    # other CPU kernel's): on this host it runs the kernel
    check = jax.export.DisabledSafetyCheck.custom_call("jattn_cpu_paged_attention")
    exported = jax.export.export(f, platforms=("cpu", "cuda"), disabled_checks=[check])(
        cache, *chunk
    )
    np.testing.assert_array_equal(exported.call(cache, *chunk), f(cache, *chunk))


PAGED_ISA_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
from jattn import paged
from jattn.kernels.cpu import status
assert f"on: {sys.argv[1]} " in status(), status()
rng = np.random.default_rng(0)
starts, num_new = np.array([1100, 37, 0, 5]), np.array([3, 2, 0, 1])  # a split row
for int8, dtype in ((False, jnp.float32), (True, jnp.float32), (False, jnp.bfloat16),
                    (False, jnp.float16)):
    cache = paged.init_paged_cache(4, 90, 16, 72, 2, 37, v_head_dim=19, quantized=int8,
                                   dtype=dtype)
    table, ids = np.full((4, 72), 90, np.int32), rng.permutation(90)
    table[0, :69], table[1, :3], table[3, :1] = ids[:69], ids[69:72], ids[72:73]
    cache = cache._replace(page_table=jnp.asarray(table))
    k, v = (jnp.asarray(rng.normal(size=(4, 1100, 2, d)), jnp.float32) for d in (37, 19))
    cache = paged.append(cache, k, v, num_new=jnp.asarray(starts))
    q = jnp.asarray(rng.normal(size=(4, 3, 4, 37)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(4, 3, 2, d)), jnp.float32) for d in (37, 19))
    for causal in (True, False):
        def f(implementation=None):
            return jax.jit(lambda c, *x: paged.update_and_attend(
                c, *x, num_new=jnp.asarray(num_new), is_causal=causal,
                implementation=implementation)[0])(cache, q, k, v)
        err = float(jnp.abs(f().astype(jnp.float32) - f("xla").astype(jnp.float32)).max())
        print(int8, dtype.__name__, causal, "max error", err)
        assert err < 2e-5, err
"""


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_fused_paged_kernel_with_each_instruction_set(isa, tmp_path):
    """Each build (JATTN_CPU_ISA picks a narrower one) against the XLA path, head sizes
    that leave a scalar tail after the vectors (37, 19), float and int8 pages, splits."""
    if isa != "generic" and f"on: {isa}" not in cpu_kernels.status():
        if isa == "avx512" or "avx512" not in cpu_kernels.status():
            pytest.skip(f"this CPU has no {isa}")
    script = tmp_path / "paged_isa_check.py"
    script.write_text(PAGED_ISA_SCRIPT)
    env = {**os.environ, "JATTN_CPU_ISA": isa, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, str(script), isa], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
