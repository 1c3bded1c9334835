"""The causality probes: exact on functions whose dependence structure we know."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import causality


def cumsum_fn(x):  # [T, d] -> [T, d]: output i depends on inputs 0..i
    return jnp.cumsum(x, axis=-2)


def reverse_cumsum_fn(x):  # output i depends on inputs i..T-1
    return jnp.cumsum(x[..., ::-1, :], axis=-2)[..., ::-1, :]


def test_gradient_dependence_of_cumsum_is_exact_tril():
    x = jax.random.normal(jax.random.key(0), (5, 3))
    dep = causality.dependence_matrix(cumsum_fn, x)
    # d cumsum_i / d x_j = 1 exactly for j <= i, else 0.
    np.testing.assert_array_equal(dep, np.tril(np.ones((5, 5))))
    assert causality.future_leak(cumsum_fn, x) == 0.0
    assert causality.is_causal(cumsum_fn, x)


def test_reverse_cumsum_leaks():
    x = jax.random.normal(jax.random.key(0), (2, 5, 3))  # batch dim too
    dep = causality.dependence_matrix(reverse_cumsum_fn, x)
    np.testing.assert_array_equal(dep, np.triu(np.ones((5, 5))))
    assert causality.future_leak(reverse_cumsum_fn, x) == 1.0
    assert not causality.is_causal(reverse_cumsum_fn, x)


def test_perturbation_matches_structure():
    x = jax.random.normal(jax.random.key(1), (6, 2))
    dep = causality.dependence_matrix(cumsum_fn, x, method="perturbation")
    lower = np.tril(np.ones((6, 6), bool))
    assert np.all(dep[~lower] == 0.0) and np.all(dep[lower] > 0.0)
    leak = causality.future_leak(reverse_cumsum_fn, x, method="perturbation")
    assert leak > 0.0


def test_token_inputs_by_perturbation():
    vocab = 7
    table = jax.random.normal(jax.random.key(2), (vocab, 4))

    def causal_model(tokens):  # [B, T] -> [B, T, 4]
        return jnp.cumsum(table[tokens], axis=-2)

    def leaky_model(tokens):
        return causal_model(tokens) + table[tokens][:, -1:, :]  # everyone sees the last token

    tokens = jax.random.randint(jax.random.key(3), (3, 5), 0, vocab)
    kw = dict(method="perturbation", in_axis=-1, out_axis=-2, vocab_size=vocab)
    assert causality.future_leak(causal_model, tokens, **kw) == 0.0
    dep = causality.dependence_matrix(leaky_model, tokens, **kw)
    assert np.all(dep[:-1, -1] > 0.0)  # the last input reaches every earlier output


def test_causal_attention_by_both_methods():
    x = jax.random.normal(jax.random.key(0), (8, 4))

    def attend(x, causal):
        qkv = x[:, None, :]
        return jattn.dot_product_attention(qkv, qkv, qkv, is_causal=causal)[:, 0, :]

    for method in ("gradient", "perturbation"):
        assert causality.future_leak(lambda x: attend(x, True), x, method=method) == 0.0
        assert causality.future_leak(lambda x: attend(x, False), x, method=method) > 0.0


def test_errors():
    tokens = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(TypeError, match="method='perturbation'"):
        causality.dependence_matrix(lambda t: t, tokens)
    with pytest.raises(ValueError, match="vocab_size"):
        causality.dependence_matrix(
            lambda t: t, tokens, method="perturbation", in_axis=-1, out_axis=-1
        )
    with pytest.raises(ValueError, match="method must be"):
        causality.dependence_matrix(cumsum_fn, jnp.ones((3, 2)), method="finite")
    with pytest.raises(ValueError, match="sequence axis"):
        causality.dependence_matrix(cumsum_fn, jnp.float32(1.0))


def test_a_nan_effect_raises_instead_of_reading_as_no_dependence():
    """Output 0 is NaN whatever the input (so its dependence on the future cannot be
    seen); XLA's CPU max drops NaNs, which made future_leak 0.0 and is_causal True."""
    x = jax.random.normal(jax.random.key(0), (16, 64))

    def nan_column(x):
        ahead = jnp.cumsum(x[::-1], axis=0)[::-1]  # depends on the future
        return jnp.concatenate([jnp.sqrt(ahead[:, :1] - 1e9), x[:, 1:]], axis=1)

    for method in ("gradient", "perturbation"):
        with pytest.raises(ValueError, match="NaN for output position 0 and input position"):
            causality.is_causal(nan_column, x, method=method)


def test_equal_infinities_are_no_change():
    """Masked logits (-inf above the diagonal) keep their -inf under every perturbation:
    no dependence there, where inf - inf alone would be NaN."""
    x = jax.random.normal(jax.random.key(1), (6, 3))

    def masked_logits(x):
        logits = x @ x.T
        return jnp.where(jnp.tril(jnp.ones((6, 6), bool)), logits, -jnp.inf)

    assert causality.is_causal(masked_logits, x, method="perturbation")
    leaky = lambda x: masked_logits(x) + x[::-1].sum()  # noqa: E731
    assert not causality.is_causal(leaky, x, method="perturbation")
