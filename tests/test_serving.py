"""jattn.models.generate_many: continuous batching over a paged KV cache.

Each request's greedy continuation must equal jattn.models.generate of its prompt alone
(itself tested against the book's loop in test_models.py), cut at its first eos id; the
number of compilations must not grow with the number of requests.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jattn import models
from jattn.models import serving

GPT_CFG = dict(
    vocab_size=61, context_length=48, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0,
    qkv_bias=True,
)  # fmt: skip
LLAMA_CFG = dict(
    vocab_size=61, context_length=48, emb_dim=32, n_heads=4, n_layers=2, hidden_dim=64,
    n_kv_groups=2, rope_base=500_000.0, dtype="float32",
    rope_freq={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_context_length": 16},
)  # fmt: skip
QWEN_CFG = dict(
    vocab_size=61, context_length=48, emb_dim=32, n_heads=4, n_layers=2, hidden_dim=64,
    head_dim=16, qk_norm=True, n_kv_groups=2, rope_base=1_000_000.0, dtype="float32",
)  # fmt: skip
BUILD = {
    "gpt2": lambda: models.GPTModel(GPT_CFG, rngs=nnx.Rngs(1)),
    "llama3": lambda: models.Llama3Model(LLAMA_CFG, rngs=nnx.Rngs(2)),
    "qwen3": lambda: models.Qwen3Model(QWEN_CFG, rngs=nnx.Rngs(3)),
}
OPTS = dict(page_size=16, prefill_chunk=16)


def prompts_of(lengths, seed=0, vocab=61):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).astype(np.int32) for n in lengths]


def cut(out, max_new, eos=()):
    out = list(out)[:max_new]
    return out[: next((i for i, t in enumerate(out) if t in eos), len(out))]


def alone(model, prompt, max_new, eos=()):
    """jattn.models.generate of one prompt, cut before its first eos id."""
    out = np.asarray(models.generate(model, jnp.asarray(prompt)[None], max_new))[0]
    return cut(out.tolist(), max_new, eos)


def references(model, prompts, max_new):
    """jattn.models.generate of the prompts as one right-padded ragged batch (one compile;
    each row equals its prompt alone, test_models.py), each cut to its max_new."""
    padded = np.zeros((len(prompts), max(p.size for p in prompts)), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : p.size] = p
    lengths = jnp.asarray([p.size for p in prompts])
    out = np.asarray(models.generate(model, padded, max(max_new), prompt_lengths=lengths))
    return [row[:m].tolist() for row, m in zip(out, max_new, strict=True)]


@pytest.mark.parametrize(
    "arch", ["gpt2", pytest.param("llama3", marks=pytest.mark.slow),
             pytest.param("qwen3", marks=pytest.mark.slow)],
)  # fmt: skip
def test_greedy_equals_generate_alone_with_eos(arch):
    model = BUILD[arch]()
    prompts = prompts_of([3, 17, 9, 26, 5])
    max_new = [9, 4, 12, 7, 14]
    refs = references(model, prompts, max_new)
    assert refs[0] == alone(model, prompts[0], max_new[0])
    # an eos id that some continuation produces after its first token, so requests stop early
    eos = next(r[2] for r in refs if len(r) > 2)
    outs, stats = models.generate_many(
        model, prompts, max_new, slots=2, eos_id=[eos], return_stats=True, **OPTS
    )
    for ref, m, out in zip(refs, max_new, outs, strict=True):
        assert out.dtype == np.int32
        assert out.tolist() == cut(ref, m, eos=(eos,))
    assert any(
        len(o) < m for o, m in zip(outs, max_new, strict=True)
    )  # some request stopped on eos
    assert stats.peak_pages <= stats.num_pages
    assert not hasattr(model.trf_blocks[0].att, "cache")  # the model was not modified


@contextlib.contextmanager
def compile_events():
    """Backend compilations inside the block (jax.monitoring, as tests/test_toy.py)."""
    events = []

    def listener(event, *_args, **_kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_compilations_do_not_grow_with_the_number_of_requests():
    model = BUILD["gpt2"]()
    few = prompts_of([30, 4, 11])
    many = few + prompts_of([7, 2, 19, 13, 5, 28, 9, 16, 3], seed=1)
    # every shape a run with these sizes can take, whatever the number of requests: prefill
    # steps of 1 or 2 rows (powers of two up to slots) over a page table of at most 3 pages
    # (48 positions of context, pages of 16), and decoding steps [slots, 1] over the 3 pages
    # (fused kernel) or 1-2 key blocks
    shapes = {(r, 16, w) for r in (1, 2) for w in (1, 2, 3)} | {(2, 1, n) for n in (1, 2, 3)}
    jax.clear_caches()
    with compile_events() as first:
        _, s1 = models.generate_many(model, few, 10, slots=2, return_stats=True, **OPTS)
    jax.clear_caches()
    with compile_events() as second:
        outs, s2 = models.generate_many(model, many, 10, slots=2, return_stats=True, **OPTS)
    assert set(s1.programs) <= shapes and set(s2.programs) <= shapes
    # one compilation per step shape, and the eager zeros of the pools, page table and lengths:
    # a bound that holds for four times the requests
    assert len(first) <= len(s1.programs) + 6 and len(second) <= len(s2.programs) + 6
    assert len(second) <= len(shapes) + 6
    with compile_events() as third:
        models.generate_many(model, many, 10, slots=2, **OPTS)
    assert third == []  # a new run of the same shapes compiles nothing
    with compile_events() as stops:
        models.generate_many(model, many, 10, slots=2, eos_id=[3, 5, 8], **OPTS)
    assert stops == []  # nor do stop tokens (the ids are data, not a shape to compile)
    with compile_events() as fourth:
        _, s4 = models.generate_many(model, many[::-1], 10, slots=2, return_stats=True, **OPTS)
    assert len(fourth) <= len(set(s4.programs) - set(s2.programs))  # only shapes not run yet
    assert outs[3].tolist() == alone(model, many[3], 10)


def test_prefill_steps_run_several_prompts_and_keep_the_output():
    model = BUILD["gpt2"]()
    prompts = prompts_of([30, 4, 11, 26, 7, 19], seed=3)
    max_new = [6, 9, 4, 7, 5, 8]
    outs, stats = models.generate_many(model, prompts, max_new, slots=4, return_stats=True, **OPTS)
    assert stats.prefill_steps < stats.prefill_chunks  # several prompts' chunks per step
    assert {p[0] for p in stats.programs if p[1] == 16} - {1, 2, 4} == set()
    for prompt, m, out in zip(prompts, max_new, outs, strict=True):
        assert out.tolist() == alone(model, prompt, m)
    _, one = models.generate_many(
        model, prompts, max_new, slots=4, prefill_rows=1, return_stats=True, **OPTS
    )
    assert one.prefill_steps == one.prefill_chunks == stats.prefill_chunks


def test_a_prefill_step_runs_the_fewest_tokens_that_hold_its_longest_piece():
    """The default chunk is capped at the context (48 here); a step's token length is the
    fewest of 16, 32, ..., the chunk that hold its longest piece of prompt, not the chunk."""
    model = BUILD["gpt2"]()
    prompts = prompts_of([45, 5, 20], seed=4)
    outs, stats = models.generate_many(
        model, prompts, 3, slots=1, page_size=16, return_stats=True
    )  # one prompt per prefill step: the 45 (one step of 48), the 5 (16), the 20 (32)
    assert {p[1] for p in stats.programs if p[1] > 1} == {16, 32, 48}
    assert stats.prefill_steps == 3
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.tolist() == alone(model, prompt, 3)


def test_identical_prompts_prefilling_together_share_their_pages():
    model = BUILD["gpt2"]()
    common = prompts_of([40])[0]
    prompts = [common, prompts_of([9], seed=5)[0], common, np.concatenate([common[:32], [1, 2]])]
    opts = dict(page_size=8, prefill_chunk=8)
    outs, stats = models.generate_many(
        model, prompts, [5, 6, 4, 7], slots=4, return_stats=True, **opts
    )
    # requests 2 and 3 wait for request 0's pages instead of writing their own copies:
    # request 2 reuses its 4 full pages (keeping its last token to prefill), request 3 all 4
    assert stats.shared_pages == 8
    assert stats.prefill_steps < stats.prefill_chunks
    for prompt, m, out in zip(prompts, [5, 6, 4, 7], outs, strict=True):
        assert out.tolist() == alone(model, prompt, m)


@pytest.mark.slow
def test_prefix_sharing_reuses_pages_and_keeps_the_output():
    model = BUILD["llama3"]()
    common = prompts_of([24])[0]
    prompts = [common, np.concatenate([common[:16], [5, 6, 7]]), common]
    opts = dict(page_size=8, prefill_chunk=8)
    outs, stats = models.generate_many(
        model, prompts, [12, 6, 5], slots=3, return_stats=True, **opts
    )
    assert stats.shared_pages == 4  # requests 1 and 2 reuse request 0's two full pages
    for ref, out in zip(references(model, prompts, [12, 6, 5]), outs, strict=True):
        assert out.tolist() == ref
    _, unshared = models.generate_many(
        model, prompts, [12, 6, 5], slots=3, share_prefixes=False, return_stats=True, **opts
    )
    assert unshared.shared_pages == 0 and unshared.peak_pages > stats.peak_pages


@pytest.mark.slow
def test_a_small_pool_makes_requests_wait_and_memory_follows_tokens():
    model = BUILD["gpt2"]()
    prompts = prompts_of([20, 3, 6, 14])
    outs, stats = models.generate_many(
        model, prompts, 8, slots=4, num_pages=4, return_stats=True, page_size=8, prefill_chunk=8
    )
    assert stats.peak_pages <= 4 < 4 * 4  # 4 slots x 4 pages would be the contiguous cache
    assert [o.tolist() for o in outs] == references(model, prompts, [8] * 4)


def test_a_request_preempted_for_pages_is_prefilled_again_and_keeps_its_output():
    model = BUILD["gpt2"]()
    prompts, max_new = prompts_of([20, 17, 9], seed=4), [20, 20, 20]
    # pages of 8: the three finish holding 5 + 5 + 4 pages, more than the pool's 10, but
    # their prompts fit it, so all three start and the last admitted gives its pages back
    opts = dict(slots=3, num_pages=10, page_size=8, prefill_chunk=8, return_stats=True)
    outs, stats = models.generate_many(model, prompts, max_new, **opts)
    assert stats.preemptions >= 1 and stats.recomputed > 0
    assert stats.peak_pages <= 10
    assert [o.tolist() for o in outs] == references(model, prompts, max_new)
    # sampling: token j of request i draws from fold_in(fold_in(key, i), j) wherever it is
    # computed, so preempting changes nothing
    kw = dict(temperature=1.0, key=jax.random.key(3))
    sampled, again = models.generate_many(model, prompts, max_new, **opts, **kw)
    roomy = models.generate_many(model, prompts, max_new, slots=3, page_size=8, **kw)
    assert again.preemptions >= 1
    assert [o.tolist() for o in sampled] == [o.tolist() for o in roomy]


def test_preemption_among_requests_sharing_prompt_pages_keeps_the_output():
    model = BUILD["gpt2"]()
    common = prompts_of([24], seed=7)[0]
    prompts = [
        common, np.concatenate([common[:16], prompts_of([5], seed=8)[0]]), common,
        prompts_of([10], seed=9)[0],
    ]  # fmt: skip
    max_new = [22, 20, 18, 16]
    # a pool of 7 pages of 8: request 1 shares request 0's first two pages (reference
    # counts), is preempted while another request still holds them, and is
    # prefilled again later
    outs, stats = models.generate_many(
        model, prompts, max_new, slots=4, num_pages=7, page_size=8, prefill_chunk=8,
        return_stats=True,
    )  # fmt: skip
    assert stats.preemptions >= 1 and stats.shared_pages >= 1 and stats.peak_pages <= 7
    assert [o.tolist() for o in outs] == references(model, prompts, max_new)


def test_the_longest_requests_start_first():
    model = BUILD["gpt2"]()
    prompts, max_new = prompts_of([3] * 5, seed=6), [2, 2, 2, 2, 9]
    outs, stats = models.generate_many(model, prompts, max_new, slots=2, return_stats=True, **OPTS)
    # the 9-token request starts at once and decodes beside the short ones: its 8 decoding
    # steps (its first token comes from its prefill) are the run's; in arrival order the
    # short ones would take 2 steps first and it would then decode alone, 10 steps
    assert stats.decode_steps == 8
    assert [o.tolist() for o in outs] == references(model, prompts, max_new)


@pytest.mark.slow
def test_sampling_does_not_depend_on_slots_or_order():
    model = BUILD["qwen3"]()
    prompts = prompts_of([5, 12, 3])
    kw = dict(temperature=1.5, top_k=20, key=jax.random.key(7), **OPTS)
    one = models.generate_many(model, prompts, 6, slots=1, **kw)
    three = models.generate_many(model, prompts, 6, slots=3, **kw)
    assert [o.tolist() for o in one] == [o.tolist() for o in three]
    other = models.generate_many(model, prompts, 6, slots=3, **{**kw, "key": jax.random.key(8)})
    assert [o.tolist() for o in other] != [o.tolist() for o in three]


def test_bad_input_is_named():
    model = BUILD["gpt2"]()
    p = prompts_of([4])
    with pytest.raises(TypeError, match="prompts must be a non-empty list"):
        models.generate_many(model, [], 4, slots=1)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds ids"):
        models.generate_many(model, [[1, 99]], 4, slots=1)
    with pytest.raises(ValueError, match="request 0: a prompt of 4 tokens"):
        models.generate_many(model, p, 46, slots=1)
    with pytest.raises(ValueError, match="one per prompt"):
        models.generate_many(model, p, [3, 4], slots=1)
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        models.generate_many(model, p, 4, slots=0)
    with pytest.raises(ValueError, match=r"eos_id must be a token id \(an int in \[0, 61\)\)"):
        models.generate_many(model, p, 4, slots=1, eos_id=61)
    with pytest.raises(ValueError, match="empty sequence"):  # as generate says
        models.generate_many(model, p, 4, slots=1, eos_id=[])
    with pytest.raises(TypeError, match=r"key must be one jax\.random key"):
        models.generate_many(model, p, 4, slots=1, temperature=1.0, key=0)
    with pytest.raises(ValueError, match="needs a random key"):
        models.generate_many(model, p, 4, slots=1, temperature=1.0)
    with pytest.raises(ValueError, match="num_pages"):
        models.generate_many(model, p, 20, slots=1, num_pages=2, page_size=8)
    with pytest.raises(TypeError, match=r"jattn\.models model"):
        serving.generate_many(object(), p, 4, slots=1)


@pytest.mark.slow
def test_int8_pages_keep_most_greedy_tokens():
    model = BUILD["gpt2"]()
    prompts = prompts_of([9, 21, 5])
    exact = models.generate_many(model, prompts, 8, slots=3, **OPTS)
    int8 = models.generate_many(model, prompts, 8, slots=3, kv_int8=True, **OPTS)
    assert [o.size for o in int8] == [8, 8, 8]
    same = np.mean(np.concatenate(exact) == np.concatenate(int8))
    assert same >= 0.8, same  # int8 keys/values move the logits a little (tests/test_paged.py)
