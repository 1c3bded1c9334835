"""Optional: the book's PyTorch classes, run live, against jattn.linen and jattn.nnx.

Skipped when torch is not installed (torch is not a dependency of jattn; install a CPU
wheel by hand to run it). The classes below are the chapter's code.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _book_reference import BOOK_OUTPUTS, BOOK_STATE_DICTS  # noqa: E402
from _module_cases import CLASSES, Case  # noqa: E402
from conftest import BOOK_INPUTS  # noqa: E402

from jattn import convert  # noqa: E402

pytestmark = pytest.mark.torch
nn = torch.nn


class SelfAttention_v1(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        attn_scores = queries @ keys.T  # omega
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vec = attn_weights @ values
        return context_vec


class SelfAttention_v2(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.T
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vec = attn_weights @ values
        return context_vec


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, num_tokens, d_in = x.shape  # noqa: RUF059 (the book's line, verbatim)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = attn_weights @ values
        return context_vec


class MultiHeadAttentionWrapper(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [
                CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
                for _ in range(num_heads)
            ]
        )

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, num_tokens, d_in = x.shape  # noqa: RUF059 (the book's line, verbatim)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)
        keys = keys.transpose(1, 2)
        queries = queries.transpose(1, 2)
        values = values.transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        context_vec = self.out_proj(context_vec)
        return context_vec


def _book_module(kind, d_in=3, d_out=2, context_length=6, num_heads=2, qkv_bias=False):
    """The chapter's constructor calls (seed 789 for v2, 123 otherwise)."""
    torch.manual_seed(789 if kind == "SelfAttentionV2" else 123)
    if kind == "SelfAttentionV1":
        return SelfAttention_v1(d_in, d_out)
    if kind == "SelfAttentionV2":
        return SelfAttention_v2(d_in, d_out, qkv_bias)
    if kind == "CausalAttention":
        return CausalAttention(d_in, d_out, context_length, 0.0, qkv_bias)
    if kind == "MultiHeadAttentionWrapper":
        return MultiHeadAttentionWrapper(d_in, d_out, context_length, 0.0, num_heads, qkv_bias)
    return MultiHeadAttention(d_in, d_out, context_length, 0.0, num_heads, qkv_bias)


def _run_torch(module, x):
    with torch.no_grad():
        return module(torch.tensor(x)).numpy()


def _book_input(kind):
    return BOOK_INPUTS if kind.startswith("SelfAttention") else np.stack([BOOK_INPUTS] * 2)


@pytest.mark.parametrize("kind", CLASSES)
def test_the_chapters_modules_give_the_same_outputs(kind):
    torch_module = _book_module(kind)
    sd = torch_module.state_dict()
    # The weights recorded in _book_reference are still what torch draws.
    for key, value in BOOK_STATE_DICTS[kind].items():
        np.testing.assert_array_equal(sd[key].numpy(), value, err_msg=key)
    x = _book_input(kind)
    expected = _run_torch(torch_module, x)
    np.testing.assert_allclose(
        expected, np.broadcast_to(BOOK_OUTPUTS[kind], expected.shape), atol=1e-4
    )
    case = Case(kind, d_out=2)
    variables = convert.from_torch_state_dict(sd, case.linen())  # tensors, mask buffers
    np.testing.assert_allclose(case.linen().apply(variables, x), expected, rtol=1e-5, atol=1e-6)
    model = convert.linen_to_nnx(variables, case.nnx())
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-6)


def test_done_when_first_token():
    torch.manual_seed(123)
    mha = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    batch = torch.stack((torch.tensor(BOOK_INPUTS), torch.tensor(BOOK_INPUTS)))
    with torch.no_grad():
        first = mha(batch)[0, 0].numpy()
    np.testing.assert_allclose(first, [0.3190, 0.4858], atol=1e-4)
    case = Case("MultiHeadAttention", d_out=2)
    variables = convert.from_torch_state_dict(mha.state_dict())
    np.testing.assert_allclose(case.linen().apply(variables, batch.numpy())[0, 0], first, atol=1e-6)
    np.testing.assert_allclose(
        convert.linen_to_nnx(variables, case.nnx())(batch.numpy())[0, 0], first, atol=1e-6
    )


@pytest.mark.parametrize("kind", CLASSES[1:])
def test_larger_modules_with_bias(kind, rng):
    torch_module = _book_module(kind, d_in=5, d_out=4, context_length=8, num_heads=2, qkv_bias=True)
    x = rng.normal(size=(3, 7, 5)).astype(np.float32)
    if kind == "SelfAttentionV2":
        x = x[0]  # the book's v2 transposes with .T: one sequence, no batch
    expected = _run_torch(torch_module, x)
    case = Case(kind, d_in=5, d_out=4, context_length=8, num_heads=2, qkv_bias=True)
    variables = convert.from_torch_state_dict(torch_module.state_dict(), case.linen())
    np.testing.assert_allclose(case.linen().apply(variables, x), expected, rtol=1e-5, atol=1e-5)
    model = convert.linen_to_nnx(variables, case.nnx())
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)
