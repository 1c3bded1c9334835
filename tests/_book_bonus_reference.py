"""The book's bonus multi-head attention classes transcribed to numpy, and their state dicts.

The classes are those of ``ch03/02_bonus_efficient-multihead-attention/
mha-implementations.ipynb`` in rasbt/LLMs-from-scratch (Apache-2.0; a verbatim copy of the
PyTorch code is tests/_book_bonus_mha.py). Each ``bonus_*`` function follows the
``forward`` of the class it is named after line by line, in float64, on a state dict in
that class's PyTorch layout (``x @ W.T + b`` for ``nn.Linear``, ``masked_fill(-inf)`` then
softmax; PyTorch's attention functions as their documented reference computations). It
knows nothing of jattn, so the converted weights are tested against an independent
implementation. Dropout is 0 throughout (eval mode).

:func:`bonus_state_dict` builds random state dicts with the keys and shapes each class's
``state_dict()`` has, mask buffers included (tests/test_torch_bonus_mha.py checks them
against the classes).
"""

from __future__ import annotations

import numpy as np
from _book_reference import book_causal, book_mha

KINDS = (
    "Ch03_MHA_Wrapper",
    "Ch03_MHA",
    "MultiHeadAttentionCombinedQKV",
    "MHAEinsum",
    "MHAPyTorchScaledDotProduct",
    "MHAPyTorchSDPAWithoutFlash",
    "MHAPyTorchClass",
    "MHAPyTorchFlexAttention",
)


def _f64(a):
    return None if a is None else np.asarray(a, np.float64)


def _softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _linear(x, weight, bias=None):
    """nn.Linear: ``x @ weight.T + bias``."""
    y = x @ _f64(weight).T
    return y if bias is None else y + _f64(bias)


def scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False):
    """``torch.nn.functional.scaled_dot_product_attention`` (dropout 0), as documented.

    A boolean ``attn_mask`` is True where a query *may* attend (the inverse of
    ``nn.MultiheadAttention``'s convention). A query that may attend nothing gets zeros, as
    torch's ``_safe_softmax`` gives (torch >= 2.5; the documented sketch would give NaN).
    """
    L, S = query.shape[-2], key.shape[-2]
    scale_factor = 1 / np.sqrt(query.shape[-1])
    attn_bias = np.zeros((L, S))
    if is_causal:
        temp_mask = np.tril(np.ones((L, S), bool))
        attn_bias = np.where(temp_mask, attn_bias, -np.inf)
    if attn_mask is not None:
        attn_bias = np.where(np.asarray(attn_mask, bool), attn_bias, -np.inf)
    attn_weight = query @ np.swapaxes(key, -2, -1) * scale_factor + attn_bias
    none = np.all(np.isneginf(attn_weight), axis=-1, keepdims=True)
    attn_weight = np.where(none, 0.0, _softmax(np.where(none, 0.0, attn_weight)))
    return attn_weight @ value


def flex_attention_causal(query, key, value):
    """``flex_attention(q, k, v, block_mask=create_block_mask(causal, ...))`` with the
    notebook's ``causal(b, h, q_idx, kv_idx) = q_idx >= kv_idx`` (default scale)."""
    L, S = query.shape[-2], key.shape[-2]
    keep = np.arange(L)[:, None] >= np.arange(S)[None, :]  # the mask_mod, evaluated
    scores = query @ np.swapaxes(key, -2, -1) / np.sqrt(query.shape[-1])
    return _softmax(np.where(keep, scores, -np.inf)) @ value


# --- the classes' forward passes, transcribed ----------------------------------------------


def bonus_ch03_mha_wrapper(sd, x, num_heads):
    """Ch03_MHA_Wrapper.forward: the chapter's CausalAttention heads, concatenated, out_proj."""
    heads = []
    for i in range(num_heads):
        head = {k[len(f"heads.{i}.") :]: v for k, v in sd.items() if k.startswith(f"heads.{i}.")}
        heads.append(book_causal(head, x))
    context_vec = np.concatenate(heads, axis=-1)
    return _linear(context_vec, sd["out_proj.weight"], sd["out_proj.bias"])


def bonus_ch03_mha(sd, x, num_heads):
    """Ch03_MHA.forward: the notebook's copy of the chapter's MultiHeadAttention, verbatim."""
    return book_mha(sd, x, num_heads)


def bonus_combined_qkv(sd, x, num_heads):
    """MultiHeadAttentionCombinedQKV.forward."""
    x = _f64(x)
    batch_size, num_tokens, embed_dim = x.shape
    qkv = _linear(x, sd["qkv.weight"], sd.get("qkv.bias"))
    head_dim = qkv.shape[-1] // 3 // num_heads
    qkv = qkv.reshape(batch_size, num_tokens, 3, num_heads, head_dim)
    qkv = qkv.transpose(2, 0, 3, 1, 4)  # permute(2, 0, 3, 1, 4)
    queries, keys, values = qkv  # unbind(0)
    attn_scores = queries @ np.swapaxes(keys, -2, -1)
    mask = np.triu(np.ones((num_tokens, num_tokens)), k=1)  # self.mask[:n, :n]
    attn_scores = np.where(mask.astype(bool), -np.inf, attn_scores)
    attn_weights = _softmax(attn_scores / keys.shape[-1] ** 0.5)
    context_vec = attn_weights @ values
    context_vec = context_vec.transpose(0, 2, 1, 3)
    # The notebook views to embed_dim (= d_in): the class only runs with d_in == d_out.
    context_vec = context_vec.reshape(batch_size, num_tokens, embed_dim)
    return _linear(context_vec, sd["proj.weight"], sd["proj.bias"])


def bonus_einsum(sd, x, num_heads):
    """MHAEinsum.forward: raw ``[d_in, d_out]`` matrices, ``bias_q/k/v``."""
    x = _f64(x)
    b, n, _ = x.shape
    Q = np.einsum("bnd,do->bno", x, _f64(sd["W_query"]))
    K = np.einsum("bnd,do->bno", x, _f64(sd["W_key"]))
    V = np.einsum("bnd,do->bno", x, _f64(sd["W_value"]))
    if sd.get("bias_q") is not None:
        Q = Q + _f64(sd["bias_q"])
        K = K + _f64(sd["bias_k"])
        V = V + _f64(sd["bias_v"])
    d_out = Q.shape[-1]
    head_dim = d_out // num_heads
    Q = Q.reshape(b, n, num_heads, head_dim).transpose(0, 2, 1, 3)
    K = K.reshape(b, n, num_heads, head_dim).transpose(0, 2, 1, 3)
    V = V.reshape(b, n, num_heads, head_dim).transpose(0, 2, 1, 3)
    scores = np.einsum("bhnd,bhmd->bhnm", Q, K) / (head_dim**0.5)
    mask = np.triu(np.ones((n, n)), k=1)
    scores = np.where(mask.astype(bool), -np.inf, scores)
    attn_weights = _softmax(scores)
    context_vec = np.einsum("bhnm,bhmd->bhnd", attn_weights, V)
    context_vec = context_vec.transpose(0, 2, 1, 3).reshape(b, n, d_out)
    return _linear(context_vec, sd["out_proj.weight"], sd["out_proj.bias"])


def _qkv_heads(sd, x, num_heads):
    """The qkv lines the SDPA and Flex classes share: queries, keys, values [b, h, T, hd]."""
    batch_size, num_tokens, _ = x.shape
    qkv = _linear(x, sd["qkv.weight"], sd.get("qkv.bias"))
    head_dim = qkv.shape[-1] // 3 // num_heads
    qkv = qkv.reshape(batch_size, num_tokens, 3, num_heads, head_dim)
    qkv = qkv.transpose(2, 0, 3, 1, 4)
    return qkv  # queries, keys, values = qkv


def _merge_and_project(sd, context_vec):
    batch_size, _, num_tokens, _ = context_vec.shape
    context_vec = context_vec.transpose(0, 2, 1, 3).reshape(batch_size, num_tokens, -1)
    return _linear(context_vec, sd["proj.weight"], sd["proj.bias"])


def bonus_sdpa(sd, x, num_heads):
    """MHAPyTorchScaledDotProduct.forward: SDPA with ``is_causal=True``."""
    queries, keys, values = _qkv_heads(sd, _f64(x), num_heads)
    context_vec = scaled_dot_product_attention(queries, keys, values, None, is_causal=True)
    return _merge_and_project(sd, context_vec)


def bonus_sdpa_without_flash(sd, x, num_heads, context_length):
    """MHAPyTorchSDPAWithoutFlash.forward: SDPA with the ``mask`` buffer as ``attn_mask``.

    As in the notebook, the buffer goes to SDPA, where True means attend: with the
    notebook's ``triu(ones, diagonal=1).bool()`` buffer the class attends to strictly
    later tokens (rasbt/LLMs-from-scratch issue #1061); pass ``sd | {'mask': ~mask}`` for
    the causal attention the section intends.
    """
    x = _f64(x)
    num_tokens = x.shape[1]
    queries, keys, values = _qkv_heads(sd, x, num_heads)
    mask = np.asarray(sd["mask"], bool)
    if context_length >= num_tokens:
        attn_mask = mask[:num_tokens, :num_tokens]
    else:
        attn_mask = mask[:context_length, :context_length]
    context_vec = scaled_dot_product_attention(queries, keys, values, attn_mask, is_causal=False)
    return _merge_and_project(sd, context_vec)


def bonus_flex(sd, x, num_heads):
    """MHAPyTorchFlexAttention.forward: flex_attention with the causal block mask."""
    queries, keys, values = _qkv_heads(sd, _f64(x), num_heads)
    return _merge_and_project(sd, flex_attention_causal(queries, keys, values))


def multi_head_attention_forward(sd, x, num_heads, attn_mask):
    """``nn.MultiheadAttention(batch_first=True)(x, x, x, attn_mask=...)[0]``, dropout 0.

    ``sd`` holds its keys (``in_proj_weight``, ``in_proj_bias``, ``bias_k``, ``bias_v``,
    ``out_proj.weight``, ``out_proj.bias``). A boolean ``attn_mask`` is True where a query
    may NOT attend. ``bias_k``/``bias_v`` (``add_bias_kv=True``) are appended as one more
    key/value token, and the mask gets a column of False (attend) for it.
    """
    bsz, tgt_len, embed_dim = x.shape
    head_dim = embed_dim // num_heads
    proj = _linear(x, sd["in_proj_weight"], sd.get("in_proj_bias"))
    q, k, v = (proj[..., i * embed_dim : (i + 1) * embed_dim] for i in range(3))
    attn_mask = np.asarray(attn_mask, bool)
    if sd.get("bias_k") is not None:
        k = np.concatenate([k, np.broadcast_to(_f64(sd["bias_k"]), (bsz, 1, embed_dim))], axis=1)
        v = np.concatenate([v, np.broadcast_to(_f64(sd["bias_v"]), (bsz, 1, embed_dim))], axis=1)
        attn_mask = np.pad(attn_mask, ((0, 0), (0, 1)))  # F.pad(attn_mask, (0, 1))

    def heads(t):  # [bsz, len, E] -> [bsz, num_heads, len, head_dim]
        return t.reshape(bsz, -1, num_heads, head_dim).transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    scores = q @ np.swapaxes(k, -2, -1) / np.sqrt(head_dim)
    scores = np.where(attn_mask, -np.inf, scores)
    attn_output = (_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(bsz, tgt_len, embed_dim)
    return _linear(attn_output, sd["out_proj.weight"], sd.get("out_proj.bias"))


def bonus_torch_mha_class(sd, x, num_heads, context_length):
    """MHAPyTorchClass.forward: nn.MultiheadAttention with the ``mask`` buffer, then proj."""
    x = _f64(x)
    _, num_tokens, _ = x.shape
    mask = np.asarray(sd["mask"], bool)
    if context_length >= num_tokens:
        attn_mask = mask[:num_tokens, :num_tokens]
    else:
        attn_mask = mask[:context_length, :context_length]
    inner = {
        k[len("multihead_attn.") :]: v for k, v in sd.items() if k.startswith("multihead_attn.")
    }
    attn_output = multi_head_attention_forward(inner, x, num_heads, attn_mask)
    return _linear(attn_output, sd["proj.weight"], sd["proj.bias"])


def bonus_forward(kind, sd, x, num_heads, context_length):
    """The transcribed forward of ``kind`` (one of :data:`KINDS`)."""
    if kind == "MHAPyTorchSDPAWithoutFlash":
        return bonus_sdpa_without_flash(sd, x, num_heads, context_length)
    if kind == "MHAPyTorchClass":
        return bonus_torch_mha_class(sd, x, num_heads, context_length)
    forward = {
        "Ch03_MHA_Wrapper": bonus_ch03_mha_wrapper,
        "Ch03_MHA": bonus_ch03_mha,
        "MultiHeadAttentionCombinedQKV": bonus_combined_qkv,
        "MHAEinsum": bonus_einsum,
        "MHAPyTorchScaledDotProduct": bonus_sdpa,
        "MHAPyTorchFlexAttention": bonus_flex,
    }[kind]
    return forward(sd, x, num_heads)


# --- random state dicts in each class's layout ---------------------------------------------


def bonus_state_dict(
    kind, rng, d_in, d_out, num_heads, context_length, qkv_bias=False, add_bias_kv=None
):
    """A random float32 state dict with the keys and shapes of ``kind``'s ``state_dict()``.

    Arguments as the class's constructor (for ``Ch03_MHA_Wrapper``, ``d_out`` is the width
    of one head). ``add_bias_kv`` (MHAPyTorchClass only) defaults to ``qkv_bias``, as the
    class sets it; ``False`` with ``qkv_bias=True`` is ``nn.MultiheadAttention(bias=True)``
    without the extra key/value token. Weights are uniform in ``±1/sqrt(fan_in)``, biases
    nonzero.
    """

    def arr(*shape, fan_in=d_in):
        bound = 1 / np.sqrt(fan_in)
        return rng.uniform(-bound, bound, size=shape).astype(np.float32)

    triu = np.triu(np.ones((context_length, context_length), np.float32), k=1)

    def linear(name, n_out, n_in, bias=True):
        return {f"{name}.weight": arr(n_out, n_in, fan_in=n_in)} | (
            {f"{name}.bias": arr(n_out, fan_in=n_in)} if bias else {}
        )

    def chapter_qkv(width, prefix=""):
        sd = {}
        for name in ("W_query", "W_key", "W_value"):
            sd |= linear(f"{prefix}{name}", width, d_in, qkv_bias)
        return sd

    if kind == "Ch03_MHA_Wrapper":
        sd = {}
        for i in range(num_heads):
            sd |= chapter_qkv(d_out, f"heads.{i}.") | {f"heads.{i}.mask": triu}
        return sd | linear("out_proj", d_out * num_heads, d_out * num_heads)
    if kind == "Ch03_MHA":
        return chapter_qkv(d_out) | linear("out_proj", d_out, d_out) | {"mask": triu}
    if kind == "MHAEinsum":
        sd = {name: arr(d_in, d_out) for name in ("W_query", "W_key", "W_value")}
        sd |= {f"bias_{n}": arr(d_out) for n in "qkv"} if qkv_bias else {}
        return sd | linear("out_proj", d_out, d_out) | {"mask": triu}
    if kind == "MHAPyTorchClass":
        add_bias_kv = qkv_bias if add_bias_kv is None else add_bias_kv
        inner = linear("multihead_attn.in_proj", 3 * d_out, d_out, qkv_bias)
        inner = {k.replace("in_proj.", "in_proj_"): v for k, v in inner.items()}
        if add_bias_kv:
            inner |= {f"multihead_attn.bias_{n}": arr(1, 1, d_out) for n in "kv"}
        inner |= linear("multihead_attn.out_proj", d_out, d_out, qkv_bias)
        return inner | linear("proj", d_out, d_out) | {"mask": triu.astype(bool)}
    sd = linear("qkv", 3 * d_out, d_in, qkv_bias) | linear("proj", d_out, d_out)
    if kind == "MultiHeadAttentionCombinedQKV":
        return sd | {"mask": triu}
    if kind == "MHAPyTorchSDPAWithoutFlash":
        return sd | {"mask": triu.astype(bool)}
    if kind in ("MHAPyTorchScaledDotProduct", "MHAPyTorchFlexAttention"):
        return sd  # no buffer
    raise ValueError(kind)
