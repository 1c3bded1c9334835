"""jattn.nnx: the same classes as jattn.linen, NNX style (d_in first, rngs=, .train()/.eval())."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _module_cases import CAUSAL_CLASSES, CLASSES, FORWARD_CASES, Case, case_id
from flax import nnx

from jattn import causality, convert
from jattn import nnx as N

# Every class once, with bias where it has one, plus grouped-query and leaky attention
# (test_linen runs the whole FORWARD_CASES table against the book's forward passes).
NNX_CASES = [Case(k, qkv_bias=k != "SelfAttentionV1") for k in CLASSES] + [
    c for c in FORWARD_CASES if c.num_kv_heads == 2 or dict(c.extra).get("causal") is False
][:2]


@pytest.mark.parametrize("case", NNX_CASES, ids=case_id)
def test_equals_linen_and_the_book_with_the_same_weights(case, rng):
    sd = case.state_dict(rng)
    x = rng.normal(size=(2, 5, case.d_in)).astype(np.float32)
    variables = convert.from_torch_state_dict(sd, case.linen())
    model = convert.linen_to_nnx(variables, case.nnx())
    y = model(x)
    np.testing.assert_allclose(y, case.linen().apply(variables, x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, case.reference(sd, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", CLASSES)
def test_parameter_tree_equals_linen(kind):
    case = Case(kind, qkv_bias=True)
    linen_params = case.linen().init(
        jax.random.key(0), jnp.ones((5, 3)), **case.call_kwargs(deterministic=True)
    )["params"]
    nnx_params = convert.nnx_to_linen(case.nnx())["params"]
    assert jax.tree.map(jnp.shape, nnx_params) == jax.tree.map(jnp.shape, linen_params)


@pytest.mark.parametrize("kind", CAUSAL_CLASSES)
def test_causal_by_gradient(kind, rng):
    model = Case(kind).nnx()
    x = jnp.asarray(rng.normal(size=(2, 6, 3)), jnp.float32)
    dep = causality.dependence_matrix(model, x)
    upper = np.triu(np.ones_like(dep, dtype=bool), k=1)
    assert np.all(dep[upper] == 0.0), "an output depends on a future token"
    assert np.all(dep[~upper] > 0.0), "an output ignores a past token"
    leaky = Case(kind, extra=(("is_causal", False),)).nnx()
    assert causality.future_leak(leaky, x) > 1e-3


def _one_hot_probe(dropout=0.5, **kw):
    """CausalAttention whose output rows are its (dropped-out) attention weights."""
    model = N.CausalAttention(6, 6, 6, dropout, **kw)
    model.W_value.kernel[...] = jnp.eye(6)
    x = jnp.eye(6, dtype=jnp.float32)[None].repeat(3, axis=0)  # [3, 6, 6]
    return model, x


def test_dropout_zeroes_weights_and_rescales_the_rest():
    model, x = _one_hot_probe(rngs=nnx.Rngs(0))
    _, w = model(x, deterministic=True, return_weights=True)
    y = np.asarray(model(x, deterministic=False))
    kept = y != 0
    np.testing.assert_allclose(y[kept], 2.0 * np.asarray(w[:, 0])[kept], rtol=1e-6)
    assert 0.2 < kept[:, np.tril(np.ones((6, 6), bool))].mean() < 0.8


def test_train_eval_and_the_call_argument():
    model, x = _one_hot_probe(rngs=nnx.Rngs(0))
    reference = model(x, deterministic=True)
    with pytest.raises(ValueError, match="no `deterministic` was given"):
        model(x)
    model.train()
    assert model.deterministic is False
    assert not np.array_equal(model(x), reference)
    np.testing.assert_array_equal(model(x, deterministic=True), reference)  # call wins
    model.eval()
    np.testing.assert_array_equal(model(x), reference)
    assert not np.array_equal(model(x, deterministic=False), reference)  # call wins
    view = nnx.view(model, deterministic=False)
    assert view.deterministic is False and model.deterministic is True


def test_which_key_a_call_uses():
    # 1. rngs at the call: the same seed gives the same mask, whatever the stored stream.
    a, x = _one_hot_probe(rngs=nnx.Rngs(params=0, dropout=1), deterministic=False)
    b, _ = _one_hot_probe(rngs=nnx.Rngs(params=0, dropout=2), deterministic=False)
    np.testing.assert_array_equal(a(x, rngs=nnx.Rngs(dropout=7)), b(x, rngs=nnx.Rngs(dropout=7)))
    key = jax.random.key(3)
    np.testing.assert_array_equal(a(x, rngs=key), b(x, rngs=key))
    np.testing.assert_array_equal(
        a(x, rngs=nnx.Rngs(dropout=7).dropout), b(x, rngs=nnx.Rngs(dropout=7))
    )
    # 2. otherwise the stored stream: it advances each call, and its seed decides.
    a2, _ = _one_hot_probe(rngs=nnx.Rngs(params=0, dropout=1), deterministic=False)
    first, second = a2(x), a2(x)
    assert not np.array_equal(first, second)
    a3, _ = _one_hot_probe(rngs=nnx.Rngs(params=0, dropout=1), deterministic=False)
    np.testing.assert_array_equal(a3(x), first)
    # An nnx.Rngs without a dropout stream falls back to its default stream.
    d, _ = _one_hot_probe(rngs=nnx.Rngs(0), deterministic=False)
    assert not np.array_equal(d(x), d(x, deterministic=True))


@pytest.mark.parametrize("kind", CAUSAL_CLASSES)
def test_training_without_a_key_raises(kind):
    x = jnp.ones((5, 3))
    for model in (
        Case(kind, dropout=0.1).nnx(nnx.Rngs(params=0)),
        Case(kind, dropout=0.1, extra=(("keep_rngs", False),)).nnx(),
    ):
        with pytest.raises(ValueError, match=r"to the constructor.*to the call.*\.eval\(\)"):
            model(x, deterministic=False)
        model(x, deterministic=False, rngs=nnx.Rngs(dropout=0))  # a key at the call works
        model(x, deterministic=True)


def test_wrapper_heads_drop_independently():
    model = N.MultiHeadAttentionWrapper(6, 6, 6, 0.5, 2, rngs=nnx.Rngs(0))
    nnx.update(model.heads_1, nnx.state(model.heads_0, nnx.Param))
    x = jnp.eye(6, dtype=jnp.float32)
    for rngs in (None, nnx.Rngs(dropout=1), jax.random.key(1)):
        y = model(x, deterministic=False, rngs=rngs)
        assert not np.array_equal(y[:, :6], y[:, 6:])
    y = model(x, deterministic=True)
    np.testing.assert_array_equal(y[:, :6], y[:, 6:])
    assert model.heads == [model.heads_0, model.heads_1]
    model.eval()
    assert all(h.deterministic for h in model.heads)


def test_nnx_jit_equals_eager_and_advances_the_stream(rng):
    x = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
    model = N.MultiHeadAttention(3, 4, 6, 0.5, 2, rngs=nnx.Rngs(0))
    eager_model = N.MultiHeadAttention(3, 4, 6, 0.5, 2, rngs=nnx.Rngs(0))

    @nnx.jit
    def forward(model, x):
        return model(x, deterministic=False)

    first = forward(model, x)
    np.testing.assert_allclose(first, eager_model(x, deterministic=False), rtol=1e-6, atol=1e-6)
    assert not np.allclose(forward(model, x), first)  # the stored stream moved on


def test_vmap_equals_batched_call(rng):
    model = N.MultiHeadAttention(3, 4, 6, 0.0, 2, num_kv_heads=1, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.normal(size=(3, 5, 3)), jnp.float32)
    mapped = jax.vmap(model)(x)
    np.testing.assert_allclose(mapped, model(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", CLASSES)
def test_returned_and_sown_weights(kind, rng):
    model = Case(kind).nnx()
    x = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
    y, w = model(x, return_weights=True)
    heads = 2 if kind in ("MultiHeadAttentionWrapper", "MultiHeadAttention") else 1
    assert w.shape == (2, heads, 5, 5)
    np.testing.assert_allclose(y, model(x))
    _, intermediates = nnx.capture(model, nnx.Intermediate)(x, sow_weights=True)
    sown = jax.tree.leaves(intermediates)
    np.testing.assert_allclose(jnp.concatenate(sown, axis=-3), w)


def test_dtype_param_dtype_and_initializers():
    model = N.MultiHeadAttention(
        3,
        4,
        6,
        0.0,
        2,
        True,
        dtype=jnp.bfloat16,
        kernel_init=nnx.initializers.constant(0.5),
        bias_init=nnx.initializers.constant(0.25),
        rngs=nnx.Rngs(0),
    )
    params = convert.nnx_to_linen(model)["params"]
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        assert leaf.dtype == jnp.float32
        np.testing.assert_array_equal(leaf, 0.25 if path[-1].key == "bias" else 0.5)
    assert model(jnp.ones((5, 3))).dtype == jnp.bfloat16
    half = N.SelfAttentionV1(3, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert half.W_query.dtype == jnp.bfloat16


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda r: N.MultiHeadAttention(3, 5, 6, 0.0, 2, rngs=r), "divisible by num_heads"),
        (lambda r: N.MultiHeadAttention(3, 4, 6, 0.0, 0, rngs=r), "num_heads must be >= 1"),
        (lambda r: N.MultiHeadAttentionWrapper(3, 4, 6, 1.5, 2, rngs=r), r"dropout must be in"),
        (lambda r: N.CausalAttention(3, 4, 6, -0.5, rngs=r), r"dropout must be in \[0, 1\)"),
        (lambda r: N.MultiHeadAttention(3, 8, 6, 0.0, 4, num_kv_heads=3, rngs=r), "num_kv_heads"),
        (lambda r: N.SelfAttentionV1(0, 2, rngs=r), "d_in must be >= 1"),
    ],
)
def test_bad_configuration_raises(build, match):
    with pytest.raises(ValueError, match=match):
        build(nnx.Rngs(0))


@pytest.mark.parametrize("kind", CLASSES)
def test_bad_inputs_raise(kind):
    model = Case(kind).nnx()
    with pytest.raises(ValueError, match="d_in = 3 features"):
        model(jnp.ones((5, 4)))
    if kind in CAUSAL_CLASSES:
        with pytest.raises(ValueError, match=r"7 tokens .* context_length is 6"):
            model(jnp.ones((7, 3)))
