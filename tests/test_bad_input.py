"""The bad-input audit: every public function, class and CLI flag of jattn, given wrong input.

Each case states the function, the bad input, the error it must raise and an excerpt of the
message (which names the argument and, where there is one, the fix). The same table is
docs/errors.md: ``python tests/test_bad_input.py > docs/errors.md`` regenerates it, and
:func:`test_errors_page_is_current` fails when the two differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli import load_train_toy
from _fake_devices import run_checks
from flax import nnx
from jax.sharding import Mesh

import jattn
from jattn import causality, convert, kernels, kvcache, masks, mods, paged, ring
from jattn import generate as gen
from jattn import linen as jl
from jattn import nnx as jn
from jattn.rope import RoPE
from jattn.toy import CopyTask, TextTask, TinyGPT, TinyGPTConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
    function: str  # as a user calls it
    bad: str  # what is wrong
    error: type[Exception]
    excerpt: str  # a plain substring of the message
    call: Callable[[], object]

    def __str__(self):
        return f"{self.function}: {self.bad}"


# ----------------------------------------------------------------------------------------
# Inputs the cases share (modules and variables built on first use)
# ----------------------------------------------------------------------------------------

KEY = jax.random.key(0)
Q = jnp.ones((2, 4, 2, 8))  # [batch, T, heads, head_dim]
X = jnp.ones((2, 4, 6))  # module input [batch, T, d_in]
dpa = jattn.dot_product_attention


def dpa_with(**kwargs):
    return lambda: dpa(Q, Q, Q, **kwargs)


def interpret_mode(on: bool, call):
    """``call`` with JATTN_PALLAS_INTERPRET set to 1 (``on``) or unset, whatever the env says."""

    def run():
        saved = os.environ.pop(kernels.INTERPRET_ENV, None)
        if on:
            os.environ[kernels.INTERPRET_ENV] = "1"
        try:
            return call()
        finally:
            os.environ.pop(kernels.INTERPRET_ENV, None)
            if saved is not None:
                os.environ[kernels.INTERPRET_ENV] = saved

    return run


def kernel_call(name, **kwargs):
    """``implementation=name`` in interpret mode: past the device check, to the option's refusal."""
    return interpret_mode(True, dpa_with(implementation=name, **kwargs))


@functools.cache
def linen_mha(dropout=0.1):
    module = jl.MultiHeadAttention(8, 4, dropout, 2)
    return module, module.init(KEY, X, deterministic=True)


def linen_call(x=X, **kwargs):
    module, variables = linen_mha()
    return lambda: module.apply(variables, x, **{"deterministic": True} | kwargs)


@functools.cache
def linen_decoder():
    module = jl.MultiHeadAttention(8, 4, 0.0, 2, decode=True)
    return module, module.init(KEY, X)


def linen_decode_overflow():
    module = jl.MultiHeadAttention(8, 4, 0.0, 2, decode=True)
    variables = module.init(KEY, X)  # a cache of capacity 4
    _, state = module.apply(variables, X, mutable=["cache"])  # full
    module.apply({**variables, **state}, X[:, :1], mutable=["cache"])


def nnx_mha(dropout=0.1, **kwargs):
    return jn.MultiHeadAttention(6, 8, 4, dropout, 2, rngs=nnx.Rngs(0), **kwargs)


def nnx_decode(*chunks, num_new=None):
    module = nnx_mha(0.0)
    module.init_cache((2, 4, 6))
    for chunk in chunks:
        module(chunk, decode=True, num_new=num_new)


def rope_mha(api):
    """A call of a MultiHeadAttention with RoPE on X, taking the call's keyword arguments."""
    if api == "nnx":
        return functools.partial(nnx_mha(0.0, rope=RoPE()), X)
    module = jl.MultiHeadAttention(8, 4, 0.0, 2, rope=RoPE())
    variables = module.init(KEY, X)
    return functools.partial(module.apply, variables, X)


CACHE = kvcache.init_cache(2, 4, 1, 4)  # batch 2, capacity 4, 1 head of width 4
CHUNK = jnp.ones((2, 2, 1, 4))
ROLLING = kvcache.init_cache(2, 4, 1, 4, rolling=True)
# a paged cache: 2 rows, a pool of 4 pages of 2 positions, 2 pages per row, none allocated
PAGED = paged.init_paged_cache(2, 4, 2, 2, 1, 4)
OWNED = PAGED._replace(page_table=jnp.array([[0, 1], [2, 3]], jnp.int32))  # all allocated
# one row holding 127 positions on pages of 2 (work-list blocks of 128 positions)
LONG = paged.init_paged_cache(1, 80, 2, 80, 1, 4)._replace(
    page_table=jnp.arange(80, dtype=jnp.int32)[None], lengths=jnp.array([127], jnp.int32)
)


LOGITS = jnp.ones((2, 5))
PROMPT = jnp.ones((2, 3), jnp.int32)
SEQ = jnp.ones((4, 3))  # [T, features] for the causality probes


def sample(logits=LOGITS, **kwargs):
    return lambda: gen.sample_next(logits, KEY, **{"temperature": 1.0} | kwargs)


def forward_fn(params, tokens):
    return jnp.zeros((*tokens.shape, 5))


def decode_fn(params, tokens, cache, num_new):
    return jnp.zeros((*tokens.shape, 5)), cache


def recompute(prompt=PROMPT, *args, fn=forward_fn, **kwargs):
    return lambda: gen.generate_recompute(fn, None, prompt, *args, **{"max_new_tokens": 2} | kwargs)


STATE_DICT = {
    "W_query.weight": np.ones((4, 3), np.float32),
    "W_key.weight": np.ones((4, 3), np.float32),
    "W_value.weight": np.ones((4, 3), np.float32),
    "out_proj.weight": np.ones((4, 4), np.float32),
    "out_proj.bias": np.ones(4, np.float32),
}


def ones(*shape):
    return np.ones(shape, np.float32)


# The bonus notebook's layouts (mha-implementations.ipynb), d_in = d_out = 4.
QKV_STATE_DICT = {"qkv.weight": ones(12, 4), "proj.weight": ones(4, 4), "proj.bias": ones(4)}
TORCH_MHA_STATE_DICT = {
    "multihead_attn.in_proj_weight": ones(12, 4),
    "multihead_attn.out_proj.weight": ones(4, 4),
    "proj.weight": ones(4, 4),
    "proj.bias": ones(4),
}
EINSUM_STATE_DICT = {n: ones(4, 4) for n in ("W_query", "W_key", "W_value")} | {
    "out_proj.weight": ones(4, 4),
    "out_proj.bias": ones(4),
}
CH03_WRAPPER_STATE_DICT = {
    f"heads.{i}.{n}.weight": ones(2, 4) for i in range(2) for n in ("W_query", "W_key", "W_value")
} | {"out_proj.weight": ones(4, 4), "out_proj.bias": ones(4)}


def from_torch_sd(sd, module=None):
    return lambda: convert.from_torch_state_dict(sd, module)


def from_torch(replace=None, drop=(), module=None):
    sd = {k: v for k, v in STATE_DICT.items() if k not in drop} | (replace or {})
    return lambda: convert.from_torch_state_dict(sd, module)


def mha_variables():
    return convert.from_torch_state_dict(STATE_DICT)


def nnx_mha_for_state_dict():
    return jn.MultiHeadAttention(3, 4, 4, 0.0, 2, rngs=nnx.Rngs(0))


def cumsum(x):
    return jnp.cumsum(x, axis=-2)


def probe(x=SEQ, fn=cumsum, **kwargs):
    return lambda: causality.dependence_matrix(fn, x, **kwargs)


MESH = Mesh(np.array(jax.devices()[:1]), ("seq",))


def ring_call(q=Q, k=Q, **kwargs):
    return lambda: ring.ring_attention(q, k, k, **{"mesh": MESH} | kwargs)


@functools.cache
def tiny_gpt():
    cfg = TinyGPTConfig(5, 8, d_model=8, num_layers=1, num_heads=2, dropout=0.0)
    model = TinyGPT(cfg)
    return model, model.init(KEY, jnp.zeros((1, 8), jnp.int32))


def gpt_call(tokens):
    def call():
        model, variables = tiny_gpt()
        return model.apply(variables, tokens)

    return call


def viz():
    pytest.importorskip("matplotlib")
    from jattn import viz

    return viz


# ----------------------------------------------------------------------------------------
# The audit
# ----------------------------------------------------------------------------------------

V, T = ValueError, TypeError

CASES = [
    # masks
    Case("causal_mask", "q_len=0", V, "q_len must be >= 1", lambda: masks.causal_mask(0)),
    Case("causal_mask", "q_len=3.0 (a float)", T, "q_len must be a Python int", lambda: masks.causal_mask(3.0)),
    Case("causal_mask", "kv_len=-2", V, "kv_len must be >= 1", lambda: masks.causal_mask(3, -2)),
    Case("causal_mask", "a traced q_len (under jit)", T, "Sizes decide array shapes", lambda: jax.jit(masks.causal_mask)(3)),
    Case("causal_mask", "offset=0.5 (a float)", T, "offset must be an int or an int array", lambda: masks.causal_mask(3, offset=0.5)),
    Case("sliding_window_mask", "local_window_size=(-1, 0)", V, "local_window_size[0] (left) must be >= 0", lambda: masks.sliding_window_mask(3, local_window_size=(-1, 0))),
    Case("sliding_window_mask", "local_window_size=(1, 1.5)", T, "local_window_size[1] (right) must be a Python int", lambda: masks.sliding_window_mask(3, local_window_size=(1, 1.5))),
    Case("sliding_window_mask", "no window", T, "sliding_window_mask needs local_window_size", lambda: masks.sliding_window_mask(3)),
    Case("lengths_to_valid", "float lengths", T, "lengths must hold integers", lambda: masks.lengths_to_valid(jnp.array([1.0]), 3)),
    Case("lengths_to_valid", "max_len=0", V, "max_len must be >= 1", lambda: masks.lengths_to_valid(jnp.array([1]), 0)),
    Case("padding_mask", "an int query_valid", T, "query_valid must be a boolean array", lambda: masks.padding_mask(jnp.ones((2, 3), int))),
    Case("padding_mask", "a scalar key_valid", V, "key_valid must have shape [batch..., length]", lambda: masks.padding_mask(None, jnp.array(True))),
    Case("padding_mask_from_lengths", "query_lengths without q_len", V, "q_len is required with query_lengths", lambda: masks.padding_mask_from_lengths(jnp.array([1]))),
    Case("padding_mask_from_lengths", "key_lengths without kv_len", V, "kv_len is required with key_lengths", lambda: masks.padding_mask_from_lengths(key_lengths=jnp.array([1]))),
    Case("segment_mask", "float ids", T, "query_segment_ids must hold integers", lambda: masks.segment_mask(jnp.ones((2, 3)))),
    Case("segment_mask", "batch dims that differ", V, "must share batch dims", lambda: masks.segment_mask(jnp.ones((2, 3), int), jnp.ones((3, 3), int))),
    Case("combine_masks", "a complex mask", T, "combine_masks argument 0 must be boolean", lambda: masks.combine_masks(jnp.ones((2, 2), jnp.complex64))),
    Case("combine_masks", "an additive float mask", V, "looks like an additive mask", lambda: masks.combine_masks(None, jnp.array([[0.0, -jnp.inf]]))),
    Case("combine_masks", "shapes that do not broadcast", V, "mask shapes do not broadcast", lambda: masks.combine_masks(jnp.ones((2, 2), bool), jnp.ones((3, 3), bool))),
    Case("large_negative", "an int dtype", T, "dtype must be a floating dtype", lambda: masks.large_negative(jnp.int32)),
    Case("large_negative", "a misspelt dtype", T, "dtype must be a floating dtype such as jnp.float32", lambda: masks.large_negative("flaot32")),
    Case("large_negative", "float64 with jax_enable_x64 off", V, "needs 64-bit mode", lambda: masks.large_negative(jnp.float64)),
    Case("mask_to_bias", "an int mask", T, "mask must be boolean", lambda: masks.mask_to_bias(jnp.ones(2, int))),
    # dot_product_attention (and its weights, dropout, the chapter's simplified forms)
    Case("dot_product_attention", "int query (token ids)", T, "query must have a floating dtype", lambda: dpa(Q.astype(int), Q, Q)),
    Case("dot_product_attention", "complex key", T, "key must have a floating dtype", lambda: dpa(Q, Q.astype(jnp.complex64), Q)),
    Case("dot_product_attention", "bool value", T, "value must have a floating dtype", lambda: dpa(Q, Q, Q.astype(bool))),
    Case("dot_product_attention", "query=None", T, "query is required", lambda: dpa(None, Q, Q)),
    Case("dot_product_attention", "rank-2 query (heads not split)", V, "Split heads first", lambda: dpa(Q[0, :, 0], Q[0, :, 0], Q[0, :, 0])),
    Case("dot_product_attention", "ranks that differ", V, "must have the same rank", lambda: dpa(Q, Q[0], Q[0])),
    Case("dot_product_attention", "batch dims that differ", V, "must share batch dims", lambda: dpa(Q, jnp.ones((3, 4, 2, 8)), jnp.ones((3, 4, 2, 8)))),
    Case("dot_product_attention", "key and value of different lengths", V, "key and value must have the same length", lambda: dpa(Q, Q, jnp.ones((2, 5, 2, 8)))),
    Case("dot_product_attention", "head_dim of query != key", V, "the same head_dim", lambda: dpa(Q, jnp.ones((2, 4, 2, 7)), jnp.ones((2, 4, 2, 7)))),
    Case("dot_product_attention", "heads not a multiple of kv heads", V, "must be a multiple of the number of key/value heads", lambda: dpa(Q, jnp.ones((2, 4, 3, 8)), jnp.ones((2, 4, 3, 8)))),
    Case("dot_product_attention", "zero-length sequence", V, "lengths, heads and head_dim must be >= 1", lambda: dpa(jnp.ones((2, 0, 2, 8)), Q, Q)),
    Case("dot_product_attention", "mask that does not broadcast", V, "does not broadcast to the attention logits shape", dpa_with(mask=jnp.ones((3, 4), bool))),
    Case("dot_product_attention", "complex mask", T, "mask must be boolean", dpa_with(mask=jnp.ones((4, 4), jnp.complex64))),
    Case("dot_product_attention", "mask='causal' (a string)", T, "use is_causal=True", dpa_with(mask="causal")),
    Case("dot_product_attention", "the book's triu buffer (True = hide)", V, "is the book's causal buffer triu(ones(T, T), diagonal=1)", dpa_with(mask=jnp.triu(jnp.ones((4, 4)), k=1))),
    Case("dot_product_attention", "an additive float mask (0 / -inf)", V, "looks like an additive mask", dpa_with(mask=jnp.where(jnp.tril(jnp.ones((4, 4), bool)), 0.0, -jnp.inf))),
    Case("dot_product_attention", "[batch, heads, T, head_dim] inputs with a mask", V, "the book's (PyTorch's) [batch, heads, T, head_dim] layout", lambda: dpa(jnp.ones((2, 2, 4, 8)), jnp.ones((2, 2, 4, 8)), jnp.ones((2, 2, 4, 8)), mask=jnp.ones((4, 4), bool))),
    Case("dot_product_attention", "int bias", T, "bias must be a float array", dpa_with(bias=jnp.ones((4, 4), int))),
    Case("dot_product_attention", "bias that does not broadcast", V, "bias of shape (5, 4) does not broadcast", dpa_with(bias=jnp.ones((5, 4)))),
    Case("dot_product_attention", "dropout_rate=1.0", V, "dropout_rate must be in [0, 1)", dpa_with(dropout_rate=1.0, dropout_rng=KEY)),
    Case("dot_product_attention", "dropout_rate=-0.1", V, "dropout_rate must be in [0, 1)", dpa_with(dropout_rate=-0.1)),
    Case("dot_product_attention", "dropout_rate=nan", V, "dropout_rate must be in [0, 1)", dpa_with(dropout_rate=float("nan"))),
    Case("dot_product_attention", "dropout_rate='0.1' (a string)", T, "dropout_rate must be a float", dpa_with(dropout_rate="0.1")),
    Case("dot_product_attention", "dropout on, no dropout_rng", V, "Pass `dropout_rng=jax.random.key(seed)`", dpa_with(dropout_rate=0.1)),
    Case("dot_product_attention", "dropout_rng=0 (an int)", T, "dropout_rng must be one jax.random key", dpa_with(dropout_rate=0.1, dropout_rng=0)),
    Case("dot_product_attention", "a batch of keys as dropout_rng", T, "jax.vmap the call", dpa_with(dropout_rate=0.1, dropout_rng=jax.random.split(KEY, 2))),
    Case("dot_product_attention", "float array as dropout_rng", T, "dropout_rng must be one jax.random key", dpa_with(dropout_rate=0.1, dropout_rng=jnp.ones(2))),
    Case("dot_product_attention", "broadcast_dropout='x'", V, "broadcast_dropout must be True, False, 'batch' or 'heads'", dpa_with(broadcast_dropout="x")),
    Case("dot_product_attention", "scale=nan", V, "scale must be a finite number", dpa_with(scale=float("nan"))),
    Case("dot_product_attention", "scale=jnp.array(inf)", V, "scale must be finite, got an array holding inf", dpa_with(scale=jnp.array(jnp.inf))),
    Case("dot_product_attention", "scale='a'", T, "scale must be a number", dpa_with(scale="a")),
    Case("dot_product_attention", "a vector scale", T, "scale must be a number", dpa_with(scale=jnp.ones(3))),
    Case("dot_product_attention", "is_causal='yes'", T, "is_causal must be a Python bool", dpa_with(is_causal="yes")),
    Case("dot_product_attention", "local_window_size=-1", V, "local_window_size[0] (left) must be >= 0", dpa_with(local_window_size=-1)),
    Case("dot_product_attention", "local_window_size=1.5", T, "local_window_size must be an int or a (left, right) pair", dpa_with(local_window_size=1.5)),
    Case("dot_product_attention", "local_window_size=(1, 2, 3)", T, "local_window_size must be an int or a (left, right) pair", dpa_with(local_window_size=(1, 2, 3))),
    Case("dot_product_attention", "query_seq_lengths of the wrong shape", V, "query_seq_lengths must have the batch shape (2,)", dpa_with(query_seq_lengths=jnp.array([1, 2, 3]))),
    Case("dot_product_attention", "float query_seq_lengths", T, "query_seq_lengths must hold integers", dpa_with(query_seq_lengths=jnp.array([1.0, 2.0]))),
    Case("dot_product_attention", "negative query_seq_lengths", V, "query_seq_lengths must be in [0, 4]", dpa_with(query_seq_lengths=jnp.array([-1, 2]))),
    Case("dot_product_attention", "key_value_seq_lengths > kv_len", V, "key_value_seq_lengths must be in [0, 4]", dpa_with(key_value_seq_lengths=jnp.array([9, 2]))),
    Case("dot_product_attention", "float query_segment_ids", T, "query_segment_ids must hold integers", dpa_with(query_segment_ids=jnp.ones((2, 4)))),
    Case("dot_product_attention", "query_segment_ids of the wrong shape", V, "query_segment_ids must have shape [batch..., length]", dpa_with(query_segment_ids=jnp.ones((2, 5), int))),
    Case("dot_product_attention", "key_value_segment_ids alone", V, "needs query_segment_ids too", dpa_with(key_value_segment_ids=jnp.ones((2, 4), int))),
    Case("dot_product_attention", "query_segment_ids only, q_len != kv_len", V, "key_value_segment_ids is required when q_len", lambda: dpa(Q, Q[:, :3], Q[:, :3], query_segment_ids=jnp.ones((2, 4), int))),
    Case("dot_product_attention", "implementation='flash'", V, "implementation must be None (automatic) or one of 'dense', 'blockwise', 'xla'", dpa_with(implementation="flash")),
    Case("dot_product_attention", "implementation='blockwise' with a traced scale", V, "implementation='blockwise' cannot be used here", lambda: jax.jit(lambda s: dpa(Q, Q, Q, scale=s, implementation="blockwise"))(0.5)),
    Case("dot_product_attention", "implementation='blockwise', return_weights=True", V, "need the full [q_len, kv_len] weight matrix", dpa_with(implementation="blockwise", return_weights=True)),
    Case("dot_product_attention", "implementation='blockwise', mask that does not broadcast", V, "does not broadcast to the attention logits shape", dpa_with(implementation="blockwise", mask=jnp.ones((3, 4), bool))),
    Case("dot_product_attention", "implementation='blockwise', dropout without a key", V, "no random key was given", dpa_with(implementation="blockwise", dropout_rate=0.5)),
    Case("dot_product_attention", "implementation='splash' on CPU, JATTN_PALLAS_INTERPRET unset", V, "set JATTN_PALLAS_INTERPRET=1 to run it in interpret mode", interpret_mode(False, dpa_with(implementation="splash"))),
    Case("dot_product_attention", "implementation='pallas_triton' on CPU, JATTN_PALLAS_INTERPRET unset", V, "it runs on GPU only, not on cpu (set JATTN_PALLAS_INTERPRET=1", interpret_mode(False, dpa_with(implementation="pallas_triton"))),
    Case("dot_product_attention", "implementation='cudnn' on CPU", V, "it needs an NVIDIA GPU of compute capability >= 8.0", dpa_with(implementation="cudnn")),
    Case("dot_product_attention", "implementation='splash' with a mask array", V, "cannot be used here: a mask array (only causal, window, lengths and segment ids are built in). Use implementation=None (automatic: the fastest path that can) or 'blockwise' or 'dense'", kernel_call("splash", mask=jnp.ones((4, 4), bool))),
    Case("dot_product_attention", "implementation='splash' with dropout", V, "dropout (jattn's explicit-key dropout lives in its own paths)", kernel_call("splash", dropout_rate=0.1, dropout_rng=KEY)),
    Case("dot_product_attention", "implementation='pallas_triton' with a bias", V, "a bias array. Use implementation=None (automatic: the fastest path that can) or 'blockwise' or 'dense'", kernel_call("pallas_triton", bias=jnp.zeros((4, 4)))),
    Case("dot_product_attention", "implementation='splash', return_weights=True", V, "return_weights=True and module= need the full [q_len, kv_len] weight matrix", kernel_call("splash", return_weights=True)),
    Case("dot_product_attention", "implementation='splash', return_residual=True", V, "return_residual=True (splash does not return its log-sum-exp)", kernel_call("splash", return_residual=True)),
    Case("dot_product_attention", "implementation='pallas_triton', a traced scale (under jit)", V, "a traced scale (the kernel compiles the scale in)", interpret_mode(True, lambda: jax.jit(lambda s: dpa(Q, Q, Q, scale=s, implementation="pallas_triton"))(0.5))),
    Case("dot_product_attention", "implementation='splash' in float16", V, "dtype float16 (splash computes in bfloat16 or float32)", kernel_call("splash", dtype=jnp.float16)),
    Case("dot_product_attention", "dtype=jnp.int32", T, "dtype must be a floating dtype", dpa_with(dtype=jnp.int32)),
    Case("dot_product_attention", "dtype=float64 with jax_enable_x64 off", V, "dtype=float64 needs 64-bit mode", dpa_with(dtype=jnp.float64)),
    # dot_product_attention: score and mask modifiers, sinks, block masks (jattn.mods)
    Case("dot_product_attention", "score_mod=2.0 (not a function)", T, "score_mod must be a function (score, b, h, q_idx, kv_idx)", dpa_with(score_mod=2.0)),
    Case("dot_product_attention", "score_mod with 4 arguments", T, "score_mod must take 5 positional arguments", dpa_with(score_mod=lambda s, b, h, q: s)),
    Case("dot_product_attention", "score_mod returning ints", T, "score_mod must return floating scores", dpa_with(score_mod=lambda s, b, h, q, k: q - k)),
    Case("dot_product_attention", "score_mod adding a whole [q_len, kv_len] array", V, "score_mod must be elementwise", dpa_with(score_mod=lambda s, b, h, q, k: s + jnp.ones((1, 1, 4, 4)))),
    Case("dot_product_attention", "score_mod that fails when traced", T, "score_mod failed when traced on abstract inputs", dpa_with(score_mod=lambda s, b, h, q, k: s @ jnp.ones(3))),
    Case("dot_product_attention", "mask_mod with 5 arguments", T, "mask_mod must take 4 positional arguments (b, h, q_idx, kv_idx)", dpa_with(mask_mod=lambda s, b, h, q, k: q >= k)),
    Case("dot_product_attention", "mask_mod returning floats", T, "mask_mod must return booleans (True = attend)", dpa_with(mask_mod=lambda b, h, q, k: (q >= k) * 1.0)),
    Case("dot_product_attention", "mask_mod returning a whole [q_len, kv_len] mask", V, "mask_mod must be elementwise", dpa_with(mask_mod=lambda b, h, q, k: jnp.ones((4, 4), bool))),
    Case("dot_product_attention", "a score_mod passed as mask_mod", T, "mask_mod must take 4 positional arguments", dpa_with(mask_mod=mods.softcap(2.0))),
    Case("dot_product_attention", "alibi slopes for 3 heads (the call has 2)", V, "alibi slopes must have one entry per query head: 3 for 2 heads", dpa_with(score_mod=mods.alibi(jnp.ones(3)))),
    Case("dot_product_attention", "relative_bias table for 3 heads", V, "relative_bias table [num_buckets, num_heads] must have one entry per query head", dpa_with(score_mod=mods.relative_bias(jnp.ones((8, 3)), max_distance=16))),
    Case("dot_product_attention", "document ids of the wrong length", V, "document segment ids have 5 positions but the call's q_len is 4", dpa_with(mask_mod=mods.document(jnp.zeros((2, 5), int)))),
    Case("dot_product_attention", "document ids for 3 sequences (the batch has 2)", V, "document segment_ids has 3 batch rows (flattened) but the call has 2", dpa_with(mask_mod=mods.document(jnp.zeros((3, 4), int)))),
    Case("dot_product_attention", "prefix_lm lengths for 3 sequences", V, "prefix_lm prefix_lengths has 3 batch rows", dpa_with(mask_mod=mods.prefix_lm(jnp.array([1, 2, 3])))),
    Case("dot_product_attention", "sinks of shape [1]", V, "sinks must have shape [num_heads] = (2,)", dpa_with(sinks=jnp.zeros(1))),
    Case("dot_product_attention", "int sinks", T, "sinks must be a float array of per-head logits", dpa_with(sinks=jnp.zeros(2, int))),
    Case("dot_product_attention", "block_mask=a bool array", T, "block_mask must be built by jattn.block_mask", dpa_with(block_mask=jnp.ones((4, 4), bool))),
    Case("dot_product_attention", "block_mask built for other lengths", V, "block_mask was built for q_len=8, kv_len=8 but the call has q_len=4", lambda: dpa(Q, Q, Q, block_mask=jattn.block_mask(mods.causal(), q_len=8))),
    Case("dot_product_attention", "block_mask built for another batch", V, "block_mask was built for batch 3 and 1 heads", lambda: dpa(Q, Q, Q, block_mask=jattn.block_mask(mods.document(jnp.zeros((3, 4), int)), q_len=4, batch_shape=3))),
    Case("dot_product_attention", "block_mask with another mask_mod", V, "mask_mod and block_mask disagree", lambda: dpa(Q, Q, Q, mask_mod=mods.sliding_window(1), block_mask=jattn.block_mask(mods.causal(), q_len=4))),
    Case("kvcache.update_and_attend", "a block_mask", T, "takes no block_mask", lambda: kvcache.update_and_attend(kvcache.init_cache(2, 4, 2, 8), Q[:, :1], Q[:, :1], Q[:, :1], block_mask=None)),
    Case("dot_product_attention_weights", "int query", T, "query must have a floating dtype", lambda: jattn.dot_product_attention_weights(Q.astype(int), Q)),
    Case("dot_product_attention_weights", "dropout_rate=2", V, "dropout_rate must be in [0, 1)", lambda: jattn.dot_product_attention_weights(Q, Q, dropout_rate=2)),
    Case("dot_product_attention_weights", "sinks of shape [3]", V, "sinks must have shape [num_heads] = (2,)", lambda: jattn.dot_product_attention_weights(Q, Q, sinks=jnp.zeros(3))),
    Case("dot_product_attention_weights", "mask_mod=True (not a function)", T, "mask_mod must be a function (b, h, q_idx, kv_idx)", lambda: jattn.dot_product_attention_weights(Q, Q, mask_mod=True)),
    # jattn.mods: ready-made modifiers, and jattn.block_mask
    Case("mods.softcap", "cap=0", V, "softcap cap must be > 0 and finite", lambda: mods.softcap(0)),
    Case("mods.softcap", "cap='a'", T, "softcap cap must be a Python number", lambda: mods.softcap("a")),
    Case("mods.alibi", "slopes of shape [2, 2]", V, "alibi slopes must have shape [num_heads]", lambda: mods.alibi(jnp.ones((2, 2)))),
    Case("mods.alibi", "int slopes", T, "alibi slopes must have a floating dtype", lambda: mods.alibi(jnp.ones(2, int))),
    Case("mods.alibi_slopes", "num_heads=0", V, "num_heads must be >= 1", lambda: mods.alibi_slopes(0)),
    Case("mods.relative_bias", "a table of rank 1", V, "relative_bias table must have shape [num_buckets, num_heads]", lambda: mods.relative_bias(jnp.ones(8))),
    Case("mods.relative_bias", "2 buckets, bidirectional", V, "relative_bias needs at least 4 buckets", lambda: mods.relative_bias(jnp.ones((2, 2)))),
    Case("mods.relative_bias", "max_distance within the exact buckets", V, "max_distance must be larger than the 8 exact-distance buckets", lambda: mods.relative_bias(jnp.ones((32, 2)), max_distance=8)),
    Case("mods.sliding_window", "left=-1", V, "sliding_window left must be >= 0", lambda: mods.sliding_window(-1)),
    Case("mods.sliding_window", "right=1.5", T, "sliding_window right must be a Python int", lambda: mods.sliding_window(2, 1.5)),
    Case("mods.prefix_lm", "float lengths", T, "prefix_lengths must hold integers", lambda: mods.prefix_lm(jnp.array([1.0]))),
    Case("mods.prefix_lm", "negative lengths", V, "prefix_lengths must be in [0, 2147483647]", lambda: mods.prefix_lm(np.array([-1, 2]))),
    Case("mods.document", "float ids", T, "segment_ids must hold integers", lambda: mods.document(jnp.ones((2, 4)))),
    Case("mods.document", "a scalar id", V, "segment_ids must have shape [batch..., length]", lambda: mods.document(3)),
    Case("mods.document", "kv ids with other batch dims", V, "segment_ids and kv_segment_ids must share batch dims", lambda: mods.document(jnp.zeros((2, 4), int), jnp.zeros((3, 4), int))),
    Case("mods.and_masks", "no masks", V, "and_masks needs at least one modifier", lambda: mods.and_masks()),
    Case("mods.compose", "a number among the score_mods", T, "compose: argument 1 is not a function", lambda: mods.compose(mods.softcap(1.0), 3)),
    Case("block_mask", "q_len=0", V, "q_len must be >= 1", lambda: jattn.block_mask(mods.causal(), q_len=0)),
    Case("block_mask", "block_q=0", V, "block_q must be >= 1", lambda: jattn.block_mask(mods.causal(), q_len=4, block_q=0)),
    Case("block_mask", "a mask_mod varying over b, no batch_shape", V, "mask_mod varies over the batch index b: pass batch_shape=", lambda: jattn.block_mask(mods.document(jnp.zeros((2, 4), int)), q_len=4)),
    Case("block_mask", "a mask_mod varying over h, no num_heads", V, "mask_mod varies over the head index h: pass num_heads=", lambda: jattn.block_mask(lambda b, h, q, k: k <= q + h, q_len=4)),
    Case("block_mask", "a score_mod in place of the mask_mod", T, "mask_mod must take 4 positional arguments", lambda: jattn.block_mask(mods.softcap(2.0), q_len=4)),
    Case("dropout", "rate=1.0", V, "rate must be in [0, 1)", lambda: jattn.dropout(jnp.ones(3), 1.0, rng=KEY)),
    Case("dropout", "int x", T, "x must have a floating dtype", lambda: jattn.dropout(jnp.ones(3, int), 0.5, rng=KEY)),
    Case("dropout", "no rng", V, "Pass `rng=jax.random.key(seed)`", lambda: jattn.dropout(jnp.ones(3), 0.5)),
    Case("dropout", "broadcast_dims=(5,) on a vector", V, "broadcast_dims (5,) name an axis outside x's 1 axes", lambda: jattn.dropout(jnp.ones(3), 0.5, rng=KEY, broadcast_dims=(5,))),
    Case("simplified_self_attention", "a vector", V, "inputs must have shape [batch..., num_tokens, d]", lambda: jattn.simplified_self_attention(jnp.ones(3))),
    Case("simplified_self_attention", "int inputs", T, "inputs must have a floating dtype", lambda: jattn.simplified_self_attention(jnp.ones((3, 3), int))),
    Case("simplified_self_attention_loop", "a batch", V, "takes one sequence [num_tokens, d]", lambda: jattn.simplified_self_attention_loop(jnp.ones((2, 3, 3)))),
    # Linen modules
    Case("linen.MultiHeadAttention", "flax's keywords (qkv_features=)", T, "takes the book's arguments, not flax's", lambda: jl.MultiHeadAttention(num_heads=2, qkv_features=8)),
    Case("linen.MultiHeadAttention", "an annotated kernel_init with model_axis", V, "kernel_init carries sharding annotations", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, model_axis="model", kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "x")))),
    Case("linen.MultiHeadAttention", "d_out=0", V, "MultiHeadAttention: d_out must be >= 1", lambda: jl.MultiHeadAttention(0, 4, 0.0, 2)),
    Case("linen.MultiHeadAttention", "d_out=8.0", T, "d_out must be a Python int", lambda: jl.MultiHeadAttention(8.0, 4, 0.0, 2)),
    Case("linen.MultiHeadAttention", "d_out not divisible by num_heads", V, "must be divisible by num_heads", lambda: jl.MultiHeadAttention(6, 4, 0.0, 4)),
    Case("linen.MultiHeadAttention", "dropout=1.0", V, "dropout must be in [0, 1)", lambda: jl.MultiHeadAttention(8, 4, 1.0, 2)),
    Case("linen.MultiHeadAttention", "dropout='0.1'", T, "dropout must be a float in [0, 1)", lambda: jl.MultiHeadAttention(8, 4, "0.1", 2)),
    Case("linen.MultiHeadAttention", "context_length=0", V, "context_length must be >= 1", lambda: jl.MultiHeadAttention(8, 0, 0.0, 2)),
    Case("linen.MultiHeadAttention", "num_kv_heads not dividing num_heads", V, "must be a multiple of num_kv_heads", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, num_kv_heads=3)),
    Case("linen.MultiHeadAttention", "dtype=jnp.int32", T, "MultiHeadAttention: dtype must be a floating dtype", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, dtype=jnp.int32)),
    Case("linen.MultiHeadAttention", "softcap=0.0", V, "MultiHeadAttention: softcap must be > 0 and finite", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, softcap=0.0)),
    Case("linen.MultiHeadAttention", "score_mod=1.0 (not a function)", T, "MultiHeadAttention: score_mod must be a function", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, score_mod=1.0)),
    Case("nnx.MultiHeadAttention", "sinks='yes'", T, "MultiHeadAttention: sinks", lambda: nnx_mha(sinks="yes")),
    Case("linen.MultiHeadAttention", "param_dtype=float64 with jax_enable_x64 off", V, "param_dtype=float64 needs 64-bit mode", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, param_dtype=jnp.float64)),
    Case("linen.MultiHeadAttention", "attention_implementation='flash'", V, "attention_implementation must be None (automatic) or one of", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, attention_implementation="flash")),
    Case("linen.MultiHeadAttention", "model_axis=3", T, "model_axis must be the name of a mesh axis", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, model_axis=3).init(KEY, X)),
    Case("linen.MultiHeadAttention", "more tokens than context_length", V, "but context_length is 4. Truncate the input", linen_call(jnp.ones((2, 5, 6)))),
    Case("linen.MultiHeadAttention", "int x (token ids)", T, "Token ids must go through an embedding first", linen_call(jnp.ones((2, 4), int))),
    Case("linen.MultiHeadAttention", "a vector x", V, "(rank >= 2)", linen_call(jnp.ones(6))),
    Case("linen.MultiHeadAttention", "x with no tokens", V, "x must hold at least one token", linen_call(jnp.ones((2, 0, 6)))),
    Case("linen.MultiHeadAttention", "x wider than the parameters' d_in", V, "the parameters were initialized for d_in = 6", linen_call(jnp.ones((2, 4, 5)))),
    Case("linen.MultiHeadAttention", "apply(params) instead of apply({'params': params})", V, "not the params dict itself", lambda: linen_mha()[0].apply(linen_mha()[1]["params"], X, deterministic=True)),
    Case("linen.MultiHeadAttention", "dropout > 0, deterministic given nowhere", V, "no `deterministic` was given", linen_call(deterministic=None)),
    Case("linen.MultiHeadAttention", "training call without a dropout key", V, "pass `rngs={'dropout': key}`", linen_call(deterministic=False)),
    Case("linen.MultiHeadAttention", "mask that does not broadcast", V, "does not broadcast to the attention logits shape", linen_call(mask=jnp.ones((3, 3), bool))),
    Case("linen.MultiHeadAttention", "num_new outside decode mode", V, "only used in decode mode", linen_call(num_new=jnp.array([1, 2]))),
    Case("linen.MultiHeadAttention", "decode=True, cache overflow", V, "KV cache overflow", linen_decode_overflow),
    Case("linen.MultiHeadAttention", "decode=True, mutable=['cache'] but no cache from init", V, "the variables hold no 'cache' collection", lambda: linen_decoder()[0].apply({"params": linen_decoder()[1]["params"]}, X[:, :1], mutable=["cache"])),
    Case("linen.MultiHeadAttention", "params made with qkv_bias=True, module without", V, "the params do not fit this module's options", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2).apply(jl.MultiHeadAttention(8, 4, 0.0, 2, qkv_bias=True).init(KEY, X), X)),
    Case("linen.MultiHeadAttention", "decode=True without mutable=['cache']", V, "mutable=['cache']) with the cache from init", lambda: linen_decoder()[0].apply(linen_decoder()[1], X[:, :1])),
    Case("linen.MultiHeadAttention", "decode=True, params only, cache not mutable", V, "decode=True reads and extends the 'cache' collection", lambda: linen_decoder()[0].apply({"params": linen_decoder()[1]["params"]}, X[:, :1])),
    Case("linen.MultiHeadAttention", "broadcast_dropout='x'", V, "broadcast_dropout must be True, False", lambda: jl.MultiHeadAttention(8, 4, 0.1, 2, broadcast_dropout="x").init(KEY, X, deterministic=False, dropout_rng=KEY)),
    Case("linen.MultiHeadAttention", "head_dim=0", V, "MultiHeadAttention: head_dim must be >= 1", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, head_dim=0)),
    Case("linen.MultiHeadAttention", "head_dim=4.0 (a float)", T, "head_dim must be a Python int", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, head_dim=4.0)),
    Case("linen.MultiHeadAttention", "odd head_dim with rope", V, "head_dim (3) must be even with rope=", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, head_dim=3, rope=RoPE())),
    Case("linen.MultiHeadAttention", "rope=10000.0 (not a RoPE)", T, "rope must be a jattn.rope.RoPE", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, rope=10_000.0)),
    Case("linen.MultiHeadAttention", "qk_norm_eps=0", V, "qk_norm_eps must be > 0 and finite", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, qk_norm=True, qk_norm_eps=0.0)),
    Case("linen.MultiHeadAttention", "qk_norm='yes'", T, "qk_norm must be a Python bool", lambda: jl.MultiHeadAttention(8, 4, 0.0, 2, qk_norm="yes")),
    Case("linen.MultiHeadAttention", "positions without rope", V, "positions is only used with rope=", linen_call(positions=jnp.arange(4))),
    Case("linen.MultiHeadAttention", "float positions", T, "positions must hold integers", lambda: rope_mha("linen")(positions=jnp.arange(4.0))),
    Case("linen.MultiHeadAttention", "positions of another length than x", V, "positions must be int [batch..., T] broadcastable to (2, 4)", lambda: rope_mha("linen")(positions=jnp.arange(3))),
    Case("linen.CausalAttention", "dropout=-0.1", V, "CausalAttention: dropout must be in [0, 1)", lambda: jl.CausalAttention(4, 4, -0.1)),
    Case("linen.MultiHeadAttentionWrapper", "num_heads=0", V, "MultiHeadAttentionWrapper: num_heads must be >= 1", lambda: jl.MultiHeadAttentionWrapper(4, 4, 0.0, 0)),
    Case("linen.SelfAttentionV1", "d_out=-1", V, "SelfAttentionV1: d_out must be >= 1", lambda: jl.SelfAttentionV1(-1)),
    Case("linen.SelfAttentionV2", "int x", T, "SelfAttentionV2: x must be a float array", lambda: jl.SelfAttentionV2(2).init(KEY, jnp.ones((3, 3), int))),
    # NNX modules
    Case("nnx.MultiHeadAttention", "flax's keywords (in_features=)", T, "in_features -> d_in", lambda: jn.MultiHeadAttention(in_features=8, num_heads=2, rngs=nnx.Rngs(0))),
    Case("nnx.MultiHeadAttention", "x of shape [batch, d_in, T]", V, "pass jnp.swapaxes(x, -1, -2)", lambda: jn.MultiHeadAttention(6, 8, 8, 0.0, 2, rngs=nnx.Rngs(0))(jnp.ones((2, 6, 4)))),
    Case("nnx.MultiHeadAttention", "d_in=0", V, "MultiHeadAttention: d_in must be >= 1", lambda: jn.MultiHeadAttention(0, 8, 4, 0.0, 2, rngs=nnx.Rngs(0))),
    Case("nnx.MultiHeadAttention", "attention_implementation='flash'", V, "attention_implementation must be None (automatic) or one of", lambda: jn.MultiHeadAttention(6, 8, 4, 0.0, 2, attention_implementation="flash", rngs=nnx.Rngs(0))),
    Case("nnx.MultiHeadAttention", "rngs=0 (not an nnx.Rngs)", T, "rngs must be an nnx.Rngs (e.g. rngs=nnx.Rngs(0)", lambda: jn.MultiHeadAttention(6, 8, 4, 0.0, 2, rngs=0)),
    Case("nnx.MultiHeadAttention", "x of another width than d_in", V, "x must have d_in = 6 features", lambda: nnx_mha()(jnp.ones((2, 4, 5)), deterministic=True)),
    Case("nnx.MultiHeadAttention", "more tokens than context_length", V, "but context_length is 4", lambda: nnx_mha()(jnp.ones((2, 5, 6)), deterministic=True)),
    Case("nnx.MultiHeadAttention", "dropout > 0, deterministic set nowhere", V, "no `deterministic` was given", lambda: nnx_mha()(X)),
    Case("nnx.MultiHeadAttention", "training call, keep_rngs=False, no rngs", V, "pass `rngs=nnx.Rngs(dropout=seed)`", lambda: nnx_mha(keep_rngs=False)(X, deterministic=False)),
    Case("nnx.MultiHeadAttention", "rngs='a' at the call", T, "rngs must be an nnx.Rngs, an nnx.RngStream or a jax.random key", lambda: nnx_mha()(X, deterministic=False, rngs="a")),
    Case("nnx.MultiHeadAttention", "decode=True before init_cache", V, "call init_cache(input_shape) first", lambda: nnx_mha()(X, deterministic=True, decode=True)),
    Case("nnx.MultiHeadAttention.init_cache", "capacity > context_length", V, "capacity 5 exceeds context_length 4", lambda: nnx_mha().init_cache((2, 5, 6))),
    Case("nnx.MultiHeadAttention.init_cache", "d_in of another width", V, "input_shape must be (batch..., capacity, d_in=6)", lambda: nnx_mha().init_cache((2, 4, 5))),
    Case("nnx.MultiHeadAttention.init_cache", "input_shape=7", T, "input_shape must be a tuple (batch..., capacity, d_in)", lambda: nnx_mha().init_cache(7)),
    Case("nnx.MultiHeadAttention.init_cache", "dtype=jnp.int32", T, "dtype must be a floating dtype", lambda: nnx_mha().init_cache((2, 4, 6), dtype=jnp.int32)),
    Case("nnx.MultiHeadAttention", "decode past the cache's capacity", V, "KV cache overflow", lambda: nnx_decode(X, X[:, :1])),
    Case("nnx.MultiHeadAttention", "decode with num_new > chunk length", V, "num_new must be in [0, 4]", lambda: nnx_decode(X, num_new=jnp.array([5, 1]))),
    Case("nnx.MultiHeadAttention", "decode with float num_new", T, "num_new must hold integers", lambda: nnx_decode(X, num_new=jnp.array([1.0, 1.0]))),
    Case("nnx.MultiHeadAttention", "decode with another batch size", V, "to match the cache", lambda: nnx_decode(jnp.ones((3, 1, 6)))),
    Case("nnx.MultiHeadAttention", "head_dim=-2", V, "MultiHeadAttention: head_dim must be >= 1", lambda: nnx_mha(0.0, head_dim=-2)),
    Case("nnx.MultiHeadAttention", "odd head_dim with rope", V, "head_dim (5) must be even with rope=", lambda: nnx_mha(0.0, head_dim=5, rope=RoPE())),
    Case("nnx.MultiHeadAttention", "rope={'theta_base': 1e4} (a dict)", T, "rope must be a jattn.rope.RoPE", lambda: nnx_mha(0.0, rope={"theta_base": 1e4})),
    Case("nnx.MultiHeadAttention", "qk_norm_eps=-1e-6", V, "qk_norm_eps must be > 0 and finite", lambda: nnx_mha(0.0, qk_norm=True, qk_norm_eps=-1e-6)),
    Case("nnx.MultiHeadAttention", "qk_norm_eps='1e-6'", T, "qk_norm_eps must be a float > 0", lambda: nnx_mha(0.0, qk_norm=True, qk_norm_eps="1e-6")),
    Case("nnx.MultiHeadAttention", "out_bias=None", T, "out_bias must be a Python bool", lambda: nnx_mha(0.0, out_bias=None)),
    Case("nnx.MultiHeadAttention", "positions without rope", V, "positions is only used with rope=", lambda: nnx_mha(0.0)(X, positions=jnp.arange(4))),
    Case("nnx.MultiHeadAttention", "positions with too many batch dims", V, "broadcastable to (2, 4)", lambda: rope_mha("nnx")(positions=jnp.zeros((3, 2, 4), int))),
    Case("nnx.SelfAttentionV1", "dtype='flaot32'", T, "SelfAttentionV1: dtype must be a floating dtype such as", lambda: jn.SelfAttentionV1(3, 4, dtype="flaot32", rngs=nnx.Rngs(0))),
    # kvcache
    Case("kvcache.init_cache", "capacity=0", V, "capacity must be >= 1", lambda: kvcache.init_cache(2, 0, 1, 4)),
    Case("kvcache.init_cache", "batch_shape=2.0", T, "batch_shape must be an int or a tuple of ints", lambda: kvcache.init_cache(2.0, 4, 1, 4)),
    Case("kvcache.init_cache", "batch_shape=(-1,)", V, "batch_shape[0] must be >= 1", lambda: kvcache.init_cache((-1,), 4, 1, 4)),
    Case("kvcache.init_cache", "dtype=jnp.int32", T, "dtype must be a floating dtype", lambda: kvcache.init_cache(2, 4, 1, 4, dtype=jnp.int32)),
    Case("kvcache.init_cache", "dtype=float64 with jax_enable_x64 off", V, "needs 64-bit mode", lambda: kvcache.init_cache(2, 4, 1, 4, dtype=jnp.float64)),
    Case("kvcache.append", "a tuple instead of a KVCache", T, "cache must be a jattn.kvcache.KVCache", lambda: kvcache.append(tuple(CACHE), CHUNK, CHUNK)),
    Case("kvcache.append", "keys with another head count", V, "to match the cache", lambda: kvcache.append(CACHE, jnp.ones((2, 2, 2, 4)), jnp.ones((2, 2, 2, 4)))),
    Case("kvcache.append", "int keys", T, "key must have a floating dtype", lambda: kvcache.append(CACHE, CHUNK.astype(int), CHUNK)),
    Case("kvcache.append", "a chunk longer than the room left", V, "KV cache overflow", lambda: kvcache.append(CACHE, jnp.ones((2, 5, 1, 4)), jnp.ones((2, 5, 1, 4)))),
    Case("kvcache.append", "negative num_new", V, "num_new must be in [0, 2]", lambda: kvcache.append(CACHE, CHUNK, CHUNK, num_new=jnp.array([-1, 1]))),
    Case("kvcache.append", "num_new of the wrong shape", V, "num_new must have the batch shape (2,)", lambda: kvcache.append(CACHE, CHUNK, CHUNK, num_new=jnp.array([1, 1, 1]))),
    Case("kvcache.append", "float num_new", T, "num_new must hold integers", lambda: kvcache.append(CACHE, CHUNK, CHUNK, num_new=jnp.array([1.0, 1.0]))),
    Case("kvcache.append", "a cache with float lengths", T, "cache.lengths must hold integers", lambda: kvcache.append(CACHE._replace(lengths=jnp.zeros(2)), CHUNK, CHUNK)),
    Case("kvcache.attend", "query_seq_lengths= (attend builds the mask)", T, "builds the decoding mask itself", lambda: kvcache.attend(CACHE, CHUNK, starts=CACHE.lengths, query_seq_lengths=CACHE.lengths)),
    Case("kvcache.attend", "a query of another batch size", V, "query must have shape", lambda: kvcache.attend(CACHE, jnp.ones((3, 1, 1, 4)), starts=CACHE.lengths)),
    Case("kvcache.attend", "float starts", T, "starts must hold integers", lambda: kvcache.attend(CACHE, CHUNK, starts=jnp.zeros(2))),
    Case("kvcache.attend", "starts of the wrong shape", V, "starts must have the batch shape (2,)", lambda: kvcache.attend(CACHE, CHUNK, starts=jnp.zeros(3, int))),
    Case("kvcache.attend", "local_window_size=-1", V, "local_window_size[0] (left) must be >= 0", lambda: kvcache.attend(CACHE, CHUNK, starts=CACHE.lengths, local_window_size=-1)),
    Case("kvcache.fits", "float num_new", T, "num_new must hold integers", lambda: kvcache.fits(CACHE, 1.5)),
    Case("kvcache.init_cache", "rolling=1 (not a bool)", T, "rolling must be a Python bool", lambda: kvcache.init_cache(2, 4, 1, 4, rolling=1)),
    Case("kvcache.update_and_attend", "rolling cache, window wider than its capacity", V, "exceeds the rolling cache's capacity (4)", lambda: kvcache.update_and_attend(ROLLING, CHUNK, CHUNK, CHUNK, local_window_size=(5, 0))),
    Case("kvcache.attend", "a rolling cache", T, "Use update_and_attend()", lambda: kvcache.attend(ROLLING, CHUNK, starts=ROLLING.lengths)),
    Case("kvcache.rolling_mask", "float starts", T, "starts must hold integers", lambda: kvcache.rolling_mask(jnp.zeros(2), 2, 4)),
    Case("kvcache.rolling_mask", "float num_new", T, "num_new must hold integers", lambda: kvcache.rolling_mask(jnp.zeros(2, int), 2, 4, num_new=jnp.ones(2))),
    Case("nnx.MultiHeadAttention.init_cache", "rolling='yes'", T, "rolling must be a Python bool", lambda: nnx_mha().init_cache((2, 4, 6), rolling="yes")),
    Case("kvcache.update_and_attend", "queries of another chunk length than the keys", V, "query and key must hold the same chunk", lambda: kvcache.update_and_attend(CACHE, jnp.ones((2, 1, 1, 4)), CHUNK, CHUNK)),
    Case("kvcache.append", "negative cache.lengths", V, "cache.lengths must be >= 0", lambda: kvcache.append(CACHE._replace(lengths=jnp.array([-1, 0])), CHUNK, CHUNK)),
    # paged
    Case("paged.append", "a chunk onto unallocated pages", V, "is not an allocated page", lambda: paged.append(PAGED, CHUNK, CHUNK)),
    Case("paged.append", "two rows whose tables name one page for the positions they write", V, "which row 1 holds as its position 0", lambda: paged.append(OWNED._replace(page_table=jnp.array([[0, 1], [0, 3]])), CHUNK, CHUNK)),
    Case("paged.update_and_attend", "a row writing a shared prefix page another row holds", V, "pages shared by rows (a common prefix) are read-only", lambda: paged.update_and_attend(OWNED._replace(page_table=jnp.array([[0, 1], [0, 3]]), lengths=jnp.array([1, 2])), CHUNK[:, :1], CHUNK[:, :1], CHUNK[:, :1])),
    Case("paged.append", "int keys", T, "key must have a floating dtype", lambda: paged.append(OWNED, CHUNK.astype(int), CHUNK)),
    Case("paged.append", "negative cache.lengths", V, "cache.lengths must be >= 0", lambda: paged.append(OWNED._replace(lengths=jnp.array([-1, 0])), CHUNK, CHUNK)),
    Case("paged.update_and_attend", "queries of another chunk length than the keys", V, "query must have shape", lambda: paged.update_and_attend(OWNED, jnp.ones((2, 1, 1, 4)), CHUNK, CHUNK, implementation="xla")),
    Case("paged.update_and_attend", "a misspelt keyword set to None", T, "unexpected keyword arguments ['local_windw_size']", lambda: paged.update_and_attend(OWNED, CHUNK, CHUNK, CHUNK, local_windw_size=None)),
    Case("paged.update_and_attend", "rolling=True", T, "a paged cache has no rolling mode", lambda: paged.update_and_attend(OWNED, CHUNK, CHUNK, CHUNK, rolling=True)),
    Case("paged.update_and_attend", "a work list (cache.blocks) missing a row's block", V, "cache.blocks misses blocks of row 0", lambda: paged.update_and_attend(LONG._replace(blocks=jnp.array([[0, 0]])), CHUNK[:1], CHUNK[:1], CHUNK[:1], implementation="xla")),
    Case("kvcache.decode_mask", "q_len=0", V, "q_len must be >= 1", lambda: kvcache.decode_mask(jnp.zeros(2, int), jnp.zeros(2, int), 0, 4)),
    # generate
    Case("generate.sample_next", "temperature=-1", V, "temperature must be >= 0", sample(temperature=-1.0)),
    Case("generate.sample_next", "temperature=inf", V, "temperature must be >= 0 and finite", sample(temperature=float("inf"))),
    Case("generate.sample_next", "temperature=nan", V, "temperature must be >= 0 and finite", sample(temperature=float("nan"))),
    Case("generate.sample_next", "temperature='1'", T, "temperature must be a float >= 0", sample(temperature="1")),
    Case("generate.sample_next", "top_k=0", V, "top_k must be an int >= 1 or None", sample(top_k=0)),
    Case("generate.sample_next", "top_k=2.5", V, "top_k must be an int >= 1 or None", sample(top_k=2.5)),
    Case("generate.sample_next", "temperature > 0 without a key", V, "needs a random key", lambda: gen.sample_next(jnp.ones((2, 5)), temperature=1.0)),
    Case("generate.sample_next", "key=0 (an int, not a key)", T, "key must be one jax.random key", lambda: gen.sample_next(LOGITS, 0, temperature=1.0)),
    Case("generate.check_stop", "eos_id as a float array", V, "got an array of float32", lambda: gen.check_stop(jnp.array([1.0]), None)),
    Case("generate.sample_next", "int logits", T, "logits must be a float array", sample(jnp.ones((2, 5), int))),
    Case("generate.sample_next", "scalar logits", V, "logits must have shape [batch..., vocab]", sample(jnp.array(1.0))),
    Case("generate.sample_next", "an empty vocabulary", V, "with vocab >= 1", sample(jnp.ones((2, 0)))),
    Case("kernels.cpu.argmax", "int logits", T, "logits must be floating point", lambda: kernels.cpu.argmax(jnp.ones((2, 5), int))),
    Case("kernels.cpu.argmax", "scalar logits", V, "logits must be [batch..., V] with V >= 1", lambda: kernels.cpu.argmax(jnp.array(1.0))),
    Case("kernels.cpu.argmax", "an empty vocabulary", V, "logits must be [batch..., V] with V >= 1", lambda: kernels.cpu.argmax(jnp.ones((2, 0)))),
    Case("generate.generate_recompute", "float prompt", V, "prompt must be int token ids [batch, prompt_len]", recompute(jnp.ones((2, 3)))),
    Case("generate.generate_recompute", "a 1-d prompt", V, "Add a batch axis with prompt[None]", recompute(jnp.ones(3, jnp.int32))),
    Case("generate.generate_recompute", "max_new_tokens=0", V, "max_new_tokens must be >= 1", recompute(max_new_tokens=0)),
    Case("generate.generate_recompute", "prompt_lengths with a 0", V, "prompt_lengths must be in [1, 3]", recompute(prompt_lengths=jnp.array([0, 3]))),
    Case("generate.generate_recompute", "float prompt_lengths", V, "prompt_lengths must be int [batch]", recompute(prompt_lengths=jnp.array([1.0, 3.0]))),
    Case("generate.generate_recompute", "negative token ids", V, "prompt holds negative token ids", recompute(-jnp.ones((2, 3), jnp.int32))),
    Case("generate.generate_recompute", "forward_fn=3", T, "forward_fn must be a function", recompute(fn=3)),
    Case("generate.generate", "decode_fn='model'", T, "decode_fn must be a function", lambda: gen.generate("model", None, {}, jnp.ones((2, 3), jnp.int32), max_new_tokens=1)),
    Case("generate.generate", "a cache too small for prompt + new tokens", V, "the KV cache holds 4 positions per row", lambda: gen.generate(decode_fn, None, {"kv": CACHE}, jnp.ones((2, 3), jnp.int32), max_new_tokens=3)),
    # convert
    Case("convert.to_numpy", "int values", T, "state_dict['w'] must hold floats", lambda: convert.to_numpy(np.ones(3, int), "w")),
    Case("convert.to_numpy", "an Inf", V, "state_dict['w'] holds NaN or Inf values", lambda: convert.to_numpy(np.array([np.inf]), "w")),
    Case("convert.to_numpy", "ragged nested lists", T, "state_dict['w'] cannot be converted to a numpy array", lambda: convert.to_numpy([[1.0], [1.0, 2.0]], "w")),
    Case("convert.from_torch_state_dict", "a list", T, "state_dict must be a mapping", lambda: convert.from_torch_state_dict([1, 2])),
    Case("convert.from_torch_state_dict", "an empty dict", V, "holds no attention parameters", lambda: convert.from_torch_state_dict({})),
    Case("convert.from_torch_state_dict", "an unknown key", V, "state_dict has unknown key 'foo'", from_torch({"foo": np.ones(2)})),
    Case("convert.from_torch_state_dict", "a missing key", V, "state_dict is missing key W_key.weight", from_torch(drop=("W_key.weight",))),
    Case("convert.from_torch_state_dict", "int weights", T, "must hold floats", from_torch({"W_key.weight": np.ones((4, 3), int)})),
    Case("convert.from_torch_state_dict", "NaN weights", V, "holds NaN or Inf values", from_torch({"W_key.weight": np.full((4, 3), np.nan)})),
    Case("convert.from_torch_state_dict", "projections with different in_features", V, "all projections read the same input", from_torch({"W_key.weight": np.ones((4, 2))})),
    Case("convert.from_torch_state_dict", "a bias on one projection only", V, "all three of W_query, W_key and W_value a bias", from_torch({"W_query.bias": np.ones(4)})),
    Case("convert.from_torch_state_dict", "weights that do not fit module=", V, "the module expects (8, 3)", lambda: convert.from_torch_state_dict(STATE_DICT, jl.MultiHeadAttention(8, 4, 0.0, 2))),
    Case("convert.from_torch_state_dict", "module='mha' (not a module)", T, "module must be a jattn.linen or jattn.nnx module", from_torch(module="mha")),
    Case("convert.from_torch_state_dict", "v1 raw matrices mixed with nn.Linear keys", V, "mixes SelfAttention_v1's raw", from_torch({"W_query": np.ones((3, 4))})),
    Case("convert.from_torch_state_dict", "combined qkv.weight with 11 rows", V, "state_dict[qkv.weight] has 11 rows, which is not divisible by 3", from_torch_sd(QKV_STATE_DICT | {"qkv.weight": ones(11, 4)})),
    Case("convert.from_torch_state_dict", "combined qkv weights that do not fit module=", V, "state_dict[qkv.weight] has shape (12, 4), the module expects (24, 4)", from_torch_sd(QKV_STATE_DICT, jl.MultiHeadAttention(8, 4, 0.0, 2))),
    Case("convert.from_torch_state_dict", "qkv.weight beside W_query.weight (two layouts)", V, "state_dict has key 'W_query.weight' beside keys of the bonus notebook's", from_torch_sd(QKV_STATE_DICT | {"W_query.weight": ones(4, 4)})),
    Case("convert.from_torch_state_dict", "nn.MultiheadAttention's bias_k (MHAPyTorchClass, qkv_bias=True)", V, "these weights cannot be loaded exactly", from_torch_sd(TORCH_MHA_STATE_DICT | {"multihead_attn.bias_k": ones(1, 1, 4)})),
    Case("convert.from_torch_state_dict", "MHAPyTorchClass weights, module with d_in != d_out", V, "build the module with d_in == d_out", from_torch_sd(TORCH_MHA_STATE_DICT, jn.MultiHeadAttention(3, 4, 4, 0.0, 2, rngs=nnx.Rngs(0)))),
    Case("convert.from_torch_state_dict", "MHAEinsum with bias_q only", V, "MHAEinsum(qkv_bias=True) has bias_q, bias_k and bias_v", from_torch_sd(EINSUM_STATE_DICT | {"bias_q": ones(4)})),
    Case("convert.from_torch_state_dict", "Ch03_MHA_Wrapper heads != the module's num_heads", V, "state_dict has 2 heads (heads.0 ... heads.1), the module has num_heads=4", from_torch_sd(CH03_WRAPPER_STATE_DICT, jl.MultiHeadAttention(4, 4, 0.0, 4))),
    Case("convert.linen_to_nnx", "params instead of {'params': params}", V, "variables must be Linen variables {'params'", lambda: convert.linen_to_nnx(mha_variables()["params"], nnx_mha_for_state_dict())),
    Case("convert.linen_to_nnx", "a module of another class", V, "has unexpected key out_proj/bias", lambda: convert.linen_to_nnx(mha_variables(), jn.CausalAttention(3, 4, 4, 0.0, rngs=nnx.Rngs(0)))),
    Case("convert.linen_to_nnx", "a Linen module", T, "module must be a jattn.nnx module", lambda: convert.linen_to_nnx(mha_variables(), jl.MultiHeadAttention(4, 4, 0.0, 2))),
    Case("convert.linen_to_nnx", "int parameter values", T, "must hold floats", lambda: convert.linen_to_nnx(jax.tree.map(lambda a: jnp.asarray(a).astype(int), mha_variables()), nnx_mha_for_state_dict())),
    Case("convert.nnx_to_linen", "not an NNX module", T, "module must be a jattn.nnx module", lambda: convert.nnx_to_linen(3)),
    Case("convert.wrapper_to_split", "MultiHeadAttention params", V, "must be MultiHeadAttentionWrapper params", lambda: convert.wrapper_to_split(mha_variables())),
    Case("convert.split_to_wrapper", "num_heads not dividing d_out", V, "num_heads (3) must be >= 1 and divide d_out (4)", lambda: convert.split_to_wrapper(mha_variables(), 3)),
    Case("convert.split_to_wrapper", "num_heads=2.0", T, "num_heads must be a Python int", lambda: convert.split_to_wrapper(mha_variables(), 2.0)),
    Case("convert.split_to_wrapper", "num_kv_heads that do not fit W_key", V, "must divide num_heads (2) and give W_key's width", lambda: convert.split_to_wrapper(mha_variables(), 2, 1)),
    # causality
    Case("causality.dependence_matrix", "method='grad'", V, "method must be 'gradient' or 'perturbation'", probe(method="grad")),
    Case("causality.dependence_matrix", "int x with method='gradient'", T, "use method='perturbation' (with vocab_size=)", probe(jnp.ones((4, 3), int))),
    Case("causality.dependence_matrix", "int x, perturbation, no vocab_size", V, "integer (token) inputs need vocab_size=", probe(jnp.ones((4, 3), int), method="perturbation")),
    Case("causality.dependence_matrix", "in_axis=5", V, "in_axis=5 is not an axis of x", probe(in_axis=5)),
    Case("causality.dependence_matrix", "out_axis=5", V, "out_axis=5 is not an axis of fn(x)", probe(out_axis=5)),
    Case("causality.dependence_matrix", "fn=3", T, "fn must be a function of one array", probe(fn=3)),
    Case("causality.dependence_matrix", "vocab_size=1", V, "vocab_size must be an int >= 2", probe(jnp.ones((4, 3), int), method="perturbation", vocab_size=1)),
    Case("causality.dependence_matrix", "a scalar x", V, "x must have a sequence axis", probe(jnp.array(1.0))),
    Case("causality.dependence_matrix", "fn returning a scalar", V, "fn must return a sequence of outputs", probe(fn=jnp.sum)),
    Case("causality.is_causal", "atol=-1", V, "atol must be >= 0", lambda: causality.is_causal(cumsum, jnp.ones((4, 3)), atol=-1)),
    Case("causality.dependence_matrix", "fn giving NaN (gradient)", V, "is NaN for output position 0 and input position 0", probe(fn=lambda x: jnp.sqrt(x - 2.0))),
    Case("causality.dependence_matrix", "fn giving NaN (perturbation)", V, "is NaN for output position 0 and input position 0", probe(fn=lambda x: jnp.sqrt(x - 2.0), method="perturbation")),
    # ring
    Case("ring.ring_attention", "mesh='m'", T, "mesh must be a jax.sharding.Mesh", ring_call(mesh="m")),
    Case("ring.ring_attention", "seq_axis not in the mesh", V, "seq_axis='x' is not an axis of the mesh", ring_call(seq_axis="x")),
    Case("ring.ring_attention", "head_axis not in the mesh", V, "head_axis='h' is not an axis of the mesh", ring_call(head_axis="h")),
    Case("ring.ring_attention", "batch_axis without batch dims", V, "batch_axis was given but query has no batch dims", ring_call(Q[0], Q[0], batch_axis="seq")),
    Case("ring.ring_attention", "block_q=0", V, "block_q must be >= 1", ring_call(block_q=0)),
    Case("ring.ring_attention", "block_k=2.5", T, "block_k must be a Python int", ring_call(block_k=2.5)),
    Case("ring.ring_attention", "is_causal with q_len != kv_len", V, "needs query and key blocks of the same length", ring_call(k=jnp.ones((2, 8, 2, 8)), is_causal=True)),
    Case("ring.ring_attention", "int query", T, "query must have a floating dtype", ring_call(Q.astype(int))),
    Case("ring.ring_attention_shard", "called outside shard_map", V, "call ring_attention_shard inside jax.shard_map", lambda: ring.ring_attention_shard(Q, Q, Q, axis_name="seq")),
    # viz
    Case("viz.attention_heatmap", "a vector", V, "weights must be a 2-d [q_len, kv_len] array", lambda: viz().attention_heatmap(np.ones(3))),
    Case("viz.attention_heatmap", "one label for three rows", V, "row_tokens has 1 labels but the matrix has 3 positions", lambda: viz().attention_heatmap(np.ones((3, 3)), ["a"])),
    Case("viz.mask_heatmap", "a float mask", T, "mask must be boolean", lambda: viz().mask_heatmap(np.ones((3, 3)))),
    Case("viz.new_figure", "ncols=0", V, "ncols must be an int >= 1", lambda: viz().new_figure(0)),
    Case("viz.line_plot", "a 2-d x", V, "x must be 1-d", lambda: viz().line_plot(np.ones((2, 2)), {"a": np.ones(2)})),
    Case("viz.bar_plot", "a NaN value", V, "values must be finite numbers", lambda: viz().bar_plot({"a": float("nan")})),
    # toy
    Case("toy.TinyGPTConfig", "vocab_size=0", V, "vocab_size must be an int >= 1", lambda: TinyGPTConfig(0, 8)),
    Case("toy.TinyGPTConfig", "mlp_ratio=0", V, "mlp_ratio must be an int >= 1", lambda: TinyGPTConfig(5, 8, mlp_ratio=0)),
    Case("toy.TinyGPTConfig", "dropout='a'", T, "dropout must be a float in [0, 1)", lambda: TinyGPTConfig(5, 8, dropout="a")),
    Case("toy.TinyGPTConfig", "d_model not a multiple of num_heads", V, "d_model (10) must be a multiple of num_heads (4)", lambda: TinyGPTConfig(5, 8, d_model=10, num_heads=4)),
    Case("toy.TinyGPT", "float tokens", T, "TinyGPT takes int token ids", gpt_call(jnp.ones((2, 4)))),
    Case("toy.TinyGPT", "token ids >= vocab_size", V, "outside [0, vocab_size = 5)", gpt_call(jnp.full((2, 4), 7))),
    Case("toy.TinyGPT", "negative token ids", V, "outside [0, vocab_size = 5)", gpt_call(jnp.full((2, 4), -1))),
    Case("toy.TinyGPT", "more tokens than context_length", V, "TinyGPT got 9 tokens but context_length is 8", gpt_call(jnp.ones((2, 9), int))),
    Case("toy.CopyTask", "num_symbols=1", V, "num_symbols must be >= 2", lambda: CopyTask(1)),
    Case("toy.TextTask", "a text shorter than two windows", V, "Use a longer text or a smaller --context-length", lambda: TextTask("abc", context_length=4)),
    Case("toy.TrainConfig", "steps=0", V, "steps must be an int >= 1", lambda: TrainConfig(steps=0)),
    Case("toy.TrainConfig", "learning_rate=nan", V, "learning_rate must be > 0 and finite", lambda: TrainConfig(learning_rate=float("nan"))),
    Case("toy.TrainConfig", "learning_rate='a'", T, "learning_rate must be a number", lambda: TrainConfig(learning_rate="a")),
    Case("toy.TrainConfig", "warmup_steps > steps", V, "warmup_steps must be in [0, steps=10]", lambda: TrainConfig(steps=10, warmup_steps=11)),
    Case("toy.TrainConfig", "warmup_steps=1.5", T, "warmup_steps must be an int", lambda: TrainConfig(warmup_steps=1.5)),
    Case("toy.TrainConfig", "seed='a'", T, "seed must be an int", lambda: TrainConfig(seed="a")),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_raises_a_clear_error(case):
    with pytest.raises(case.error, match=re.escape(case.excerpt)):
        case.call()


# ----------------------------------------------------------------------------------------
# Operands sharded over a mesh's explicit axes (two fake devices, in a process of their own)
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardedCase:
    name: str  # the case's name in tests/_explicit_mesh_checks.py's refusals section
    implementation: str  # the kernel asked for by name
    bad: str  # what about the call the kernel cannot take
    excerpt: str


# Under jax.set_mesh of a mesh ('b',) of 2 devices, jax.make_mesh's default (explicit) axes,
# dot_product_attention at T = 256 (GQA, 4 query heads over 2 kv heads) with operands
# jax.device_put with a NamedSharding; every message also says to call the kernel inside
# jax.shard_map, or to pass implementation=None.
SHARDED_CASES = [
    ShardedCase("score_mod reads h", "cpu_fused", "heads sharded, a score_mod reading its head index", "a score_mod that reads its batch or head index would see a device's own"),
    ShardedCase("mask_mod reads h", "pallas", "heads sharded, a mask_mod reading its head index", "a mask_mod that reads its batch or head index would see a device's own"),
    ShardedCase("block mask per head", "cpu_fused", "heads sharded, a block_mask built from a mask_mod reading its head index", "would see a device's own (the mask_mod the block_mask was built from)"),
    ShardedCase("tokens sharded", "cpu_fused", "the operands sharded along their tokens", "the queries are sharded along their tokens or features"),
    ShardedCase("kv heads split", "cpu_fused", "6 query heads over 3 key/value heads, the heads over 2 devices", "3 key/value heads cannot follow the query heads over 2 devices"),
    ShardedCase("rows past first", "cpu_fused", "batch [2, 2], the second axis sharded, a block_mask of per-row documents", "rows (flattened batch) would split across batch axes past the first"),
    ShardedCase("placed closure", "blockwise", "a mask_mod closing over an array placed on the mesh", "close over an unplaced copy"),
]  # fmt: skip


def test_sharded_operands_a_kernel_cannot_take_are_refused_by_name():
    names = [c.name for c in SHARDED_CASES]
    messages = run_checks(Path(__file__).with_name("_explicit_mesh_checks.py"), "refusals", *names)
    for case in SHARDED_CASES:
        message = messages[case.name]
        assert message.startswith(f"implementation='{case.implementation}' cannot be used here")
        assert case.excerpt in message, (case.name, message)
        assert "Use implementation=None" in message, (case.name, message)
        if case.implementation != "blockwise":
            assert "call it inside jax.shard_map" in message, (case.name, message)


# ----------------------------------------------------------------------------------------
# x64 on: float64 is accepted where it was refused above
# ----------------------------------------------------------------------------------------


def test_float64_is_accepted_with_x64_on():
    with jax.enable_x64(True):
        q = jnp.ones((1, 3, 1, 2), jnp.float64)
        assert dpa(q, q, q, dtype=jnp.float64).dtype == jnp.float64
        assert masks.large_negative(jnp.float64).dtype == jnp.float64
        assert kvcache.init_cache(1, 2, 1, 2, dtype=jnp.float64).keys.dtype == jnp.float64
        module = jl.MultiHeadAttention(4, 3, 0.0, 2, param_dtype=jnp.float64)
        variables = module.init(KEY, jnp.ones((1, 3, 2), jnp.float64))
        assert variables["params"]["W_query"]["kernel"].dtype == jnp.float64


# ----------------------------------------------------------------------------------------
# train_toy.py flags: exit status 2 (or 1) and one line on stderr naming the flag
# ----------------------------------------------------------------------------------------


def _run_cli(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = load_train_toy().main(argv)
        except SystemExit as e:
            status = e.code
    return status, err.getvalue()


@dataclasses.dataclass(frozen=True)
class FlagCase:
    bad: str  # the flags, as a user types them
    status: int
    excerpt: str
    argv: tuple[str, ...] | None = None  # default: bad.split()
    setup: Callable[[Path], list[str]] | None = None  # more argv, made in a fresh folder

    def __str__(self):
        return self.bad


def _occupied(tmp: Path) -> list[str]:
    (tmp / "run").mkdir()
    (tmp / "run" / "config.json").write_text("{}")
    return ["--out", str(tmp / "run")]


def _changed(tmp: Path) -> list[str]:
    (tmp / "run").mkdir()
    (tmp / "run" / "config.json").write_text('{"train": {"steps": 7}}')
    return ["--out", str(tmp / "run"), "--resume"]


def _binary(tmp: Path) -> list[str]:
    (tmp / "b.txt").write_bytes(b"\xff\xfe\x00bad")
    return ["--text", str(tmp / "b.txt")]


def _short(tmp: Path) -> list[str]:
    (tmp / "s.txt").write_text("too short")
    return ["--text", str(tmp / "s.txt"), "--out", str(tmp / "o")]


F = FlagCase
FLAG_CASES = [
    F("--steps 0", 2, "--steps: must be >= 1, got 0"),
    F("--steps ten", 2, "--steps: expected an integer, got 'ten'"),
    F("--lr 0", 2, "--lr: must be > 0, got 0.0"),
    F("--lr abc", 2, "--lr: expected a number, got 'abc'"),
    F("--dropout 1", 2, "--dropout: must be in [0.0, 1.0), got 1.0"),
    F("--weight-decay -1", 2, "--weight-decay: must be in [0.0, inf], got -1.0"),
    F("--clip-norm 0", 2, "--clip-norm: must be > 0, got 0.0"),
    F("--batch-size 0", 2, "--batch-size: must be >= 1, got 0"),
    F("--num-symbols 1", 2, "--num-symbols: must be >= 2, got 1"),
    F("--prefix-len 0", 2, "--prefix-len: must be >= 1, got 0"),
    F("--context-length 1", 2, "--context-length: must be >= 2, got 1"),
    F("--d-model 0", 2, "--d-model: must be >= 1, got 0"),
    F("--num-layers 0", 2, "--num-layers: must be >= 1, got 0"),
    F("--num-heads 0", 2, "--num-heads: must be >= 1, got 0"),
    F("--d-model 10 --num-heads 4", 2, "--d-model (10) must be a multiple of --num-heads (4)"),
    F("--warmup-steps 50 --steps 10", 2, "--warmup-steps (50) must not exceed --steps (10)"),
    F("--warmup-steps -1", 2, "--warmup-steps: must be >= 0, got -1"),
    F("--checkpoint-every 0", 2, "--checkpoint-every: must be >= 1, got 0"),
    F("--eval-every 0", 2, "--eval-every: must be >= 1, got 0"),
    F("--seed x", 2, "--seed: invalid int value: 'x'"),
    F("--runs causal,causal", 2, "--runs: expected distinct names from causal,leaky"),
    F("--runs ''", 2, "--runs: expected distinct names from causal,leaky", ("--runs", "")),
    F("--platform abacus", 2, "--platform: invalid choice: 'abacus'"),
    F("--model-parallel 3 --num-heads 4", 2, "--model-parallel (3) must divide --num-heads (4)"),
    F("--process-id 0", 2, "--coordinator, --num-processes and --process-id go together"),
    F("--resume", 2, "--resume needs --out DIR"),
    F("--text /no/such/file.txt", 2, "--text: no such file: /no/such/file.txt"),
    F("--text <a binary file>", 2, "cannot read", (), _binary),
    F("--text <a file too short>", 1, "Use a longer text or a smaller --context-length", (), _short),
    F("--out <a folder holding a run>", 1, "already holds a run; pass --resume", (), _occupied),
    F("--resume --out <a folder with no run>", 1, "holds no run (no config.json)", ("--resume",),
      lambda tmp: ["--out", str(tmp)]),
    F("--resume --out <a run with other settings>", 1, "the settings differ from the run", (), _changed),
]  # fmt: skip


@pytest.mark.parametrize("case", FLAG_CASES, ids=str)
def test_bad_flag_exits_with_one_line(case, tmp_path):
    argv = [*(case.bad.split() if case.argv is None else case.argv)]
    argv += case.setup(tmp_path) if case.setup else []
    status, err = _run_cli(argv)
    assert status == case.status, err
    assert err.startswith("train_toy.py: error: ") and err.count("\n") == 1, err
    assert case.excerpt in err


# ----------------------------------------------------------------------------------------
# docs/errors.md is this table
# ----------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_errors_page() -> str:
    lines = [
        "# Errors jattn raises on bad input",
        "",
        "Every row is a test (tests/test_bad_input.py): the call, what is wrong with its input,",
        "the exception, and a piece of the message, which names the argument and the fix.",
        "Regenerate this page with `python tests/test_bad_input.py > docs/errors.md`.",
        "",
        f"{len(CASES)} library cases, {len(FLAG_CASES)} `train_toy.py` flag cases and "
        f"{len(SHARDED_CASES)} sharded-operand cases.",
        "",
        "## Library",
        "",
        "| function | bad input | error | message excerpt |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| `{c.function}` | {_cell(c.bad)} | `{c.error.__name__}` | {_cell(c.excerpt)} |"
        for c in CASES
    ]
    lines += [
        "",
        "## `train_toy.py` flags",
        "",
        "Bad flags exit with status 2 before JAX is imported; problems found later (the text",
        "file, the output folder) with status 1. The message is one line on stderr.",
        "",
        "| flags | exit status | message excerpt |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{_cell(c.bad)}` | {c.status} | {_cell(c.excerpt)} |" for c in FLAG_CASES]
    lines += [
        "",
        "## Operands sharded over a mesh's explicit axes",
        "",
        "Under `jax.set_mesh` of a mesh with explicit axes (`jax.make_mesh`'s default), a",
        "kernel without a partitioning rule runs on each device's rows and heads only when",
        "that is the same call. Asked for by name where it is not, it raises `ValueError`",
        "naming why and what to do instead (for the kernels: call them inside `jax.shard_map`",
        "on each device's shard); the automatic rule (`implementation=None`) takes a path",
        "that can. Checked on 2 fake CPU devices, mesh axis `'b'`, `dot_product_attention`",
        "with 4 query heads over 2 key/value heads unless the row says otherwise.",
        "",
        "| implementation | call | message excerpt |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| `{c.implementation}` | {_cell(c.bad)} | {_cell(c.excerpt)} |" for c in SHARDED_CASES
    ]
    lines += [
        "",
        "## Not errors",
        "",
        "* float64 inputs with `jax_enable_x64` off are converted to float32 by JAX itself when",
        "  they become arrays, and attention runs in float32 (asking for `dtype=jnp.float64`",
        "  explicitly is the error above). With x64 on, float64 runs in float64.",
        "* Mixed input dtypes (float16 query, float32 key) are promoted, as `jnp.result_type`.",
        "* Fully masked query rows give zero output and zero weights (and finite gradients).",
        "* Under `jax.jit`, values (lengths, token ids, cache fills) are not known, so the checks",
        "  that read values run only on concrete arrays; shape and dtype checks always run.",
        "  A KV cache that overflows under jit drops the extra tokens (see `jattn.kvcache`).",
        "  Where traced values would change every answer without a sign, the program checks",
        "  them and wrong ones give NaN output and gradients: `varlen_attention`'s",
        "  `cu_seqlens`, and the models' `segment_ids` that come back to a document without",
        "  `positions=`. Token ids and GPT-2 positions outside their tables give NaN (JAX's",
        "  out-of-range gather). Arrays a jitted function closes over are concrete: checked.",
        "",
        "## Training (`train_toy.py`)",
        "",
        "| event | what happens | exit status |",
        "| --- | --- | --- |",
        "| the loss or gradient norm becomes NaN or Inf | the run stops with `training diverged at"
        " step N`; no checkpoint after the last finite step is written, the last good one is"
        " kept | 3 |",
        "| Ctrl-C (SIGINT) | the current step finishes, is logged and checkpointed; `--resume`"
        " continues and ends exactly where an uninterrupted run ends (a second Ctrl-C quits at"
        " once) | 130 |",
        "| the process is killed (SIGKILL) while a checkpoint is written | orbax writes into a"
        " temporary folder renamed only when complete, so `--resume` starts from the last"
        " complete checkpoint | (killed) |",
    ]
    return "\n".join(lines) + "\n"


def test_errors_page_is_current():
    page = (ROOT / "docs" / "errors.md").read_text()
    assert page == render_errors_page(), (
        "docs/errors.md is out of date: python tests/test_bad_input.py > docs/errors.md"
    )


if __name__ == "__main__":
    sys.stdout.write(render_errors_page())
