"""Packed training through the modules and the book's models: ``segment_ids=`` / ``positions=``.

The reference is each document run alone: a packed batch's logits, loss and parameter
gradients must equal those of its documents one by one (positions restart per document,
so RoPE and GPT-2's learned positions see each document as if it were alone).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _book_models_reference import random_state_dict
from flax import linen as nn
from flax import nnx

import jattn
from jattn import linen as jlinen
from jattn import models
from jattn import nnx as jnnx

CFGS = {
    "gpt2": dict(
        vocab_size=97, context_length=32, emb_dim=32, n_heads=4, n_layers=1, drop_rate=0.0,
        qkv_bias=True,
    ),
    "llama3": dict(
        vocab_size=97, context_length=32, emb_dim=32, n_heads=4, n_layers=1, hidden_dim=64,
        n_kv_groups=2, rope_base=500_000.0, dtype="float32",
        rope_freq={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_context_length": 16},
    ),
    "qwen3": dict(
        vocab_size=97, context_length=32, emb_dim=32, n_heads=4, n_layers=1, hidden_dim=64,
        head_dim=16, qk_norm=True, n_kv_groups=2, rope_base=1_000_000.0, dtype="float32",
    ),
}  # fmt: skip
DOC_LENGTHS = (5, 9, 3, 7, 2)  # rows of 16: [5, 9, 2] and [3, 7]


def documents(vocab=97, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in DOC_LENGTHS]


def packed_loss(model, packed):
    """Summed next-token cross-entropy over the packed rows, never across documents."""
    tokens, seg = jnp.asarray(packed.tokens), jnp.asarray(packed.segment_ids)
    logits = model(tokens, segment_ids=seg)  # [R, L, V]
    # A target counts where the next token belongs to the same (real) document.
    valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
    return jnp.sum(jnp.where(valid, ce, 0.0))


def per_document_loss(model, docs):
    total = 0.0
    for doc in docs:
        logits = model(jnp.asarray(doc)[None])[0]  # [n, V]
        total = total + jnp.sum(
            optax.softmax_cross_entropy_with_integer_labels(logits[:-1], jnp.asarray(doc[1:]))
        )
    return total


@pytest.mark.parametrize("arch", ["gpt2", "llama3", "qwen3"])
def test_packed_logits_loss_and_gradients_equal_the_documents_alone(arch):
    cfg = CFGS[arch]
    model = models.from_book(arch, cfg, random_state_dict(arch, cfg, 0))
    docs = documents()
    packed = jattn.pack(docs, 16)
    assert packed.tokens.shape[0] < len(docs)  # several documents share rows
    # Logits, per document (each side one jitted program: eager op-by-op runs of the
    # documents' five lengths compile far more).
    logits = nnx.jit(lambda m, t, s: m(t, segment_ids=s))(model, packed.tokens, packed.segment_ids)
    alone = nnx.jit(lambda m, ds: [m(d[None])[0] for d in ds])(model, docs)
    for got, want in zip(jattn.unpack(packed, logits), alone, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    # The loss and the gradients of every parameter.
    loss_p, grads_p = nnx.jit(nnx.value_and_grad(packed_loss))(model, packed)
    loss_d, grads_d = nnx.jit(nnx.value_and_grad(per_document_loss))(model, docs)
    np.testing.assert_allclose(loss_p, loss_d, rtol=1e-5)
    flat_p, flat_d = jax.tree.leaves(grads_p), jax.tree.leaves(grads_d)
    assert len(flat_p) == len(flat_d) > 0
    for gp, gd in zip(flat_p, flat_d, strict=True):
        np.testing.assert_allclose(gp, gd, atol=2e-5 * max(1.0, float(np.abs(gd).max())), rtol=0)


def test_without_segment_ids_packed_documents_leak_into_each_other():
    """The check above can fail: the same rows without segment ids are not the documents."""
    cfg = CFGS["llama3"]
    model = models.from_book("llama3", cfg, random_state_dict("llama3", cfg, 0))
    docs = documents()
    packed = jattn.pack(docs, 16)
    call = nnx.jit(lambda model, tokens, positions=None: model(tokens, positions=positions))
    fourth = jattn.unpack(packed, call(model, packed.tokens, packed.positions))[3]
    assert packed.starts[3] > 0
    assert not np.allclose(fourth, call(model, docs[3][None])[0], atol=1e-3)


def test_explicit_positions_equal_the_derived_ones_and_blockwise_equals_dense():
    cfg = CFGS["qwen3"]
    sd = random_state_dict("qwen3", cfg, 1)
    dense = models.from_book("qwen3", cfg, sd, attention_implementation="dense")
    blockwise = models.from_book("qwen3", cfg, sd, attention_implementation="blockwise")
    packed = jattn.pack(documents(seed=1), 16)
    ref = dense(packed.tokens, segment_ids=packed.segment_ids)
    np.testing.assert_allclose(
        dense(packed.tokens, segment_ids=packed.segment_ids, positions=packed.positions),
        ref,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        blockwise(packed.tokens, segment_ids=packed.segment_ids), ref, atol=2e-5
    )


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(segment_ids=np.zeros((2, 15), np.int32)), ValueError, "broadcastable"),
        (dict(segment_ids=np.zeros((2, 16))), TypeError, "segment_ids must hold integers"),
        (dict(positions=np.full((16,), 32)), ValueError, r"positions must be in \[0, 31\]"),
        (dict(positions=np.full((16,), -1)), ValueError, "positions must be in"),
        # one value per row is not one per token (it would broadcast over the row)
        (dict(positions=np.zeros((2, 1), np.int32)), ValueError, "broadcastable"),
        (dict(segment_ids=np.ones((2, 1), np.int32)), ValueError, "broadcastable"),
        # document 1 again after document 2: attention would join the runs, positions not
        (
            dict(segment_ids=np.repeat([[1, 2, 1, 0]], 4, axis=1).repeat(2, axis=0)),
            ValueError,
            "comes back to document 1 at token 8",
        ),
    ],
)
def test_bad_packed_arguments_are_a_clear_error(kwargs, error, match):
    model = models.from_book("gpt2", CFGS["gpt2"], random_state_dict("gpt2", CFGS["gpt2"], 0))
    with pytest.raises(error, match=match):
        model(np.zeros((2, 16), np.int32), **kwargs)


@pytest.mark.parametrize("name", sorted(CFGS))
def test_traced_segment_ids_that_come_back_give_nan_logits_and_gradients(name):
    """In a jitted training step the ids are traced and the entry cannot read them: the
    program checks them, and a row that comes back to a document after another (without
    positions=) makes the logits and the gradients NaN, where an eager call raises. Ids
    that never come back (in any order: 2 before 1 is fine) give the bits of a call that
    read them at the entry; with positions= given the same row is fine."""
    cfg = CFGS[name]
    model = models.from_book(name, cfg, random_state_dict(name, cfg, 0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 16)), jnp.int32)
    back = np.repeat([[1, 2, 1, 0], [2, 2, 1, 1]], 4, axis=1)  # row 0 comes back to 1
    good = np.repeat([[1, 2, 3, 0], [2, 2, 1, 1]], 4, axis=1)

    def loss(model, seg, positions=None):
        logits = model(tokens, segment_ids=seg, positions=positions)
        return jnp.sum(jnp.sin(logits)), logits

    step = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (_, logits), grads = step(model, jnp.asarray(back))
    assert np.isnan(logits).all()
    read = {  # the embedding rows the batch reads (the others' gradients are 0, rightly)
        "tok_emb": np.unique(tokens),
        "pos_emb": np.unique(jattn.positions_from_segment_ids(back)),
    }
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        table = next((k for k in read if k in jax.tree_util.keystr(path)), None)
        assert np.isnan(g if table is None else g[read[table]]).all(), path
    with pytest.raises(ValueError, match="comes back to document 1"):
        model(tokens, segment_ids=back)

    (_, logits), grads = step(model, jnp.asarray(good))
    (_, want), want_grads = nnx.jit(nnx.value_and_grad(lambda m: loss(m, good), has_aux=True))(
        model
    )  # the ids read at the entry
    np.testing.assert_array_equal(logits, want)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_array_equal(g, ref)

    positions = jnp.asarray(jattn.positions_from_segment_ids(back))
    (_, logits), _ = step(model, jnp.asarray(back), positions)
    assert np.isfinite(logits).all()


def test_a_document_split_in_two_runs_with_explicit_positions_is_one_document():
    """With positions= given, ids are read as attention reads them: document 1 in two
    runs, positions continuing across the gap, equals document 1 alone."""
    model = models.from_book("gpt2", CFGS["gpt2"], random_state_dict("gpt2", CFGS["gpt2"], 0))
    a, b, c = documents()[:3]  # 5, 9 and 3 tokens
    tokens = np.concatenate([a, b, c])[None]
    seg = np.array([[1] * 5 + [2] * 9 + [1] * 3])
    pos = np.array([[*range(5), *range(9), *range(5, 8)]])
    got = np.asarray(model(tokens, segment_ids=seg, positions=pos))[0]
    alone = np.asarray(model(np.concatenate([a, c])[None]))[0]
    np.testing.assert_allclose(got[seg[0] == 1], alone, atol=1e-5)
    np.testing.assert_allclose(got[seg[0] == 2], np.asarray(model(b[None]))[0], atol=1e-5)


def test_packed_arguments_in_decode_mode_are_a_clear_error():
    cfg = CFGS["llama3"]
    model = models.from_book("llama3", cfg, random_state_dict("llama3", cfg, 0))
    model.init_cache(1, 8)
    with pytest.raises(ValueError, match="full-sequence calls"):
        model(np.zeros((1, 4), np.int32), decode=True, segment_ids=np.ones((1, 4), np.int32))


# ----------------------------------------------------------------------------------------
# The modules
# ----------------------------------------------------------------------------------------


def _rows_and_docs(d_in=8, seed=0):
    rng = np.random.default_rng(seed)
    packed = jattn.pack([list(range(n)) for n in (3, 6, 4, 2)], 8)  # 2 rows of 8
    x = jnp.asarray(rng.standard_normal((*packed.tokens.shape, d_in)), jnp.float32)
    docs = jattn.unpack(packed, x)  # each document's inputs [n, d_in]
    return packed, x, docs


def test_nnx_multi_head_attention_with_segment_ids_and_rope_equals_each_document():
    packed, x, docs = _rows_and_docs()
    mha = jnnx.MultiHeadAttention(
        8, 8, 8, 0.0, 2, num_kv_heads=1, rope=jattn.rope.RoPE(), rngs=nnx.Rngs(0)
    )
    out = mha(x, segment_ids=packed.segment_ids, positions=packed.positions)
    for got, doc in zip(jattn.unpack(packed, out), docs, strict=True):
        np.testing.assert_allclose(got, mha(doc[None])[0], atol=1e-5)
    with pytest.raises(ValueError, match=r"segment_ids must be int \[batch..., T\]"):
        mha(x, segment_ids=packed.segment_ids[:, :5])


def test_linen_multi_head_attention_with_segment_ids_equals_each_document():
    packed, x, docs = _rows_and_docs(seed=1)
    mha = jlinen.MultiHeadAttention(d_out=8, context_length=8, dropout=0.0, num_heads=2)
    params = mha.init(jax.random.key(0), x, deterministic=True)
    apply = jax.jit(mha.apply)  # one program a shape instead of eager operations
    out = apply(params, x, segment_ids=packed.segment_ids)
    for got, doc in zip(jattn.unpack(packed, out), docs, strict=True):
        np.testing.assert_allclose(got, apply(params, doc[None])[0], atol=1e-5)
    assert isinstance(mha, nn.Module)
