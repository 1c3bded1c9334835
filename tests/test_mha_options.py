"""MultiHeadAttention's options for the book's later models: head_dim, out_bias, qk_norm, rope.

References: a float64 numpy transcription of the computation (projections, RMSNorm over
head_dim, the book's rotate-half RoPE at given positions, causal grouped-query attention,
output projection) written here from the definitions, and ``tests/reference.py``'s
attention. Linen and NNX must agree through ``jattn.convert.linen_to_nnx``, decoding must
equal the full forward pass, and ragged rows must continue at their own positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _book_models_reference import rope_inv_freq
from flax import nnx
from reference import np_attention

from jattn import convert, kvcache
from jattn import linen as L
from jattn import nnx as N
from jattn.rope import RoPE

D_IN, D_OUT, CONTEXT = 12, 16, 24
LLAMA_ROPE = RoPE(
    500_000.0,
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context_length": 8},
)

# (name, options): every option alone and the book's two combinations.
OPTIONS = [
    ("default", {}),
    ("head_dim", {"head_dim": 6, "num_kv_heads": 2}),
    ("no_out_bias", {"out_bias": False, "qkv_bias": True}),
    ("qk_norm", {"qk_norm": True, "qk_norm_eps": 1e-3}),
    ("rope", {"rope": RoPE(10_000.0)}),
    ("llama3", {"num_kv_heads": 2, "out_bias": False, "rope": LLAMA_ROPE}),
    (
        "qwen3",
        {"head_dim": 10, "num_kv_heads": 1, "out_bias": False, "qk_norm": True, "rope": RoPE(1e6)},
    ),
]
IDS = [name for name, _ in OPTIONS]


def nnx_module(options, *, num_heads=4, rngs_seed=0, **kw):
    opts = dict(options)
    qkv_bias = opts.pop("qkv_bias", False)
    return N.MultiHeadAttention(
        D_IN, D_OUT, CONTEXT, 0.0, num_heads, qkv_bias, **opts, **kw, rngs=nnx.Rngs(rngs_seed)
    )


def linen_module(options, *, num_heads=4, **kw):
    opts = dict(options)
    qkv_bias = opts.pop("qkv_bias", False)
    return L.MultiHeadAttention(D_OUT, CONTEXT, 0.0, num_heads, qkv_bias, **opts, **kw)


def randomize(model, seed=1):
    """Random parameters everywhere (RMSNorm scales near 1), so no option hides behind an init."""
    rng = np.random.default_rng(seed)
    params = convert.nnx_to_linen(model)["params"]

    def draw(path, leaf):
        names = [getattr(p, "key", p) for p in path]
        if names[-1] == "scale":
            return 1.0 + 0.2 * rng.standard_normal(leaf.shape)
        return 0.4 * rng.standard_normal(leaf.shape)

    return convert.linen_to_nnx({"params": jax.tree_util.tree_map_with_path(draw, params)}, model)


# ----------------------------------------------------------------------------------------
# The float64 reference
# ----------------------------------------------------------------------------------------


def np_rms_norm(x, scale, eps):
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * scale


def np_rope(x, positions, rope: RoPE):
    """The book's rotate-half RoPE at explicit positions. x: [B, T, heads, D]; positions [B?, T]."""
    d = x.shape[-1]
    freq = None if rope.freq_config is None else rope.freq_config.to_book()
    inv_freq = rope_inv_freq(d, rope.theta_base, freq)
    angles = np.asarray(positions, np.float64)[..., None] * inv_freq  # [B?, T, D/2]
    angles = np.concatenate([angles, angles], axis=-1)[..., None, :]  # [B?, T, 1, D]
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def np_mha(params, x, options, *, num_heads=4, positions=None, window=None):
    """float64 MultiHeadAttention with the options, causal (keys at most ``window`` back),
    from Linen-layout params."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    kv_heads = options.get("num_kv_heads", num_heads)
    head_dim = options.get("head_dim", D_OUT // num_heads)
    t = x.shape[-2]

    def dense(name, y):
        out = y @ p[name]["kernel"]
        return out + p[name]["bias"] if "bias" in p[name] else out

    q = dense("W_query", x).reshape(*x.shape[:-1], num_heads, head_dim)
    k = dense("W_key", x).reshape(*x.shape[:-1], kv_heads, head_dim)
    v = dense("W_value", x).reshape(*x.shape[:-1], kv_heads, head_dim)
    if options.get("qk_norm"):
        eps = options.get("qk_norm_eps", 1e-6)
        q = np_rms_norm(q, p["q_norm"]["scale"], eps)
        k = np_rms_norm(k, p["k_norm"]["scale"], eps)
    if options.get("rope") is not None:
        positions = np.arange(t) if positions is None else positions
        q, k = np_rope(q, positions, options["rope"]), np_rope(k, positions, options["rope"])
    back = np.arange(t)[:, None] - np.arange(t)[None, :]  # query position - key position
    out = np_attention(q, k, v, mask=(back >= 0) & (back <= (t if window is None else window)))
    return dense("out_proj", out.reshape(*x.shape[:-1], num_heads * head_dim))


# ----------------------------------------------------------------------------------------
# Forward pass
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,options", OPTIONS, ids=IDS)
def test_nnx_and_linen_equal_the_float64_reference(name, options, rng):
    x = rng.normal(size=(2, 7, D_IN)).astype(np.float32)
    model = randomize(nnx_module(options))
    variables = convert.nnx_to_linen(model)
    ref = np_mha(variables["params"], x, options)
    np.testing.assert_allclose(model(x), ref, rtol=1e-5, atol=1e-5)
    linen = linen_module(options)
    np.testing.assert_allclose(linen.apply(variables, x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,options", OPTIONS, ids=IDS)
def test_linen_params_load_into_nnx_and_agree(name, options, rng):
    x = rng.normal(size=(3, 5, D_IN)).astype(np.float32)
    linen = linen_module(options)
    variables = linen.init(jax.random.key(2), x)
    variables = {
        "params": jax.tree.map(
            lambda a: a + 0.1 * jax.random.normal(jax.random.key(3), a.shape), variables["params"]
        )
    }
    model = convert.linen_to_nnx(variables, nnx_module(options))
    np.testing.assert_allclose(model(x), linen.apply(variables, x), rtol=1e-6, atol=1e-6)
    assert jax.tree.map(jnp.shape, convert.nnx_to_linen(model)["params"]) == jax.tree.map(
        jnp.shape, variables["params"]
    )


def test_parameter_shapes_follow_head_dim_and_the_flags():
    model = nnx_module({"head_dim": 6, "num_kv_heads": 2, "out_bias": False, "qk_norm": True})
    shapes = jax.tree.map(jnp.shape, convert.nnx_to_linen(model)["params"])
    assert shapes == {
        "W_query": {"kernel": (D_IN, 4 * 6)},
        "W_key": {"kernel": (D_IN, 2 * 6)},
        "W_value": {"kernel": (D_IN, 2 * 6)},
        "out_proj": {"kernel": (4 * 6, D_OUT)},
        "q_norm": {"scale": (6,)},
        "k_norm": {"scale": (6,)},
    }
    assert model.head_dim == 6
    model.init_cache((2, 8, D_IN))
    assert model.cache.get_value().keys.shape == (2, 8, 2, 6)
    # The defaults keep chapter 3's tree: no norms, out_proj with a bias.
    default = jax.tree.map(jnp.shape, convert.nnx_to_linen(nnx_module({}))["params"])
    assert set(default) == {"W_query", "W_key", "W_value", "out_proj"}
    assert default["out_proj"] == {"kernel": (D_OUT, D_OUT), "bias": (D_OUT,)}


def test_head_dim_frees_d_out_from_num_heads():
    # d_out = 16 is not a multiple of 3 heads, which is fine once head_dim is given.
    model = N.MultiHeadAttention(D_IN, D_OUT, CONTEXT, 0.0, 3, head_dim=5, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 4, D_IN))
    assert model(x).shape == (2, 4, D_OUT)
    with pytest.raises(ValueError, match="must be divisible by num_heads"):
        N.MultiHeadAttention(D_IN, D_OUT, CONTEXT, 0.0, 3, rngs=nnx.Rngs(0))


def test_scale_is_one_over_sqrt_head_dim():
    # One head of width 8 inside d_out = 4: the logits scale must follow head_dim, not d_out.
    model = randomize(N.MultiHeadAttention(D_IN, 4, CONTEXT, 0.0, 1, head_dim=8, rngs=nnx.Rngs(0)))
    x = np.random.default_rng(0).normal(size=(5, D_IN))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), convert.nnx_to_linen(model)["params"])
    q, k = x @ p["W_query"]["kernel"], x @ p["W_key"]["kernel"]  # [5, 8]
    logits = np.where(np.tril(np.ones((5, 5), bool)), q @ k.T / np.sqrt(8.0), -np.inf)
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    _, weights = model(x.astype(np.float32), return_weights=True)  # [1 head, 5, 5]
    np.testing.assert_allclose(weights[0], expected, rtol=1e-5, atol=1e-6)


def test_dtype_bfloat16_runs_in_bfloat16():
    options = dict(OPTIONS)["qwen3"]
    model = randomize(nnx_module(options, dtype=jnp.bfloat16))
    x = np.random.default_rng(0).normal(size=(2, 6, D_IN)).astype(np.float32)
    out = model(jnp.asarray(x, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    ref = np_mha(convert.nnx_to_linen(model)["params"], x, options)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=0.05 * np.abs(ref).max())


# ----------------------------------------------------------------------------------------
# Positions
# ----------------------------------------------------------------------------------------


def test_explicit_positions_rotate_per_row(rng):
    options = dict(OPTIONS)["llama3"]
    model = randomize(nnx_module(options))
    x = rng.normal(size=(2, 5, D_IN)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4], [0, 2, 4, 6, 8]])
    out = model(x, positions=jnp.asarray(positions))
    ref = np_mha(convert.nnx_to_linen(model)["params"], x, options, positions=positions)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    default = model(x)
    np.testing.assert_array_equal(out[0], default[0])
    assert not np.allclose(out[1], default[1], atol=1e-3)
    np.testing.assert_array_equal(model(x, positions=jnp.arange(5)), default)
    # RoPE sees relative positions only: a shift by a constant changes nothing but rounding.
    np.testing.assert_allclose(model(x, positions=jnp.arange(5) + 9), default, atol=1e-4)


# ----------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rope", "llama3", "qwen3"])
def test_nnx_decode_equals_the_full_forward_pass(name, rng):
    model = randomize(nnx_module(dict(OPTIONS)[name]))
    x = rng.normal(size=(2, 9, D_IN)).astype(np.float32)
    full = model(x)
    model.init_cache((2, 12, D_IN))
    step = nnx.jit(lambda m, chunk: m(chunk, decode=True))  # one program per chunk length
    steps = [step(model, x[:, :4])]
    steps += [step(model, x[:, t : t + 1]) for t in range(4, 7)]
    steps.append(step(model, x[:, 7:]))
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["rope", "qwen3"])
def test_linen_decode_equals_the_full_forward_pass(name, rng):
    options = dict(OPTIONS)[name]
    x = rng.normal(size=(2, 8, D_IN)).astype(np.float32)
    plain = linen_module(options)
    params = plain.init(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda a: a + 0.2 * jax.random.normal(jax.random.key(4), a.shape), params)
    full = plain.apply({"params": params}, x)
    decoder = linen_module(options, decode=True)
    cache = decoder.init(jax.random.key(0), jnp.zeros((2, 10, D_IN)))["cache"]
    outs = []
    for chunk in (x[:, :3], x[:, 3:4], x[:, 4:5], x[:, 5:]):
        out, updated = decoder.apply({"params": params, "cache": cache}, chunk, mutable=["cache"])
        outs.append(out)
        cache = updated["cache"]
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)


def test_ragged_rows_continue_at_their_own_positions(rng):
    model = randomize(nnx_module(dict(OPTIONS)["qwen3"]))
    x = rng.normal(size=(2, 6, D_IN)).astype(np.float32)
    nxt = rng.normal(size=(2, 1, D_IN)).astype(np.float32)
    lengths = np.array([3, 6])
    model.init_cache((2, 10, D_IN))
    prefill = model(x, decode=True, num_new=jnp.asarray(lengths))
    step = model(nxt, decode=True)
    for b, n in enumerate(lengths):
        alone = model(np.concatenate([x[b, :n], nxt[b]])[None])[0]
        np.testing.assert_allclose(prefill[b, :n], alone[:n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(step[b, 0], alone[n], rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(prefill[b, n:]) == 0.0)  # padding attends nothing, no out bias


def test_linen_ragged_rows_continue_at_their_own_positions(rng):
    options = dict(OPTIONS)["llama3"]
    model = randomize(nnx_module(options))
    variables = convert.nnx_to_linen(model)
    x = rng.normal(size=(2, 5, D_IN)).astype(np.float32)
    nxt = rng.normal(size=(2, 1, D_IN)).astype(np.float32)
    lengths = jnp.array([2, 5])
    decoder = linen_module(options, decode=True)
    cache = decoder.init(jax.random.key(0), jnp.zeros((2, 8, D_IN)))["cache"]
    prefill, state = decoder.apply(
        {**variables, "cache": cache}, x, num_new=lengths, mutable=["cache"]
    )
    step, _ = decoder.apply({**variables, **state}, nxt, mutable=["cache"])
    for b, n in enumerate(np.asarray(lengths)):
        alone = model(np.concatenate([x[b, :n], nxt[b]])[None])[0]  # NNX, same weights
        np.testing.assert_allclose(prefill[b, :n], alone[:n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(step[b, 0], alone[n], rtol=1e-5, atol=1e-5)


def test_jitted_decode_step_compiles_once(rng):
    model = randomize(nnx_module(dict(OPTIONS)["qwen3"]))
    model.init_cache((2, 12, D_IN))
    traces = []

    @nnx.jit
    def step(model, x):
        traces.append(1)
        return model(x, decode=True)

    x = rng.normal(size=(2, 8, D_IN)).astype(np.float32)
    outs = [step(model, jnp.asarray(x[:, t : t + 1])) for t in range(8)]
    assert len(traces) == 1
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), model(x), rtol=1e-5, atol=1e-5)


def test_rolling_cache_decodes_windowed_attention_in_nnx_and_linen(rng):
    options = dict(OPTIONS)["qwen3"]
    model = randomize(nnx_module(options))
    variables = convert.nnx_to_linen(model)
    x = rng.normal(size=(2, 11, D_IN)).astype(np.float32)
    ref = np_mha(variables["params"], x, options, window=4)
    model.init_cache((2, 4, D_IN), rolling=True)
    nnx_out = [model(x[:, :6], decode=True)]  # a prefill longer than the cache
    nnx_out += [model(x[:, t : t + 1], decode=True) for t in range(6, 11)]
    np.testing.assert_allclose(jnp.concatenate(nnx_out, axis=1), ref, rtol=1e-5, atol=1e-5)
    # Linen: the same cache, put into the 'cache' collection by hand
    decoder = linen_module(options, decode=True)
    cache = {"kv": kvcache.init_cache(2, 4, 1, 10, rolling=True)}
    linen_out = []
    for sl in (slice(0, 6), *(slice(t, t + 1) for t in range(6, 11))):
        out, state = decoder.apply({**variables, "cache": cache}, x[:, sl], mutable=["cache"])
        linen_out.append(out)
        cache = state["cache"]
    np.testing.assert_allclose(jnp.concatenate(linen_out, axis=1), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache["kv"].lengths, [11, 11])
