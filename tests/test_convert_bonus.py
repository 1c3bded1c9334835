"""jattn.convert loads every layout of the book's bonus multi-head attention notebook.

The state dicts are hand-built numpy arrays in each class's layout
(tests/_book_bonus_reference.py), checked against a float64 numpy transcription of the
class's forward; tests/test_torch_bonus_mha.py runs the PyTorch classes themselves.
"""

import dataclasses
import re

import numpy as np
import pytest
from _book_bonus_reference import KINDS, bonus_forward, bonus_state_dict
from flax import nnx

from jattn import convert
from jattn import linen as L
from jattn import nnx as N

# Classes whose forward needs d_in == d_out: CombinedQKV views its output to x's width,
# MHAPyTorchClass's nn.MultiheadAttention(embed_dim=d_out) reads x of width d_out.
SQUARE = ("MultiHeadAttentionCombinedQKV", "MHAPyTorchClass")


@dataclasses.dataclass(frozen=True)
class Bonus:
    """One notebook class with its constructor arguments (dropout 0)."""

    kind: str
    d_in: int = 6
    d_out: int = 8
    num_heads: int = 2
    context_length: int = 7
    qkv_bias: bool = False
    add_bias_kv: bool | None = None  # MHAPyTorchClass: default qkv_bias, as the class

    def __post_init__(self):
        if self.kind in SQUARE:
            object.__setattr__(self, "d_in", self.d_out)

    def __str__(self):
        return (
            f"{self.kind}-{self.d_in}-{self.d_out}-h{self.num_heads}-"
            f"ctx{self.context_length}-bias{int(self.qkv_bias)}"
        )

    @property
    def width(self):  # jattn's d_out: the wrapper's heads side by side
        return self.d_out * (self.num_heads if self.kind == "Ch03_MHA_Wrapper" else 1)

    def state_dict(self, rng):
        return bonus_state_dict(
            self.kind, rng, self.d_in, self.d_out, self.num_heads, self.context_length,
            self.qkv_bias, self.add_bias_kv,
        )  # fmt: skip

    def reference(self, sd, x):
        """The transcribed forward; SDPAWithoutFlash with its mask fixed (issue #1061)."""
        if self.kind == "MHAPyTorchSDPAWithoutFlash":
            sd = sd | {"mask": ~np.asarray(sd["mask"], bool)}
        return bonus_forward(self.kind, sd, x, self.num_heads, self.context_length)

    def linen(self):
        return L.MultiHeadAttention(
            self.width, self.context_length, 0.0, self.num_heads, self.qkv_bias
        )

    def nnx(self):
        return N.MultiHeadAttention(
            self.d_in, self.width, self.context_length, 0.0, self.num_heads, self.qkv_bias,
            rngs=nnx.Rngs(0),
        )  # fmt: skip


def _loadable(kind):
    """The configurations jattn loads (MHAPyTorchClass's qkv_bias=True adds bias_k/bias_v)."""
    cases = [
        Bonus(kind),
        Bonus(kind, qkv_bias=True),
        Bonus(kind, d_in=5, d_out=12, num_heads=3, context_length=9, qkv_bias=True),
        Bonus(kind, d_in=12, d_out=4, num_heads=4, context_length=4),
        Bonus(kind, d_in=3, d_out=2, num_heads=1, context_length=6, qkv_bias=True),
    ]
    if kind == "MHAPyTorchClass":
        cases = [dataclasses.replace(c, add_bias_kv=False) for c in cases]
    return cases


CASES = [case for kind in KINDS for case in _loadable(kind)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_notebook_layouts_give_the_notebooks_outputs(case, rng):
    sd = case.state_dict(rng)
    x = rng.normal(size=(2, case.context_length - 1, case.d_in)).astype(np.float32)
    expected = case.reference(sd, x)
    variables = convert.from_torch_state_dict(sd, case.linen())
    np.testing.assert_allclose(case.linen().apply(variables, x), expected, rtol=1e-5, atol=1e-5)
    model = convert.linen_to_nnx(variables, case.nnx())
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)
    # The same variables come back without module= (the layout is told by the keys).
    bare = convert.from_torch_state_dict(sd)
    for path in ("W_query", "W_key", "W_value", "out_proj"):
        for leaf, value in variables["params"][path].items():
            np.testing.assert_array_equal(bare["params"][path][leaf], value)


def test_the_notebooks_sdpa_without_flash_mask_is_not_causal(rng):
    # Why the case above flips that class's buffer: the notebook passes
    # triu(ones, diagonal=1).bool() to SDPA, where True means attend, so the first token
    # attends to the later ones (rasbt/LLMs-from-scratch issue #1061). jattn loads the
    # weights into the causal module the section intends.
    case = Bonus("MHAPyTorchSDPAWithoutFlash")
    sd = case.state_dict(rng)
    x = rng.normal(size=(1, 4, case.d_in))
    as_written = bonus_forward(case.kind, sd, x, case.num_heads, case.context_length)
    changed = x.copy()
    changed[:, 1:] += 1.0
    later = bonus_forward(case.kind, sd, changed, case.num_heads, case.context_length)
    assert not np.allclose(as_written[:, 0], later[:, 0])  # token 0 sees tokens 1...
    causal = case.reference(sd, x)
    np.testing.assert_allclose(causal[:, 0], case.reference(sd, changed)[:, 0])


def test_split_order_and_orientation(rng):
    # qkv rows [0:d) are the query, [d:2d) the key, [2d:3d) the value, as the forward's
    # view(b, T, 3, heads, head_dim).unbind over the 3 says; kernels are the transposes.
    sd = Bonus("MHAPyTorchScaledDotProduct", qkv_bias=True).state_dict(rng)
    params = convert.from_torch_state_dict(sd)["params"]
    for i, name in enumerate(("W_query", "W_key", "W_value")):
        np.testing.assert_array_equal(params[name]["kernel"], sd["qkv.weight"][8 * i : 8 * i + 8].T)
        np.testing.assert_array_equal(params[name]["bias"], sd["qkv.bias"][8 * i : 8 * i + 8])
    np.testing.assert_array_equal(params["out_proj"]["kernel"], sd["proj.weight"].T)
    # MHAEinsum's raw matrices are already [d_in, d_out]: no transpose.
    sd = Bonus("MHAEinsum", qkv_bias=True).state_dict(rng)
    params = convert.from_torch_state_dict(sd)["params"]
    np.testing.assert_array_equal(params["W_key"]["kernel"], sd["W_key"])
    np.testing.assert_array_equal(params["W_value"]["bias"], sd["bias_v"])
    # Ch03_MHA_Wrapper: head i's weights are columns i*d_out ... of the fused kernel.
    sd = Bonus("Ch03_MHA_Wrapper", d_out=2, num_heads=3).state_dict(rng)
    params = convert.from_torch_state_dict(sd)["params"]
    np.testing.assert_array_equal(
        params["W_value"]["kernel"][:, 4:6], sd["heads.2.W_value.weight"].T
    )
    assert "bias" not in params["W_query"]


def test_two_output_projections_fold_into_one(rng):
    # MHAPyTorchClass: nn.MultiheadAttention's out_proj (W1, b1), then proj (W2, b2):
    # one layer W = W2 @ W1, b = W2 @ b1 + b2, computed here in float64 by hand.
    for bias in (False, True):
        sd = Bonus("MHAPyTorchClass", qkv_bias=bias, add_bias_kv=False).state_dict(rng)
        out = convert.from_torch_state_dict(sd)["params"]["out_proj"]
        w1 = sd["multihead_attn.out_proj.weight"].astype(np.float64)
        w2 = sd["proj.weight"].astype(np.float64)
        b1 = sd.get("multihead_attn.out_proj.bias", np.zeros(8)).astype(np.float64)
        np.testing.assert_allclose(out["kernel"], (w2 @ w1).T, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(out["bias"], w2 @ b1 + sd["proj.bias"], rtol=1e-6, atol=1e-7)
        assert out["kernel"].dtype == np.float32
    # in_proj_weight splits like qkv.weight.
    params = convert.from_torch_state_dict(sd)["params"]
    np.testing.assert_array_equal(
        params["W_value"]["kernel"], sd["multihead_attn.in_proj_weight"][16:].T
    )


def _without(sd, *keys):
    return {k: v for k, v in sd.items() if k not in keys}


def _sd(kind, **kwargs):
    return Bonus(kind, **kwargs).state_dict(np.random.default_rng(0))


QKV = _sd("MultiHeadAttentionCombinedQKV")
QKV_BIAS = _sd("MHAPyTorchScaledDotProduct", qkv_bias=True)
EINSUM = _sd("MHAEinsum", qkv_bias=True)
TORCH_MHA = _sd("MHAPyTorchClass")
TORCH_MHA_BIAS = _sd("MHAPyTorchClass", qkv_bias=True, add_bias_kv=False)
WRAPPER = _sd("Ch03_MHA_Wrapper")
F32 = np.float32


@pytest.mark.parametrize(
    ("sd", "excerpt"),
    [
        (QKV | {"qkv.weight": np.zeros((23, 8), F32)}, "qkv.weight] has 23 rows, which is not divisible by 3"),
        (QKV | {"qkv.weight": np.zeros(24, F32)}, "qkv.weight] must be 2-D [3 * d_out, d_in]"),
        (QKV | {"qkv.bias": np.zeros(8, F32)}, "qkv.bias] must have shape (24,)"),
        (QKV | {"proj.weight": np.zeros((8, 6), F32)}, "proj.weight] must have shape (8, 8)"),
        (_without(QKV, "proj.bias"), "missing key proj.bias"),
        ({"proj.weight": np.zeros((8, 8), F32), "proj.bias": np.zeros(8, F32)}, "missing key qkv.weight"),
        (QKV | {"W_query.weight": np.zeros((8, 8), F32)}, "'W_query.weight' beside keys of the bonus notebook's MultiHeadAttentionCombinedQKV"),
        (QKV | {"qkv.scale": np.zeros(8, F32)}, "unknown key 'qkv.scale'"),
        (_without(EINSUM, "bias_k"), "missing key bias_k: MHAEinsum(qkv_bias=True)"),
        (EINSUM | {"W_key": np.zeros((8, 6), F32)}, "W_key] must be a 2-D [d_in, d_out] matrix"),
        (EINSUM | {"bias_q": np.zeros(6, F32)}, "bias_q] must have shape (8,)"),
        (_without(EINSUM, "out_proj.weight"), "missing key out_proj.weight"),
        (_without(EINSUM, "W_value"), "missing key W_value"),
        (TORCH_MHA | {"multihead_attn.bias_k": np.zeros((1, 1, 8), F32)}, "nn.MultiheadAttention(add_bias_kv=True)"),
        (TORCH_MHA | {"multihead_attn.in_proj_weight": np.zeros((24, 6), F32)}, "must have shape (3 * embed_dim, embed_dim)"),
        (TORCH_MHA | {"multihead_attn.in_proj_weight": np.zeros((25, 8), F32)}, "not divisible by 3"),
        (_without(TORCH_MHA_BIAS, "multihead_attn.out_proj.bias"), "missing key multihead_attn.out_proj.bias: nn.MultiheadAttention(bias=True)"),
        (_without(TORCH_MHA, "proj.weight"), "missing key proj.weight"),
        (_without(TORCH_MHA, "multihead_attn.in_proj_weight"), "missing key multihead_attn.in_proj_weight"),
        (TORCH_MHA | {"qkv.weight": np.zeros((24, 8), F32)}, "'qkv.weight' beside keys of the bonus notebook's MHAPyTorchClass"),
        (WRAPPER | {"out_proj.weight": np.zeros((8, 8), F32)}, "out_proj.weight] must have shape (16, 16)"),
        (_without(WRAPPER, "heads.1.W_key.weight"), "missing key heads.1.W_key.weight"),
        (_without(WRAPPER, "out_proj.bias"), "missing key out_proj.bias"),
        (WRAPPER | {"W_query.weight": np.zeros((8, 6), F32)}, "'W_query.weight' beside heads"),
    ],
)  # fmt: skip
def test_errors_name_the_key(sd, excerpt):
    with pytest.raises(ValueError, match=re.escape(excerpt)):
        convert.from_torch_state_dict(sd)


MODULE_CASES = [
    (QKV, L.MultiHeadAttention(16, 7, 0.0, 2), "state_dict[qkv.weight] has shape (24, 8), the module expects (48, 8)"),
    (QKV, L.MultiHeadAttention(8, 7, 0.0, 2, qkv_bias=True), "state_dict is missing key qkv.bias"),
    (EINSUM, L.MultiHeadAttention(8, 7, 0.0, 2), "state_dict has unexpected key bias_q"),
    (QKV, L.CausalAttention(8, 7, 0.0), "which load into a jattn MultiHeadAttention; the module is a CausalAttention"),
    (QKV, L.MultiHeadAttention(8, 7, 0.0, 2, num_kv_heads=1), "The module has grouped-query attention"),
    (WRAPPER, L.MultiHeadAttention(16, 7, 0.0, 4), "state_dict has 2 heads (heads.0 ... heads.1), the module has num_heads=4"),
    (TORCH_MHA, N.MultiHeadAttention(6, 8, 7, 0.0, 2, rngs=nnx.Rngs(0)), "build the module with d_in == d_out"),
    (TORCH_MHA, N.MultiHeadAttention(4, 4, 7, 0.0, 2, rngs=nnx.Rngs(0)), "state_dict[multihead_attn.in_proj_weight] has shape (24, 8), the module expects (12, 4)"),
]  # fmt: skip


@pytest.mark.parametrize(("sd", "module", "excerpt"), MODULE_CASES)
def test_errors_against_the_module(sd, module, excerpt):
    with pytest.raises(ValueError, match=re.escape(excerpt)):
        convert.from_torch_state_dict(sd, module)


def test_the_right_modules_pass():
    with pytest.raises(TypeError, match=re.escape("module must be a jattn.linen or jattn.nnx")):
        convert.from_torch_state_dict(QKV, "mha")
    convert.from_torch_state_dict(TORCH_MHA_BIAS, L.MultiHeadAttention(8, 7, 0.0, 2, True))
    convert.from_torch_state_dict(WRAPPER, N.MultiHeadAttention(6, 16, 7, 0.0, 2, rngs=nnx.Rngs(0)))


def test_module_check_with_model_axis():
    # model_axis= boxes a Linen module's params (nn.Partitioned); the check unboxes them,
    # for the notebook's layouts and the chapter's alike.
    sharded = L.MultiHeadAttention(8, 7, 0.0, 2, model_axis="model")
    convert.from_torch_state_dict(QKV, sharded)
    with pytest.raises(ValueError, match=re.escape("the module expects (48, 8)")):
        convert.from_torch_state_dict(QKV, L.MultiHeadAttention(16, 7, 0.0, 2, model_axis="m"))
    chapter = _sd("Ch03_MHA")
    convert.from_torch_state_dict(chapter, L.MultiHeadAttention(8, 7, 0.0, 2, model_axis="model"))
    with pytest.raises(ValueError, match=re.escape("the module expects (4, 6)")):
        convert.from_torch_state_dict(chapter, L.MultiHeadAttention(4, 7, 0.0, 2, model_axis="m"))
