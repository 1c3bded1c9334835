"""The book's later models transcribed to float64 numpy: RoPE, GPT-2 (ch04), Llama 3, Qwen3.

Each function follows the PyTorch code of ``llms_from_scratch`` (``ch04``, ``llama3``,
``qwen3``) line by line, in the book's layout ``(b, heads, T, head_dim)``, on a state dict
with the book's keys. It knows nothing of jattn, so jattn's models are tested against an
independent implementation, also where torch is not installed.

``book_state_dict_shapes`` lists the parameter shapes of the book's classes for a config,
read off their constructors (``nn.Linear(in, out).weight`` is ``(out, in)``).
"""

from __future__ import annotations

import numpy as np

# ----------------------------------------------------------------------------------------
# RoPE (llms_from_scratch.llama3.compute_rope_params / apply_rope; qwen3 has the same
# functions without freq_config)
# ----------------------------------------------------------------------------------------


def rope_inv_freq(head_dim, theta_base=10_000, freq_config=None):
    """The first half of the book's compute_rope_params: inverse frequencies (scaled)."""
    assert head_dim % 2 == 0
    inv_freq = 1.0 / (
        theta_base ** (np.arange(0, head_dim, 2, dtype=np.float64)[: head_dim // 2] / head_dim)
    )
    if freq_config is not None:
        low_freq_wavelen = freq_config["original_context_length"] / freq_config["low_freq_factor"]
        high_freq_wavelen = freq_config["original_context_length"] / freq_config["high_freq_factor"]
        wavelen = 2 * np.pi / inv_freq
        inv_freq_llama = np.where(
            wavelen > low_freq_wavelen, inv_freq / freq_config["factor"], inv_freq
        )
        smooth_factor = (
            freq_config["original_context_length"] / wavelen - freq_config["low_freq_factor"]
        ) / (freq_config["high_freq_factor"] - freq_config["low_freq_factor"])
        smoothed_inv_freq = (1 - smooth_factor) * (
            inv_freq / freq_config["factor"]
        ) + smooth_factor * inv_freq
        is_medium_freq = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
        inv_freq = np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq


def compute_rope_params(head_dim, theta_base=10_000, context_length=4096, freq_config=None):
    inv_freq = rope_inv_freq(head_dim, theta_base, freq_config)
    positions = np.arange(context_length, dtype=np.float64)
    angles = positions[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles), np.sin(angles)


def apply_rope(x, cos, sin):
    """x: (batch, heads, seq_len, head_dim), float64."""
    _, _, seq_len, head_dim = x.shape
    x1 = x[..., : head_dim // 2]
    x2 = x[..., head_dim // 2 :]
    cos = cos[:seq_len, :][None, None]
    sin = sin[:seq_len, :][None, None]
    rotated = np.concatenate((-x2, x1), axis=-1)
    return (x * cos) + (rotated * sin)


# ----------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------


def linear(x, sd, name, bias=True):
    """nn.Linear: x @ W.T + b."""
    y = x @ np.asarray(sd[f"{name}.weight"], np.float64).T
    if bias and f"{name}.bias" in sd:
        y = y + np.asarray(sd[f"{name}.bias"], np.float64)
    return y


def softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def layer_norm(x, scale, shift, eps=1e-5):
    """ch04.LayerNorm: biased variance, eps 1e-5."""
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return np.asarray(scale, np.float64) * ((x - mean) / np.sqrt(var + eps)) + np.asarray(
        shift, np.float64
    )


def gelu(x):
    """ch04.GELU: the tanh approximation."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def rms_norm(x, weight, eps):
    """torch.nn.RMSNorm (Llama 3) and qwen3.RMSNorm: x * rsqrt(mean(x^2) + eps) * weight."""
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def silu(x):
    return x / (1 + np.exp(-x))


def causal_attention(queries, keys, values, head_dim, window=None):
    """(b, h, T, d) each; masked_fill(-inf) above the diagonal, softmax(scores / sqrt(d)).

    ``window`` (not in the book): also hide keys more than ``window`` positions back
    (sliding-window attention, what a rolling KV cache of ``window`` slots computes).
    """
    t = queries.shape[2]
    scores = queries @ keys.transpose(0, 1, 3, 2)
    hidden = np.triu(np.ones((t, t), bool), 1)
    if window is not None:
        hidden |= np.tril(np.ones((t, t), bool), -window - 1)
    scores = np.where(hidden, -np.inf, scores)
    return softmax(scores / head_dim**0.5) @ values


# ----------------------------------------------------------------------------------------
# GPT-2 (ch04.GPTModel, eval mode)
# ----------------------------------------------------------------------------------------


def gpt_forward(cfg, sd, in_idx):
    """ch04.GPTModel.forward in eval mode (dropout off). in_idx: int (b, T)."""
    b, t = in_idx.shape
    x = (
        np.asarray(sd["tok_emb.weight"], np.float64)[in_idx]
        + np.asarray(sd["pos_emb.weight"], np.float64)[np.arange(t)]
    )
    h = cfg["n_heads"]
    d = cfg["emb_dim"] // h
    for i in range(cfg["n_layers"]):
        p = f"trf_blocks.{i}."
        shortcut = x
        x = layer_norm(x, sd[p + "norm1.scale"], sd[p + "norm1.shift"])
        keys = linear(x, sd, p + "att.W_key").reshape(b, t, h, d).transpose(0, 2, 1, 3)
        queries = linear(x, sd, p + "att.W_query").reshape(b, t, h, d).transpose(0, 2, 1, 3)
        values = linear(x, sd, p + "att.W_value").reshape(b, t, h, d).transpose(0, 2, 1, 3)
        context = (
            causal_attention(queries, keys, values, d).transpose(0, 2, 1, 3).reshape(b, t, h * d)
        )
        x = linear(context, sd, p + "att.out_proj") + shortcut
        shortcut = x
        x = layer_norm(x, sd[p + "norm2.scale"], sd[p + "norm2.shift"])
        x = linear(gelu(linear(x, sd, p + "ff.layers.0")), sd, p + "ff.layers.2") + shortcut
    x = layer_norm(x, sd["final_norm.scale"], sd["final_norm.shift"])
    return linear(x, sd, "out_head", bias=False)


# ----------------------------------------------------------------------------------------
# Llama 3 and Qwen3 (llama3.Llama3Model, qwen3.Qwen3Model)
# ----------------------------------------------------------------------------------------


def _gqa(x, sd, p, cfg, head_dim, cos, sin, norm_key, window=None):
    b, t, _ = x.shape
    h, g = cfg["n_heads"], cfg["n_kv_groups"]
    queries = (
        linear(x, sd, p + "att.W_query", bias=False)
        .reshape(b, t, h, head_dim)
        .transpose(0, 2, 1, 3)
    )
    keys = (
        linear(x, sd, p + "att.W_key", bias=False).reshape(b, t, g, head_dim).transpose(0, 2, 1, 3)
    )
    values = (
        linear(x, sd, p + "att.W_value", bias=False)
        .reshape(b, t, g, head_dim)
        .transpose(0, 2, 1, 3)
    )
    if cfg.get("qk_norm"):
        queries = rms_norm(queries, sd[p + "att.q_norm." + norm_key], 1e-6)
        keys = rms_norm(keys, sd[p + "att.k_norm." + norm_key], 1e-6)
    queries = apply_rope(queries, cos, sin)
    keys = apply_rope(keys, cos, sin)
    keys = np.repeat(keys, h // g, axis=1)  # torch.repeat_interleave(group_size, dim=1)
    values = np.repeat(values, h // g, axis=1)
    context = (
        causal_attention(queries, keys, values, head_dim, window)
        .transpose(0, 2, 1, 3)
        .reshape(b, t, h * head_dim)
    )
    return linear(context, sd, p + "att.out_proj", bias=False)


def _rope_decoder(cfg, sd, in_idx, *, head_dim, freq_config, norm_key, eps, window=None):
    t = in_idx.shape[1]
    cos, sin = compute_rope_params(head_dim, cfg["rope_base"], t, freq_config)
    x = np.asarray(sd["tok_emb.weight"], np.float64)[in_idx]
    for i in range(cfg["n_layers"]):
        p = f"trf_blocks.{i}."
        shortcut = x
        x = rms_norm(x, sd[p + "norm1." + norm_key], eps)
        x = _gqa(x, sd, p, cfg, head_dim, cos, sin, norm_key, window) + shortcut
        shortcut = x
        x = rms_norm(x, sd[p + "norm2." + norm_key], eps)
        hidden = silu(linear(x, sd, p + "ff.fc1", bias=False)) * linear(
            x, sd, p + "ff.fc2", bias=False
        )
        x = linear(hidden, sd, p + "ff.fc3", bias=False) + shortcut
    x = rms_norm(x, sd["final_norm." + norm_key], eps)
    return linear(x, sd, "out_head", bias=False)


def llama3_forward(cfg, sd, in_idx, window=None):
    """llama3.Llama3Model.forward: torch.nn.RMSNorm (key 'weight', eps 1e-5).

    ``window``: sliding-window attention (not in the book); sequences may then be longer
    than ``context_length`` (the RoPE tables are computed for the sequence).
    """
    return _rope_decoder(
        cfg,
        sd,
        in_idx,
        head_dim=cfg["emb_dim"] // cfg["n_heads"],
        freq_config=cfg["rope_freq"],
        norm_key="weight",
        eps=1e-5,
        window=window,
    )


def qwen3_forward(cfg, sd, in_idx, window=None):
    """qwen3.Qwen3Model.forward: qwen3.RMSNorm (key 'scale', eps 1e-6), QK-norm."""
    head_dim = cfg["head_dim"] if cfg["head_dim"] is not None else cfg["emb_dim"] // cfg["n_heads"]
    return _rope_decoder(
        cfg,
        sd,
        in_idx,
        head_dim=head_dim,
        freq_config=None,
        norm_key="scale",
        eps=1e-6,
        window=window,
    )


# ----------------------------------------------------------------------------------------
# Parameter shapes of the book's classes
# ----------------------------------------------------------------------------------------


def book_state_dict_shapes(arch, cfg):
    """{key: shape} of ``model.state_dict()`` of the book's class (persistent entries only)."""
    e, v, n = cfg["emb_dim"], cfg["vocab_size"], cfg["n_layers"]
    shapes = {"tok_emb.weight": (v, e)}
    if arch == "gpt2":
        c = cfg["context_length"]
        shapes["pos_emb.weight"] = (c, e)
        for i in range(n):
            p = f"trf_blocks.{i}."
            for name in ("W_query", "W_key", "W_value"):
                shapes[p + f"att.{name}.weight"] = (e, e)
                if cfg["qkv_bias"]:
                    shapes[p + f"att.{name}.bias"] = (e,)
            shapes[p + "att.out_proj.weight"] = (e, e)
            shapes[p + "att.out_proj.bias"] = (e,)
            shapes[p + "att.mask"] = (c, c)  # ch03's registered buffer
            shapes[p + "ff.layers.0.weight"] = (4 * e, e)
            shapes[p + "ff.layers.0.bias"] = (4 * e,)
            shapes[p + "ff.layers.2.weight"] = (e, 4 * e)
            shapes[p + "ff.layers.2.bias"] = (e,)
            for norm in ("norm1", "norm2"):
                shapes[p + f"{norm}.scale"] = (e,)
                shapes[p + f"{norm}.shift"] = (e,)
        shapes["final_norm.scale"] = (e,)
        shapes["final_norm.shift"] = (e,)
        shapes["out_head.weight"] = (v, e)
        return shapes
    h, g, hidden = cfg["n_heads"], cfg["n_kv_groups"], cfg["hidden_dim"]
    if arch == "llama3":
        d, norm_key, qk_norm = e // h, "weight", False
    else:
        d = cfg["head_dim"] if cfg["head_dim"] is not None else e // h
        norm_key, qk_norm = "scale", cfg["qk_norm"]
    for i in range(n):
        p = f"trf_blocks.{i}."
        shapes[p + "att.W_query.weight"] = (h * d, e)
        shapes[p + "att.W_key.weight"] = (g * d, e)
        shapes[p + "att.W_value.weight"] = (g * d, e)
        shapes[p + "att.out_proj.weight"] = (e, h * d)
        if qk_norm:
            shapes[p + "att.q_norm.scale"] = (d,)
            shapes[p + "att.k_norm.scale"] = (d,)
        shapes[p + "ff.fc1.weight"] = (hidden, e)
        shapes[p + "ff.fc2.weight"] = (hidden, e)
        shapes[p + "ff.fc3.weight"] = (e, hidden)
        shapes[p + f"norm1.{norm_key}"] = (e,)
        shapes[p + f"norm2.{norm_key}"] = (e,)
    shapes[f"final_norm.{norm_key}"] = (e,)
    shapes["out_head.weight"] = (v, e)
    return shapes


def random_state_dict(arch, cfg, seed=0, scale=0.3):
    """A float32 state dict of the book's shapes: norms near 1, the rest N(0, scale^2)."""
    rng = np.random.default_rng(seed)
    sd = {}
    for key, shape in book_state_dict_shapes(arch, cfg).items():
        if key.endswith("att.mask"):
            sd[key] = np.triu(np.ones(shape, np.float32), 1)
        elif "norm" in key and key.endswith(("scale", "weight")):
            sd[key] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            sd[key] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return sd
