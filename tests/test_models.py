"""jattn.models: the book's GPT-2, Llama 3 and Qwen3 on jattn's modules.

References: a float64 numpy transcription of the book's forward passes
(tests/_book_models_reference.py) always; the book's own PyTorch classes when torch and
llms-from-scratch are installed (``@pytest.mark.torch``).

Only the tests that need torch / llms-from-scratch skip (when those are absent).
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _book_models_reference import (
    book_state_dict_shapes,
    gpt_forward,
    llama3_forward,
    qwen3_forward,
    random_state_dict,
)
from _fake_devices import run_checks
from flax import nnx

from jattn import models
from jattn import nnx as jnnx
from jattn.kernels import cpu as cpu_kernels
from jattn.models import generation, layers

GPT_CFG = dict(
    vocab_size=97,
    context_length=32,
    emb_dim=32,
    n_heads=4,
    n_layers=2,
    drop_rate=0.0,
    qkv_bias=False,
)
LLAMA_CFG = dict(
    vocab_size=97, context_length=64, emb_dim=32, n_heads=4, n_layers=2, hidden_dim=64, n_kv_groups=2,
    rope_base=500_000.0, dtype="float32",
    rope_freq={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context_length": 16},
)  # fmt: skip
QWEN_CFG = dict(
    vocab_size=97, context_length=64, emb_dim=32, n_heads=4, n_layers=2, hidden_dim=64, head_dim=16,
    qk_norm=True, n_kv_groups=2, rope_base=1_000_000.0, dtype="float32",
)  # fmt: skip
FORWARD = {"gpt2": gpt_forward, "llama3": llama3_forward, "qwen3": qwen3_forward}
CFGS = {"gpt2": GPT_CFG, "llama3": LLAMA_CFG, "qwen3": QWEN_CFG}
PROMPT = np.array([[3, 14, 15, 92, 65, 35], [89, 79, 32, 38, 46, 26]])

ARCHS = ["gpt2", "llama3", "qwen3"]


def load(arch, cfg=None, seed=0):
    cfg = CFGS[arch] if cfg is None else cfg
    sd = random_state_dict(arch, cfg, seed)
    return models.from_book(arch, cfg, sd), sd


# ----------------------------------------------------------------------------------------
# Logits against the float64 transcription of the book
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_the_books_forward_pass(arch):
    model, sd = load(arch)
    logits = model(PROMPT)
    assert logits.shape == (2, 6, 97) and logits.dtype == jnp.float32
    ref = FORWARD[arch](CFGS[arch], sd, PROMPT)
    np.testing.assert_allclose(logits, ref, atol=1e-4 * max(1.0, np.abs(ref).max()), rtol=0)


def test_gpt_with_qkv_bias_and_dropout_in_eval_mode():
    cfg = {**GPT_CFG, "qkv_bias": True, "drop_rate": 0.1}
    model, sd = load("gpt2", cfg)
    model.eval()
    np.testing.assert_allclose(model(PROMPT), gpt_forward(cfg, sd, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "arch,cfg",
    [
        ("llama3", {**LLAMA_CFG, "rope_freq": None, "n_kv_groups": 4}),
        ("llama3", {**LLAMA_CFG, "n_kv_groups": 1}),
        ("qwen3", {**QWEN_CFG, "qk_norm": False, "head_dim": None}),
    ],
)
def test_rope_models_in_other_settings(arch, cfg):
    model, sd = load(arch, cfg)
    np.testing.assert_allclose(model(PROMPT), FORWARD[arch](cfg, sd, PROMPT), atol=1e-4, rtol=0)


def test_any_number_of_batch_dims():
    model, sd = load("gpt2")
    ref = gpt_forward(GPT_CFG, sd, PROMPT)
    np.testing.assert_allclose(model(PROMPT[0]), ref[0], atol=1e-4, rtol=0)
    stacked = np.stack([PROMPT, PROMPT[::-1]])  # [2, 2, T]
    out = model(stacked)
    assert out.shape == (2, 2, 6, 97)
    np.testing.assert_allclose(out[1], ref[::-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_gelu_is_chapter_4s_formula_in_the_inputs_dtype(dtype, tol):
    x = jnp.asarray(np.linspace(-12.0, 12.0, 20001), dtype)
    y = layers.gelu(x)
    assert y.dtype == dtype
    t = np.asarray(x, np.float64)  # the formula in float64 on the rounded inputs
    ref = 0.5 * t * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (t + 0.044715 * t**3)))
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, atol=tol, rtol=tol)


def test_bfloat16_gpt_runs_in_bfloat16_close_to_float32():
    sd = random_state_dict("gpt2", GPT_CFG)
    half = models.from_book("gpt2", GPT_CFG, sd, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    logits = half(PROMPT)
    assert logits.dtype == jnp.bfloat16 and half.tok_emb.embedding.dtype == jnp.bfloat16
    ref = gpt_forward(GPT_CFG, sd, PROMPT)
    # bfloat16 weights and activations: ~3 significant digits
    np.testing.assert_allclose(
        np.asarray(logits, np.float32), ref, atol=0.05 * np.abs(ref).max(), rtol=0
    )
    half.init_cache(2, 8)
    assert half.trf_blocks[0].att.cache.get_value().keys.dtype == jnp.bfloat16


def test_jitted_model_equals_eager():
    model, _ = load("gpt2")
    eager = model(PROMPT)
    jitted = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(PROMPT))
    np.testing.assert_allclose(jitted, eager, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------
# Weight mapping
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_parameters_map_one_to_one_onto_the_books_keys(arch):
    model, _ = load(arch)
    expected = book_state_dict_shapes(arch, CFGS[arch])
    expected = {k: v for k, v in expected.items() if not k.endswith("att.mask")}
    got = {k: shape for k, (_, shape, _) in models.book_keys(model).items()}
    assert got == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_round_trips(arch):
    model, sd = load(arch)
    back = models.to_book_state_dict(model)
    assert set(back) == set(sd)
    for key, value in sd.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    again = models.from_book(arch, CFGS[arch], back)
    np.testing.assert_array_equal(again(PROMPT), model(PROMPT))


def test_bfloat16_arrays_load_and_cast():
    sd = random_state_dict("gpt2", GPT_CFG)
    half = {k: v.astype(jnp.bfloat16) for k, v in sd.items()}
    model = models.from_book("gpt2", GPT_CFG, half)
    assert model.tok_emb.embedding.dtype == jnp.float32
    np.testing.assert_array_equal(
        model.tok_emb.embedding[...], half["tok_emb.weight"].astype(np.float32)
    )


@pytest.mark.parametrize(
    "keys,arch",
    [
        (book_state_dict_shapes("gpt2", GPT_CFG), "gpt2"),
        (
            [
                "tok_emb.weight",
                "trf_blocks.0.ff.fc1.weight",
                "trf_blocks.0.norm1.weight",
                "final_norm.weight",
            ],
            "llama3",
        ),
        (
            [
                "tok_emb.weight",
                "trf_blocks.0.ff.fc1.weight",
                "trf_blocks.0.norm1.scale",
                "final_norm.scale",
            ],
            "qwen3",
        ),
        (
            [
                "W_query.weight",
                "W_key.weight",
                "W_value.weight",
                "out_proj.weight",
                "out_proj.bias",
            ],
            "attention",
        ),
        (["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"], "huggingface"),
        (["foo"], None),
    ],
)
def test_detect_arch(keys, arch):
    assert models.detect_arch(keys) == arch


# ----------------------------------------------------------------------------------------
# Dropout (GPT-2)
# ----------------------------------------------------------------------------------------


def test_dropout_needs_a_mode_and_follows_keys():
    cfg = {**GPT_CFG, "drop_rate": 0.2}
    model = models.GPTModel(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"drop_rate=0\.2 but no `deterministic`"):
        model(PROMPT)
    eval_out = model(PROMPT, deterministic=True)
    a = model(PROMPT, deterministic=False, rngs=jax.random.key(1))
    b = model(PROMPT, deterministic=False, rngs=jax.random.key(1))
    c = model(PROMPT, deterministic=False, rngs=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, eval_out)
    model.train()
    d, e = model(PROMPT), model(PROMPT)  # the kept streams advance
    assert not np.allclose(d, e)
    model.eval()
    np.testing.assert_array_equal(model(PROMPT), eval_out)


def test_no_dropout_needs_no_mode():
    model = models.GPTModel(GPT_CFG, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model(PROMPT), model(PROMPT, deterministic=False))


# ----------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_one_token_at_a_time_equals_the_full_pass(arch):
    model, _ = load(arch)
    full = model(PROMPT)
    model.init_cache(2, 16)
    steps = [model(PROMPT[:, :3], decode=True)]
    steps += [model(PROMPT[:, t : t + 1], decode=True) for t in range(3, 6)]
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(model.cache_lengths(), [6, 6])
    model.init_cache(2, 16)  # a reset
    np.testing.assert_array_equal(model.cache_lengths(), [0, 0])


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_prefill_continues_each_row_after_its_own_tokens(arch):
    model, _ = load(arch)
    lengths = np.array([4, 6])
    padded = np.where(np.arange(6) < lengths[:, None], PROMPT, 0)
    model.init_cache(2, 16)
    prefill = model(padded, decode=True, num_new=jnp.asarray(lengths))
    nxt = np.array([[7], [8]])
    step = model(nxt, decode=True)
    for b, n in enumerate(lengths):
        seq = np.concatenate([PROMPT[b, :n], nxt[b]])[None]
        ref = model(seq)[0]
        np.testing.assert_allclose(prefill[b, :n], ref[:n], atol=1e-5, rtol=0)
        np.testing.assert_allclose(step[b, 0], ref[n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_at_one_position_per_row(arch):
    """logits_at gives each row's logits at its own position, full pass and decode alike,
    equal to the full logits there (the output head applied to that position alone)."""
    model, _ = load(arch)
    at = np.array([5, 2])
    full = model(PROMPT)
    got = model(PROMPT, logits_at=jnp.asarray(at))
    assert got.shape == (2, 97)
    np.testing.assert_allclose(got, full[np.arange(2), at], atol=1e-5, rtol=0)
    lengths = np.array([4, 6])
    model.init_cache(2, 16)
    last = model(PROMPT, decode=True, num_new=jnp.asarray(lengths), logits_at=lengths - 1)
    np.testing.assert_allclose(last, full[np.arange(2), lengths - 1], atol=1e-5, rtol=0)


def test_gpt_decoding_past_its_context_through_a_rolling_cache_is_a_clear_error():
    """GPT-2's position embedding has context_length rows: a rolling cache would run on
    with every later token at the last position."""
    model, _ = load("gpt2")
    model.init_cache(1, 4, rolling=True)
    tokens = np.arange(33)[None] % 97
    for t in range(32):  # up to the context: fine
        model(tokens[:, t : t + 1], decode=True)
    with pytest.raises(ValueError, match=r"reaches position 32, past cfg\['context_length'\]"):
        model(tokens[:, 32:], decode=True)


def test_gpt_built_from_params_only_rngs_and_numpy_sizes():
    """nnx.Rngs(params=0), flax's idiom, builds a GPT (dropout then needs rngs= when
    training), and init_cache takes numpy integers."""
    cfg = dict(GPT_CFG, drop_rate=0.1)
    model = models.GPTModel(cfg, rngs=nnx.Rngs(params=0))
    ref = models.GPTModel(cfg, rngs=nnx.Rngs(params=0, dropout=1))
    np.testing.assert_array_equal(
        model(PROMPT, deterministic=True), ref(PROMPT, deterministic=True)
    )
    out = model(PROMPT, deterministic=False, rngs=nnx.Rngs(dropout=2))
    assert not np.allclose(out, model(PROMPT, deterministic=True))
    model.init_cache(np.int64(2), np.int64(8))
    assert model.cache_lengths().shape == (2,)


def test_decode_without_a_cache_is_a_clear_error():
    model, _ = load("gpt2")
    with pytest.raises(ValueError, match=r"call model.init_cache"):
        model(PROMPT, decode=True)


# ----------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------


def greedy_reference(arch, cfg, sd, prompt, n):
    """The book's generate_text_simple on the numpy transcription."""
    idx = np.asarray(prompt)
    for _ in range(n):
        logits = FORWARD[arch](cfg, sd, idx[:, -cfg["context_length"] :])
        idx = np.concatenate([idx, logits[:, -1].argmax(-1)[:, None]], axis=1)
    return idx[:, prompt.shape[1] :]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_equals_the_books_loop_cached_or_not(arch):
    model, sd = load(arch)
    cached = models.generate(model, PROMPT, 12)
    uncached = models.generate(model, PROMPT, 12, use_cache=False)
    assert cached.shape == (2, 12) and cached.dtype == jnp.int32
    np.testing.assert_array_equal(cached, uncached)
    np.testing.assert_array_equal(cached, greedy_reference(arch, CFGS[arch], sd, PROMPT, 12))
    assert not hasattr(model.trf_blocks[0].att, "cache")  # the model was not modified


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_window_generates_past_the_context_as_windowed_attention(arch):
    # context 16, a rolling cache of 5 positions, 6 + 14 tokens: past the context.
    cfg = {**CFGS[arch], "context_length": 16}
    model, sd = load(arch, cfg)
    out = models.generate(model, PROMPT, 14, window=5)
    idx = PROMPT
    for _ in range(14):  # the book's loop, uncropped, on the windowed transcription
        logits = FORWARD[arch](cfg, sd, idx, window=5)
        idx = np.concatenate([idx, logits[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(out, idx[:, PROMPT.shape[1] :])
    # Within window + 1 positions, the rolling cache changes nothing.
    np.testing.assert_array_equal(
        models.generate(model, PROMPT, 6, window=10), models.generate(model, PROMPT, 6)
    )


def test_rolling_cache_decode_equals_the_windowed_forward_pass():
    cfg = {**QWEN_CFG, "context_length": 16}
    model, sd = load("qwen3", cfg)
    seq = np.concatenate([PROMPT, PROMPT[:, ::-1], PROMPT], axis=1)  # 18 tokens
    model.init_cache(2, 4, rolling=True)
    steps = [model(seq[:, :7], decode=True)]  # a prefill longer than the cache
    steps += [model(seq[:, t : t + 1], decode=True) for t in range(7, 18)]
    ref = qwen3_forward(cfg, sd, seq, window=4)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), ref, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(model.cache_lengths(), [18, 18])


def test_sampling_is_fixed_by_the_key():
    model, _ = load("gpt2")
    a = models.generate(model, PROMPT, 12, temperature=1.5, key=jax.random.key(0))
    b = models.generate(model, PROMPT, 12, temperature=1.5, key=jax.random.key(0))
    c = models.generate(model, PROMPT, 12, temperature=1.5, key=jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # top_k=1 leaves only the argmax to sample: greedy
    np.testing.assert_array_equal(
        models.generate(model, PROMPT, 12, temperature=1.5, top_k=1, key=jax.random.key(3)),
        models.generate(model, PROMPT, 12),
    )


def test_ragged_prompts_generate_as_if_alone():
    model, _ = load("gpt2")
    lengths = np.array([3, 6])
    padded = np.where(np.arange(6) < lengths[:, None], PROMPT, 0)
    together = models.generate(model, padded, 5, prompt_lengths=jnp.asarray(lengths))
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(
            together[b], models.generate(model, PROMPT[b : b + 1, :n], 5)[0]
        )


def test_generation_compiles_once(monkeypatch):
    traces = []
    original = generation.NNXDecodeFn.__call__

    def counting(self, *args):
        traces.append(1)
        return original(self, *args)

    monkeypatch.setattr(generation.NNXDecodeFn, "__call__", counting)
    model, _ = load("gpt2")
    prompt = PROMPT[:, :5]  # shapes no other test uses, so the first call compiles
    models.generate(model, prompt, 7)
    first = len(traces)
    assert first > 0
    models.generate(model, prompt[::-1], 7)  # new tokens, same shapes
    other, _ = load("gpt2", seed=1)  # new weights, same structure
    models.generate(other, prompt, 7)
    assert len(traces) == first


# ----------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------

SD = random_state_dict("gpt2", GPT_CFG)


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize(
    "call,error,match",
    [
        # configs
        (
            lambda: models.GPTModel(_without(GPT_CFG, "qkv_bias"), rngs=nnx.Rngs(0)),
            ValueError,
            r"missing \['qkv_bias'\]",
        ),
        (
            lambda: models.GPTModel({**GPT_CFG, "emb_size": 3}, rngs=nnx.Rngs(0)),
            ValueError,
            r"unknown \['emb_size'\]",
        ),
        (
            lambda: models.Llama3Model(GPT_CFG, rngs=nnx.Rngs(0)),
            ValueError,
            "looks like a GPT-2 config.*arch='gpt2'",
        ),
        (
            lambda: models.Qwen3Model({**QWEN_CFG, "num_experts": 8}, rngs=nnx.Rngs(0)),
            ValueError,
            "mixture-of-experts",
        ),
        (
            lambda: models.GPTModel({**GPT_CFG, "n_heads": "4"}, rngs=nnx.Rngs(0)),
            TypeError,
            r"cfg\['n_heads'\] must be an int",
        ),
        (
            lambda: models.GPTModel({**GPT_CFG, "n_heads": 5}, rngs=nnx.Rngs(0)),
            ValueError,
            r"cfg\['emb_dim'\] \(32\) must be divisible by cfg\['n_heads'\] \(5\)",
        ),
        (
            lambda: models.GPTModel({**GPT_CFG, "drop_rate": 1.0}, rngs=nnx.Rngs(0)),
            ValueError,
            r"cfg\['drop_rate'\] must be in \[0, 1\)",
        ),
        (
            lambda: models.GPTModel({**GPT_CFG, "qkv_bias": 1}, rngs=nnx.Rngs(0)),
            TypeError,
            r"cfg\['qkv_bias'\] must be True or False",
        ),
        (
            lambda: models.GPTModel({**GPT_CFG, "vocab_size": 0}, rngs=nnx.Rngs(0)),
            ValueError,
            r"cfg\['vocab_size'\] must be >= 1",
        ),
        (lambda: models.GPTModel(GPT_CFG, rngs=0), TypeError, "rngs must be an nnx.Rngs"),
        (
            lambda: models.GPTModel(GPT_CFG, dtype=jnp.int32, rngs=nnx.Rngs(0)),
            TypeError,
            "dtype must be a float dtype",
        ),
        (lambda: models.GPTModel([1, 2], rngs=nnx.Rngs(0)), TypeError, "configuration dict"),
        (
            lambda: models.config_from_book("llama3", {**LLAMA_CFG, "n_kv_groups": 3}),
            ValueError,
            r"cfg\['n_heads'\] \(4\) must be a multiple of cfg\['n_kv_groups'\] \(3\)",
        ),
        (
            lambda: models.config_from_book("llama3", {**LLAMA_CFG, "rope_freq": {"factor": 8.0}}),
            ValueError,
            r"cfg\['rope_freq'\].*missing",
        ),
        (
            lambda: models.config_from_book("llama3", {**LLAMA_CFG, "rope_base": 0}),
            ValueError,
            r"cfg\['rope_base'\].*positive",
        ),
        (
            lambda: models.config_from_book("llama3", {**LLAMA_CFG, "emb_dim": 36}),
            ValueError,
            "head dimension .9. must be even",
        ),
        (
            lambda: models.config_from_book("llama3", {**LLAMA_CFG, "dtype": "int8"}),
            TypeError,
            r"cfg\['dtype'\] must be a float dtype",
        ),
        (
            lambda: models.config_from_book("llama3", {**LLAMA_CFG, "dtype": object()}),
            TypeError,
            r"cfg\['dtype'\] must be a float dtype",
        ),
        (
            lambda: models.config_from_book("llama3", {**LLAMA_CFG, "dtype": "float64"}),
            ValueError,
            "64-bit mode",
        ),
        (
            lambda: models.config_from_book("qwen3", {**QWEN_CFG, "head_dim": 0}),
            ValueError,
            r"cfg\['head_dim'\] must be >= 1",
        ),
        (
            lambda: models.config_from_book("qwen3", {**QWEN_CFG, "qk_norm": None}),
            TypeError,
            r"cfg\['qk_norm'\] must be True or False",
        ),
        (lambda: models.config_from_book("gpt3", GPT_CFG), ValueError, "arch must be one of"),
        # state dicts
        (
            lambda: models.from_book("gpt", GPT_CFG, SD),
            ValueError,
            r"arch must be one of \['gpt2', 'llama3', 'qwen3'\]",
        ),
        (
            lambda: models.from_book("gpt2", GPT_CFG, list(SD.items())),
            TypeError,
            "state_dict must be a mapping",
        ),
        (
            lambda: models.from_book("gpt2", GPT_CFG, random_state_dict("llama3", LLAMA_CFG)),
            ValueError,
            r"looks like a Llama 3 state dict .*from_book\('llama3'",
        ),
        (lambda: models.from_book("llama3", LLAMA_CFG, SD), ValueError, "looks like a GPT-2"),
        (
            lambda: models.from_book("qwen3", QWEN_CFG, random_state_dict("llama3", LLAMA_CFG)),
            ValueError,
            "looks like a Llama 3",
        ),
        (
            lambda: models.from_book("gpt2", GPT_CFG, {"W_query.weight": np.ones((2, 3))}),
            ValueError,
            "single chapter-3 attention module.*from_torch_state_dict",
        ),
        (
            lambda: models.from_book(
                "gpt2", GPT_CFG, {"model.embed_tokens.weight": np.ones((2, 3))}
            ),
            ValueError,
            "Hugging Face keys",
        ),
        (
            lambda: models.from_book(
                "gpt2", GPT_CFG, _without(SD, "trf_blocks.1.ff.layers.2.bias")
            ),
            ValueError,
            r"missing key 'trf_blocks.1.ff.layers.2.bias'",
        ),
        (
            lambda: models.from_book("gpt2", GPT_CFG, _without(SD, "out_head.weight")),
            ValueError,
            r"missing key 'out_head.weight'",
        ),
        (
            lambda: models.from_book("gpt2", {**GPT_CFG, "n_layers": 1}, SD),
            ValueError,
            r"unexpected key 'trf_blocks.1.*more blocks than cfg\['n_layers'\] = 1",
        ),
        (
            lambda: models.from_book("gpt2", {**GPT_CFG, "n_layers": 3}, SD),
            ValueError,
            r"missing key 'trf_blocks.2.*cfg\['n_layers'\]",
        ),
        (
            lambda: models.from_book("gpt2", {**GPT_CFG, "qkv_bias": True}, SD),
            ValueError,
            r"missing key 'trf_blocks.0.att.W_\w+.bias' \(and 5 more\).*cfg\['qkv_bias'\] \(it is True\)",
        ),
        (
            lambda: models.from_book(
                "gpt2", GPT_CFG, {**SD, "trf_blocks.0.att.W_key.bias": np.zeros(32)}
            ),
            ValueError,
            r"unexpected key 'trf_blocks.0.att.W_key.bias'.*qkv_bias",
        ),
        (
            lambda: models.from_book("gpt2", {**GPT_CFG, "vocab_size": 98}, SD),
            ValueError,
            r"state_dict\['tok_emb.weight'\] has shape \(97, 32\), but the config gives \(98, 32\)",
        ),
        (
            lambda: models.from_book(
                "gpt2", GPT_CFG, {**SD, "trf_blocks.0.att.W_query.weight": np.ones((32, 16))}
            ),
            ValueError,
            r"W_query.weight'\] has shape \(32, 16\), but the config gives \(32, 32\)",
        ),
        (
            lambda: models.from_book("gpt2", GPT_CFG, {**SD, "final_norm.scale": np.ones(32, int)}),
            TypeError,
            r"state_dict\['final_norm.scale'\] must hold floats",
        ),
        (
            lambda: models.from_book(
                "gpt2", GPT_CFG, {**SD, "final_norm.scale": np.full(32, np.nan)}
            ),
            ValueError,
            "NaN or Inf",
        ),
        (
            lambda: models.to_book_state_dict(
                jnnx.MultiHeadAttention(4, 4, 4, 0.0, 2, rngs=nnx.Rngs(0))
            ),
            TypeError,
            "jattn.models model",
        ),
    ],
)
def test_bad_config_or_state_dict_is_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


GPT = models.GPTModel(GPT_CFG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "call,error,match",
    [
        (
            lambda: GPT(np.array([[1, 97]])),
            ValueError,
            r"token_ids must be in \[0, 97\).*from 1 to 97",
        ),
        (lambda: GPT(np.array([[-1, 3]])), ValueError, r"token_ids must be in \[0, 97\)"),
        (
            lambda: GPT(np.ones((1, 33), int)),
            ValueError,
            r"33 tokens .* cfg\['context_length'\] is 32",
        ),
        (lambda: GPT(np.ones((1, 3))), TypeError, "token_ids must be integer"),
        (lambda: GPT(np.ones((1, 0), int)), ValueError, "num_tokens >= 1"),
        (
            lambda: GPT(PROMPT, logits_at=np.array([1.0, 2.0])),
            TypeError,
            "logits_at must hold integer",
        ),
        (
            lambda: GPT(PROMPT, logits_at=np.array(1)),
            ValueError,
            r"logits_at must be int \[batch...\] = \(2,\)",
        ),
        (
            lambda: GPT(PROMPT, logits_at=np.array([0, 6])),
            ValueError,
            r"logits_at must be in \[0, 6\).*from 0 to 6",
        ),
        (
            lambda: models.generate(GPT, np.array([[1, 200]]), 3),
            ValueError,
            r"token_ids must be in \[0, 97\)",
        ),
        (
            lambda: models.generate(GPT, np.ones((1, 20), int), 14),
            ValueError,
            r"need 33 positions, more than cfg\['context_length'\] = 32",
        ),
        (
            lambda: models.generate(GPT, np.ones(5, int), 3),
            ValueError,
            r"\[batch, prompt_len\].*token_ids\[None\]",
        ),
        (
            lambda: models.generate(GPT, np.ones((1, 20), int), 14, window=8),
            ValueError,
            "GPT-2's position embedding ends at the context",
        ),
        (
            lambda: models.generate(GPT, PROMPT, 3, window=0),
            ValueError,
            r"window must be None or an int in \[1, 32\]",
        ),
        (
            lambda: models.generate(GPT, PROMPT, 3, window=4, use_cache=False),
            ValueError,
            "needs use_cache=True",
        ),
        (lambda: models.generate(GPT, PROMPT, 0), ValueError, "max_new_tokens must be an int >= 1"),
        (
            lambda: models.generate(GPT, PROMPT, 3, temperature=1.0),
            ValueError,
            "needs a random key",
        ),
        (lambda: models.generate(object(), PROMPT, 3), TypeError, "jattn.models model"),
        # the book's generate_text_simple(model, idx, max_new_tokens, context_size): the
        # fourth argument is not read as a temperature
        (lambda: models.generate(GPT, PROMPT, 3, 16), TypeError, "positional argument"),
        (lambda: models.generate_stream(GPT, PROMPT, 3, 16), TypeError, "positional argument"),
    ],
)
def test_bad_tokens_are_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------------------
# Against the book's own PyTorch models
# ----------------------------------------------------------------------------------------


def _book_model(arch, cfg):
    torch = pytest.importorskip("torch")
    if arch == "gpt2":
        from llms_from_scratch.ch04 import GPTModel as Book
    elif arch == "llama3":
        from llms_from_scratch.llama3 import Llama3Model as Book
    else:
        from llms_from_scratch.qwen3 import Qwen3Model as Book
    if arch != "gpt2":
        cfg = {**cfg, "dtype": torch.float32}
    torch.manual_seed(123)
    model = Book(cfg)
    model.eval()
    return torch, model, cfg


@pytest.mark.torch
@pytest.mark.parametrize("arch", ARCHS)
def test_the_books_pytorch_model_loads_and_agrees(arch):
    pytest.importorskip("llms_from_scratch")
    torch, book, cfg = _book_model(
        arch, {**CFGS[arch], "drop_rate": 0.1} if arch == "gpt2" else CFGS[arch]
    )
    model = models.from_book(arch, cfg, book.state_dict())
    model.eval()
    with torch.no_grad():
        ref = book(torch.from_numpy(PROMPT)).numpy()
    np.testing.assert_allclose(model(PROMPT), ref, atol=1e-4, rtol=0)

    from llms_from_scratch.ch04 import generate_text_simple

    idx = generate_text_simple(book, torch.from_numpy(PROMPT), 12, cfg["context_length"]).numpy()
    np.testing.assert_array_equal(models.generate(model, PROMPT, 12), idx[:, PROMPT.shape[1] :])


@pytest.mark.torch
@pytest.mark.parametrize("arch", ARCHS)
def test_saved_weights_load_strictly_into_the_books_model(arch):
    pytest.importorskip("llms_from_scratch")
    torch, book, _ = _book_model(arch, CFGS[arch])
    model, _ = load(arch)
    book.load_state_dict(
        {k: torch.from_numpy(v) for k, v in models.to_book_state_dict(model).items()}
    )
    with torch.no_grad():
        ref = book(torch.from_numpy(PROMPT)).numpy()
    np.testing.assert_allclose(model(PROMPT), ref, atol=1e-4, rtol=0)


@pytest.mark.torch
def test_bfloat16_torch_tensors_load():
    torch = pytest.importorskip("torch")
    sd = {
        k: torch.from_numpy(v).to(torch.bfloat16)
        for k, v in random_state_dict("gpt2", GPT_CFG).items()
    }
    model = models.from_book("gpt2", GPT_CFG, sd)
    np.testing.assert_array_equal(
        model.out_head.kernel[...], sd["out_head.weight"].float().numpy().T
    )


@pytest.mark.torch
def test_the_books_full_size_configs_parse():
    torch = pytest.importorskip("torch")
    llama3 = pytest.importorskip("llms_from_scratch.llama3")
    qwen3 = pytest.importorskip("llms_from_scratch.qwen3")
    for cfg, head_dim in ((llama3.LLAMA32_CONFIG_1B, 64), (llama3.LLAMA32_CONFIG_3B, 128)):
        parsed = models.config_from_book("llama3", cfg)
        assert parsed.dtype == jnp.bfloat16 and parsed.head_dim == head_dim
        assert parsed.rope_freq.to_book() == cfg["rope_freq"]
    parsed = models.config_from_book("qwen3", qwen3.QWEN_CONFIG_06_B)
    assert (parsed.head_dim, parsed.qk_norm, parsed.n_kv_groups) == (128, True, 8)
    assert (
        models.config_from_book("qwen3", {**qwen3.QWEN3_CONFIG_8B, "dtype": torch.float32}).dtype
        == jnp.float32
    )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        models.config_from_book("qwen3", qwen3.QWEN3_CONFIG_30B_A3B)


@pytest.mark.parametrize("name,cfg", [("gpt2", GPT_CFG), ("llama3", LLAMA_CFG)])
def test_concrete_arrays_closed_over_in_a_jitted_function_are_read_and_checked(name, cfg):
    """Arrays a jitted function closes over are concrete: the entries read their values
    with numpy (jnp.min inside the trace is traced, and int() of it was a
    ConcretizationTypeError) and check them as in an eager call."""
    model = models.from_book(name, cfg, random_state_dict(name, cfg, 0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 8)))
    positions, at = jnp.asarray(np.arange(8)[None].repeat(2, 0)), jnp.asarray([3, 7])
    got = nnx.jit(lambda m: m(tokens, positions=positions, logits_at=at))(model)
    np.testing.assert_allclose(got, model(tokens, logits_at=at), atol=1e-5)
    for kwargs, match in (
        (dict(token_ids=tokens.at[0, 0].set(cfg["vocab_size"])), "token_ids must be in"),
        (dict(token_ids=tokens, positions=positions.at[0, 0].set(-1)), "positions must be in"),
        (dict(token_ids=tokens, logits_at=at.at[0].set(8)), "logits_at must be in"),
    ):
        with pytest.raises(ValueError, match=match):
            nnx.jit(lambda m, kwargs=kwargs: m(**kwargs))(model)


@pytest.mark.parametrize("name", ["GPTModel", "Llama3Model", "Qwen3Model"])
def test_models_train_on_batch_sharded_tokens_on_an_explicit_mesh(name):
    """jax.make_mesh's explicit axes, token ids sharded over the batch (2 fake devices, in
    a process of their own: tests/_explicit_mesh_checks.py): the embedding states its rows'
    sharding (flax's gather raised without it) and the attention runs on each device's rows
    (the fused kernel per device), so the jitted forward and gradient equal the unsharded
    model's and the logits stay sharded."""
    got = _explicit_models()[name]
    assert got["routes"] == ["cpu_fused" if cpu_kernels.available() else "blockwise"]
    assert got["err"] < 1e-5 and got["grad_err"] < 1e-5, got
    assert got["spec"] == ["b", None, None]


@functools.cache
def _explicit_models() -> dict:
    return run_checks(Path(__file__).with_name("_explicit_mesh_checks.py"), "models")


@functools.cache
def _explicit_decoding() -> dict:
    return run_checks(Path(__file__).with_name("_explicit_mesh_checks.py"), "decoding")


_GENERATIONS = ["greedy", "eos", "sampled", "rolling", "recompute", "stream"]


@pytest.mark.slow  # multi-device generation (about 40 s of CPU)
@pytest.mark.parametrize("case", _GENERATIONS)
@pytest.mark.parametrize("name", ["GPTModel", "Llama3Model", "Qwen3Model"])
def test_models_generate_from_batch_sharded_prompts_on_an_explicit_mesh(name, case):
    """generate / generate_stream from prompts sharded over the batch on jax.make_mesh's
    explicit axes (2 fake devices, tests/_explicit_mesh_checks.py; they raised in the KV
    cache's write before): the same tokens as the unsharded run (greedy with per-row prompt
    lengths, stop tokens and lengths, top-k sampling from one key, a rolling cache, the
    recomputing loop, the stream), the rows still sharded, and the fused cache kernel (no
    partitioning rule) left to the general path where the unsharded run takes it."""
    got = _explicit_decoding()[f"{name} {case}"]
    assert got["equal"], got
    assert all(spec[0] == "b" for spec in got["specs"]), got
    unsharded_fused, sharded_fused = got["fused"]
    assert not sharded_fused
    cached = case in ("greedy", "eos", "sampled", "stream")  # a rolling cache is not fused
    assert unsharded_fused == (cached and cpu_kernels.available())


@pytest.mark.slow  # multi-device generation (about 40 s of CPU)
def test_generation_on_batch_sharded_prompts_moves_only_the_stop_flag():
    """The compiled generation loop on batch-sharded prompts: each device decodes its own
    rows through its own share of the caches; only "has every row stopped" (a bool
    all-reduce) travels between the devices."""
    assert _explicit_decoding()["moved"] == ["pred"]


@pytest.mark.slow  # multi-device generation (about 40 s of CPU)
def test_generate_from_sharded_prompts_needs_no_set_mesh():
    """Prompts placed with jax.device_put on an explicit mesh, no jax.set_mesh: the same
    tokens, rows still sharded (the prompt lengths were placed on one device and raised)."""
    got = _explicit_decoding()["without_set_mesh"]
    assert got["equal"] and got["spec"] == ["b", None], got


@pytest.mark.slow  # multi-device generation (about 40 s of CPU)
@pytest.mark.parametrize("kind", ["plain", "rolling"])
def test_nnx_module_decodes_with_heads_sharded_on_an_explicit_mesh(kind):
    """MultiHeadAttention(model_axis=...) decoding on an explicit mesh (heads over 2 fake
    devices): the cache built unsharded takes the heads' layout at its first write (it
    raised before), and a jitted prefill and step equal the unsharded module's."""
    got = _explicit_decoding()["module"][kind]
    assert got["err"] < 1e-6, got
    assert got["cache_spec"] == [None, None, "b", None]
