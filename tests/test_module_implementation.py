"""attention_implementation on the Linen and NNX modules, and autodiff on the default path.

At 256 tokens on CPU the automatic rule picks the blockwise path, which has a custom VJP:
reverse mode only. Under forward-mode autodiff (jax.jvp) the automatic rule sees the
transformation and uses the dense path instead; attention_implementation='blockwise'
refuses it with a clear error, and 'dense' always works. None of this may change the
function: the same outputs, and a Jacobian-vector product consistent with the blockwise
path's vector-Jacobian product (<u, J v> == <Jᵀ u, v>).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _module_cases import CLASSES, Case

from jattn import kernels
from jattn._routing import AUTO_MIN_LEN as T  # where the automatic rule picks blockwise (CPU)


def _forward(api: str, kind: str, implementation):
    """``x -> module(x)`` for the class built with ``attention_implementation``."""
    case = Case(kind, context_length=T, extra=(("attention_implementation", implementation),))
    kwargs = case.call_kwargs(deterministic=True)
    x0 = jnp.zeros((1, T, case.d_in))
    if api == "linen":
        module = case.linen()
        variables = module.init(jax.random.key(0), x0, **kwargs)
        return lambda x: module.apply(variables, x, **kwargs)
    module = case.nnx()  # nnx.Rngs(0): the same parameters for every implementation
    return lambda x: module(x, **kwargs)


@pytest.fixture(scope="module")
def backend_is_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("the automatic rule's threshold tested here is the CPU one")


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("kind", CLASSES)
def test_dense_enables_forward_mode_and_agrees_with_blockwise(api, kind, rng, backend_is_cpu):
    case = Case(kind)
    x = jnp.asarray(rng.normal(size=(1, T, case.d_in)), jnp.float32)
    v = jnp.asarray(rng.normal(size=x.shape), jnp.float32)  # input tangent
    auto, dense, blockwise = (_forward(api, kind, impl) for impl in (None, "dense", "blockwise"))

    # Forced onto the blockwise path, forward mode is refused with the fix in the message.
    with pytest.raises(ValueError, match=r"forward-mode autodiff .* or 'dense'"):
        jax.jvp(blockwise, (x,), (v,))

    y_dense, jv = jax.jvp(dense, (x,), (v,))
    # The automatic rule sees jax.jvp and takes the dense path: the same JVP.
    _, jv_auto = jax.jvp(auto, (x,), (v,))
    np.testing.assert_allclose(jv_auto, jv, rtol=1e-6, atol=1e-6)
    y_auto, vjp = jax.vjp(auto, x)
    np.testing.assert_allclose(y_dense, y_auto, rtol=1e-5, atol=1e-5)
    # Without jax.jvp the rule takes its CPU path at T: the fused kernel where it was built.
    chosen = "cpu_fused" if kernels.adapter("cpu_fused").available("cpu") else "blockwise"
    np.testing.assert_allclose(_forward(api, kind, chosen)(x), y_auto, rtol=0, atol=0)

    u = jnp.asarray(rng.normal(size=y_auto.shape), jnp.float32)  # output cotangent
    (ju,) = vjp(u)
    lhs, rhs = float(jnp.vdot(u, jv)), float(jnp.vdot(ju, v))
    assert np.isfinite(lhs) and abs(lhs) > 0
    np.testing.assert_allclose(lhs, rhs, rtol=1e-4)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_wrapper_passes_the_setting_to_its_heads(api):
    case = Case("MultiHeadAttentionWrapper", extra=(("attention_implementation", "dense"),))
    if api == "linen":
        wrapper = case.linen()
        heads = wrapper.bind(wrapper.init(jax.random.key(0), jnp.zeros((2, 3)))).heads
    else:
        heads = case.nnx().heads
    assert [h.attention_implementation for h in heads] == ["dense", "dense"]
