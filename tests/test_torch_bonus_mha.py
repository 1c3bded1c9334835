"""Optional: the book's bonus multi-head attention classes, run live, loaded into jattn.

Skipped when torch is not installed. The classes are the notebook's code, verbatim
(tests/_book_bonus_mha.py); each is built after ``torch.manual_seed(123)``, run causally in
eval mode with dropout 0, and its ``state_dict()`` loaded with
``jattn.convert.from_torch_state_dict`` into jattn's Linen and NNX ``MultiHeadAttention``.
"""

import dataclasses
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import _book_bonus_mha as book  # noqa: E402
from _book_bonus_reference import KINDS, bonus_forward, bonus_state_dict  # noqa: E402
from flax import nnx  # noqa: E402

from jattn import convert  # noqa: E402
from jattn import linen as L  # noqa: E402
from jattn import nnx as N  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    # torch's own note that eager flex_attention is unfused; the numbers are what we test.
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

# CombinedQKV views its output to x's width and MHAPyTorchClass's
# nn.MultiheadAttention(embed_dim=d_out) reads x of width d_out: both need d_in == d_out.
SQUARE = ("MultiHeadAttentionCombinedQKV", "MHAPyTorchClass")


@dataclasses.dataclass(frozen=True)
class Config:
    d_in: int
    d_out: int
    num_heads: int
    context_length: int
    num_tokens: int
    qkv_bias: bool

    def __str__(self):
        return "-".join(f"{v:d}" for v in dataclasses.astuple(self))


CONFIGS = [
    Config(6, 8, 2, 7, 6, False),
    Config(6, 8, 2, 7, 7, True),
    Config(5, 12, 3, 9, 4, True),
    Config(12, 4, 4, 4, 4, False),
    Config(3, 2, 1, 6, 6, True),
]


def _sizes(kind, cfg):
    return dataclasses.replace(cfg, d_in=cfg.d_out) if kind in SQUARE else cfg


def _torch_module(kind, cfg, bias_kv=True):
    """The notebook's class after torch.manual_seed(123), in eval mode.

    ``bias_kv=False`` (MHAPyTorchClass with qkv_bias=True only) swaps in
    ``nn.MultiheadAttention(bias=True, add_bias_kv=False)``, the variant jattn can hold.
    """
    torch.manual_seed(123)
    module = getattr(book, kind)(
        d_in=cfg.d_in, d_out=cfg.d_out, context_length=cfg.context_length, dropout=0.0,
        num_heads=cfg.num_heads, qkv_bias=cfg.qkv_bias,
    )  # fmt: skip
    if kind == "MHAPyTorchClass" and cfg.qkv_bias and not bias_kv:
        module.multihead_attn = torch.nn.MultiheadAttention(
            cfg.d_out, cfg.num_heads, bias=True, batch_first=True
        )
    if kind == "MHAPyTorchClass":
        # nn.MultiheadAttention starts its biases at zero; draw them so the mapping shows.
        with torch.no_grad():
            for name, p in module.multihead_attn.named_parameters():
                if "bias" in name:
                    p.uniform_(-0.5, 0.5)
    if kind == "MHAPyTorchSDPAWithoutFlash":
        # The notebook's buffer makes SDPA attend to later tokens only (issue #1061 of
        # rasbt/LLMs-from-scratch); its inverse is the causal mask the section intends.
        module.mask = ~module.mask
    return module.eval()


def _run(kind, module, cfg):
    torch.manual_seed(123)
    x = torch.randn(2, cfg.num_tokens, cfg.d_in)
    with torch.no_grad():
        try:
            y = module(x)
        except (RuntimeError, NotImplementedError) as e:
            if kind != "MHAPyTorchFlexAttention":
                raise
            pytest.skip(f"flex_attention does not run on this torch {torch.__version__}: {e}")
    return x.numpy(), y.numpy()


def _jattn(kind, cfg, qkv_bias):
    width = cfg.d_out * (cfg.num_heads if kind == "Ch03_MHA_Wrapper" else 1)
    linen = L.MultiHeadAttention(width, cfg.context_length, 0.0, cfg.num_heads, qkv_bias)
    model = N.MultiHeadAttention(
        cfg.d_in, width, cfg.context_length, 0.0, cfg.num_heads, qkv_bias, rngs=nnx.Rngs(0)
    )
    return linen, model


CASES = [
    (kind, _sizes(kind, cfg))
    for kind in KINDS
    for cfg in CONFIGS
    if not (kind == "MHAPyTorchClass" and cfg.qkv_bias)  # add_bias_kv: below
]


@pytest.mark.parametrize(("kind", "cfg"), CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_notebook_classes_load_into_jattn(kind, cfg):
    if kind == "MHAPyTorchFlexAttention" and book.flex_attention is None:
        pytest.skip(f"torch {torch.__version__} has no flex_attention (needs >= 2.5)")
    module = _torch_module(kind, cfg)
    x, expected = _run(kind, module, cfg)
    sd = module.state_dict()
    # The hand-built layouts of test_convert_bonus.py are these classes' layouts ...
    built = bonus_state_dict(
        kind, np.random.default_rng(0), cfg.d_in, cfg.d_out, cfg.num_heads,
        cfg.context_length, cfg.qkv_bias,
    )  # fmt: skip
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: v.shape for k, v in built.items()}
    # ... and the numpy transcription is their forward.
    sd_np = {k: v.numpy() for k, v in sd.items()}
    reference = bonus_forward(kind, sd_np, x, cfg.num_heads, cfg.context_length)
    np.testing.assert_allclose(reference, expected, rtol=1e-5, atol=1e-5)

    linen, model = _jattn(kind, cfg, cfg.qkv_bias)
    variables = convert.from_torch_state_dict(sd, linen)  # tensors, mask buffers
    np.testing.assert_allclose(linen.apply(variables, x), expected, rtol=1e-5, atol=1e-5)
    model = convert.linen_to_nnx(variables, model)
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.qkv_bias], ids=str)
def test_torch_mha_class_with_qkv_bias(cfg):
    cfg = _sizes("MHAPyTorchClass", cfg)
    # qkv_bias=True sets add_bias_kv=True: an extra key/value token every query attends
    # to. The transcription follows it; jattn refuses rather than compute something else.
    module = _torch_module("MHAPyTorchClass", cfg)
    x, expected = _run("MHAPyTorchClass", module, cfg)
    sd = module.state_dict()
    sd_np = {k: v.numpy() for k, v in sd.items()}
    reference = bonus_forward("MHAPyTorchClass", sd_np, x, cfg.num_heads, cfg.context_length)
    np.testing.assert_allclose(reference, expected, rtol=1e-5, atol=1e-5)
    without = {k: v for k, v in sd_np.items() if not k.endswith(("bias_k", "bias_v"))}
    dropped = bonus_forward("MHAPyTorchClass", without, x, cfg.num_heads, cfg.context_length)
    assert not np.allclose(dropped, expected, atol=1e-3)  # the token matters
    with pytest.raises(ValueError, match=re.escape("nn.MultiheadAttention(add_bias_kv=True)")):
        convert.from_torch_state_dict(sd)

    # nn.MultiheadAttention(bias=True) without the extra token loads, biases and all.
    module = _torch_module("MHAPyTorchClass", cfg, bias_kv=False)
    x, expected = _run("MHAPyTorchClass", module, cfg)
    linen, model = _jattn("MHAPyTorchClass", cfg, True)
    variables = convert.from_torch_state_dict(module.state_dict(), linen)
    np.testing.assert_allclose(linen.apply(variables, x), expected, rtol=1e-5, atol=1e-5)
    model = convert.linen_to_nnx(variables, model)
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)


def test_sdpa_without_flash_as_written_is_not_causal():
    # The notebook's class, buffer untouched: token 0's output changes with later tokens.
    cfg = CONFIGS[0]
    torch.manual_seed(123)
    module = book.MHAPyTorchSDPAWithoutFlash(
        d_in=cfg.d_in, d_out=cfg.d_out, num_heads=cfg.num_heads,
        context_length=cfg.context_length,
    ).eval()  # fmt: skip
    x = torch.randn(1, cfg.num_tokens, cfg.d_in)
    changed = x.clone()
    changed[:, 1:] += 1.0
    with torch.no_grad():
        assert not torch.allclose(module(x)[:, 0], module(changed)[:, 0])
