"""jattn's modules inside other people's Flax models: explicit meshes, users' sharding
annotations, flax's keywords, and flax's attention checkpoints (issue 23, items 8 and 9)."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _fake_devices import run_checks
from flax import nnx

from jattn import convert
from jattn import linen as jl
from jattn import nnx as jn

CHECKS = Path(__file__).parent / "_explicit_sharding_checks.py"
D_IN, HEADS, HEAD_DIM, D_OUT, T = 6, 2, 4, 5, 7


@pytest.mark.parametrize("devices", [2, 4])
def test_model_axis_works_on_an_explicit_mesh(devices):
    """jax.make_mesh's explicit axes: the row-split out projection states its output
    sharding, so both APIs run there (eager and jitted) and equal the unsharded module."""
    got = run_checks(CHECKS, devices)
    assert got["axis_types"] == ["AxisType.Explicit", "AxisType.Explicit"]
    for api in ("nnx", "linen"):
        for mode in ("eager", "jit"):
            assert got[api][mode]["err"] < 1e-5, (api, mode, got[api][mode])
            assert got[api][mode]["spec"][0] == "batch", (api, mode, got[api][mode])
            assert got[api][mode]["spec"][-1] is None
    assert got["nnx"]["out_kernel"] == ["model", None]


def test_users_annotations_are_kept_without_model_axis():
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "heads"))
    module = jl.MultiHeadAttention(8, 4, 0.0, 2, kernel_init=init)
    variables = module.init(jax.random.key(0), jnp.ones((1, 4, 6)))
    specs = nn.get_partition_spec(variables)["params"]
    for name in ("W_query", "W_key", "W_value", "out_proj"):
        assert tuple(specs[name]["kernel"]) == ("embed", "heads"), name


@pytest.mark.parametrize(
    "api, init",
    [
        ("linen", nn.with_partitioning(nn.initializers.lecun_normal(), (None, "x"))),
        ("linen", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("a", "b"))),
        ("nnx", nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "x"))),
    ],
)
def test_users_annotations_with_model_axis_are_refused(api, init):
    with pytest.raises(ValueError, match="kernel_init carries sharding annotations"):
        if api == "linen":
            jl.MultiHeadAttention(8, 4, 0.0, 2, model_axis="model", kernel_init=init)
        else:
            jn.MultiHeadAttention(
                6, 8, 4, 0.0, 2, model_axis="model", kernel_init=init, rngs=nnx.Rngs(0)
            )


@pytest.mark.parametrize(
    "build",
    [
        lambda: jn.MultiHeadAttention(in_features=8, num_heads=2, rngs=nnx.Rngs(0)),
        lambda: jn.CausalAttention(8, 8, 4, dropout_rate=0.1, rngs=nnx.Rngs(0)),
        lambda: jl.MultiHeadAttention(num_heads=2, qkv_features=8),
    ],
)
def test_flax_keywords_get_the_book_signature(build):
    with pytest.raises(TypeError, match=r"takes the book's arguments, not flax's: .*\(d_"):
        build()


def _flax_and_inputs(use_bias):
    flax_mha = nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=HEADS * HEAD_DIM, out_features=D_OUT, use_bias=use_bias
    )
    x = jax.random.normal(jax.random.key(1), (2, T, D_IN))
    return flax_mha, flax_mha.init(jax.random.key(0), x), x


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_from_flax_attention_equals_flax(use_bias, causal):
    flax_mha, variables, x = _flax_and_inputs(use_bias)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2])) if causal else None
    expected = flax_mha.apply(variables, x, mask=mask)
    ours = jl.MultiHeadAttention(
        D_OUT, T, 0.0, HEADS, qkv_bias=use_bias, head_dim=HEAD_DIM, out_bias=use_bias,
        is_causal=causal,
    )  # fmt: skip
    params = convert.from_flax_attention(variables)
    np.testing.assert_allclose(ours.apply(params, x), expected, rtol=1e-5, atol=1e-5)
    nnx_module = jn.MultiHeadAttention(
        D_IN, D_OUT, T, 0.0, HEADS, qkv_bias=use_bias, head_dim=HEAD_DIM, out_bias=use_bias,
        is_causal=causal, rngs=nnx.Rngs(0),
    )  # fmt: skip
    convert.linen_to_nnx(params, nnx_module)
    np.testing.assert_allclose(nnx_module(x), expected, rtol=1e-5, atol=1e-5)


def test_from_flax_attention_reads_flax_nnx_params():
    flax_mha = nnx.MultiHeadAttention(
        HEADS, D_IN, qkv_features=HEADS * HEAD_DIM, out_features=D_OUT, decode=False,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2, T, D_IN))
    params = convert.from_flax_attention(nnx.to_pure_dict(nnx.state(flax_mha, nnx.Param)))
    ours = jl.MultiHeadAttention(D_OUT, T, 0.0, HEADS, qkv_bias=True, head_dim=HEAD_DIM)
    ours = ours.clone(is_causal=False)
    np.testing.assert_allclose(ours.apply(params, x), flax_mha(x), rtol=1e-5, atol=1e-5)


def test_from_flax_attention_refuses_what_it_cannot_hold():
    _, variables, _ = _flax_and_inputs(True)
    params = dict(variables["params"], query_ln={"scale": np.ones(HEAD_DIM, np.float32)})
    with pytest.raises(ValueError, match="query_ln"):
        convert.from_flax_attention(params)
    params = {k: v for k, v in variables["params"].items() if k != "out"}
    with pytest.raises(ValueError, match="needs 'out/kernel'"):
        convert.from_flax_attention(params)
