"""Score/mask modifiers and sinks in the modules (Linen, NNX) and in KV-cache decoding.

References: the float64 numpy attention of tests/reference.py (``np_flex_attention``)
with numpy versions of the modifiers written here from their definitions (ALiBi,
Gemma's soft-capping, T5's buckets, prefix-LM, documents, windows, gpt-oss's sinks), the
full-sequence :func:`jattn.dot_product_attention` with the same modifiers (decoding must
equal it), and finite differences (``jax.test_util.check_grads`` in float64).
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads
from reference import np_flex_attention, np_t5_bucket

import jattn
from jattn import convert, kvcache, mods
from jattn import linen as jl
from jattn import nnx as jn

dpa = jattn.dot_product_attention

D_IN, D_OUT, H, KVH = 12, 16, 4, 2  # head_dim 4, two query heads per key/value head
CONTEXT = 32


# ----------------------------------------------------------------------------------------
# numpy modifiers, from their definitions
# ----------------------------------------------------------------------------------------


def np_relative(table, bidirectional, max_distance):
    bucket = np.vectorize(lambda r: np_t5_bucket(r, table.shape[0], bidirectional, max_distance))
    return lambda s, b, h, qi, ki: s + table[bucket(ki - qi), h]


def np_alibi(slopes):
    return lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)


def np_softcap(cap, inner=None):
    def score(s, b, h, qi, ki):
        s = s if inner is None else inner(s, b, h, qi, ki)
        return cap * np.tanh(s / cap)

    return score


def np_causal(t, s):
    return np.arange(t)[:, None] >= np.arange(s)[None, :]


PARAMS = np.random.default_rng(7)
SLOPES = PARAMS.uniform(0.1, 1.0, H).astype(np.float32)
TABLE = PARAMS.normal(size=(8, H)).astype(np.float32)
SINKS = PARAMS.normal(size=H).astype(np.float32)


# ----------------------------------------------------------------------------------------
# Modules: options, parameter trees, equality with the functional call
# ----------------------------------------------------------------------------------------


def linen_mha(**kw):
    return jl.MultiHeadAttention(D_OUT, CONTEXT, 0.0, H, num_kv_heads=KVH, **kw)


def nnx_mha(**kw):
    return jn.MultiHeadAttention(
        D_IN, D_OUT, CONTEXT, 0.0, H, num_kv_heads=KVH, **kw, rngs=nnx.Rngs(0)
    )


def tokens(seed, shape=(2, 7, D_IN), dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def np_module(params, x, *, score=None, mask=None, sinks=None):
    """The MultiHeadAttention forward pass in float64 numpy, attention by np_flex_attention."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    n, t = x.shape[0], x.shape[1]
    q = (x @ p["W_query"]["kernel"]).reshape(n, t, H, -1)
    k = (x @ p["W_key"]["kernel"]).reshape(n, t, KVH, -1)
    v = (x @ p["W_value"]["kernel"]).reshape(n, t, KVH, -1)
    out, _, _ = np_flex_attention(q, k, v, score=score, mask=mask, sinks=sinks)
    return out.reshape(n, t, -1) @ p["out_proj"]["kernel"] + p["out_proj"]["bias"]


def doc_ids(n, t):
    """Document ids [n, t]: row 0 has documents of 3 tokens, row 1 of 4."""
    return np.stack([np.arange(t) // 3, np.arange(t) // 4])[:n].astype(np.int32)


# name -> (module options, numpy score, numpy mask [N|1, 1, T, T] of a 7-token input)
MODULE_CASES = {
    "softcap": (dict(softcap=0.8), np_softcap(0.8), np_causal(7, 7)[None, None]),
    "alibi+softcap (cap last)": (
        dict(score_mod=mods.alibi(jnp.asarray(SLOPES)), softcap=1.5),
        np_softcap(1.5, np_alibi(SLOPES)),
        np_causal(7, 7)[None, None],
    ),
    "relative_bias+window": (
        dict(
            score_mod=mods.relative_bias(jnp.asarray(TABLE), bidirectional=False, max_distance=16),
            mask_mod=mods.sliding_window(2),
        ),
        np_relative(TABLE, False, 16),
        (np_causal(7, 7) & (np.arange(7)[None, :] >= np.arange(7)[:, None] - 2))[None, None],
    ),
    "sinks+document": (
        dict(sinks=True, mask_mod=mods.document(jnp.asarray(doc_ids(2, 7)))),
        None,
        np_causal(7, 7)[None, None]
        & (doc_ids(2, 7)[:, :, None] == doc_ids(2, 7)[:, None, :])[:, None],
    ),
    "prefix_lm (is_causal=False)": (
        dict(is_causal=False, mask_mod=mods.prefix_lm(jnp.array([3, 5]))),
        None,
        (np_causal(7, 7)[None] | (np.arange(7)[None, None, :] < np.array([3, 5])[:, None, None]))[
            :, None
        ],
    ),
}


def with_sinks(variables, values=SINKS):
    """The variables with the sinks parameter set to ``values`` (zeros at init)."""
    params = dict(variables["params"])
    params["sinks"] = jnp.asarray(values, params["sinks"].dtype)
    return {"params": params}


def init_linen(options, x, seed):
    """A Linen module with ``options`` and its variables (SINKS set when it has sinks)."""
    module = linen_mha(**options)
    variables = module.init(jax.random.key(seed), x)
    return module, with_sinks(variables) if options.get("sinks") else variables


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_linen_and_nnx_modules_equal_the_numpy_reference(case):
    options, np_score, np_mask = MODULE_CASES[case]
    x = tokens(0)
    module, variables = init_linen(options, x, 1)
    want = np_module(
        variables["params"], x, score=np_score, mask=np_mask,
        sinks=SINKS if options.get("sinks") else None,
    )  # fmt: skip
    got = module.apply(variables, x)
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-5)
    model = convert.linen_to_nnx(variables, nnx_mha(**options))
    np.testing.assert_allclose(model(x), got, atol=1e-6)


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_module_equals_its_projections_and_the_functional_call(case):
    options, _, _ = MODULE_CASES[case]
    x = tokens(2)
    module, variables = init_linen(options, x, 3)
    p = variables["params"]
    split = lambda y, heads: y.reshape(*y.shape[:-1], heads, -1)  # noqa: E731
    q = split(x @ p["W_query"]["kernel"], H)
    k = split(x @ p["W_key"]["kernel"], KVH)
    v = split(x @ p["W_value"]["kernel"], KVH)
    score_mod = options.get("score_mod")
    if "softcap" in options:
        cap = mods.softcap(options["softcap"])
        score_mod = cap if score_mod is None else mods.compose(score_mod, cap)
    attended = dpa(
        q, k, v, is_causal=options.get("is_causal", True), score_mod=score_mod,
        mask_mod=options.get("mask_mod"), sinks=p.get("sinks"),
    )  # fmt: skip
    want = (
        attended.reshape(*x.shape[:-1], -1) @ p["out_proj"]["kernel"]
        + p["out_proj"]["bias"][None, None]
    )
    np.testing.assert_allclose(module.apply(variables, x), want, atol=2e-6)


def test_options_off_keep_the_parameter_trees():
    x = tokens(0)
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    plain = shapes(linen_mha().init(jax.random.key(0), x))
    modified = linen_mha(
        softcap=30.0, score_mod=mods.alibi(jnp.asarray(SLOPES)), mask_mod=mods.sliding_window(3)
    ).init(jax.random.key(0), x)
    assert shapes(modified) == plain
    nnx_plain = shapes(nnx.state(nnx_mha(), nnx.Param))
    nnx_modified = nnx_mha(softcap=30.0, mask_mod=mods.causal())
    assert shapes(nnx.state(nnx_modified, nnx.Param)) == nnx_plain
    assert nnx_modified.sinks is None
    assert nnx_modified.softcap == 30.0


def test_sinks_are_a_zero_initialised_per_head_parameter_in_param_dtype():
    x = tokens(0)
    variables = linen_mha(sinks=True, param_dtype=jnp.bfloat16).init(jax.random.key(0), x)
    plain = linen_mha(param_dtype=jnp.bfloat16).init(jax.random.key(0), x)
    assert set(variables["params"]) == set(plain["params"]) | {"sinks"}
    sinks = variables["params"]["sinks"]
    assert sinks.shape == (H,) and sinks.dtype == jnp.bfloat16
    np.testing.assert_array_equal(sinks, np.zeros(H))
    model = nnx_mha(sinks=True, param_dtype=jnp.bfloat16)
    assert isinstance(model.sinks, nnx.Param)
    assert model.sinks[...].shape == (H,) and model.sinks[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(model.sinks[...], np.zeros(H))
    # The NNX module's state converts to the Linen tree, sinks included
    assert set(convert.nnx_to_linen(model)["params"]) == set(variables["params"])


def test_sinks_are_partitioned_over_the_model_axis():
    x = tokens(0)
    variables = linen_mha(sinks=True, model_axis="model").init(jax.random.key(0), x)
    specs = nn.get_partition_spec(variables)["params"]
    assert specs["sinks"] == jax.sharding.PartitionSpec("model")


def test_sink_gradients_match_finite_differences_in_both_apis():
    with jax.enable_x64(True):
        x = tokens(4, dtype=jnp.float64)
        module = linen_mha(sinks=True, softcap=2.0, param_dtype=jnp.float64)
        variables = with_sinks(module.init(jax.random.key(5), x))
        params = variables["params"]

        def loss(sinks):
            y = module.apply({"params": {**params, "sinks": sinks}}, x)
            return jnp.sum(jnp.sin(y))

        check_grads(loss, (params["sinks"],), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
        grad_linen = jax.grad(loss)(params["sinks"])
        assert np.all(np.abs(grad_linen) > 0)

        model = convert.linen_to_nnx(
            variables, nnx_mha(sinks=True, softcap=2.0, param_dtype=jnp.float64)
        )
        grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(model)
        np.testing.assert_allclose(grads["sinks"][...], grad_linen, rtol=1e-10)


def test_jitted_modules_with_modifiers_trace_once_and_equal_eager():
    options = dict(sinks=True, softcap=1.0, score_mod=mods.alibi(jnp.asarray(SLOPES)))
    module = linen_mha(**options)
    variables = with_sinks(module.init(jax.random.key(0), tokens(0)))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(variables, x):
        return jax.value_and_grad(lambda v: jnp.sum(module.apply(v, x) ** 2))(variables)

    for seed in (1, 2):
        x = tokens(seed)
        loss, grads = step(variables, x)
        eager = jax.value_and_grad(lambda v, x=x: jnp.sum(module.apply(v, x) ** 2))(variables)
        np.testing.assert_allclose(loss, eager[0], rtol=1e-5)
        np.testing.assert_allclose(
            grads["params"]["sinks"], eager[1]["params"]["sinks"], rtol=1e-4, atol=1e-6
        )

    model = convert.linen_to_nnx(variables, nnx_mha(**options))

    @nnx.jit
    @chex.assert_max_traces(n=1)
    def nnx_step(model, x):
        return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    for seed in (1, 2):
        loss, grads = nnx_step(model, tokens(seed))
        np.testing.assert_allclose(loss, step(variables, tokens(seed))[0], rtol=1e-5)
        assert np.all(np.isfinite(grads["sinks"][...]))


@pytest.mark.parametrize(
    "options, exc, match",
    [
        (dict(softcap=0.0), ValueError, "softcap must be > 0"),
        (dict(softcap=float("inf")), ValueError, "softcap must be > 0"),
        (dict(softcap="50"), TypeError, "softcap must be a float"),
        (dict(softcap=True), TypeError, "softcap must be a float"),
        (dict(score_mod=3), TypeError, "score_mod must be a function"),
        (dict(mask_mod="causal"), TypeError, "mask_mod must be a function"),
        (dict(sinks=1), TypeError, "sinks"),
    ],
)
def test_bad_options_are_clear_errors_in_both_apis(options, exc, match):
    with pytest.raises(exc, match=f"MultiHeadAttention: {match}"):
        linen_mha(**options)
    with pytest.raises(exc, match=f"MultiHeadAttention: {match}"):
        nnx_mha(**options)


def test_a_bad_modifier_signature_is_reported_at_the_call():
    module = nnx_mha(score_mod=lambda s, b, h: s)
    with pytest.raises(TypeError, match="score_mod must take 5 positional arguments"):
        module(tokens(0))


# ----------------------------------------------------------------------------------------
# KV-cache decoding with modifiers == the full-sequence call
# ----------------------------------------------------------------------------------------

N, L, CAP, DH = 2, 11, 16, 8
PREFIX = np.array([4, 6], np.int32)
IDS = np.stack([np.repeat([0, 1, 2, 3, 4, 5], 3)[:CAP], np.repeat([0, 1, 2, 3], 5)[:CAP]]).astype(
    np.int32
)  # [N, CAP]: documents of 3 and of 5 tokens


def qkv(seed):
    r = np.random.default_rng(seed)
    q = r.normal(size=(N, L, H, DH)).astype(np.float32)
    k = r.normal(size=(N, L, KVH, DH)).astype(np.float32)
    v = r.normal(size=(N, L, KVH, DH)).astype(np.float32)
    return q, k, v


def decode_case(name):
    """``(decode kwargs, full-call kwargs, numpy kwargs for [N, L] positions)``."""
    causal = np_causal(L, L)[None, None]
    doc = (IDS[:, :L, None] == IDS[:, None, :L])[:, None]
    alibi, softcap = mods.alibi(jnp.asarray(SLOPES)), mods.softcap(0.7)
    relative = mods.relative_bias(jnp.asarray(TABLE), bidirectional=False, max_distance=16)
    sliding = (np.arange(L)[None, :] >= np.arange(L)[:, None] - 3)[None, None]
    cases = {
        "alibi": ({"score_mod": alibi}, {}, {"score": np_alibi(SLOPES)}),
        "softcap": ({"score_mod": softcap}, {}, {"score": np_softcap(0.7)}),
        "relative_bias": ({"score_mod": relative}, {}, {"score": np_relative(TABLE, False, 16)}),
        "sliding_window": ({"mask_mod": mods.sliding_window(3)}, {}, {"mask": causal & sliding}),
        "document": (
            {"mask_mod": mods.document(jnp.asarray(IDS))},
            {"mask_mod": mods.document(jnp.asarray(IDS[:, :L]))},
            {"mask": causal & doc},
        ),
        "prefix_lm": (
            {"mask_mod": mods.prefix_lm(jnp.asarray(PREFIX)), "is_causal": False},
            {},
            {"mask": causal | (np.arange(L)[None, None, None, :] < PREFIX[:, None, None, None])},
        ),
        "sinks": ({"sinks": jnp.asarray(SINKS)}, {}, {"sinks": SINKS}),
        "alibi+softcap+document+sinks": (
            {
                "score_mod": mods.compose(alibi, softcap),
                "mask_mod": mods.document(jnp.asarray(IDS)),
                "sinks": jnp.asarray(SINKS),
            },
            {"mask_mod": mods.document(jnp.asarray(IDS[:, :L]))},
            {
                "score": np_softcap(0.7, np_alibi(SLOPES)),
                "mask": causal & doc,
                "sinks": SINKS,
            },
        ),
    }
    decode_kw, full_override, np_kw = cases[name]
    full_kw = {"is_causal": True, **decode_kw, **full_override}
    np_kw.setdefault("mask", causal)
    return decode_kw, full_kw, np_kw


DECODE_CASES = [
    "alibi", "softcap", "relative_bias", "sliding_window", "document", "prefix_lm", "sinks",
    "alibi+softcap+document+sinks",
]  # fmt: skip

# Chunks per row (real tokens): row 0 has 11 tokens, row 1 has 9; the first chunk holds
# each row's whole prefix (prefix-LM: the prefix must be prefilled at once).
TOKEN_BY_TOKEN = [(6, 6)] + [(1, 1)] * 5
RAGGED = [(4, 6), (3, 0), (1, 2), (3, 1)]


def run_decode(cache, q, k, v, schedule, **kwargs):
    """Feeds each row its real tokens in the schedule's chunks (right-padded per chunk);
    returns ``[N, L, H, DH]`` with each real token's output (zeros elsewhere)."""
    out = np.zeros_like(q)
    pos = np.zeros(N, int)
    step = jax.jit(functools.partial(kvcache.update_and_attend, **kwargs))  # a program a shape
    for chunk in schedule:
        t = max(chunk)

        def take(x, chunk=chunk, t=t, starts=tuple(pos)):
            rows = [x[b, starts[b] : starts[b] + chunk[b]] for b in range(N)]
            return np.stack([np.pad(r, [(0, t - len(r))] + [(0, 0)] * 2) for r in rows])

        y, cache = step(cache, take(q), take(k), take(v), num_new=np.array(chunk, np.int32))
        for b in range(N):
            out[b, pos[b] : pos[b] + chunk[b]] = np.asarray(y[b, : chunk[b]])
            # padding queries attend nothing: zero output
            np.testing.assert_array_equal(np.asarray(y[b, chunk[b] :]), 0.0)
        pos += np.array(chunk)
    return out, pos


@pytest.mark.parametrize("schedule", [TOKEN_BY_TOKEN, RAGGED], ids=["token_by_token", "ragged"])
@pytest.mark.parametrize("name", DECODE_CASES)
def test_decoding_with_modifiers_equals_the_full_call_and_numpy(name, schedule):
    decode_kw, full_kw, np_kw = decode_case(name)
    q, k, v = qkv(0)
    cache = kvcache.init_cache(N, CAP, KVH, DH)
    got, lengths = run_decode(cache, q, k, v, schedule, **decode_kw)
    full = np.asarray(dpa(q, k, v, implementation="dense", **full_kw))
    want, _, _ = np_flex_attention(q, k, v, **np_kw)
    for b in range(N):
        np.testing.assert_allclose(got[b, : lengths[b]], full[b, : lengths[b]], atol=2e-6)
        np.testing.assert_allclose(got[b, : lengths[b]], want[b, : lengths[b]], atol=2e-5)


ROLLING_CAP = 4


@pytest.mark.parametrize(
    "schedule", [[(1, 1)] * L, [(5, 3), (1, 4), (5, 2)]], ids=["token_by_token", "ragged"]
)
@pytest.mark.parametrize("name", ["alibi", "relative_bias", "document", "sinks", "softcap"])
def test_rolling_cache_modifiers_see_each_slots_absolute_position(name, schedule):
    decode_kw, full_kw, np_kw = decode_case(name)
    q, k, v = qkv(1)
    cache = kvcache.init_cache(N, ROLLING_CAP, KVH, DH, rolling=True)
    got, lengths = run_decode(cache, q, k, v, schedule, **decode_kw)
    # a rolling cache attends the last `capacity` keys before each query and itself
    full = np.asarray(
        dpa(q, k, v, implementation="dense", local_window_size=(ROLLING_CAP, 0), **full_kw)
    )
    window = (np.arange(L)[None, :] >= np.arange(L)[:, None] - ROLLING_CAP)[None, None]
    want, _, _ = np_flex_attention(q, k, v, **{**np_kw, "mask": np_kw["mask"] & window})
    for b in range(N):
        np.testing.assert_allclose(got[b, : lengths[b]], full[b, : lengths[b]], atol=2e-6)
        np.testing.assert_allclose(got[b, : lengths[b]], want[b, : lengths[b]], atol=2e-5)


def test_the_modifiers_see_absolute_query_positions_and_the_batch_index():
    # rows with 3 and 1 tokens cached; a chunk of 2: queries at positions (3, 4) and (1, 2).
    # A query at position >= 4 sees every causal key, others keys 0 and 1 only; batch row
    # 1 sees key 0 only. Relative query indices (0, 1) would hide the keys 2..4 of (0, 1).
    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx < 2) | (q_idx >= 4)) & ((b == 0) | (kv_idx == 0))

    cache = kvcache.init_cache(2, 6, 1, 2)._replace(lengths=jnp.array([3, 1], jnp.int32))
    q = jnp.ones((2, 2, 1, 2))
    (_, weights), _ = kvcache.update_and_attend(
        cache, q, q, q, mask_mod=mask_mod, return_weights=True
    )
    visible = np.asarray(weights[:, 0] > 0)  # [2, 2 queries, 6 keys]
    want = np.zeros((2, 2, 6), bool)
    want[0, 0, :2] = True  # position 3
    want[0, 1, :5] = True  # position 4: keys 0..4
    want[1, :, 0] = True
    np.testing.assert_array_equal(visible, want)


def test_rolling_cache_kv_idx_is_the_position_each_slot_holds():
    # capacity 3 after 5 tokens: slots 0, 1, 2 hold positions 3, 4, 2; the next token (5)
    # sees them and itself. With q·k zeroed (scale 0) and score = kv_idx, each weight is
    # proportional to exp(position).
    cache = kvcache.init_cache(1, 3, 1, 2, rolling=True)
    x = jnp.ones((1, 5, 1, 2))
    _, cache = kvcache.update_and_attend(cache, x, x, x)
    one = jnp.ones((1, 1, 1, 2))
    (_, weights), _ = kvcache.update_and_attend(
        cache, one, one, one, score_mod=lambda s, b, h, q, kv: s + kv.astype(s.dtype),
        scale=0.0, return_weights=True,
    )  # fmt: skip
    w = np.asarray(weights[0, 0, 0], np.float64)  # keys: slots 0, 1, 2, then the chunk's own
    positions = np.array([3, 4, 2, 5])
    np.testing.assert_allclose(w, np.exp(positions) / np.exp(positions).sum(), rtol=1e-5)


def test_update_and_attend_validates_the_cache_once(monkeypatch):
    calls = []
    check = kvcache._check_cache

    def counting(cache):
        calls.append(1)
        return check(cache)

    monkeypatch.setattr(kvcache, "_check_cache", counting)
    cache = kvcache.init_cache(2, 8, KVH, DH)
    q, k, v = qkv(0)
    kvcache.update_and_attend(cache, q[:, :3], k[:, :3], v[:, :3], score_mod=mods.softcap(1.0))
    assert len(calls) == 1
    rolling = kvcache.init_cache(2, 4, KVH, DH, rolling=True)
    calls.clear()
    kvcache.update_and_attend(rolling, q[:, :3], k[:, :3], v[:, :3])
    assert len(calls) == 1


def test_jitted_decoding_with_ready_made_modifiers_traces_once():
    decode_kw, full_kw, _ = decode_case("alibi+softcap+document+sinks")
    q, k, v = qkv(2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(cache, q, k, v, score_mod, mask_mod, sinks):
        return kvcache.update_and_attend(
            cache, q, k, v, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks
        )

    cache = kvcache.init_cache(N, CAP, KVH, DH)
    outs = []
    for i in range(L):
        y, cache = step(cache, q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], **decode_kw)
        outs.append(y)
    full = dpa(q, k, v, implementation="dense", **full_kw)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-6)


def test_decoding_gradients_reach_closed_over_arrays_and_sinks():
    q, k, v = qkv(3)
    slopes, sinks = jnp.asarray(SLOPES), jnp.asarray(SINKS)

    def decoded(slopes, sinks):
        cache = kvcache.init_cache(N, CAP, KVH, DH)
        y, _ = kvcache.update_and_attend(
            cache, q, k, v, score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi),
            sinks=sinks,
        )  # fmt: skip
        return jnp.sum(jnp.sin(y))

    def full(slopes, sinks):
        y = dpa(q, k, v, is_causal=True, score_mod=mods.alibi(slopes), sinks=sinks)
        return jnp.sum(jnp.sin(y))

    got, want = jax.grad(decoded, (0, 1))(slopes, sinks), jax.grad(full, (0, 1))(slopes, sinks)
    for g, w in zip(got, want, strict=True):
        assert np.all(np.abs(w) > 0)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"block_mask": "bm"}, TypeError, "takes no block_mask"),
        ({"score_mod": lambda s, b: s}, TypeError, "score_mod must take 5 positional"),
        ({"mask_mod": lambda b, h, q, k: q - k}, TypeError, "mask_mod must return booleans"),
        (
            {"mask_mod": mods.document(jnp.zeros((3, CAP), jnp.int32))},
            ValueError,
            "document segment_ids has 3 batch rows",
        ),
        ({"score_mod": mods.alibi(jnp.ones(3))}, ValueError, "one entry per query head"),
    ],
)
def test_decoding_modifier_errors_are_clear(kwargs, exc, match):
    q, k, v = qkv(0)
    cache = kvcache.init_cache(N, CAP, KVH, DH)
    with pytest.raises(exc, match=match):
        kvcache.update_and_attend(cache, q[:, :1], k[:, :1], v[:, :1], **kwargs)


# ----------------------------------------------------------------------------------------
# Modules decoding with their options
# ----------------------------------------------------------------------------------------

MODULE_DECODE = {
    "alibi+softcap+sinks": dict(score_mod=mods.alibi(jnp.asarray(SLOPES)), softcap=1.0, sinks=True),
    "document+relative": dict(
        mask_mod=mods.document(jnp.asarray(IDS)),
        score_mod=mods.relative_bias(jnp.asarray(TABLE), bidirectional=False, max_distance=16),
    ),
}


@pytest.mark.parametrize("case", list(MODULE_DECODE))
def test_modules_decode_with_their_options_as_their_full_forward(case):
    options = MODULE_DECODE[case]
    x = tokens(6, (N, L, D_IN))
    full_options = dict(options)
    if "mask_mod" in options:  # the full forward's document ids cover its L tokens
        full_options["mask_mod"] = mods.document(jnp.asarray(IDS[:, :L]))
    module = linen_mha(**options, decode=True)
    variables = linen_mha(**full_options).init(jax.random.key(7), x)
    if options.get("sinks"):
        variables = with_sinks(variables)
    full = linen_mha(**full_options).apply(variables, x)
    cache = module.init(jax.random.key(0), jnp.zeros((N, CAP, D_IN)))["cache"]
    # a ragged prefill (rows of 5 and 3 tokens), then single tokens
    y, state = module.apply(
        {**variables, "cache": cache}, x[:, :5], num_new=jnp.array([5, 3]), mutable=["cache"]
    )
    np.testing.assert_allclose(y[0], full[0, :5], atol=2e-6)
    np.testing.assert_allclose(y[1, :3], full[1, :3], atol=2e-6)
    cache = state["cache"]
    model = convert.linen_to_nnx(variables, nnx_mha(**options))
    model.init_cache((N, CAP, D_IN))
    model(x[:, :5], decode=True, num_new=jnp.array([5, 3]))
    for i in range(3):
        step = jnp.stack([x[0, 5 + i], x[1, 3 + i]])[:, None]
        y, state = module.apply({**variables, "cache": cache}, step, mutable=["cache"])
        cache = state["cache"]
        np.testing.assert_allclose(y[0, 0], full[0, 5 + i], atol=2e-6)
        np.testing.assert_allclose(y[1, 0], full[1, 3 + i], atol=2e-6)
        np.testing.assert_allclose(model(step, decode=True), y, atol=2e-6)


def test_a_long_prefill_with_modifiers_runs_blockwise_and_equals_the_full_call():
    # 300 queries over a capacity of 320: the automatic rule runs the decoding call on the
    # blockwise path, with the cache's position-shifted modifiers hoisted into its tiles.
    r = np.random.default_rng(12)
    t, cap = 300, 320
    q = jnp.asarray(r.normal(size=(N, t, H, DH)), jnp.float32)
    k = jnp.asarray(r.normal(size=(N, t, KVH, DH)), jnp.float32)
    v = jnp.asarray(r.normal(size=(N, t, KVH, DH)), jnp.float32)
    ids = np.stack([np.arange(cap) // 70, np.arange(cap) // 110]).astype(np.int32)
    alibi, sinks = mods.alibi(jnp.asarray(SLOPES)), jnp.asarray(SINKS)
    cache = kvcache.init_cache(N, cap, KVH, DH)
    kwargs = dict(score_mod=alibi, mask_mod=mods.document(jnp.asarray(ids)), sinks=sinks)
    auto, _ = kvcache.update_and_attend(cache, q, k, v, **kwargs)
    blockwise, _ = kvcache.update_and_attend(cache, q, k, v, implementation="blockwise", **kwargs)
    np.testing.assert_array_equal(auto, blockwise)
    full = dpa(
        q, k, v, is_causal=True, score_mod=alibi, sinks=sinks,
        mask_mod=mods.document(jnp.asarray(ids[:, :t])), implementation="dense",
    )  # fmt: skip
    np.testing.assert_allclose(blockwise, full, atol=2e-5)
