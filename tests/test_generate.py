"""jattn.generate: sampling rules, cached generation == recomputing generation, one compile.

The model is a two-layer attention-only language model written here with pure functions:
its full forward pass uses ``jax.nn.dot_product_attention`` (an independent reference), its
decoding pass uses ``jattn.kvcache``. The generators only see the two functions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import generate as gen
from jattn import kvcache as kv

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 11, 24, 16, 4, 2
HEAD_DIM = WIDTH // HEADS


def init_params(key):
    keys = iter(jax.random.split(key, 3 + 4 * LAYERS))

    def normal(shape, scale=1.0):
        return scale * jax.random.normal(next(keys), shape)

    return {
        "tok": normal((VOCAB, WIDTH)),
        "pos": normal((CONTEXT, WIDTH)),
        "head": normal((WIDTH, VOCAB), WIDTH**-0.5),
        "layers": [
            {name: normal((WIDTH, WIDTH), WIDTH**-0.5) for name in ("q", "k", "v", "o")}
            for _ in range(LAYERS)
        ],
    }


def _heads(x):
    return x.reshape(*x.shape[:-1], HEADS, HEAD_DIM)  # [B, T, D] -> [B, T, H, hd]


def _run(params, tokens, positions, attention):
    # [B, T, D]: token plus position embedding
    pos = params["pos"][positions]  # [T, D] or [B, T, D]
    x = params["tok"][tokens] + pos.reshape((1,) * (3 - pos.ndim) + pos.shape)
    for i, layer in enumerate(params["layers"]):
        q, k, v = (_heads(x @ layer[n]) for n in "qkv")
        out = attention(i, q, k, v)  # [B, T, H, hd]
        x = x + out.reshape(x.shape) @ layer["o"]
    return x @ params["head"]  # [B, T, V]


def forward_fn(params, tokens):
    """Full causal forward pass: logits [B, S, V]."""
    positions = jnp.arange(tokens.shape[1])
    return _run(
        params,
        tokens,
        positions,
        lambda i, q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    )


def decode_fn(params, tokens, caches, num_new):
    """A chunk through the cached model: (logits [B, T, V], caches)."""
    caches = list(caches)
    positions = caches[0].lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]  # [B, T]
    positions = jnp.minimum(positions, CONTEXT - 1)  # padding may run past the table

    def attention(i, q, k, v):
        out, caches[i] = kv.update_and_attend(caches[i], q, k, v, num_new=num_new)
        return out

    return _run(params, tokens, positions, attention), tuple(caches)


def empty_caches(batch, capacity=CONTEXT):
    return tuple(kv.init_cache(batch, capacity, HEADS, HEAD_DIM) for _ in range(LAYERS))


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.key(1))


PROMPT = jnp.array([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0], [5, 0, 0, 0, 0]], jnp.int32)
PROMPT_LENGTHS = jnp.array([5, 3, 1], jnp.int32)


# ----------------------------------------------------------------------------------------
# The model itself: cached logits equal full-pass logits
# ----------------------------------------------------------------------------------------


def test_cached_logits_equal_full_forward_logits(params):
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, VOCAB)
    full = forward_fn(params, tokens)
    step = jax.jit(decode_fn)
    logits, caches = step(params, tokens[:, :6], empty_caches(2), jnp.array([6, 6]))
    steps = [logits]
    for t in range(6, 9):
        logits, caches = step(params, tokens[:, t : t + 1], caches, jnp.array([1, 1]))
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# Generators
# ----------------------------------------------------------------------------------------


jitted_forward = jax.jit(forward_fn)


def recompute_one_row_at_a_time(params, prompt, n, num_new):
    """Greedy, by hand: a growing sequence per row, no padding, no cache (the book's loop)."""
    seq = list(np.asarray(prompt[:n]))
    for _ in range(num_new):
        logits = jitted_forward(params, jnp.asarray(seq)[None])[0, -1]
        seq.append(int(jnp.argmax(logits)))
    return seq[n:]


def test_greedy_cached_equals_the_books_loop_for_ragged_prompts(params):
    out = gen.generate(decode_fn, params, empty_caches(3), PROMPT, PROMPT_LENGTHS, max_new_tokens=5)
    assert out.shape == (3, 5) and out.dtype == jnp.int32
    for b in range(3):
        ref = recompute_one_row_at_a_time(params, PROMPT[b], int(PROMPT_LENGTHS[b]), 5)
        np.testing.assert_array_equal(out[b], ref)


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}, {"temperature": 2.0, "top_k": 1}],
)
def test_cached_and_recompute_generators_agree(params, sampling):
    key = jax.random.key(7)
    cached = gen.generate(
        decode_fn,
        params,
        empty_caches(3),
        PROMPT,
        PROMPT_LENGTHS,
        max_new_tokens=8,
        key=key,
        **sampling,
    )
    recomputed = gen.generate_recompute(
        forward_fn, params, PROMPT, PROMPT_LENGTHS, max_new_tokens=8, key=key, **sampling
    )
    np.testing.assert_array_equal(cached, recomputed)


def test_sampling_is_fixed_by_the_key(params):
    def run(seed):
        return gen.generate(
            decode_fn,
            params,
            empty_caches(3),
            PROMPT,
            PROMPT_LENGTHS,
            max_new_tokens=12,
            key=jax.random.key(seed),
            temperature=1.5,
        )

    a, b, c = run(0), run(0), run(1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)  # 36 tokens from 11 ids: equal by chance ~ never


def test_top_k_one_is_greedy(params):
    args = (decode_fn, params, empty_caches(3), PROMPT, PROMPT_LENGTHS)
    greedy = gen.generate(*args, max_new_tokens=6)
    top1 = gen.generate(*args, max_new_tokens=6, key=jax.random.key(3), temperature=5.0, top_k=1)
    np.testing.assert_array_equal(greedy, top1)


def test_one_new_token_and_full_length_prompts(params):
    out = gen.generate(decode_fn, params, empty_caches(3), PROMPT, max_new_tokens=1)
    ref = jnp.argmax(forward_fn(params, PROMPT)[:, -1], axis=-1)
    np.testing.assert_array_equal(out[:, 0], ref)


def test_generate_compiles_once_per_shape(params):
    traces = []

    def counting_decode_fn(params, tokens, caches, num_new):
        traces.append(tokens.shape)  # runs only while tracing
        return decode_fn(params, tokens, caches, num_new)

    kw = {"max_new_tokens": 5, "temperature": 1.0}
    gen.generate(
        counting_decode_fn,
        params,
        empty_caches(3),
        PROMPT,
        PROMPT_LENGTHS,
        key=jax.random.key(0),
        **kw,
    )
    assert sorted(traces) == [(3, 1), (3, 5)]  # the prefill and the step, once each
    other_prompt = (PROMPT + 1) % VOCAB
    gen.generate(
        counting_decode_fn,
        params,
        empty_caches(3),
        other_prompt,
        jnp.array([2, 4, 5], jnp.int32),
        key=jax.random.key(1),
        **kw,
    )
    assert len(traces) == 2  # new prompt, lengths and key: no retrace


# ----------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------


def test_cache_too_small_is_a_clear_error(params):
    with pytest.raises(ValueError, match=r"KV cache holds 8 positions per row, but a row needs 11"):
        gen.generate(decode_fn, params, empty_caches(3, capacity=8), PROMPT, max_new_tokens=7)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"temperature": 1.0}, ValueError, "needs a random key"),
        ({"temperature": -1.0}, ValueError, "temperature must be >= 0"),
        ({"top_k": 0}, ValueError, "top_k must be an int >= 1"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
        (
            {"prompt_lengths": jnp.array([5, 0, 1])},
            ValueError,
            r"prompt_lengths must be in \[1, 5\]",
        ),
        (
            {"prompt_lengths": jnp.array([5, 3])},
            ValueError,
            r"prompt_lengths must be int \[batch\]",
        ),
        ({"prompt": PROMPT[0]}, ValueError, r"prompt must be int token ids \[batch, prompt_len\]"),
    ],
)
def test_bad_arguments(params, kwargs, exc, match):
    args = {"prompt": PROMPT, "max_new_tokens": 3} | kwargs
    for fn, first in (
        (gen.generate, (decode_fn, params, empty_caches(3))),
        (gen.generate_recompute, (forward_fn, params)),
    ):
        with pytest.raises(exc, match=match):
            fn(*first, **args)


# ----------------------------------------------------------------------------------------
# sample_next
# ----------------------------------------------------------------------------------------


def test_sample_next_greedy_is_argmax():
    logits = jax.random.normal(jax.random.key(0), (4, 3, 9))
    np.testing.assert_array_equal(gen.sample_next(logits), np.argmax(logits, axis=-1))


def test_sample_next_greedy_takes_the_first_of_ties_and_nans_as_argmax():
    logits = np.array(
        [[1.0, 3.0, 3.0, 0.0], [np.nan, 2.0, np.nan, 1.0], [2.0, 1.0, np.nan, 5.0], [-np.inf] * 4],
        np.float32,
    )
    picked = jax.jit(gen.sample_next)(jnp.asarray(logits))
    np.testing.assert_array_equal(picked, np.argmax(logits, axis=-1))
    assert picked.dtype == jnp.int32


@pytest.mark.parametrize("vocab", [4099, 8192, 50257])
def test_sample_next_greedy_finds_nans_in_a_large_vocabulary(vocab):
    """Rows as a model's output head gives them (a matmul inside the same program), with a
    NaN column, a NaN after the row's largest, +inf and NaN together, ties and -0.0 / 0.0:
    numpy's argmax (the first NaN, else the first largest). XLA's CPU max reduction of
    such rows drops the NaNs, so a pick that trusted it answered a number's index."""
    rng = np.random.default_rng(vocab)
    w = rng.normal(size=(8, vocab)).astype(np.float32)
    w[:, vocab // 3] = np.nan  # every row: NaN in the middle
    x = np.eye(8, dtype=np.float32)
    x[1] = 0.0  # row 1: all zeros, then NaN from 0 * NaN
    logits = np.asarray(x @ w)
    picked = jax.jit(lambda x, w: gen.sample_next(x @ w))(x, w)
    np.testing.assert_array_equal(picked, np.argmax(logits, axis=-1))
    rows = rng.normal(size=(6, vocab)).astype(np.float32)
    rows[0, [5, vocab - 1]] = [np.inf, np.nan]  # +inf first, NaN later: the NaN
    rows[1, [7, 9]] = rows[1].max() + 1.0  # a tie for the largest: the first
    rows[2] = np.where(rng.random(vocab) < 0.5, -0.0, 0.0)  # -0.0 == 0.0: index 0
    rows[3] = -np.inf
    rows[4, vocab - 2] = np.nan
    rows[5] = np.round(rows[5])  # many ties
    np.testing.assert_array_equal(jax.jit(gen.sample_next)(rows), np.argmax(rows, axis=-1))


def test_sample_next_follows_the_tempered_softmax():
    logits = jnp.array([2.0, 1.0, 0.0, -1.0, 0.5])
    n, temperature = 20000, 0.8
    keys = jax.random.split(jax.random.key(0), n)
    draws = jax.vmap(lambda k: gen.sample_next(logits, k, temperature=temperature))(keys)
    freq = np.bincount(np.asarray(draws), minlength=5) / n
    p = np.exp(np.asarray(logits) / temperature)
    p /= p.sum()
    # each frequency within 4 standard deviations of its probability
    np.testing.assert_array_less(np.abs(freq - p), 4 * np.sqrt(p * (1 - p) / n) + 1e-12)


def test_sample_next_top_k_renormalises_over_the_k_best():
    logits = jnp.array([0.3, 2.0, -1.0, 1.5, 1.9, 0.0])
    n = 20000
    keys = jax.random.split(jax.random.key(1), n)
    draws = np.asarray(
        jax.vmap(lambda k: gen.sample_next(logits, k, temperature=1.0, top_k=3))(keys)
    )
    assert set(np.unique(draws)) <= {1, 3, 4}
    p = np.zeros(6)
    p[[1, 3, 4]] = np.exp(np.asarray(logits)[[1, 3, 4]])
    p /= p.sum()
    freq = np.bincount(draws, minlength=6) / n
    np.testing.assert_array_less(np.abs(freq - p), 4 * np.sqrt(p * (1 - p) / n) + 1e-12)
