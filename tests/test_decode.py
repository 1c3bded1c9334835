"""Decoding with a KV cache in the Linen and NNX modules.

The reference is always the module's own full causal forward pass (no cache) on each
row's real tokens: prefill + one-token steps must give the same outputs (float32, 1e-5).
"""

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _module_cases import Case, case_id
from flax import nnx

from jattn import convert
from jattn import generate as gen
from jattn import linen as L
from jattn import nnx as N

CAPACITY = 10
PROMPT_LENGTHS = np.array([3, 5, 1])  # ragged: right-padded to 5 in the prefill chunk
STEPS = 4

DECODE_CASES = [
    Case("CausalAttention", context_length=CAPACITY),
    Case("CausalAttention", context_length=CAPACITY, qkv_bias=True),
    Case("MultiHeadAttentionWrapper", context_length=CAPACITY),
    Case("MultiHeadAttention", context_length=CAPACITY),
    Case("MultiHeadAttention", context_length=CAPACITY, qkv_bias=True),
    Case("MultiHeadAttention", d_out=8, context_length=CAPACITY, num_heads=4, num_kv_heads=2),
]


def decoding(case: Case) -> Case:
    return dataclasses.replace(case, extra=(*case.extra, ("decode", True)))


def sequences(rng, case, batch=3):
    """x [B, max prompt + STEPS, d_in]: row b's real tokens are its first PROMPT_LENGTHS[b] + STEPS."""
    return jnp.asarray(
        rng.normal(size=(batch, PROMPT_LENGTHS.max() + STEPS, case.d_in)), jnp.float32
    )


def token_at(x, positions):
    """[B, S, d] -> [B, 1, d]: row b's token at positions[b]."""
    return x[np.arange(x.shape[0]), positions][:, None]


def run_decoding(call, x, lengths=PROMPT_LENGTHS, steps=STEPS):
    """Ragged prefill, then one token per step; returns each row's outputs in order.

    ``call(chunk, num_new) -> output`` runs one decoding call (and keeps the cache).
    """
    out = call(x[:, : lengths.max()], jnp.asarray(lengths, jnp.int32))
    rows = [[out[b, : lengths[b]]] for b in range(x.shape[0])]
    for i in range(steps):
        out = call(token_at(x, lengths + i), None)
        for b in range(x.shape[0]):
            rows[b].append(out[b])
    return [np.concatenate(r) for r in rows]


def assert_rows_equal_full_forward(rows, full_forward, x, lengths=PROMPT_LENGTHS, steps=STEPS):
    # One full pass over x: being causal, its first n + steps outputs of row b depend on
    # that row's first n + steps tokens only, which are exactly the ones decoded.
    ref = full_forward(x)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(rows[b], ref[b, : n + steps], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Linen
# ----------------------------------------------------------------------------------------


def linen_decoder(case, x_shape):
    """Parameters from the plain module, the cache from a decode-mode init (flax's way)."""
    model, decoder = case.linen(), decoding(case).linen()
    params = model.init(jax.random.key(0), jnp.ones(x_shape))["params"]
    cache = decoder.init(jax.random.key(0), jnp.ones((*x_shape[:-2], CAPACITY, x_shape[-1])))[
        "cache"
    ]
    return model, decoder, params, cache


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_linen_prefill_then_steps_equals_full_forward(case, rng):
    x = sequences(rng, case)
    model, decoder, params, cache = linen_decoder(case, x.shape)
    state = {"cache": cache}

    @jax.jit
    def step(params, cache, chunk, num_new):
        return decoder.apply(
            {"params": params, "cache": cache}, chunk, num_new=num_new, mutable=["cache"]
        )

    def call(chunk, num_new):
        out, state["cache"] = step(params, state["cache"], chunk, num_new)
        state["cache"] = state["cache"]["cache"]
        return out

    rows = run_decoding(call, x)
    assert_rows_equal_full_forward(rows, lambda z: model.apply({"params": params}, z), x)


def test_linen_cache_collection_is_sized_by_the_init_input():
    m = L.MultiHeadAttention(8, 12, 0.0, num_heads=4, num_kv_heads=2, decode=True)
    variables = m.init(jax.random.key(0), jnp.ones((3, 7, 5)))
    cache = variables["cache"]["kv"]
    assert cache.keys.shape == cache.values.shape == (3, 7, 2, 2)  # [B, capacity, K, head_dim]
    assert cache.lengths.shape == (3,) and not cache.lengths.any()
    wrapper = L.MultiHeadAttentionWrapper(4, 12, 0.0, 3, decode=True)
    caches = wrapper.init(jax.random.key(0), jnp.ones((2, 6, 5)))["cache"]
    assert sorted(caches) == ["heads_0", "heads_1", "heads_2"]
    assert caches["heads_1"]["kv"].keys.shape == (2, 6, 1, 4)


def test_linen_init_in_decode_mode_returns_the_plain_forward(rng):
    case = Case("MultiHeadAttention", context_length=CAPACITY)
    x = jnp.asarray(rng.normal(size=(2, 6, 3)), jnp.float32)
    out, variables = decoding(case).linen().init_with_output(jax.random.key(0), x)
    ref = case.linen().apply({"params": variables["params"]}, x)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_linen_jitted_decode_step_traces_once(rng):
    case = Case("MultiHeadAttention", context_length=CAPACITY)
    x = sequences(rng, case)
    _, decoder, params, cache = linen_decoder(case, x.shape)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(cache, token):
        out, updated = decoder.apply({"params": params, "cache": cache}, token, mutable=["cache"])
        return out, updated["cache"]

    for i in range(5):
        _, cache = step(cache, x[:, i : i + 1])
    np.testing.assert_array_equal(cache["kv"].lengths, [5, 5, 5])


def test_linen_capacity_overflow_is_a_clear_error(rng):
    case = Case("CausalAttention", context_length=CAPACITY)
    decoder = decoding(case).linen()
    variables = decoder.init(jax.random.key(0), jnp.ones((2, 4, 3)))  # capacity 4
    x = jnp.asarray(rng.normal(size=(2, 3, 3)), jnp.float32)
    _, updated = decoder.apply(variables, x, mutable=["cache"])
    with pytest.raises(ValueError, match=r"KV cache overflow.*capacity is 4"):
        decoder.apply(variables | updated, x[:, :2], mutable=["cache"])


def test_linen_num_new_outside_decode_mode_is_an_error(rng):
    m = L.CausalAttention(4, CAPACITY, 0.0)
    x = jnp.ones((2, 3, 3))
    with pytest.raises(ValueError, match=r"num_new \(real tokens.*only used in decode mode"):
        m.apply(m.init(jax.random.key(0), x), x, num_new=jnp.array([3, 2]))


# ----------------------------------------------------------------------------------------
# NNX
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_nnx_prefill_then_steps_equals_full_forward(case, rng):
    x = sequences(rng, case)
    model = case.nnx()
    model.init_cache((x.shape[0], CAPACITY, case.d_in))
    step = nnx.jit(lambda m, chunk, num_new: m(chunk, decode=True, num_new=num_new))
    rows = run_decoding(lambda chunk, num_new: step(model, chunk, num_new), x)
    # without decode=True the same module runs its plain forward pass (the cache is unused)
    assert_rows_equal_full_forward(rows, model, x)


def test_nnx_equals_linen_in_decode_mode(rng):
    case = Case("MultiHeadAttention", context_length=CAPACITY, qkv_bias=True)
    x = sequences(rng, case)
    _, decoder, params, cache = linen_decoder(case, x.shape)
    nnx_model = convert.linen_to_nnx({"params": params}, case.nnx())
    nnx_model.init_cache((x.shape[0], CAPACITY, case.d_in))
    lengths = jnp.asarray(PROMPT_LENGTHS, jnp.int32)
    chunk = x[:, : PROMPT_LENGTHS.max()]
    linen_out, _ = decoder.apply(
        {"params": params, "cache": cache}, chunk, num_new=lengths, mutable=["cache"]
    )
    np.testing.assert_allclose(
        nnx_model(chunk, decode=True, num_new=lengths), linen_out, rtol=1e-6, atol=1e-6
    )


def test_nnx_init_cache_shapes_and_dtype():
    m = Case("MultiHeadAttention", d_out=8, num_heads=4, num_kv_heads=2, context_length=9).nnx()
    m.init_cache((2, 3, 9, 3), dtype=jnp.bfloat16)
    cache = m.cache.get_value()
    assert cache.keys.shape == (2, 3, 9, 2, 2) and cache.keys.dtype == jnp.bfloat16
    assert cache.lengths.shape == (2, 3)
    w = Case("MultiHeadAttentionWrapper", context_length=9).nnx()
    w.init_cache((4, 9, 3))
    assert all(h.cache.get_value().keys.shape == (4, 9, 1, 4) for h in w.heads)
    # the parameters are untouched: the cache is its own variable type
    assert "cache" not in nnx.state(m, nnx.Param) and "cache" in nnx.state(m, nnx.Cache)


def test_nnx_jitted_decode_step_traces_once(rng):
    case = Case("MultiHeadAttentionWrapper", context_length=CAPACITY)
    x = sequences(rng, case)
    model = case.nnx()
    model.init_cache((x.shape[0], CAPACITY, case.d_in))

    @nnx.jit
    @chex.assert_max_traces(n=1)
    def step(model, token):
        return model(token, decode=True)

    for i in range(5):
        step(model, x[:, i : i + 1])
    np.testing.assert_array_equal(model.heads_0.cache.get_value().lengths, [5, 5, 5])


@pytest.mark.parametrize(
    ("action", "exc", "match"),
    [
        (lambda m, x: m(x, decode=True), ValueError, r"call init_cache\(input_shape\) first"),
        (lambda m, x: m.init_cache((2, 11, 3)), ValueError, "capacity 11 exceeds context_length"),
        (
            lambda m, x: m(x, num_new=jnp.array([1, 1])),
            ValueError,
            r"num_new \(real tokens.*only used in decode",
        ),
    ],
)
def test_nnx_decode_errors(action, exc, match):
    model = Case("MultiHeadAttention", context_length=CAPACITY).nnx()
    with pytest.raises(exc, match=match):
        action(model, jnp.ones((2, 3, 3)))


def test_nnx_capacity_overflow_is_a_clear_error():
    model = Case("CausalAttention", context_length=CAPACITY).nnx()
    model.init_cache((2, 4, 3))
    model(jnp.ones((2, 3, 3)), decode=True)
    with pytest.raises(ValueError, match=r"KV cache overflow.*capacity is 4"):
        model(jnp.ones((2, 2, 3)), decode=True)


# ----------------------------------------------------------------------------------------
# Generation through a Linen model built from the modules
# ----------------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Embedding -> one jattn MultiHeadAttention -> vocabulary head (no positions needed:
    causal attention alone already breaks the symmetry between positions)."""

    decode: bool = False

    @nn.compact
    def __call__(self, tokens, num_new=None):
        x = nn.Embed(13, 16)(tokens)
        attn = L.MultiHeadAttention(16, 24, 0.0, 4, decode=self.decode)
        kw = {"num_new": num_new} if self.decode else {}
        return nn.Dense(13)(x + attn(x, **kw))


def test_generation_with_the_linen_modules_is_deterministic_per_key():
    prompt = jnp.array([[1, 2, 3, 4], [5, 6, 0, 0]], jnp.int32)
    lengths = jnp.array([4, 2], jnp.int32)
    params = TinyLM().init(jax.random.key(0), prompt)["params"]
    cache = TinyLM(decode=True).init(jax.random.key(0), jnp.zeros((2, 24), jnp.int32))["cache"]
    decode_fn, forward_fn = gen.LinenDecodeFn(TinyLM(decode=True)), gen.LinenForwardFn(TinyLM())

    def sample(seed, **kw):
        key = jax.random.key(seed)
        cached = gen.generate(
            decode_fn, params, cache, prompt, lengths, max_new_tokens=10, key=key, **kw
        )
        again = gen.generate_recompute(
            forward_fn, params, prompt, lengths, max_new_tokens=10, key=key, **kw
        )
        np.testing.assert_array_equal(cached, again)  # the cache changes nothing
        return np.asarray(cached)

    greedy = sample(0)
    np.testing.assert_array_equal(greedy, sample(5))  # greedy ignores the key
    hot = sample(0, temperature=2.0)
    np.testing.assert_array_equal(hot, sample(0, temperature=2.0))
    assert not np.array_equal(hot, sample(1, temperature=2.0))
    assert gen.LinenDecodeFn(TinyLM(decode=True)) == decode_fn  # hashable: jit reuses it


class TinyNnxLM(nnx.Module):
    """The same small LM in NNX: embedding -> jattn.nnx.MultiHeadAttention -> head."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(13, 16, rngs=rngs)
        self.attn = N.MultiHeadAttention(16, 16, 24, 0.0, 4, rngs=rngs)
        self.head = nnx.Linear(16, 13, rngs=rngs)

    def __call__(self, tokens, decode=False, num_new=None):
        x = self.embed(tokens)
        return self.head(x + self.attn(x, decode=decode, num_new=num_new))


def test_generation_with_the_nnx_modules():
    prompt = jnp.array([[1, 2, 3, 4], [5, 6, 0, 0]], jnp.int32)
    lengths = jnp.array([4, 2], jnp.int32)
    model = TinyNnxLM(nnx.Rngs(0))
    model.attn.init_cache((2, 12, 16))
    graphdef, params, cache = nnx.split(model, nnx.Param, nnx.Cache)

    def decode_fn(params, tokens, cache, num_new):
        model = nnx.merge(graphdef, params, cache)
        logits = model(tokens, decode=True, num_new=num_new)
        return logits, nnx.state(model, nnx.Cache)

    def forward_fn(params, tokens):
        return nnx.merge(graphdef, params, cache)(tokens)

    key = jax.random.key(0)
    for kw in ({}, {"temperature": 1.0, "top_k": 5}):
        cached = gen.generate(
            decode_fn, params, cache, prompt, lengths, max_new_tokens=8, key=key, **kw
        )
        again = gen.generate_recompute(
            forward_fn, params, prompt, lengths, max_new_tokens=8, key=key, **kw
        )
        np.testing.assert_array_equal(cached, again)
    # the capacity check sees the KVCache inside the NNX state
    with pytest.raises(ValueError, match="KV cache holds 12 positions per row"):
        gen.generate(decode_fn, params, cache, prompt, lengths, max_new_tokens=10)


# ----------------------------------------------------------------------------------------
# The toy GPT (jattn.toy.TinyGPT): positions continue per row from the cache
# ----------------------------------------------------------------------------------------


def test_tiny_gpt_decoding_equals_its_full_forward_for_ragged_prompts():
    from jattn.toy import TinyGPT, TinyGPTConfig

    cfg = TinyGPTConfig(vocab_size=11, context_length=16, d_model=32, num_layers=2, dropout=0.0)
    model, decoder = TinyGPT(cfg), TinyGPT(cfg, decode=True)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    cache = decoder.init(jax.random.key(0), jnp.zeros((3, 12), jnp.int32))["cache"]
    prompt = jnp.array([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0], [5, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.array([5, 3, 1], jnp.int32)
    kw = {"max_new_tokens": 7, "key": jax.random.key(1), "temperature": 1.0}
    cached = gen.generate(gen.LinenDecodeFn(decoder), params, cache, prompt, lengths, **kw)
    again = gen.generate_recompute(gen.LinenForwardFn(model), params, prompt, lengths, **kw)
    np.testing.assert_array_equal(cached, again)
    # and the logits themselves, for the ragged prefill
    logits, _ = gen.LinenDecodeFn(decoder)(params, prompt, cache, lengths)
    full = model.apply({"params": params}, prompt)
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(logits[b, :n], full[b, :n], rtol=1e-5, atol=1e-5)
