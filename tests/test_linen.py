"""jattn.linen: the chapter's classes against the book's forward passes, masks, dropout, errors."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _module_cases import CAUSAL_CLASSES, CLASSES, FORWARD_CASES, Case, case_id

from jattn import causality, convert, masks
from jattn import linen as L


def _init(case: Case, x, **kw):
    return case.linen().init(jax.random.key(0), x, **case.call_kwargs(deterministic=True), **kw)


# Each case with one of: no batch dim, one, two (cycling keeps the suite small).
BATCHED_CASES = [(c, [(), (2,), (2, 3)][i % 3]) for i, c in enumerate(FORWARD_CASES)]


@pytest.mark.parametrize(
    ("case", "batch"), BATCHED_CASES, ids=[f"{case_id(c)}-batch{b}" for c, b in BATCHED_CASES]
)
def test_matches_numpy_transcription_of_the_book(case, batch, rng):
    # Random book-layout weights, loaded through the converter, against the book's forward.
    sd = case.state_dict(rng)
    x = rng.normal(size=(*batch, 5, case.d_in)).astype(np.float32)
    variables = convert.from_torch_state_dict(sd, case.linen())
    y = case.linen().apply(variables, x)
    np.testing.assert_allclose(y, case.reference(sd, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", CLASSES)
def test_parameter_names_follow_the_book(kind):
    case = Case(kind, qkv_bias=True)
    shapes = jax.tree.map(jnp.shape, _init(case, jnp.ones((5, 3)))["params"])
    qkv = {n: {"kernel": (3, 4), "bias": (4,)} for n in ("W_query", "W_key", "W_value")}
    expected = {
        "SelfAttentionV1": {n: (3, 4) for n in ("W_query", "W_key", "W_value")},
        "SelfAttentionV2": qkv,
        "CausalAttention": qkv,
        "MultiHeadAttentionWrapper": {"heads_0": qkv, "heads_1": qkv},
        "MultiHeadAttention": qkv | {"out_proj": {"kernel": (4, 4), "bias": (4,)}},
    }[kind]
    assert shapes == expected


def test_gqa_shrinks_key_value_projections():
    m = L.MultiHeadAttention(8, 6, 0.0, num_heads=4, num_kv_heads=2)
    shapes = jax.tree.map(jnp.shape, m.init(jax.random.key(0), jnp.ones((5, 3)))["params"])
    assert shapes["W_query"]["kernel"] == (3, 8)
    assert shapes["W_key"]["kernel"] == shapes["W_value"]["kernel"] == (3, 4)


@pytest.mark.parametrize("kind", CAUSAL_CLASSES)
def test_causal_by_gradient(kind, rng):
    case = Case(kind)
    x = jnp.asarray(rng.normal(size=(2, 6, 3)), jnp.float32)
    m, variables = case.linen(), _init(case, x)
    dep = causality.dependence_matrix(lambda z: m.apply(variables, z), x)
    upper = np.triu(np.ones_like(dep, dtype=bool), k=1)
    assert np.all(dep[upper] == 0.0), "an output depends on a future token"
    assert np.all(dep[~upper] > 0.0), "an output ignores a past token"


@pytest.mark.parametrize("kind", CAUSAL_CLASSES)
def test_causal_false_leaks_the_future(kind, rng):
    case = Case(kind, extra=(("is_causal", False),))
    x = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
    m, variables = case.linen(), _init(case, x)
    assert causality.future_leak(lambda z: m.apply(variables, z), x) > 1e-3


@pytest.mark.parametrize(
    "kind", ["CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention"]
)
def test_padding_mask_is_anded_with_causal_mask(kind, rng):
    # Two pad tokens in front, hidden by a key mask: the real tokens must see only each
    # other, so their outputs equal those of the unpadded sequence.
    case = Case(kind)
    tokens = rng.normal(size=(4, 3)).astype(np.float32)
    padded = np.concatenate([rng.normal(size=(2, 3)).astype(np.float32) * 9, tokens])
    m, variables = case.linen(), _init(case, padded)
    key_valid = np.arange(6) >= 2
    mask = masks.padding_mask(key_valid=jnp.asarray(key_valid))  # [1, 1, T]
    y_padded = m.apply(variables, padded, mask)
    np.testing.assert_allclose(y_padded[2:], m.apply(variables, tokens), rtol=1e-5, atol=1e-6)
    # The two pad queries see no key at all: zero context (MHA: just the out_proj bias).
    expected = variables["params"]["out_proj"]["bias"] if kind == "MultiHeadAttention" else 0.0
    np.testing.assert_allclose(y_padded[:2], np.broadcast_to(expected, y_padded[:2].shape))


@pytest.mark.parametrize("kind", CLASSES)
def test_returned_and_sown_weights(kind, rng):
    case = Case(kind)
    x = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
    m, variables = case.linen(), _init(case, x)
    y, w = m.apply(variables, x, return_weights=True)
    heads = 2 if kind in ("MultiHeadAttentionWrapper", "MultiHeadAttention") else 1
    assert w.shape == (2, heads, 5, 5)
    np.testing.assert_allclose(y, m.apply(variables, x))
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    if case.causal:
        assert np.all(np.asarray(w)[..., np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] == 0)
    _, state = m.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    sown = jax.tree.leaves(state["intermediates"])
    np.testing.assert_allclose(jnp.concatenate(sown, axis=-3), w)


def _one_hot_probe(dropout, **kw):
    """CausalAttention whose values are the inputs and inputs are one-hot rows.

    Then output row i is row i of the (dropped-out) attention weights, so dropout can be
    read off directly.
    """
    m = L.CausalAttention(6, 6, dropout, **kw)
    x = jnp.eye(6, dtype=jnp.float32)[None].repeat(3, axis=0)  # [3, 6, 6]
    variables = m.init(jax.random.key(0), x, deterministic=True)
    variables["params"]["W_value"]["kernel"] = jnp.eye(6)
    return m, variables, x


def test_dropout_zeroes_weights_and_rescales_the_rest():
    m, variables, x = _one_hot_probe(0.5)
    _, w = m.apply(variables, x, deterministic=True, return_weights=True)
    w = np.asarray(w[:, 0])  # [3, 6, 6] pre-dropout weights
    y = np.asarray(m.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)}))
    kept = y != 0
    np.testing.assert_allclose(y[kept], 2.0 * w[kept], rtol=1e-6)  # scaled by 1 / (1 - 0.5)
    lower = np.tril(np.ones((6, 6), bool))
    assert 0.2 < kept[:, lower].mean() < 0.8  # some dropped, some kept (63 draws)
    # Independent per example, as torch.nn.Dropout in the book...
    assert not np.array_equal(kept[0], kept[1])
    # ...or one mask for the whole batch with broadcast_dropout=True (flax's default).
    shared = L.CausalAttention(6, 6, 0.5, broadcast_dropout=True)
    y = np.asarray(shared.apply(variables, x, deterministic=False, dropout_rng=jax.random.key(1)))
    assert np.array_equal(y[0] != 0, y[1] != 0) and np.array_equal(y[0] != 0, y[2] != 0)


def test_dropout_same_key_same_output_other_key_other_output():
    m, variables, x = _one_hot_probe(0.5)

    def run(**kw):
        return m.apply(variables, x, deterministic=False, **kw)

    k1, k2 = jax.random.key(1), jax.random.key(2)
    np.testing.assert_array_equal(run(rngs={"dropout": k1}), run(rngs={"dropout": k1}))
    assert not np.array_equal(run(rngs={"dropout": k1}), run(rngs={"dropout": k2}))
    np.testing.assert_array_equal(run(dropout_rng=k2), run(dropout_rng=k2))
    assert not np.array_equal(run(dropout_rng=k1), run(dropout_rng=k2))


def test_deterministic_ignores_the_key_and_equals_dropout_zero(rng):
    x = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
    m = L.MultiHeadAttention(4, 6, 0.5, 2)
    variables = m.init(jax.random.key(0), x, deterministic=True)
    no_dropout = L.MultiHeadAttention(4, 6, 0.0, 2).apply(variables, x)
    inference = m.apply(variables, x, deterministic=True, rngs={"dropout": jax.random.key(1)})
    np.testing.assert_array_equal(inference, no_dropout)
    # The call argument wins over the attribute, in both directions.
    trained = L.MultiHeadAttention(4, 6, 0.5, 2, deterministic=False)
    np.testing.assert_array_equal(trained.apply(variables, x, deterministic=True), no_dropout)
    evaluated = L.MultiHeadAttention(4, 6, 0.5, 2, deterministic=True)
    dropped = evaluated.apply(variables, x, deterministic=False, dropout_rng=jax.random.key(3))
    assert not np.allclose(dropped, no_dropout)


def test_wrapper_heads_drop_independently():
    # Two identical heads: only dropout can make their halves of the output differ.
    m = L.MultiHeadAttentionWrapper(6, 6, 0.5, 2)
    x = jnp.eye(6, dtype=jnp.float32)
    variables = m.init(jax.random.key(0), x, deterministic=True)
    variables["params"]["heads_1"] = variables["params"]["heads_0"]
    for kw in ({"rngs": {"dropout": jax.random.key(1)}}, {"dropout_rng": jax.random.key(1)}):
        y = m.apply(variables, x, deterministic=False, **kw)
        assert not np.array_equal(y[:, :6], y[:, 6:])
    y = m.apply(variables, x, deterministic=True)
    np.testing.assert_array_equal(y[:, :6], y[:, 6:])


def test_jit_equals_eager_and_traces_once(rng):
    m = L.MultiHeadAttention(4, 6, 0.1, 2)
    x = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
    variables = m.init(jax.random.key(0), x, deterministic=True)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(variables, x, key):
        return m.apply(variables, x, deterministic=False, rngs={"dropout": key})

    key = jax.random.key(4)
    eager = m.apply(variables, x, deterministic=False, rngs={"dropout": key})
    np.testing.assert_allclose(step(variables, x, key), eager, rtol=1e-6, atol=1e-6)
    step(variables, x + 1.0, jax.random.key(5))  # a second call must not retrace
    chex.clear_trace_counter()


def test_vmap_equals_batched_call(rng):
    m = L.MultiHeadAttention(4, 6, 0.0, 2, num_kv_heads=1)
    x = jnp.asarray(rng.normal(size=(3, 5, 3)), jnp.float32)
    variables = m.init(jax.random.key(0), x)
    mapped = jax.vmap(lambda z: m.apply(variables, z))(x)
    np.testing.assert_allclose(mapped, m.apply(variables, x), rtol=1e-6, atol=1e-6)


def test_dtype_param_dtype_and_initializers():
    x = jnp.ones((2, 5, 3), jnp.float32)
    m = L.MultiHeadAttention(
        4,
        6,
        0.0,
        2,
        True,
        dtype=jnp.bfloat16,
        kernel_init=nn.initializers.constant(0.5),
        bias_init=nn.initializers.constant(0.25),
    )
    variables = m.init(jax.random.key(0), x)
    for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"]):
        assert leaf.dtype == jnp.float32
        expected = 0.25 if path[-1].key == "bias" else 0.5
        np.testing.assert_array_equal(leaf, expected)
    assert m.apply(variables, x).dtype == jnp.bfloat16
    half = L.CausalAttention(2, 6, 0.0, param_dtype=jnp.bfloat16)
    params = half.init(jax.random.key(0), x)["params"]
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


def test_v1_default_init_is_the_books_uniform():
    w = L.SelfAttentionV1(400).init(jax.random.key(0), jnp.ones((5, 3)))["params"]["W_query"]
    assert 0.0 <= float(w.min()) and float(w.max()) < 1.0 and abs(float(w.mean()) - 0.5) < 0.05


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: L.MultiHeadAttention(5, 6, 0.0, 2), "d_out .5. must be divisible by num_heads"),
        (lambda: L.MultiHeadAttention(4, 6, 0.0, 0), "num_heads must be >= 1"),
        (lambda: L.MultiHeadAttentionWrapper(4, 6, 0.0, 0), "num_heads must be >= 1"),
        (lambda: L.MultiHeadAttention(4, 6, 1.0, 2), r"dropout must be in \[0, 1\)"),
        (lambda: L.CausalAttention(4, 6, -0.1), r"dropout must be in \[0, 1\)"),
        (lambda: L.MultiHeadAttention(8, 6, 0.0, 4, num_kv_heads=3), "multiple of num_kv_heads"),
        (lambda: L.CausalAttention(4, 0, 0.0), "context_length must be >= 1"),
        (lambda: L.SelfAttentionV2(0), "d_out must be >= 1"),
    ],
)
def test_bad_configuration_raises(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("kind", CAUSAL_CLASSES)
def test_too_many_tokens_raises(kind):
    case = Case(kind)
    variables = _init(case, jnp.ones((6, 3)))
    with pytest.raises(ValueError, match=r"7 tokens .* context_length is 6"):
        case.linen().apply(variables, jnp.ones((7, 3)))


def test_dropout_without_deterministic_or_key_raises():
    m = L.MultiHeadAttention(4, 6, 0.1, 2)
    x = jnp.ones((5, 3))
    variables = m.init(jax.random.key(0), x, deterministic=True)
    with pytest.raises(ValueError, match="no `deterministic` was given"):
        m.apply(variables, x)
    for module in (m, L.MultiHeadAttentionWrapper(2, 6, 0.1, 2), L.CausalAttention(4, 6, 0.1)):
        variables = module.init(jax.random.key(0), x, deterministic=True)
        with pytest.raises(ValueError, match=r"rngs=\{'dropout': key\}.*dropout_rng=key"):
            module.apply(variables, x, deterministic=False)


def test_bad_inputs_raise():
    m = L.MultiHeadAttention(4, 6, 0.0, 2)
    variables = m.init(jax.random.key(0), jnp.ones((5, 3)))
    with pytest.raises(TypeError, match="float array"):
        m.apply(variables, jnp.ones((5, 3), jnp.int32))
    with pytest.raises(ValueError, match="rank >= 2"):
        m.apply(variables, jnp.ones((3,)))
    with pytest.raises(ValueError, match="does not broadcast"):
        m.apply(variables, jnp.ones((2, 5, 3)), jnp.ones((3, 2, 5, 5), bool))
