"""jattn.convert: the book's PyTorch weights give the book's outputs; Linen <-> NNX; wrapper <-> split."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _book_reference import BOOK_OUTPUTS, BOOK_STATE_DICTS
from _module_cases import CLASSES, Case
from conftest import BOOK_INPUTS
from flax import nnx

from jattn import convert
from jattn import linen as L
from jattn import nnx as N

BOOK_CASES = {kind: Case(kind, d_out=2) for kind in CLASSES}


def _book_input(kind):
    # v1 and v2 take the 6 x 3 inputs; the others the batch torch.stack((inputs, inputs)).
    return BOOK_INPUTS if kind.startswith("SelfAttention") else np.stack([BOOK_INPUTS] * 2)


@pytest.mark.parametrize("kind", CLASSES)
def test_book_weights_give_the_books_printed_outputs(kind):
    # The weights torch draws in the chapter, loaded into Linen and NNX, against the
    # numbers printed in the book (4 decimals there, hence atol=1e-4).
    case = BOOK_CASES[kind]
    mask_buffer = {"mask": np.triu(np.ones((6, 6), np.float32), k=1)}  # ignored
    sd = BOOK_STATE_DICTS[kind] | (mask_buffer if kind in ("CausalAttention",) else {})
    variables = convert.from_torch_state_dict(sd, case.linen())
    x = _book_input(kind)
    y_linen = case.linen().apply(variables, x)
    y_nnx = convert.linen_to_nnx(variables, case.nnx())(x)
    expected = np.broadcast_to(np.asarray(BOOK_OUTPUTS[kind], np.float32), y_linen.shape)
    np.testing.assert_allclose(y_linen, expected, atol=1e-4)
    np.testing.assert_allclose(y_nnx, expected, atol=1e-4)


def test_done_when_first_token_of_the_chapters_batch():
    # torch.manual_seed(123); MultiHeadAttention(3, 2, 6, 0.0, num_heads=2) -> [0.3190, 0.4858]
    variables = convert.from_torch_state_dict(BOOK_STATE_DICTS["MultiHeadAttention"])
    batch = np.stack([BOOK_INPUTS] * 2)
    y = L.MultiHeadAttention(2, 6, 0.0, num_heads=2).apply(variables, batch)
    np.testing.assert_allclose(y[0, 0], [0.3190, 0.4858], atol=1e-4)
    model = N.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(convert.linen_to_nnx(variables, model)(batch)[0, 0], y[0, 0])


def test_layouts_and_transposes():
    sd = BOOK_STATE_DICTS["MultiHeadAttention"]
    params = convert.from_torch_state_dict(sd)["params"]
    np.testing.assert_array_equal(params["W_query"]["kernel"], sd["W_query.weight"].T)
    np.testing.assert_array_equal(params["out_proj"]["bias"], sd["out_proj.bias"])
    raw = convert.from_torch_state_dict(BOOK_STATE_DICTS["SelfAttentionV1"])["params"]
    np.testing.assert_array_equal(raw["W_key"], BOOK_STATE_DICTS["SelfAttentionV1"]["W_key"])
    wrapper = convert.from_torch_state_dict(
        BOOK_STATE_DICTS["MultiHeadAttentionWrapper"] | {"heads.1.mask": np.zeros((6, 6))}
    )["params"]
    assert sorted(wrapper) == ["heads_0", "heads_1"]


def test_tensor_like_values_are_read_without_torch():
    class FakeTensor:  # what from_torch_state_dict relies on: .detach().cpu().numpy()
        def __init__(self, a):
            self.a = a

        def detach(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            return self.a

    sd = {k: FakeTensor(v) for k, v in BOOK_STATE_DICTS["CausalAttention"].items()}
    params = convert.from_torch_state_dict(sd)["params"]
    np.testing.assert_array_equal(
        params["W_value"]["kernel"], BOOK_STATE_DICTS["CausalAttention"]["W_value.weight"].T
    )


def test_to_numpy_reads_arrays_and_bfloat16():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(convert.to_numpy(a, "w"), a)
    np.testing.assert_array_equal(convert.to_numpy([[1.0, 2.0]], "w"), [[1.0, 2.0]])
    half = a.astype(jnp.bfloat16)  # ml_dtypes' bfloat16: kept as it is
    assert convert.to_numpy(half, "w").dtype == jnp.bfloat16
    with pytest.raises(TypeError, match=r"state_dict\['w'\] must hold floats, got dtype int64"):
        convert.to_numpy(np.ones(3, np.int64), "w")
    with pytest.raises(ValueError, match=r"state_dict\['w'\] holds NaN or Inf"):
        convert.to_numpy(np.array([1.0, np.inf], jnp.bfloat16), "w")


@pytest.mark.torch
def test_to_numpy_reads_torch_bfloat16_tensors_exactly():
    torch = pytest.importorskip("torch")
    t = torch.randn(3, 4, dtype=torch.float32).to(torch.bfloat16)
    array = convert.to_numpy(t, "out_proj.weight")
    assert array.dtype == np.float32
    np.testing.assert_array_equal(array, t.float().numpy())
    sd = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in MHA_SD.items()}
    params = convert.from_torch_state_dict(sd)["params"]
    np.testing.assert_array_equal(params["W_key"]["kernel"], sd["W_key.weight"].float().numpy().T)


def _without(sd, key):
    return {k: v for k, v in sd.items() if k != key}


MHA_SD = BOOK_STATE_DICTS["MultiHeadAttention"]
QKV_SD = BOOK_STATE_DICTS["CausalAttention"]
BIASED_SD = QKV_SD | {f"{n}.bias": np.zeros(2, np.float32) for n in ("W_query", "W_key", "W_value")}


@pytest.mark.parametrize(
    ("sd", "match"),
    [
        (MHA_SD | {"W_gate.weight": np.zeros((2, 3))}, "unknown key 'W_gate.weight'"),
        (_without(MHA_SD, "W_key.weight"), "missing key W_key.weight"),
        (_without(BIASED_SD, "W_value.bias"), "missing key W_value.bias"),
        (
            _without(BOOK_STATE_DICTS["MultiHeadAttentionWrapper"], "heads.0.W_query.weight"),
            "missing key heads.0.W_query.weight",
        ),
        (
            {
                k.replace("heads.1.", "heads.2."): v
                for k, v in BOOK_STATE_DICTS["MultiHeadAttentionWrapper"].items()
            },
            r"missing key heads.1.W_query.weight",
        ),
        (_without(BOOK_STATE_DICTS["SelfAttentionV1"], "W_value"), "missing key W_value"),
        (MHA_SD | {"out_proj.bias": np.zeros(3, np.float32)}, r"out_proj.bias\] must have shape"),
        (MHA_SD | {"out_proj.weight": np.zeros((2, 3), np.float32)}, r"out_proj.weight\] must"),
        (QKV_SD | {"W_key.weight": np.zeros((2, 4), np.float32)}, r"W_key.weight\] has in_feat"),
        (QKV_SD | {"W_value.weight": np.zeros((3, 3), np.float32)}, r"W_value.weight\] must have"),
        (QKV_SD | {"W_query.weight": np.zeros(3, np.float32)}, r"W_query.weight\] must be 2-D"),
        (QKV_SD | {"W_query": np.zeros((3, 2), np.float32)}, "mixes SelfAttention_v1's raw"),
        ({"mask": np.zeros((6, 6))}, "no attention parameters"),
    ],
)
def test_from_torch_state_dict_errors_name_the_key(sd, match):
    with pytest.raises(ValueError, match=match):
        convert.from_torch_state_dict(sd)


def test_an_out_proj_without_bias_loads_into_out_bias_false():
    """The book's GroupedQueryAttention has no out_proj bias: the weights load into a module
    with out_bias=False, which equals the module with a zero bias; applied to a module
    that expects the bias, the params are refused (flax would not notice)."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3)), jnp.float32)
    sd = _without(MHA_SD, "out_proj.bias")
    no_bias = convert.from_torch_state_dict(sd)
    zero = convert.from_torch_state_dict(sd | {"out_proj.bias": np.zeros(2, np.float32)})
    got = L.MultiHeadAttention(2, 6, 0.0, 2, out_bias=False).apply(no_bias, x, deterministic=True)
    want = L.MultiHeadAttention(2, 6, 0.0, 2).apply(zero, x, deterministic=True)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"missing \[\"\['out_proj'\]\['bias'\]\"\]"):
        L.MultiHeadAttention(2, 6, 0.0, 2).apply(no_bias, x, deterministic=True)


def test_from_torch_state_dict_checks_against_the_module():
    with pytest.raises(
        ValueError, match=r"W_query.weight\] has shape \(2, 3\), the module expects \(4, 3\)"
    ):
        convert.from_torch_state_dict(MHA_SD, L.MultiHeadAttention(4, 6, 0.0, 2))
    with pytest.raises(ValueError, match=r"missing key out_proj\.(weight|bias)"):
        convert.from_torch_state_dict(QKV_SD, L.MultiHeadAttention(2, 6, 0.0, 2))
    with pytest.raises(ValueError, match=r"unexpected key W_query\.bias"):
        convert.from_torch_state_dict(BIASED_SD, L.CausalAttention(2, 6, 0.0))
    with pytest.raises(ValueError, match=r"missing key out_proj\.bias"):
        convert.from_torch_state_dict(
            _without(MHA_SD, "out_proj.bias"), L.MultiHeadAttention(2, 6, 0.0, 2)
        )
    # An NNX module works too, and knows d_in.
    with pytest.raises(ValueError, match=r"W_query.weight\] has shape \(2, 3\), .* \(2, 4\)"):
        convert.from_torch_state_dict(QKV_SD, N.CausalAttention(4, 2, 6, 0.0, rngs=nnx.Rngs(0)))
    convert.from_torch_state_dict(QKV_SD, N.CausalAttention(3, 2, 6, 0.0, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="must hold floats"):
        convert.from_torch_state_dict(QKV_SD | {"W_key.weight": np.zeros((2, 3), np.int32)})
    with pytest.raises(TypeError, match="mapping"):
        convert.from_torch_state_dict([("W_query", 1)])


@pytest.mark.parametrize("kind", CLASSES)
def test_linen_nnx_round_trip(kind, rng):
    case = Case(kind, qkv_bias=True)
    variables = convert.from_torch_state_dict(case.state_dict(rng))
    model = convert.linen_to_nnx(variables, case.nnx())
    back = convert.nnx_to_linen(model)
    jax.tree.map(np.testing.assert_array_equal, back, variables)


def test_linen_to_nnx_errors_and_dtype():
    case = Case("MultiHeadAttention")
    variables = case.linen().init(jax.random.key(0), jnp.ones((5, 3)))
    with pytest.raises(ValueError, match="missing key out_proj/bias"):
        params = dict(variables["params"]) | {"out_proj": {"kernel": jnp.eye(4)}}
        convert.linen_to_nnx({"params": params}, case.nnx())
    with pytest.raises(ValueError, match="unexpected key W_query/bias"):
        params = dict(variables["params"]) | {
            "W_query": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones(4)}
        }
        convert.linen_to_nnx({"params": params}, case.nnx())
    with pytest.raises(
        ValueError, match=r"W_key/kernel\] has shape \(3, 4\), the module expects \(3, 2\)"
    ):
        convert.linen_to_nnx(variables, Case("MultiHeadAttention", num_kv_heads=1).nnx())
    with pytest.raises(ValueError, match=r"Linen variables \{'params'"):
        convert.linen_to_nnx(variables["params"], case.nnx())
    half = N.MultiHeadAttention(3, 4, 6, 0.0, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    convert.linen_to_nnx(variables, half)
    assert half.out_proj.kernel.dtype == jnp.bfloat16


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_wrapper_equals_split_through_the_converters(qkv_bias, rng):
    # The chapter's claim: the wrapper of num_heads CausalAttention heads and the
    # MultiHeadAttention with weight splits compute the same thing.
    x = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
    wrapper = L.MultiHeadAttentionWrapper(2, 6, 0.0, 3, qkv_bias)
    wrapper_vars = convert.from_torch_state_dict(
        Case("MultiHeadAttentionWrapper", d_out=2, num_heads=3, qkv_bias=qkv_bias).state_dict(rng)
    )
    split = L.MultiHeadAttention(6, 6, 0.0, 3, qkv_bias)
    split_vars = convert.wrapper_to_split(wrapper_vars)
    np.testing.assert_allclose(
        split.apply(split_vars, x), wrapper.apply(wrapper_vars, x), rtol=1e-5, atol=1e-6
    )

    # ...and back: any MultiHeadAttention is a wrapper followed by its out_proj.
    mha_vars = convert.from_torch_state_dict(
        Case("MultiHeadAttention", d_out=6, num_heads=3, qkv_bias=qkv_bias).state_dict(rng)
    )
    heads, out_proj = convert.split_to_wrapper(mha_vars, num_heads=3)
    y_wrapped = nn.Dense(6).apply(out_proj, wrapper.apply(heads, x))
    np.testing.assert_allclose(split.apply(mha_vars, x), y_wrapped, rtol=1e-5, atol=1e-5)
    jax.tree.map(
        np.testing.assert_array_equal,
        convert.wrapper_to_split(heads)["params"]["W_query"],
        mha_vars["params"]["W_query"],
    )


def test_split_to_wrapper_with_grouped_query_attention(rng):
    x = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    case = Case("MultiHeadAttention", d_out=8, num_heads=4, num_kv_heads=2)
    variables = convert.from_torch_state_dict(case.state_dict(rng))
    heads, out_proj = convert.split_to_wrapper(variables, num_heads=4, num_kv_heads=2)
    y_wrapped = nn.Dense(8).apply(
        out_proj, L.MultiHeadAttentionWrapper(2, 6, 0.0, 4).apply(heads, x)
    )
    np.testing.assert_allclose(case.linen().apply(variables, x), y_wrapped, rtol=1e-5, atol=1e-5)


def test_wrapper_split_errors():
    mha = convert.from_torch_state_dict(BOOK_STATE_DICTS["MultiHeadAttention"])
    with pytest.raises(ValueError, match=r"heads_0 \.\.\. heads_"):
        convert.wrapper_to_split(mha)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be >= 1 and divide d_out \(2\)"):
        convert.split_to_wrapper(mha, num_heads=3)
    with pytest.raises(ValueError, match=r"num_kv_heads \(1\) must divide"):
        convert.split_to_wrapper(mha, num_heads=2, num_kv_heads=1)
    wrapper = convert.from_torch_state_dict(BOOK_STATE_DICTS["MultiHeadAttentionWrapper"])
    with pytest.raises(ValueError, match=r"missing \['W_query', 'W_key', 'W_value', 'out_proj'\]"):
        convert.split_to_wrapper(wrapper, num_heads=2)
