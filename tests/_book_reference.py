"""The book's chapter-3 forward passes transcribed to numpy, and its recorded numbers.

Each ``book_*`` function follows the PyTorch ``forward`` of the class it is named after,
line by line (``x @ W.T + b`` for ``nn.Linear``, ``masked_fill(-inf)`` then softmax), on a
state dict in the PyTorch layout. It runs in float64 and knows nothing of jattn, so the
modules are tested against an independent implementation.

``BOOK_STATE_DICTS`` are the weights the book's classes get after ``torch.manual_seed``
(123 for v1, CausalAttention, the wrapper and MultiHeadAttention; 789 for v2) with
``d_in=3, d_out=2``; tests/test_torch_crosscheck.py checks they still are what torch
draws. ``BOOK_OUTPUTS`` are the outputs printed in the chapter for the six-token example
(rounded to 4 decimals there, so compare with ``atol=1e-4``).
"""

from __future__ import annotations

import numpy as np

# --- weights drawn by the book's PyTorch code (see the module docstring) ------------------

_SEED_123_QKV = {
    "W_query.weight": [
        [-0.23542964458465576, 0.019124476239085197, -0.28674593567848206],
        [0.21772661805152893, -0.491934210062027, 0.423223078250885],
    ],
    "W_key.weight": [
        [-0.4196414053440094, -0.45901766419410706, -0.3648201823234558],
        [0.2614781856536865, -0.21332639455795288, 0.21605217456817627],
    ],
    "W_value.weight": [
        [-0.49001413583755493, -0.35029205679893494, -0.21198919415473938],
        [-0.1134607195854187, -0.440439373254776, 0.37804362177848816],
    ],
}
_SEED_123_SECOND_HEAD = {
    "W_query.weight": [
        [-0.13615716993808746, 0.1853223294019699, 0.4082694947719574],
        [0.107563816010952, 0.1578768491744995, 0.5572923421859741],
    ],
    "W_key.weight": [
        [-0.26039040088653564, 0.18287640810012817, -0.2568724453449249],
        [0.4126031696796417, 0.46110451221466064, -0.5323009490966797],
    ],
    "W_value.weight": [
        [0.4928526282310486, 0.27569305896759033, 0.25159022212028503],
        [0.237680584192276, 0.4799507260322571, -0.07623306661844254],
    ],
}


def _f32(d):
    return {k: np.asarray(v, dtype=np.float32) for k, v in d.items()}


BOOK_STATE_DICTS = {
    # torch.manual_seed(123); SelfAttention_v1(3, 2)
    "SelfAttentionV1": _f32(
        {
            "W_query": [
                [0.29611194133758545, 0.516562283039093],
                [0.2516707181930542, 0.6885567903518677],
                [0.07397246360778809, 0.866521954536438],
            ],
            "W_key": [
                [0.13657987117767334, 0.10247904062271118],
                [0.18405646085739136, 0.7264467477798462],
                [0.3152539134025574, 0.6871066689491272],
            ],
            "W_value": [
                [0.07563531398773193, 0.19663816690444946],
                [0.31641197204589844, 0.4017401337623596],
                [0.1185683012008667, 0.8273953795433044],
            ],
        }
    ),
    # torch.manual_seed(789); SelfAttention_v2(3, 2)
    "SelfAttentionV2": _f32(
        {
            "W_query.weight": [
                [0.31605908274650574, 0.45680856704711914, 0.5118348598480225],
                [-0.16828539967536926, -0.3378770351409912, -0.0917738676071167],
            ],
            "W_key.weight": [
                [0.4058058261871338, -0.4704205393791199, 0.23680520057678223],
                [0.2133607417345047, -0.2600506544113159, -0.5105429887771606],
            ],
            "W_value.weight": [
                [0.25256988406181335, -0.1414782702922821, -0.19618134200572968],
                [0.5191074013710022, -0.08516757935285568, -0.2043270468711853],
            ],
        }
    ),
    # torch.manual_seed(123); CausalAttention(3, 2, 6, 0.0)
    "CausalAttention": _f32(_SEED_123_QKV),
    # torch.manual_seed(123); MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    "MultiHeadAttentionWrapper": _f32(
        {f"heads.0.{k}": v for k, v in _SEED_123_QKV.items()}
        | {f"heads.1.{k}": v for k, v in _SEED_123_SECOND_HEAD.items()}
    ),
    # torch.manual_seed(123); MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    "MultiHeadAttention": _f32(
        _SEED_123_QKV
        | {
            "out_proj.weight": [
                [-0.16675779223442078, 0.2269725799560547],
                [0.5000259876251221, 0.13173823058605194],
            ],
            "out_proj.bias": [0.1933588683605194, 0.6825409531593323],
        }
    ),
}

# --- outputs printed in the chapter (4 decimals) ------------------------------------------
# v1 and v2 take the 6 x 3 inputs; the others the batch torch.stack((inputs, inputs)),
# whose two rows are equal, so one [6, d] block is recorded.

BOOK_OUTPUTS = {
    "SelfAttentionV1": [
        [0.2996, 0.8053],
        [0.3061, 0.8210],
        [0.3058, 0.8203],
        [0.2948, 0.7939],
        [0.2927, 0.7891],
        [0.2990, 0.8040],
    ],
    "SelfAttentionV2": [
        [-0.0739, 0.0713],
        [-0.0748, 0.0703],
        [-0.0749, 0.0702],
        [-0.0760, 0.0685],
        [-0.0763, 0.0679],
        [-0.0754, 0.0693],
    ],
    "CausalAttention": [
        [-0.4519, 0.2216],
        [-0.5874, 0.0058],
        [-0.6300, -0.0632],
        [-0.5675, -0.0843],
        [-0.5526, -0.0981],
        [-0.5299, -0.1081],
    ],
    "MultiHeadAttentionWrapper": [
        [-0.4519, 0.2216, 0.4772, 0.1063],
        [-0.5874, 0.0058, 0.5891, 0.3257],
        [-0.6300, -0.0632, 0.6202, 0.3860],
        [-0.5675, -0.0843, 0.5478, 0.3589],
        [-0.5526, -0.0981, 0.5321, 0.3428],
        [-0.5299, -0.1081, 0.5077, 0.3493],
    ],
    "MultiHeadAttention": [
        [0.3190, 0.4858],
        [0.2943, 0.3897],
        [0.2856, 0.3593],
        [0.2693, 0.3873],
        [0.2639, 0.3928],
        [0.2575, 0.4028],
    ],
}


# --- the forward passes, transcribed ------------------------------------------------------


def _softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _linear(sd, name, x):
    """nn.Linear: ``x @ weight.T + bias``."""
    y = x @ np.asarray(sd[f"{name}.weight"], np.float64).T
    if f"{name}.bias" in sd:
        y = y + np.asarray(sd[f"{name}.bias"], np.float64)
    return y


def book_v1(sd, x):
    """SelfAttention_v1.forward on ``x [..., T, d_in]``."""
    x = np.asarray(x, np.float64)
    keys = x @ np.asarray(sd["W_key"], np.float64)
    queries = x @ np.asarray(sd["W_query"], np.float64)
    values = x @ np.asarray(sd["W_value"], np.float64)
    attn_scores = queries @ np.swapaxes(keys, -1, -2)
    attn_weights = _softmax(attn_scores / keys.shape[-1] ** 0.5)
    return attn_weights @ values


def book_v2(sd, x):
    """SelfAttention_v2.forward on ``x [..., T, d_in]``."""
    x = np.asarray(x, np.float64)
    keys, queries, values = (_linear(sd, n, x) for n in ("W_key", "W_query", "W_value"))
    attn_scores = queries @ np.swapaxes(keys, -1, -2)
    attn_weights = _softmax(attn_scores / keys.shape[-1] ** 0.5)
    return attn_weights @ values


def book_causal(sd, x, causal=True):
    """CausalAttention.forward (dropout 0) on ``x [..., T, d_in]``; ``causal=False``: no mask."""
    x = np.asarray(x, np.float64)
    num_tokens = x.shape[-2]
    keys, queries, values = (_linear(sd, n, x) for n in ("W_key", "W_query", "W_value"))
    attn_scores = queries @ np.swapaxes(keys, -1, -2)
    if causal:
        mask = np.triu(np.ones((num_tokens, num_tokens)), k=1).astype(bool)
        attn_scores = np.where(mask, -np.inf, attn_scores)
    attn_weights = _softmax(attn_scores / keys.shape[-1] ** 0.5)
    return attn_weights @ values


def book_wrapper(sd, x, num_heads, causal=True):
    """MultiHeadAttentionWrapper.forward: the heads' outputs concatenated."""
    outs = []
    for i in range(num_heads):
        head = {k[len(f"heads.{i}.") :]: v for k, v in sd.items() if k.startswith(f"heads.{i}.")}
        outs.append(book_causal(head, x, causal))
    return np.concatenate(outs, axis=-1)


def book_mha(sd, x, num_heads, num_kv_heads=None, causal=True):
    """MultiHeadAttention.forward (dropout 0) on ``x [..., T, d_in]``.

    ``num_kv_heads`` (grouped-query attention, not in the book) repeats each key/value head
    for the ``num_heads // num_kv_heads`` query heads that share it.
    """
    x = np.asarray(x, np.float64)
    *batch, num_tokens, _ = x.shape
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    keys, queries, values = (_linear(sd, n, x) for n in ("W_key", "W_query", "W_value"))
    d_out = queries.shape[-1]
    head_dim = d_out // num_heads

    def heads(t, n):  # view(b, T, n, head_dim).transpose(1, 2) -> [..., n, T, head_dim]
        t = t.reshape(*batch, num_tokens, n, head_dim)
        t = np.swapaxes(t, -2, -3)
        return np.repeat(t, num_heads // n, axis=-3)

    keys, values, queries = (
        heads(keys, num_kv_heads),
        heads(values, num_kv_heads),
        heads(queries, num_heads),
    )
    attn_scores = queries @ np.swapaxes(keys, -1, -2)
    if causal:
        mask = np.triu(np.ones((num_tokens, num_tokens)), k=1).astype(bool)
        attn_scores = np.where(mask, -np.inf, attn_scores)
    attn_weights = _softmax(attn_scores / keys.shape[-1] ** 0.5)
    context_vec = np.swapaxes(attn_weights @ values, -2, -3)
    context_vec = context_vec.reshape(*batch, num_tokens, d_out)
    return _linear(sd, "out_proj", context_vec)


def random_state_dict(kind, rng, d_in, d_out, num_heads=1, qkv_bias=False, num_kv_heads=None):
    """A random state dict in the book's PyTorch layout (keys and ``[out, in]`` shapes)."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads

    def arr(*shape):
        return rng.normal(size=shape).astype(np.float32)

    if kind == "SelfAttentionV1":
        return {n: arr(d_in, d_out) for n in ("W_query", "W_key", "W_value")}

    def qkv(d_q, d_kv):
        sd = {"W_query.weight": arr(d_q, d_in)}
        sd |= {f"{n}.weight": arr(d_kv, d_in) for n in ("W_key", "W_value")}
        if qkv_bias:
            sd |= {"W_query.bias": arr(d_q)}
            sd |= {f"{n}.bias": arr(d_kv) for n in ("W_key", "W_value")}
        return sd

    if kind in ("SelfAttentionV2", "CausalAttention"):
        return qkv(d_out, d_out)
    if kind == "MultiHeadAttentionWrapper":
        return {f"heads.{i}.{k}": v for i in range(num_heads) for k, v in qkv(d_out, d_out).items()}
    if kind == "MultiHeadAttention":
        head_dim = d_out // num_heads
        sd = qkv(d_out, num_kv_heads * head_dim)
        return sd | {"out_proj.weight": arr(d_out, d_out), "out_proj.bias": arr(d_out)}
    raise ValueError(kind)
