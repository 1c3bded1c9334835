"""jattn's modifiers against PyTorch: ``flex_attention`` forward (eager, CPU) for each
ready-made modifier, ``create_block_mask`` for block masks, and torch autograd through a
plain-torch attention for the gradients (flex_attention has no CPU backward).

Every torch modifier here is written from its definition in torch ops (T5's bucketing as
in HF transformers' ``T5Attention._relative_position_bucket``); nothing is shared with
jattn but the inputs.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import mods

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

pytestmark = pytest.mark.torch

B, T, H, KV, D = 2, 64, 4, 2, 16
CAP = 1.5


def t5_bucket(relative_position, num_buckets, bidirectional, max_distance):
    """HF transformers' T5Attention._relative_position_bucket (torch ops)."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return relative_buckets + torch.where(is_small, relative_position, if_large)


def case_inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    k = rng.normal(size=(B, T, KV, D)).astype(np.float32)
    v = rng.normal(size=(B, T, KV, D)).astype(np.float32)
    params = {
        "slopes": np.asarray(mods.alibi_slopes(H)),
        "table": rng.normal(size=(32, H)).astype(np.float32),
        "prefix": np.array([5, 40]),
        "ids": np.stack([np.repeat([0, 1, 2, 3], 16), np.repeat([0, 1], [50, 14])]),
        "sinks": rng.normal(size=H).astype(np.float32),
    }
    return q, k, v, params


def torch_mods(p, tp):
    """name -> (score_mod, mask_mod) in torch, from their definitions (``tp``: torch params)."""
    return {
        "softcap": (lambda s, b, h, qi, ki: CAP * torch.tanh(s / CAP), None),
        "alibi": (lambda s, b, h, qi, ki: s + tp["slopes"][h] * (ki - qi), None),
        "alibi_symmetric": (lambda s, b, h, qi, ki: s - tp["slopes"][h] * torch.abs(ki - qi), None),
        "relative_bias": (
            lambda s, b, h, qi, ki: s + tp["table"][t5_bucket(ki - qi, 32, True, 128), h],
            None,
        ),
        "causal": (None, lambda b, h, qi, ki: qi >= ki),
        "sliding_window": (None, lambda b, h, qi, ki: (ki >= qi - 8) & (ki <= qi)),
        "prefix_lm": (None, lambda b, h, qi, ki: (ki <= qi) | (ki < tp["prefix"][b])),
        "document": (None, lambda b, h, qi, ki: tp["ids"][b, qi] == tp["ids"][b, ki]),
        "causal&document+alibi+softcap": (
            lambda s, b, h, qi, ki: CAP * torch.tanh((s + tp["slopes"][h] * (ki - qi)) / CAP),
            lambda b, h, qi, ki: (qi >= ki) & (tp["ids"][b, qi] == tp["ids"][b, ki]),
        ),
    }


def jattn_mods(p):
    ids = jnp.asarray(p["ids"])
    return {
        "softcap": (mods.softcap(CAP), None),
        "alibi": (mods.alibi(jnp.asarray(p["slopes"])), None),
        "alibi_symmetric": (mods.alibi(jnp.asarray(p["slopes"]), symmetric=True), None),
        "relative_bias": (mods.relative_bias(jnp.asarray(p["table"])), None),
        "causal": (None, mods.causal()),
        "sliding_window": (None, mods.sliding_window(8)),
        "prefix_lm": (None, mods.prefix_lm(jnp.asarray(p["prefix"]))),
        "document": (None, mods.document(ids)),
        "causal&document+alibi+softcap": (
            mods.compose(mods.alibi(jnp.asarray(p["slopes"])), mods.softcap(CAP)),
            mods.causal() & mods.document(ids),
        ),
    }


NAMES = list(
    torch_mods(case_inputs()[3], {k: torch.tensor(v) for k, v in case_inputs()[3].items()})
)


def to_torch_bhtd(x):
    return torch.tensor(np.swapaxes(x, 1, 2))  # [B, T, H, D] -> [B, H, T, D]


def flex_forward(q, k, v, score_mod, mask_mod, sinks=None):
    """torch flex_attention (eager, CPU) in jattn's layout; sinks folded in through the lse."""
    qt, kt, vt = (to_torch_bhtd(x) for x in (q, k, v))
    block_mask = None
    if mask_mod is not None:
        block_mask = flex.create_block_mask(mask_mod, B, H, T, T, device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out, aux = flex.flex_attention(
            qt, kt, vt, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
            return_aux=flex.AuxRequest(lse=True),
        )  # fmt: skip
    lse = aux.lse  # [B, H, T], natural log
    if sinks is not None:
        # One more logit per row: the output scales by sum(exp(s)) / (sum(exp(s)) + exp(sink)).
        sink = torch.tensor(sinks)[None, :, None]
        new_lse = torch.logaddexp(lse, sink)
        out = out * torch.exp(lse - new_lse)[..., None]
        lse = new_lse
    return np.swapaxes(out.numpy(), 1, 2), lse.numpy()


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_torch_flex_attention(name, with_sinks):
    q, k, v, p = case_inputs()
    tp = {key: torch.tensor(value) for key, value in p.items()}
    sinks = p["sinks"] if with_sinks else None
    want, want_lse = flex_forward(q, k, v, *torch_mods(p, tp)[name], sinks=sinks)
    score_mod, mask_mod = jattn_mods(p)[name]
    out, lse = jattn.dot_product_attention(
        q, k, v, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, return_residual=True
    )
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.swapaxes(lse, 1, 2), want_lse, atol=2e-5, rtol=1e-5)


def dense_states(torch_bm, nq, nk):
    """jattn's tile states (0 empty, 1 partial, 2 full) from torch's BlockMask index lists."""

    def dense(num, idx):
        out = np.zeros((*num.shape, nk), bool)
        for pos in np.ndindex(*num.shape):
            out[pos][idx[pos][: num[pos]]] = True
        return out

    partial = dense(torch_bm.kv_num_blocks.numpy(), torch_bm.kv_indices.numpy())
    full = dense(torch_bm.full_kv_num_blocks.numpy(), torch_bm.full_kv_indices.numpy())
    return np.where(full, 2, np.where(partial, 1, 0))


@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "document"])
def test_block_mask_matches_torch_create_block_mask(name):
    _, _, _, p = case_inputs()
    tp = {key: torch.tensor(value) for key, value in p.items()}
    torch_bm = flex.create_block_mask(
        torch_mods(p, tp)[name][1], B, H, T, T, device="cpu", BLOCK_SIZE=16
    )
    want = dense_states(torch_bm, T // 16, T // 16)  # [B, H, nq, nk]
    bm = jattn.block_mask(
        jattn_mods(p)[name][1], q_len=T, batch_shape=B, num_heads=H, block_q=16, block_k=16
    )
    np.testing.assert_array_equal(np.broadcast_to(bm.state, want.shape), want)


# ----------------------------------------------------------------------------------------
# Gradients: torch autograd through plain torch attention
# ----------------------------------------------------------------------------------------


def torch_attention(q, k, v, score_mod, mask_mod, sinks):
    """Materialised FlexAttention semantics in torch ops ([B, H, T, D] tensors)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    b, h, qi, ki = (
        torch.arange(n).view(*[(-1 if i == axis else 1) for i in range(4)])
        for axis, n in enumerate(s.shape)
    )
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    w = torch.softmax(s, dim=-1)
    if sinks is not None:
        w = w[..., :-1]
    return w @ v


@pytest.mark.parametrize(
    "name",
    ["alibi", "relative_bias", "softcap", "causal&document+alibi+softcap", "prefix_lm"],
)
def test_gradients_match_torch_autograd(name):
    q, k, v, p = case_inputs(1)
    cot = np.random.default_rng(5).normal(size=(B, T, H, D)).astype(np.float32)
    tp = {
        key: torch.tensor(value, requires_grad=value.dtype == np.float32)
        for key, value in p.items()
    }
    leaves = [to_torch_bhtd(x).requires_grad_() for x in (q, k, v)]
    score_mod, mask_mod = torch_mods(p, tp)[name]
    out = torch_attention(*leaves, score_mod, mask_mod, tp["sinks"])
    (out * to_torch_bhtd(cot)).sum().backward()
    want = [np.swapaxes(x.grad.numpy(), 1, 2) for x in leaves]
    param = {"alibi": "slopes", "relative_bias": "table"}.get(name, "slopes")

    def loss(q, k, v, param_value, sinks):
        p2 = dict(p, **{param: param_value})
        score_mod, mask_mod = jattn_mods(p2)[name]
        out = jattn.dot_product_attention(
            q, k, v, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks
        )
        return jnp.sum(out * cot)

    grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(
        q, k, v, jnp.asarray(p[param]), jnp.asarray(p["sinks"])
    )
    for got, ref in zip(grads[:3], want, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(grads[4], tp["sinks"].grad.numpy(), atol=1e-4, rtol=1e-4)
    if name in ("alibi", "relative_bias", "causal&document+alibi+softcap"):
        ref = tp[param].grad.numpy()
        assert np.abs(ref).max() > 1e-3  # the gradient is not trivially zero
        np.testing.assert_allclose(grads[3], ref, atol=1e-4, rtol=1e-4)
