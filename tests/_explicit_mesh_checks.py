"""Attention and the models on explicitly sharded operands (jax.make_mesh's default axes).

Run as ``python _explicit_mesh_checks.py SECTION [CASE...]`` (2 fake CPU devices, a
``('b',)`` mesh) by tests/test_routing.py (``attention``: the automatic rule, against a
float64 numpy reference computed on the whole arrays, and the kernels by name on each
device's share, with the per-device cases named; ``per_device``: the other per-device
cases named, for the slow leg; ``pallas_per_device``: jattn's Pallas kernel in interpret
mode with dropout and modifiers, about 16 s, for the slow leg), tests/test_models.py
(``models``: the three models' forward and gradient against the unsharded model;
``decoding``: their generation and the NNX module's KV cache against the unsharded ones)
and tests/test_bad_input.py (``refusals``: the messages of the calls named, which a kernel
by name cannot take, for docs/errors.md); prints one JSON object.
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import partial

from _fake_devices import force_cpu_devices

force_cpu_devices(2)

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import np_attention

import jattn
from jattn import _fused_cache, _routing, models
from jattn import nnx as jn
from jattn.kernels.cpu import _library

B, T, H, K, D = 4, 256, 4, 2, 16  # T: past the fused CPU kernel's and blockwise's lengths
TS = 128  # the per-device operand cases' tokens (the kernels by name)
MQA = "one key/value head"  # the per-device case of k and v with one head
SPECS = {"batch": P("b"), "heads": P(None, None, "b")}
OPS = "all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter"
jax.config.update("jax_numpy_rank_promotion", "raise")  # as strict as the test suite
BUILT = _library.library() is not None  # else the automatic rule has no kernel to take
CHOSEN: list[str] = []  # the routes taken, read by a spy on _routing.choose


def _spy(*call):
    CHOSEN.append(_REAL_CHOOSE(*call))
    return CHOSEN[-1]


_REAL_CHOOSE, _routing.choose = _routing.choose, _spy


def operands():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, K, D)).astype(np.float32) for _ in "kv")
    segments = np.repeat(np.arange(4), T // 4)[None].repeat(B, 0).astype(np.int32)
    return q, k, v, segments


def reference(q, k, v, segments):
    """float64 ``(out, d loss / d q)`` of the causal, segment-masked call, loss = sum(out^2):
    the gradient through the weights' Jacobian, row by row."""
    mask = np.tril(np.ones((T, T), bool)) & (segments[:, :, None] == segments[:, None, :])
    mask = mask[:, None]  # [B, 1, T, T]
    out, w = np_attention(q, k, v, mask=mask, return_weights=True)
    d_out = 2 * out
    v_full = np.repeat(np.asarray(v, np.float64), H // K, axis=-2)
    d_w = np.einsum("bthd,bshd->bhts", d_out, v_full)
    d_logits = w * (d_w - (d_w * w).sum(-1, keepdims=True))
    k_full = np.repeat(np.asarray(k, np.float64), H // K, axis=-2)
    return out, np.einsum("bhts,bshd->bthd", d_logits, k_full) / np.sqrt(D)


def attend(implementation, **options):
    def f(q, k, v, segments):
        return jattn.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=segments,
            key_value_segment_ids=segments, implementation=implementation, **options,
        )  # fmt: skip

    return f


# Options whose sharded blockwise result must equal the unsharded one: the same dropout
# mask from the same key, and a per-head modifier seeing the global head index.
OPTIONS = {
    "dropout": dict(dropout_rate=0.2, dropout_rng=jax.random.key(3)),
    "alibi": dict(score_mod=jattn.mods.alibi(jattn.mods.alibi_slopes(H))),
}


# Modifiers that read no batch or head index: a window (cpu_fused reads its block mask) and
# two that jattn's Pallas kernel traces in
WINDOW = jattn.mods.sliding_window(40)
PALLAS_MODS = {
    "score_mod": dict(score_mod=lambda s, b, h, q, kv: s - 0.02 * jnp.abs(q - kv).astype(s.dtype)),
    "mask_mod": dict(mask_mod=lambda b, h, q, kv: (kv < 16) | ((q - kv) % 3 != 1)),
}


# Modifiers a kernel cannot take per device: they see the global batch and head indices.
REFUSED = {
    "score_mod": dict(score_mod=lambda s, b, h, q, kv: s + 0.1 * h),
    "mask_mod": dict(mask_mod=lambda b, h, q, kv: (q + h) % 3 != 0),
    # tiles per head of a mask_mod of the user's that reads its head index
    "block_mask": dict(
        block_mask=jattn.block_mask(lambda b, h, q, kv: q - kv < 8 * (h + 1), q_len=T, num_heads=H)
    ),
}


def spec_of(x) -> list:
    """``x``'s partition spec, names as strings."""
    return [None if s is None else str(s) for s in x.sharding.spec]


def placed(mesh, spec, arrays) -> list:
    """q, k, v sharded by ``spec``; the segment ids by its batch and length entries."""
    sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays[:3]]
    return [*sharded, jax.device_put(arrays[3], NamedSharding(mesh, P(*spec[:2])))]


def summary(out, dq, want) -> dict:
    """Errors against the reference, the result's and gradient's specs, and the routes the
    calls took since the last summary."""
    routes = sorted(set(CHOSEN))
    CHOSEN.clear()
    return {
        "routes": routes,
        "err": float(np.max(np.abs(np.asarray(out, np.float64) - want[0]))),
        "grad_err": float(np.max(np.abs(np.asarray(dq, np.float64) - want[1]))),
        "spec": spec_of(out),
        "grad_spec": spec_of(dq),
    }


def run(f, mesh, spec, arrays):
    args = placed(mesh, spec, arrays)
    loss = jax.jit(jax.grad(lambda q, *rest: jnp.sum(f(q, *rest) ** 2)))
    with jax.set_mesh(mesh):
        return jax.jit(f)(*args), loss(*args)


def collectives(mesh, spec, arrays) -> list[str]:
    """The element types the compiled forward and gradient of the automatic rule's call
    move between devices: each device computes its own rows or heads, so only blockwise's
    tile schedule (bool flags per tile, shared by the batch) may travel."""
    f = attend(None)
    args = placed(mesh, spec, arrays)
    grad = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))
    with jax.set_mesh(mesh):
        texts = [jax.jit(g).lower(*args).compile().as_text() for g in (f, grad)]
    CHOSEN.clear()
    return moved_types(*texts)


def moved_types(*texts) -> list[str]:
    """The element types the collectives of compiled programs ``texts`` move."""
    moved = []
    for text in texts:
        for result in re.findall(rf"= (.*?) (?:{OPS})(?:-start)?\(", text):
            moved += re.findall(r"(\w+)\[", result)
    return sorted(set(moved))


def with_options(mesh, spec, arrays) -> dict:
    """Max |sharded blockwise - unsharded blockwise| per entry of OPTIONS."""
    errs = {}
    for name, options in OPTIONS.items():
        f = attend("blockwise", **options)
        want = f(*arrays)
        got = run(f, mesh, spec, arrays)[0]
        errs[name] = float(jnp.max(jnp.abs(got - want)))
    CHOSEN.clear()
    return errs


def refused(mesh, spec, arrays, implementation, **options) -> str:
    try:
        run(attend(implementation, **options), mesh, spec, arrays)
    except ValueError as e:
        return str(e)
    finally:
        CHOSEN.clear()
    return ""


def _operand_cases(rng) -> dict:
    """The per-device cases: keyword arguments of ``jattn.dot_product_attention`` beyond
    q, k, v (TS tokens, causal), each an operand the kernel reads per row or per head."""
    ts = TS
    bias = rng.normal(size=(B, 1, ts, ts)).astype(np.float32)
    shared_bias = rng.normal(size=(1, H, ts, ts)).astype(np.float32)
    mask = rng.random((B, 1, ts, ts)) < 0.8
    segments = np.repeat(np.arange(2), ts // 2)[None].repeat(B, 0).astype(np.int32)
    return {
        "bias per row": dict(bias=bias),
        "bias shared by the rows": dict(bias=shared_bias),
        "mask and lengths": dict(
            mask=mask,
            query_seq_lengths=np.array([ts, 100, 64, 1], np.int32),
            key_value_seq_lengths=np.array([ts, 90, ts, 40], np.int32),
        ),
        "sinks": dict(sinks=rng.normal(size=(H,)).astype(np.float32)),
        "two segment arrays": dict(
            query_segment_ids=segments, key_value_segment_ids=segments[:, ::-1].copy()
        ),
        "log-sum-exp": dict(return_residual=True),
        # keyed by the global batch and head indices: each device is given its rows'
        # numbers in the whole call, and ALiBi's slopes split with the heads
        "dropout": dict(dropout_rate=0.3, dropout_rng=jax.random.key(7)),
        "dropout shared by the heads": dict(
            dropout_rate=0.3, dropout_rng=jax.random.key(8), broadcast_dropout="heads"
        ),
        "dropout shared by the rows": dict(
            dropout_rate=0.3, dropout_rng=jax.random.key(9), broadcast_dropout="batch"
        ),
        "alibi": dict(slopes=np.asarray(jattn.mods.alibi_slopes(H))),
        "softcap": dict(score_mod=jattn.mods.softcap(2.0)),
        # tiles of a mask_mod that reads no batch or head index: one state for every device
        "block mask": dict(block_mask=jattn.block_mask(WINDOW, q_len=ts, block_q=32, block_k=32)),
        # tiles per row of packed documents: the tiles and the segment ids split with the rows
        "document block mask": dict(
            block_mask=jattn.block_mask(
                jattn.mods.and_masks(jattn.mods.causal(), jattn.mods.document(documents(rng))),
                q_len=ts,
                batch_shape=B,
                block_q=32,
                block_k=32,
            )
        ),
    }


def documents(rng) -> np.ndarray:
    """Segment ids ``[B, TS]`` of packed documents of random lengths, a different packing
    per row."""
    return np.sort(rng.integers(0, 4, size=(B, TS)), axis=1).astype(np.int32)


def mods_cases(rng) -> dict:
    """jattn.mods' modifiers reading arrays by batch row or head (traced into jattn's Pallas
    kernel): each device is given its rows' or heads' share of the arrays."""
    table = rng.normal(size=(32, H)).astype(np.float32)
    return {
        "relative_bias": dict(score_mod=jattn.mods.relative_bias(table, bidirectional=False)),
        "document": dict(mask_mod=jattn.mods.document(documents(rng))),
        "prefix_lm": dict(
            mask_mod=jattn.mods.prefix_lm(np.array([3, 40, 0, 100], np.int32)), is_causal=False
        ),
    }


def _per_device_case(mesh, q, k, v, options, kernel="cpu_fused") -> dict:
    """``kernel`` by name on operands sharded by each of SPECS against the unsharded dense
    call: per spec, the largest error of the output (and lse) and of every gradient (q, k,
    v, bias, sinks, ALiBi's slopes), relative to the largest entry; the output's spec and
    the route."""
    learned = ("bias", "sinks", "slopes")
    differentiable = {n: jnp.asarray(x) for n, x in options.items() if n in learned}
    fixed = {n: x for n, x in options.items() if n not in differentiable}

    def call(implementation):
        def f(q, k, v, diff):
            given = dict(diff)
            if "slopes" in given:
                given["score_mod"] = jattn.mods.alibi(given.pop("slopes"))
            options = {"is_causal": True, **given, **fixed}  # a case may say is_causal=False
            out = jattn.dot_product_attention(q, k, v, implementation=implementation, **options)
            outs = out if isinstance(out, tuple) else (out,)
            return outs, sum(jnp.sum(jnp.sin(o)) for o in outs)

        return f

    def both(f, *args):
        return f(*args)[0], jax.grad(lambda *a: f(*a)[1], argnums=(0, 1, 2, 3))(*args)

    want = jax.tree.leaves(jax.jit(partial(both, call("dense")))(q, k, v, differentiable))
    CHOSEN.clear()
    result = {}
    for name, spec in SPECS.items():
        with jax.set_mesh(mesh):
            full = (*spec, *(None,) * (4 - len(spec)))
            kv_spec = P(*full[:2], full[2] if k.shape[2] > 1 else None)
            pairs = ((q, spec), (k, kv_spec), (v, kv_spec))
            args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in pairs]
            got = jax.jit(partial(both, call(kernel)))(*args, differentiable)
        pairs = zip(jax.tree.leaves(got), want, strict=True)
        errs = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs]
        result[name] = {"routes": sorted(set(CHOSEN)), "err": max(errs), "spec": spec_of(got[0][0])}
        CHOSEN.clear()
    return result


def per_device(mesh, *names: str) -> dict:
    """``{spec name: {case: result}}``: :func:`_per_device_case` for the cases named, of
    :func:`_operand_cases` (GQA, H heads over K) and "one key/value head" (MQA). The test
    names them: some in the default leg's section, the others in the slow leg's."""
    rng = np.random.default_rng(5)
    q = rng.normal(size=(B, TS, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, TS, K, D)).astype(np.float32) for _ in "kv")
    cases = _operand_cases(rng)
    unknown = set(names) - {*cases, MQA}
    if unknown:
        raise ValueError(f"no per-device cases named {sorted(unknown)}")
    cases = {n: o for n, o in cases.items() if n in names}
    result = _by_spec(mesh, q, k, v, cases, "cpu_fused")
    k, v = (rng.normal(size=(B, TS, 1, D)).astype(np.float32) for _ in "kv")
    one = _by_spec(mesh, q, k, v, {MQA: {}} if MQA in names else {}, "cpu_fused")
    return {name: {**result[name], **one[name]} for name in SPECS}


def per_device_section(mesh, *names: str) -> dict:
    """The slow leg's per-device cases (:func:`per_device`), where the kernel is built,
    laid out as the attention section's: ``{spec name: {"per_device": {case: result}}}``."""
    cases = per_device(mesh, *names) if BUILT else {}
    return {"built": BUILT, **{name: {"per_device": c} for name, c in cases.items()}}


def _by_spec(mesh, q, k, v, cases: dict, kernel: str) -> dict:
    """``{spec name: {case: result}}`` of :func:`_per_device_case` for each of ``cases``."""
    result = {name: {} for name in SPECS}
    for case, options in cases.items():
        for name, got in _per_device_case(mesh, q, k, v, options, kernel).items():
            result[name][case] = got
    return result


def pallas_per_device(mesh) -> dict:
    """``{spec name: {case: result}}``: jattn's Pallas kernel (interpret mode) by name with
    dropout, ALiBi and modifiers of its own on sharded operands (:func:`_per_device_case`)."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=(B, TS, h, D)).astype(np.float32) for h in (H, K, K))
    cases = {n: o for n, o in _operand_cases(rng).items() if n in ("dropout", "alibi")}
    cases.update(PALLAS_MODS)
    cases.update(mods_cases(rng))
    os.environ["JATTN_PALLAS_INTERPRET"] = "1"
    try:
        return _by_spec(mesh, q, k, v, cases, "pallas")
    finally:
        del os.environ["JATTN_PALLAS_INTERPRET"]


def traced_block_masks(mesh) -> dict:
    """Block masks built under jax.jit (their states traced), batch-sharded, against the
    unsharded dense call: cpu_fused by name on each device's share; inside a jax.shard_map
    of the user's (which raised an internal jax error rebuilding the state on the host);
    and a mask_mod closing over a traced array, or over one placed on the mesh, which
    jax.shard_map cannot close over: the automatic rule takes another path, and the kernel
    by name says why."""
    q = np.random.default_rng(8).normal(size=(B, TS, H, D)).astype(np.float32)
    keep = jnp.arange(TS) % 5 != 0
    placed = jax.device_put(keep, NamedSharding(mesh, P()))  # on the mesh, replicated

    @partial(jax.jit, static_argnums=(2, 3))
    def f(q, keep, implementation, closure):
        if closure == "placed":  # a concrete array of the mesh, closed over
            keep = placed
        mod = (lambda b, h, qi, kv: keep[kv] & (kv <= qi)) if closure else WINDOW
        bm = jattn.block_mask(mod, q_len=TS, block_q=32, block_k=32)
        return jattn.dot_product_attention(q, q, q, block_mask=bm, implementation=implementation)

    want = {closure: f(q, keep, "dense", closure) for closure in (False, True)}
    want["placed"] = want[True]
    CHOSEN.clear()
    result = {}
    with jax.set_mesh(mesh):
        qs = jax.device_put(q, NamedSharding(mesh, P("b")))
        inner = jax.shard_map(
            lambda q: f(q, keep, "cpu_fused", False), in_specs=P("b"), out_specs=P("b")
        )
        for name, call, closure in (
            ("cpu_fused", lambda: f(qs, keep, "cpu_fused", False), False),
            ("shard_map", lambda: jax.jit(inner)(qs), False),
            ("closure", lambda: f(qs, keep, None, True), True),
            ("placed", lambda: f(qs, keep, None, "placed"), "placed"),
        ):
            got = call()
            result[name] = {
                "err": float(jnp.max(jnp.abs(got - want[closure]))),
                "routes": sorted(set(CHOSEN)),
            }
            CHOSEN.clear()
        try:
            f(qs, keep, "cpu_fused", True)
            result["closure_refused"] = ""
        except ValueError as e:
            result["closure_refused"] = str(e)
    CHOSEN.clear()
    return result


def _past_first():
    """``(f, q)``: queries of two batch axes [2, 2] and ``f(q, implementation)``, attention
    with a block mask of per-row packed documents (rows of the flattened batch)."""
    rng = np.random.default_rng(11)
    q = rng.normal(size=(2, 2, TS, H, D)).astype(np.float32)
    mod = jattn.mods.and_masks(jattn.mods.causal(), jattn.mods.document(documents(rng)))
    bm = jattn.block_mask(mod, q_len=TS, batch_shape=B, block_q=32, block_k=32)

    @partial(jax.jit, static_argnums=1)
    def f(q, implementation):
        return jattn.dot_product_attention(q, q, q, block_mask=bm, implementation=implementation)

    return f, q


def rows_past_first(mesh) -> dict:
    """:func:`_past_first`'s call with the second batch axis sharded (the devices' shares
    would not split the mask's rows into blocks): cpu_fused by name refuses, and the
    automatic rule's answer equals the unsharded dense call's."""
    f, q = _past_first()
    want = f(q, "dense")
    CHOSEN.clear()
    with jax.set_mesh(mesh):
        got = f(jax.device_put(q, NamedSharding(mesh, P(None, "b"))), None)
    result = {"routes": sorted(set(CHOSEN)), "err": float(jnp.max(jnp.abs(got - want)))}
    CHOSEN.clear()
    return {**result, "refused": past_first_refused(mesh, f, q)}


def past_first_refused(mesh, f, q) -> str:
    """cpu_fused's refusal of :func:`_past_first`'s call ``f`` on ``q`` with the second
    batch axis sharded ("": it ran)."""
    with jax.set_mesh(mesh):
        qs = jax.device_put(q, NamedSharding(mesh, P(None, "b")))
        try:
            f(qs, "cpu_fused")
        except ValueError as e:
            return str(e)
    return ""


def placed_closure_refused(mesh) -> str:
    """blockwise by name on batch-sharded queries with a mask_mod closing over an array
    placed on the mesh (:func:`placed_modifiers` compares the automatic rule's answer)."""
    keep = jax.device_put(jnp.arange(T) % 5 != 0, NamedSharding(mesh, P()))
    q = np.random.default_rng(12).normal(size=(B, T, H, D)).astype(np.float32)

    @jax.jit
    def f(q):
        mod = lambda b, h, qi, kv: keep[kv] & (kv <= qi)  # noqa: E731
        return jattn.dot_product_attention(q, q, q, mask_mod=mod, implementation="blockwise")

    with jax.set_mesh(mesh):
        try:
            f(jax.device_put(q, NamedSharding(mesh, P("b"))))
        except ValueError as e:
            return str(e)
    return ""


def refusals(mesh, *names: str) -> dict:
    """``{case: message}``: the ValueError of each named call that a kernel by name cannot
    run on explicitly sharded operands ("": it ran). tests/test_bad_input.py names the
    cases and checks the excerpts docs/errors.md shows."""
    arrays, heads = operands(), SPECS["heads"]
    calls = {
        "score_mod reads h": lambda: refused(mesh, heads, arrays, "cpu_fused", **REFUSED["score_mod"]),
        "mask_mod reads h": lambda: refused(mesh, heads, arrays, "pallas", **REFUSED["mask_mod"]),
        "block mask per head": lambda: refused(mesh, heads, arrays, "cpu_fused", **REFUSED["block_mask"]),
        "tokens sharded": lambda: refused(mesh, P(None, "b"), arrays, "cpu_fused"),
        "kv heads split": lambda: split_groups(mesh),
        "rows past first": lambda: past_first_refused(mesh, *_past_first()),
        "placed closure": lambda: placed_closure_refused(mesh),
    }  # fmt: skip
    unknown = set(names) - set(calls)
    if unknown:
        raise ValueError(f"no refusal cases named {sorted(unknown)}")
    return {name: calls[name]() for name in names}


def split_groups(mesh) -> str:
    """6 query heads over 3 key/value heads, the heads over 2 devices: a device's query
    heads would need a key/value head it does not hold, so the kernel by name refuses."""
    rng = np.random.default_rng(6)
    q = rng.normal(size=(2, TS, 6, D)).astype(np.float32)
    k = rng.normal(size=(2, TS, 3, D)).astype(np.float32)
    q = jax.device_put(q, NamedSharding(mesh, P(None, None, "b")))  # k, v replicated
    try:
        jax.jit(lambda q, k: jattn.dot_product_attention(q, k, k, implementation="cpu_fused"))(
            q, jax.device_put(k, NamedSharding(mesh, P()))
        )
    except ValueError as e:
        return str(e)
    return ""


def pallas_interpreted(mesh, spec, arrays, want) -> dict:
    """jattn's Pallas kernel by name (interpret mode, as CPU tests run it) on the sharded
    operands: the same per-device run as the CPU kernel's."""
    os.environ["JATTN_PALLAS_INTERPRET"] = "1"
    try:
        return summary(*run(attend("pallas"), mesh, spec, arrays), want)
    finally:
        del os.environ["JATTN_PALLAS_INTERPRET"]


def without_set_mesh(mesh, arrays, want) -> dict:
    """The automatic rule on batch-sharded operands placed with ``jax.device_put`` and no
    ``jax.set_mesh``: the per-device run takes the mesh from the operands' types."""
    f = attend(None)
    args = placed(mesh, P("b"), arrays)
    out = jax.jit(f)(*args)
    dq = jax.jit(jax.grad(lambda q, *rest: jnp.sum(f(q, *rest) ** 2)))(*args)
    return summary(out, dq, want)


def in_shard_map(mesh, arrays, want) -> dict:
    """The fused kernel by name inside ``jax.shard_map`` over the batch: each device's own
    rows, no obstacle."""
    f = jax.shard_map(attend("cpu_fused"), mesh=mesh, in_specs=P("b"), out_specs=P("b"))
    out, dq = run(f, mesh, P("b"), arrays)
    return summary(out, dq, want)


def module_grad(mesh, dropout: float = 0.0) -> dict:
    """The NNX module with model_axis (heads over 'b') at T past the kernels' lengths, with
    ``dropout`` (in training, one key): a jitted gradient equals the unsharded module's."""
    x = jax.random.normal(jax.random.key(1), (2, T, 8))

    def loss(m, x):
        rngs = nnx.Rngs(dropout=jax.random.key(4))
        return jnp.sum(m(x, deterministic=not dropout, rngs=rngs) ** 2)

    plain = jn.MultiHeadAttention(8, 8, T, dropout, 2, rngs=nnx.Rngs(0))
    want = nnx.grad(loss)(plain, x)
    CHOSEN.clear()
    with jax.set_mesh(mesh):
        module = jn.MultiHeadAttention(8, 8, T, dropout, 2, model_axis="b", rngs=nnx.Rngs(0))
        got = nnx.jit(nnx.grad(loss))(module, jax.device_put(x, NamedSharding(mesh, P())))
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return {  # relative to each gradient's largest entry
        "routes": sorted(set(CHOSEN)),
        "err": max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs),
    }


def small_models() -> dict:
    """GPT-2, Llama 3 and Qwen3 of one layer, context T, by class name."""
    small = dict(vocab_size=64, context_length=T, emb_dim=32, n_heads=2, n_layers=1)
    rope = dict(hidden_dim=64, n_kv_groups=1, rope_base=10_000.0, dtype=jnp.float32)
    cfgs = {
        "GPTModel": dict(small, drop_rate=0.0, qkv_bias=False),
        "Llama3Model": dict(small, **rope, rope_freq=None),
        "Qwen3Model": dict(small, **rope, head_dim=16, qk_norm=True),
    }
    return {name: getattr(models, name)(cfg, rngs=nnx.Rngs(0)) for name, cfg in cfgs.items()}


def models_check(mesh) -> dict:
    """Each model (GPT-2, Llama 3, Qwen3; one layer, T = 256) on batch-sharded token ids:
    its jitted forward and gradient against the unsharded model's (relative), the
    logits' spec and the attention's route."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(B, T)), jnp.int32)

    def loss(m, t):
        return jnp.mean(m(t) ** 2)

    result = {}
    for name, model in small_models().items():
        want, grad_want = model(tokens), nnx.grad(loss)(model, tokens)
        CHOSEN.clear()
        with jax.set_mesh(mesh):
            sharded = jax.device_put(tokens, NamedSharding(mesh, P("b")))
            out = nnx.jit(lambda m, t: m(t))(model, sharded)
            grad = nnx.jit(nnx.grad(loss))(model, sharded)
        pairs = zip(jax.tree.leaves(grad), jax.tree.leaves(grad_want), strict=True)
        result[name] = {
            "routes": sorted(set(CHOSEN)),
            "err": float(jnp.max(jnp.abs(out - want)) / jnp.max(jnp.abs(want))),
            "grad_err": max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs),
            "spec": spec_of(out),
        }
    return result


# The decoding check's runs, (model, prompt ids [B, 12]) -> the result: greedy with
# per-row prompt lengths, stop tokens, top-k sampling, a rolling cache, the recomputing
# loop and the stream.
GENERATIONS = {
    "greedy": lambda m, t: models.generate(m, t, 8, prompt_lengths=jnp.asarray([12, 5, 9, 3])),
    "eos": lambda m, t: models.generate(m, t, 8, eos_id=[3, 7], return_lengths=True),
    "sampled": lambda m, t: models.generate(
        m, t, 8, temperature=1.0, top_k=5, key=jax.random.key(3)
    ),
    "rolling": lambda m, t: models.generate(m, t, 8, window=6),
    "recompute": lambda m, t: models.generate(m, t, 8, use_cache=False),
    "stream": lambda m, t: jnp.stack(list(models.generate_stream(m, t, 8, eos_id=3)), axis=1),
}
FUSED: list[bool] = []  # whether the KV caches' calls took the fused kernel (a spy)


def _fused_spy(*call):
    FUSED.append(_REAL_TAKES(*call))
    return FUSED[-1]


_REAL_TAKES, _fused_cache.takes = _fused_cache.takes, _fused_spy


def decoding_check(mesh) -> dict:
    """Each model's generation (GENERATIONS) from batch-sharded prompts against the
    unsharded run: equal tokens, rows still sharded, the fused cache kernel not taken
    (it has no partitioning rule) where the unsharded run takes it; the element types the
    compiled loop moves between devices; and the NNX module's KV cache with its heads
    sharded (:func:`module_decoding`)."""
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, size=(B, 12)), jnp.int32)
    result = {}
    for name, model in small_models().items():
        for case, run_case in GENERATIONS.items():
            FUSED.clear()
            want = jax.tree.leaves(run_case(model, tokens))
            fused = any(FUSED)
            FUSED.clear()
            with jax.set_mesh(mesh):
                sharded = jax.device_put(tokens, NamedSharding(mesh, P("b")))
                got = jax.tree.leaves(run_case(model, sharded))
            result[f"{name} {case}"] = {
                "equal": all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)),
                "specs": [spec_of(x) for x in got],
                "fused": [fused, any(FUSED)],
            }
    sharded = jax.device_put(tokens, NamedSharding(mesh, P("b")))
    with jax.set_mesh(mesh):
        loop = jax.jit(lambda t: models.generate(model, t, 8, eos_id=3))
        result["moved"] = moved_types(loop.lower(sharded).compile().as_text())
    got = models.generate(model, sharded, 8, eos_id=3)  # no jax.set_mesh
    result["without_set_mesh"] = {
        "equal": bool(np.array_equal(got, models.generate(model, tokens, 8, eos_id=3))),
        "spec": spec_of(got),
    }
    result["module"] = {rolling: module_decoding(mesh, rolling) for rolling in ("plain", "rolling")}
    return result


def module_decoding(mesh, kind: str) -> dict:
    """The NNX module with model_axis (heads over 'b'): a jitted prefill of 9 tokens and
    one step through its cache (``kind`` "rolling": a rolling one of 6 positions) against
    the unsharded module's (max abs error), and the output's spec."""
    x = jax.random.normal(jax.random.key(1), (2, 10, 8))

    def run(module, x):
        module.init_cache((2, 6 if kind == "rolling" else 12, 8), rolling=kind == "rolling")
        first = module(x[:, :9], decode=True)
        return jnp.concatenate([first, module(x[:, 9:], decode=True)], axis=1)

    want = run(jn.MultiHeadAttention(8, 8, 16, 0.0, 2, rngs=nnx.Rngs(0)), x)
    with jax.set_mesh(mesh):
        module = jn.MultiHeadAttention(8, 8, 16, 0.0, 2, model_axis="b", rngs=nnx.Rngs(0))
        got = nnx.jit(run)(module, jax.device_put(x, NamedSharding(mesh, P())))
        keys = module.cache.get_value().keys
    return {"err": float(jnp.max(jnp.abs(got - want))), "cache_spec": spec_of(keys)}


def attention_check(mesh, *per_device_cases: str) -> dict:
    arrays = operands()
    want = reference(*arrays)
    auto_mesh = jax.make_mesh((2,), ("b",), axis_types=(AxisType.Auto,))
    result = {"axis_types": [str(t) for t in mesh.axis_types], "built": BUILT}
    for name, spec in SPECS.items():
        result[name] = {
            "auto": summary(*run(attend(None), mesh, spec, arrays), want),
            "blockwise": summary(*run(attend("blockwise"), mesh, spec, arrays), want),
            "collectives": collectives(mesh, spec, arrays),
            "refused": refused(mesh, spec, arrays, "cpu_fused", **REFUSED["score_mod"]),
            "refused_mask_mod": refused(mesh, spec, arrays, "pallas", **REFUSED["mask_mod"]),
            "refused_block_mask": refused(mesh, spec, arrays, "cpu_fused", **REFUSED["block_mask"]),
            # an automatic mesh: no sharding in the types, the kernel is taken (XLA gathers)
            "auto_mesh": summary(*run(attend(None), auto_mesh, spec, arrays), want),
        }
    result["without_set_mesh"] = without_set_mesh(mesh, arrays, want)
    if BUILT:
        result["shard_map"] = in_shard_map(mesh, arrays, want)
        for name, cases in per_device(mesh, *per_device_cases).items():
            result[name]["per_device"] = cases
        result["split_groups"] = split_groups(mesh)
        result["rows_past_first"] = rows_past_first(mesh)
        result["traced_block_masks"] = traced_block_masks(mesh)
    for name, spec in SPECS.items():
        result[name]["pallas"] = pallas_interpreted(mesh, spec, arrays, want)
    result["module"] = module_grad(mesh)
    result["module_dropout"] = module_grad(mesh, dropout=0.2)
    return result


def placed_modifiers(mesh) -> dict:
    """Modifiers reading arrays placed on the mesh, batch-sharded queries at T (blockwise's
    lengths), against the unsharded dense call on the same arrays unplaced: the largest
    error relative to the largest value, of the output and the gradients (q; the slopes).
    jattn.mods' modifiers pass their arrays into blockwise's loops (the mesh's axes made
    automatic there), which raised on them before; a document mask or prefix of per-row
    arrays sharded over the batch replicates them to read any row (jax raised
    ShardingTypeError); a lambda closing over a placed array goes to dense, and blockwise by
    name says why. Also blockwise with dropout and ALiBi on the operands of the attention
    section, sharded and not (:func:`with_options`)."""
    rng = np.random.default_rng(9)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    slopes = jattn.mods.alibi_slopes(H)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, size=(B, T)), axis=1), jnp.int32)
    prefix = jnp.asarray([3, 40, 0, 100], jnp.int32)
    keep = jnp.arange(T) % 5 != 0

    def options(case, slopes, ids, prefix, keep):
        return {
            "alibi": dict(score_mod=jattn.mods.alibi(slopes), is_causal=True),
            "composed": dict(
                score_mod=jattn.mods.compose(jattn.mods.alibi(slopes), jattn.mods.softcap(4.0)),
                is_causal=True,
            ),
            "document": dict(
                mask_mod=jattn.mods.and_masks(jattn.mods.causal(), jattn.mods.document(ids))
            ),
            "prefix": dict(mask_mod=jattn.mods.prefix_lm(prefix)),
            "closure": dict(mask_mod=lambda b, h, qi, kv: keep[kv] & (kv <= qi)),
        }[case]

    @partial(jax.jit, static_argnums=(0, 1))
    def grads(case, implementation, q, *arrays):
        def loss(q, slopes):
            out = jattn.dot_product_attention(
                q, q, q, implementation=implementation,
                **options(case, slopes, *arrays[1:]),
            )  # fmt: skip
            return jnp.sum(out**2), out

        (_, out), grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(q, arrays[0])
        return out, grad

    unplaced = (q, slopes, ids, prefix, keep)

    def on_mesh():  # q and the per-row arrays over the batch; slopes and keep replicated
        specs = (P("b"), P(), P("b"), P("b"), P())
        return [
            jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(unplaced, specs, strict=True)
        ]

    result = {}
    for case, implementation in (("alibi", "blockwise"), ("composed", None),
                                 ("document", None), ("document", "blockwise"),
                                 ("prefix", "blockwise"), ("closure", None)):  # fmt: skip
        want = grads(case, "dense", *unplaced)
        CHOSEN.clear()
        with jax.set_mesh(mesh):
            got = grads(case, implementation, *on_mesh())
        errs = [
            float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        ]
        result[f"{case} {implementation or 'auto'}"] = {
            "routes": sorted(set(CHOSEN)), "err": max(errs), "spec": spec_of(got[0]),
        }  # fmt: skip
    want = grads("document", "dense", *unplaced)  # placed, called with no jax.set_mesh
    got = grads("document", None, *on_mesh())
    errs = [
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ]
    result["document without set_mesh"] = {"err": max(errs), "spec": spec_of(got[0])}
    result["closure refused"] = placed_closure_refused(mesh)
    arrays = operands()  # blockwise with dropout and ALiBi, sharded and not
    for name, spec in SPECS.items():
        result[f"options {name}"] = with_options(mesh, spec, arrays)
    CHOSEN.clear()
    return result


def main() -> None:
    mesh = jax.make_mesh((2,), ("b",))
    sections = {
        "attention": attention_check,
        "per_device": per_device_section,
        "pallas_per_device": pallas_per_device,
        "placed_modifiers": placed_modifiers,
        "refusals": refusals,
        "models": models_check,
        "decoding": decoding_check,
    }
    check = sections[sys.argv[1]]
    print(json.dumps(check(mesh, *sys.argv[2:])))


if __name__ == "__main__":
    main()
