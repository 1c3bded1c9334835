"""The five classes of the chapter as test cases: how to build each in Linen and NNX.

One table so test_linen, test_nnx, test_convert and test_torch_crosscheck build the same
modules the same way. ``d_out`` is the class's own (per head for the wrapper).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from _book_reference import book_causal, book_mha, book_v1, book_v2, book_wrapper, random_state_dict
from flax import nnx

from jattn import linen as L
from jattn import nnx as N

CLASSES = (
    "SelfAttentionV1",
    "SelfAttentionV2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
)
CAUSAL_CLASSES = CLASSES[2:]


@dataclasses.dataclass(frozen=True)
class Case:
    """One class with one configuration."""

    kind: str
    d_in: int = 3
    d_out: int = 4
    context_length: int = 6
    dropout: float = 0.0
    num_heads: int = 2
    qkv_bias: bool = False
    num_kv_heads: int | None = None
    extra: tuple = ()  # extra keyword arguments as (name, value) pairs

    @property
    def causal(self) -> bool:
        return dict(self.extra).get("is_causal", True) and self.kind in CAUSAL_CLASSES

    def linen(self):
        kw = dict(self.extra)
        if self.kind == "SelfAttentionV1":
            return L.SelfAttentionV1(self.d_out, **kw)
        if self.kind == "SelfAttentionV2":
            return L.SelfAttentionV2(self.d_out, self.qkv_bias, **kw)
        if self.kind == "CausalAttention":
            return L.CausalAttention(
                self.d_out, self.context_length, self.dropout, self.qkv_bias, **kw
            )
        if self.kind == "MultiHeadAttentionWrapper":
            return L.MultiHeadAttentionWrapper(
                self.d_out, self.context_length, self.dropout, self.num_heads, self.qkv_bias, **kw
            )
        return L.MultiHeadAttention(
            self.d_out,
            self.context_length,
            self.dropout,
            self.num_heads,
            self.qkv_bias,
            num_kv_heads=self.num_kv_heads,
            **kw,
        )

    def nnx(self, rngs=None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        kw = dict(self.extra) | {"rngs": rngs}
        if self.kind == "SelfAttentionV1":
            return N.SelfAttentionV1(self.d_in, self.d_out, **kw)
        if self.kind == "SelfAttentionV2":
            return N.SelfAttentionV2(self.d_in, self.d_out, self.qkv_bias, **kw)
        if self.kind == "CausalAttention":
            return N.CausalAttention(
                self.d_in, self.d_out, self.context_length, self.dropout, self.qkv_bias, **kw
            )
        if self.kind == "MultiHeadAttentionWrapper":
            return N.MultiHeadAttentionWrapper(
                self.d_in,
                self.d_out,
                self.context_length,
                self.dropout,
                self.num_heads,
                self.qkv_bias,
                **kw,
            )
        return N.MultiHeadAttention(
            self.d_in,
            self.d_out,
            self.context_length,
            self.dropout,
            self.num_heads,
            self.qkv_bias,
            num_kv_heads=self.num_kv_heads,
            **kw,
        )

    def state_dict(self, rng: np.random.Generator) -> dict:
        """Random weights in the book's PyTorch layout."""
        heads = self.num_heads if self.kind in CLASSES[3:] else 1
        return random_state_dict(
            self.kind, rng, self.d_in, self.d_out, heads, self.qkv_bias, self.num_kv_heads
        )

    def reference(self, sd, x):
        """The numpy transcription of the book's forward pass."""
        if self.kind == "SelfAttentionV1":
            return book_v1(sd, x)
        if self.kind == "SelfAttentionV2":
            return book_v2(sd, x)
        if self.kind == "CausalAttention":
            return book_causal(sd, x, self.causal)
        if self.kind == "MultiHeadAttentionWrapper":
            return book_wrapper(sd, x, self.num_heads, self.causal)
        return book_mha(sd, x, self.num_heads, self.num_kv_heads, self.causal)

    def call_kwargs(self, **kw) -> dict:
        """Keyword arguments only the classes with dropout accept (dropped for v1/v2)."""
        return kw if self.kind in CAUSAL_CLASSES else {}


# Every class, with and without bias, plus grouped-query and leaky variants.
FORWARD_CASES = (
    [Case(kind) for kind in CLASSES]
    + [Case(kind, qkv_bias=True) for kind in CLASSES[1:]]
    + [
        Case("MultiHeadAttention", d_out=8, num_heads=4, num_kv_heads=2),
        Case("MultiHeadAttention", d_out=6, num_heads=3, num_kv_heads=1, qkv_bias=True),
        Case("CausalAttention", extra=(("is_causal", False),)),
        Case("MultiHeadAttentionWrapper", extra=(("is_causal", False),)),
        Case("MultiHeadAttention", extra=(("is_causal", False),)),
    ]
)


def case_id(case: Case) -> str:
    parts = [case.kind]
    if case.qkv_bias:
        parts.append("bias")
    if case.num_kv_heads:
        parts.append(f"gqa{case.num_heads}-{case.num_kv_heads}")
    parts += [f"{k}={v}" for k, v in case.extra]
    return "-".join(parts)
