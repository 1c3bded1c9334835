"""Every JAX autodiff mode on the default path, at lengths where the automatic rule picks blockwise.

The blockwise path has a custom VJP: it serves reverse mode (and forward mode over it,
``jax.hessian``) directly. For forward mode applied to the call (``jax.jvp``,
``jax.jacfwd``) and for reverse mode of reverse mode, the automatic rule sees the
transformation and takes the dense path. Each result is checked against the dense path
(and the dense path against float64 finite differences by ``check_grads`` in
``tests/test_numerics.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._routing import AUTO_MIN_LEN

T = AUTO_MIN_LEN  # the automatic rule picks blockwise here (CPU)


@pytest.fixture(scope="module")
def inputs():
    if jax.default_backend() != "cpu":
        pytest.skip("the automatic rule's threshold tested here is the CPU one")
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(k, (1, T, 2, 8), jnp.float32) for k in keys)


def _loss(implementation):
    def loss(q, k, v):
        out = jattn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        return jnp.sum(jnp.sin(out))

    return loss


def _attention(implementation):
    return lambda q: jattn.dot_product_attention(
        q, q, q, is_causal=True, implementation=implementation
    )


def test_jvp_on_the_default_path_equals_dense(inputs):
    q, _, _ = inputs
    tangent = jnp.cos(q)
    out, jv = jax.jvp(_attention(None), (q,), (tangent,))
    out_d, jv_d = jax.jvp(_attention("dense"), (q,), (tangent,))
    np.testing.assert_allclose(out, out_d, atol=2e-6)
    np.testing.assert_allclose(jv, jv_d, atol=2e-6)
    # jvp inside a jit: the automatic rule sees it too
    _, jv_jit = jax.jit(lambda q, t: jax.jvp(_attention(None), (q,), (t,)))(q, tangent)
    np.testing.assert_allclose(jv_jit, jv_d, atol=2e-6)


def test_jacfwd_on_the_default_path_equals_jacrev(inputs):
    q = inputs[0][:, :, :1, :2]  # a small Jacobian: [1, T, 1, 2] -> scalar
    f = lambda x: jnp.sum(_attention(None)(x) ** 2)  # noqa: E731
    np.testing.assert_allclose(jax.jacfwd(f)(q), jax.jacrev(f)(q), rtol=1e-4, atol=1e-6)


def test_grad_of_grad_on_the_default_path_equals_dense(inputs):
    def second(implementation):
        grad = jax.grad(_loss(implementation))
        return jax.grad(lambda q, k, v: jnp.sum(grad(q, k, v) ** 2))

    np.testing.assert_allclose(second(None)(*inputs), second("dense")(*inputs), atol=1e-5)


def test_hessian_vector_product_runs_on_blockwise_and_equals_dense(inputs):
    q, k, v = inputs

    def hvp(implementation):
        grad = jax.grad(_loss(implementation))
        return jax.jvp(lambda x: grad(x, k, v), (q,), (jnp.cos(q),))[1]

    np.testing.assert_allclose(hvp("blockwise"), hvp("dense"), atol=1e-5)


@pytest.mark.parametrize(
    "transform,excerpt",
    [
        (lambda f, q: jax.jvp(f, (q,), (q,)), "forward-mode autodiff"),
        (
            lambda f, q: jax.grad(lambda x: jnp.sum(jax.grad(lambda y: jnp.sum(f(y)))(x)))(q),
            "nested",
        ),
    ],
)
def test_explicit_blockwise_refuses_what_its_custom_vjp_cannot_do(inputs, transform, excerpt):
    with pytest.raises(ValueError, match=f"{excerpt}.*Use implementation=None .* or 'dense'"):
        transform(_attention("blockwise"), inputs[0])


def test_jvp_of_a_jitted_call_is_invisible_to_the_automatic_rule(inputs):
    # The documented limit: jax.jvp applied outside a jax.jit traced beforehand cannot be
    # seen from inside, so the default path fails as JAX fails for any custom VJP; the
    # fix (implementation='dense') works.
    q = inputs[0]
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(jax.jit(_attention(None)), (q,), (q,))
    jax.jvp(jax.jit(_attention("dense")), (q,), (q,))
