"""``implementation='pallas'``: jattn's own Pallas flash-attention kernels, with its whole contract.

One FlashAttention-2 kernel family (:mod:`jattn.kernels.pallas._flash`; in-tile pieces in
:mod:`jattn.kernels.pallas._common`) lowered per platform: Triton on NVIDIA GPUs
(:mod:`jattn.kernels.pallas.gpu`: ``[N, T, H, D]`` blocks), Mosaic on TPUs (``[N, H, T,
D]`` blocks, key tiles of 128 lanes, scalars in SMEM), interpret mode on any backend when
``JATTN_PALLAS_INTERPRET=1``. It honours, inside the kernels:

* causal masks and sliding windows (the band), query / key lengths, segment ids (separate
  key ids too), each skipping the tiles they hide; grouped-query attention reading each
  key/value head once (never repeated);
* a bias (any shape broadcastable to ``[batch..., H, Tq, Tk]``) with its gradient in its
  own shape; attention sinks with their gradient; soft-capping, ALiBi (slopes get a
  gradient) and any elementwise ``score_mod`` / ``mask_mod`` traced into the kernel body
  (the arrays they close over become kernel operands, float ones get gradients);
* a :class:`jattn.BlockMask`'s (or the ``mask_mod``'s) tile states: EMPTY tiles skipped,
  FULL tiles computed without the elementwise mask;
* dropout with jattn's position-keyed bits (:mod:`jattn._prng`): the same key gives the
  same mask as the dense and blockwise paths, generated per tile (no ``[T, T]`` mask);
* the log-sum-exp (differentiable: its cotangent enters the kernels' backward); rows
  that attend nothing give zero output, zero gradients and :func:`jattn.large_negative`
  (their sink's logit with sinks), as jattn's own paths.

Ready-made modifiers are recognised and run natively: :func:`jattn.mods.causal` and
:func:`jattn.mods.sliding_window` become the band, :func:`jattn.mods.document` segment
ids, a bare :func:`jattn.mods.softcap` / :func:`jattn.mods.alibi` native soft-capping /
ALiBi. Other modifiers run as traced; compiled (GPU, TPU) they must be elementwise jnp
code (no gather: the kernels cannot index an array by a traced position), else the route
refuses them.

Refused (routing falls back, naming the reason): a mask array, returned weights, flax's
einsum hooks, float64, a traced scale, an explicit matmul precision, head sizes over 256.
On a TPU host splash stays first where it takes the call.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.extend
import jax.numpy as jnp

from jattn import _prng, _util, block_masks, blockwise, mods
from jattn.kernels import _common as adapters_common
from jattn.kernels import _platforms
from jattn.kernels.pallas import _common as C
from jattn.kernels.pallas import _flash

__all__ = [
    "LSE_HAS_GRADIENT",
    "NAME",
    "RETURNS_LSE",
    "attention",
    "attention_given",
    "available",
    "block_sizes",
    "obstacle",
]

Array = jax.Array

NAME = "pallas"
RETURNS_LSE = True
LSE_HAS_GRADIENT = True

_DTYPES = ("bfloat16", "float16", "float32")
_GPU_PLATFORMS = ("cuda", "gpu")
# Tiles (rows, keys) per platform: the forward pass's and the backward passes' (TPU: the
# key tiles are sliced along lanes, so multiples of 128).
_BLOCKS = {
    "gpu": ((128, 64), (64, 64)),
    "tpu": ((128, 128), (128, 128)),
    "interpret": ((64, 64), (64, 64)),
}
_MAX_GPU_HEAD_DIM = 256
# Primitives a traced modifier may use compiled (GPU, TPU): elementwise arithmetic,
# comparisons, casts and broadcasting (no gather: neither Triton nor Mosaic has one).
_COMPILED_PRIMITIVES = frozenset(
    """add sub mul div rem max min neg abs sign exp exp2 log log1p tanh logistic sqrt rsqrt
    pow integer_pow floor ceil round erf sin cos select_n eq ne lt le gt ge and or not xor
    shift_left shift_right_logical shift_right_arithmetic convert_element_type
    broadcast_in_dim reshape squeeze expand_dims stop_gradient clamp copy copy_p pjit jit
    custom_jvp_call square""".split()
)


def available(platform: str) -> bool:
    """True on NVIDIA GPUs (``'cuda'``; ``'gpu'`` as ``jax.default_backend()`` names them)
    and TPUs (``'tpu'``)."""
    return platform in _GPU_PLATFORMS or platform == "tpu"


@contextlib.contextmanager
def block_sizes(forward: tuple[int, int], backward: tuple[int, int]):
    """Sets the tiles ``(rows, keys)`` of the forward and backward kernels while active
    (all platforms; powers of two, at least 16 on GPU). For tests and tuning."""
    saved = dict(_BLOCKS)
    _BLOCKS.update({k: (tuple(forward), tuple(backward)) for k in _BLOCKS})
    try:
        yield
    finally:
        _BLOCKS.clear()
        _BLOCKS.update(saved)


# ----------------------------------------------------------------------------------------
# Recognising the ready-made modifiers
# ----------------------------------------------------------------------------------------


def _mask_parts(mask_mod) -> list:
    return list(mask_mod.mods) if isinstance(mask_mod, mods.MaskAnd) else [mask_mod]


def _split_mask(mask_mod, has_segments: bool):
    """``(band, document, rest)`` of a mask_mod: the causal / window parts as a band
    ``(lo, hi)``, a :func:`jattn.mods.document` part (None when segment ids are given too),
    and what remains (a mask_mod or None)."""
    if mask_mod is None:
        return (None, None), None, None
    lo, hi, document, rest = None, None, None, []
    for part in _mask_parts(mask_mod):
        if isinstance(part, mods.Causal):
            hi = 0 if hi is None else min(hi, 0)
        elif isinstance(part, mods.SlidingWindow):
            lo = -part.left if lo is None else max(lo, -part.left)
            if part.right is not None:
                hi = part.right if hi is None else min(hi, part.right)
        elif isinstance(part, mods.Document) and document is None and not has_segments:
            document = part
        else:
            rest.append(part)
    rest = None if not rest else rest[0] if len(rest) == 1 else mods.and_masks(*rest)
    return (lo, hi), document, rest


def _split_score(score_mod):
    """``(softcap, alibi, rest)``: a bare soft-cap or ALiBi runs natively; anything else is
    traced (``rest``)."""
    if isinstance(score_mod, mods.SoftCap):
        return score_mod.cap, None, None
    if isinstance(score_mod, mods.Alibi):
        return None, score_mod, None
    return None, None, score_mod


def _band(is_causal: bool, window, mod_band) -> tuple[int | None, int | None]:
    lo, hi = mod_band
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    if window is not None:
        left, right = window
        lo = -left if lo is None else max(lo, -left)
        if right is not None:
            hi = right if hi is None else min(hi, right)
    return lo, hi


# ----------------------------------------------------------------------------------------
# The contract: obstacle and attention
# ----------------------------------------------------------------------------------------


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def _compiled_modifier_obstacle(fn, kind: str, dtype) -> str | None:
    """Why a traced modifier cannot run in the compiled kernel (None: it can)."""
    index = [
        jax.ShapeDtypeStruct(s, jnp.int32)
        for s in ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 16, 1), (1, 1, 1, 16))
    ]
    scores = [jax.ShapeDtypeStruct((1, 1, 16, 16), jnp.float32)] if kind == "score_mod" else []
    jaxpr = jax.make_jaxpr(fn)(*scores, *index).jaxpr
    unsupported = sorted(_primitives(jaxpr) - _COMPILED_PRIMITIVES)
    if unsupported:
        return (
            f"a {kind} using {', '.join(unsupported)} (the compiled kernel runs elementwise "
            "modifiers only; no array indexed by a position)"
        )
    return None


def obstacle(query) -> str | None:
    """Why jattn's Pallas kernel cannot honour the call (None: it can), from a
    :class:`jattn.kernels.KernelQuery`."""
    native = available(query.platform)
    if not native and not query.interpret:
        return (
            f"jattn's Pallas kernel runs on NVIDIA GPUs ('cuda') and TPUs, not on "
            f"{query.platform} (set JATTN_PALLAS_INTERPRET=1 to run it in interpret mode, "
            "slowly, for tests)"
        )
    if query.needs_dense is not None:
        return query.needs_dense
    # It takes a bias and dropout itself: the shared refusals are asked without them.
    reason = adapters_common.common_obstacle(
        query._replace(has_bias=False, dropout=False),
        dtypes=_DTYPES,
        kernel="jattn's Pallas kernel",
    )
    if reason is not None:
        return reason
    if query.platform == "tpu" and jnp.dtype(query.dtype) == jnp.float16:
        return "dtype float16 on TPU (the Mosaic kernel computes in bfloat16 or float32)"
    if query.traced_scale:
        return "a traced scale (the kernel compiles the scale in)"
    if not query.default_precision:
        return "an explicit matmul precision (the kernel picks its own)"
    if 0 in (query.q_shape[-3], query.kv_shape[-3]):
        return "an empty sequence"
    if native and not query.interpret:
        if max(query.q_shape[-1], query.v_head_dim) > _MAX_GPU_HEAD_DIM:
            return f"head_dim over {_MAX_GPU_HEAD_DIM} (the kernel's tiles)"
        _, _, score_rest = _split_score(query.score_mod)
        if score_rest is not None:
            reason = _compiled_modifier_obstacle(score_rest, "score_mod", query.dtype)
            if reason is not None:
                return reason
        mask_rest = _split_mask(query.mask_mod, query.has_segments)[2]
        if mask_rest is not None:
            return _compiled_modifier_obstacle(mask_rest, "mask_mod", query.dtype)
    return None


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _blocks(q_len: int, kv_len: int, interpret: bool, mosaic: bool):
    """The forward and backward tiles, no larger than the (power-of-two) lengths need."""
    fwd, bwd = _BLOCKS["interpret" if interpret else "tpu" if mosaic else "gpu"]
    least = 128 if mosaic and not interpret else 16

    def fit(block):
        return min(block[0], _pow2(q_len)), min(block[1], _pow2(kv_len, least))

    return fit(fwd), fit(bwd)


def _layout(interpret: bool, head_dim: int, mosaic: bool) -> _flash.Layout:
    if interpret:
        return _flash.Layout(None, True)
    several = len(_platforms.route_platforms() or ()) > 1
    if mosaic:
        return _flash.Layout(None, False, "tpu" if several else None)
    from jattn.kernels.pallas import gpu

    return _flash.Layout(gpu.compiler_params(head_dim), False, "cuda" if several else None)


def _hoist(fn, kind: str, blocks) -> tuple[dict, list]:
    """``fn`` hoisted at each tile shape in ``blocks``: ``({shape: converted}, consts)``."""
    converted, consts = {}, None
    for bq, bk in sorted(set(blocks)):
        index = [
            jax.ShapeDtypeStruct(s, jnp.int32)
            for s in ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, bq, 1), (1, 1, 1, bk))
        ]
        args = (
            [jax.ShapeDtypeStruct((1, 1, bq, bk), jnp.float32)] if kind == "score" else []
        ) + index
        fn_at, consts_at = blockwise.hoist(fn, *args)
        if consts is not None and len(consts_at) != len(consts):
            raise NotImplementedError(
                f"the {kind}_mod closes over different arrays per tile shape."
            )
        converted[(bq, bk)] = fn_at
        consts = consts_at if consts is None else consts
    return converted, list(consts)


def attention(q, k, v, ops, settings, *, interpret: bool, platform: str | None = None):
    """jattn's Pallas flash attention of a validated call (contract: :mod:`jattn.kernels`).

    Args:
      q: ``[batch..., Tq, H, D]``; k: ``[batch..., Tk, K, D]``; v: ``[batch..., Tk, K, Dv]``.
      ops, settings: :class:`jattn._call.Operands` / :class:`jattn._call.Settings`.
      interpret: run the kernels in interpret mode.
      platform: the platform lowered for (None: the default backend): ``'tpu'`` takes the
        Mosaic layout (heads before positions, scalars in SMEM), any other the GPU one.

    Returns:
      ``(out [batch..., Tq, H, Dv]`` in q's dtype, ``lse [batch..., H, Tq]`` float32,
      differentiable).
    """
    spec, layout, ins, kernel_out = _prepare(q, k, v, ops, settings, interpret, platform)
    return kernel_out(*_flash.flash(spec, layout, ins))


def attention_given(
    q, k, v, ops, settings, *, out, lse, interpret: bool, platform: str | None = None
):  # fmt: skip
    """:func:`attention` with its forward pass given: ``out`` / ``lse`` as it returned them
    for these inputs. Differentiating it runs the backward kernels alone (no forward
    kernel), e.g. where the forward pass ran in another primitive.

    Args:
      q, k, v, ops, settings, interpret, platform: as :func:`attention`.
      out: ``[batch..., Tq, H, Dv]``; lse: ``[batch..., H, Tq]`` float32.

    Returns:
      ``(out, lse)``: the given values, with the kernels' gradient.
    """
    spec, layout, ins, kernel_out = _prepare(q, k, v, ops, settings, interpret, platform)
    out3, _ = adapters_common.flatten_batch(out, 3)
    lse3, _ = adapters_common.flatten_batch(lse, 2)
    out3 = adapters_common.pad_axis(adapters_common.pad_axis(out3, 1, spec.padded_q), 3, spec.v_dim)
    out3 = jnp.swapaxes(out3, 1, 2) if spec.mosaic else out3
    # Padded rows get a log-sum-exp above any logit: their probabilities are exactly 0
    # (their output cotangent is 0 too), never an overflow.
    lse3 = jnp.pad(
        lse3.astype(jnp.float32), ((0, 0), (0, 0), (0, spec.padded_q - lse3.shape[-1])),
        constant_values=_PADDED_LSE,
    )[..., None]  # fmt: skip
    return kernel_out(*_flash.given(spec, layout, ins, out3.astype(ins.q.dtype), lse3))


# The log-sum-exp given to padded query rows (attention_given).
_PADDED_LSE = 1e30


def _prepare(q, k, v, ops, settings, interpret: bool, platform: str | None):
    """``(spec, layout, ins, kernel_out)``: the kernels' static description, layout and
    operands for a validated call, and ``kernel_out(out, lse)``, which turns the kernels'
    padded outputs into :func:`attention`'s."""
    q3, batch_shape = adapters_common.flatten_batch(q, 3)
    k3, _ = adapters_common.flatten_batch(k, 3)
    v3, _ = adapters_common.flatten_batch(v, 3)
    n, q_len, heads, head_dim = q3.shape
    kv_len, kv_heads, v_dim = k3.shape[1], k3.shape[2], v3.shape[-1]
    mosaic = (platform or jax.default_backend()) == "tpu"
    fwd_block, bwd_block = _blocks(q_len, kv_len, interpret, mosaic)
    lcm_q = math.lcm(fwd_block[0], bwd_block[0])
    lcm_k = math.lcm(fwd_block[1], bwd_block[1])
    padded_q, padded_kv = (
        _util.round_up(q_len, lcm_q),
        _util.round_up(kv_len, lcm_k),
    )
    d_pad, dv_pad = _pow2(head_dim), _pow2(v_dim)
    has_segments = ops.q_segments is not None
    mod_band, document, mask_rest = _split_mask(settings.mask_mod, has_segments)
    softcap, alibi, score_rest = _split_score(settings.score_mod)
    blocks_used = (fwd_block, bwd_block)

    def pad(x, length, width):
        x = adapters_common.pad_axis(adapters_common.pad_axis(x, 1, length), 3, width)
        return jnp.swapaxes(x, 1, 2) if mosaic else x  # TPU: [N, H, T, D]

    ins = dict(
        q=pad(q3, padded_q, d_pad), k=pad(k3, padded_kv, d_pad), v=pad(v3, padded_kv, dv_pad)
    )
    spec = dict(
        batch=n, q_len=q_len, kv_len=kv_len, padded_q=padded_q, padded_kv=padded_kv,
        num_heads=heads, kv_heads=kv_heads, head_dim=d_pad, v_dim=dv_pad, scale=float(ops.scale),
        band=_band(settings.is_causal, settings.window, mod_band),
        fwd_block=fwd_block, bwd_block=bwd_block, softcap=softcap, mosaic=mosaic,
    )  # fmt: skip
    _lengths(ins, spec, ops, n)
    _segments(ins, spec, ops, document, n, q_len, kv_len, padded_q, padded_kv)
    if ops.bias is not None:
        bias = blockwise.tile_layout(ops.bias, batch_shape, heads, kv_heads, padded_q, padded_kv)
        bias = bias.reshape(bias.shape[0], bias.shape[1] * bias.shape[2], *bias.shape[3:])
        if mosaic and bias.shape[-1] == 1:  # TPU blocks cannot split a size-1 key axis
            bias = jnp.broadcast_to(bias, (*bias.shape[:-1], padded_kv))
        ins["bias"] = bias
        spec["bias"] = tuple(s > 1 for s in ins["bias"].shape)
    if alibi is not None:
        ins["slopes"] = alibi.slopes.astype(jnp.float32).reshape(heads, 1, 1)
        spec["alibi"] = alibi.symmetric
    if ops.sinks is not None:
        ins["sinks"] = ops.sinks.reshape(heads, 1, 1)
        spec["sinks"] = True
    if ops.dropout_rng is not None:
        _dropout(ins, spec, ops, settings, n, heads, q_len, padded_q)
    if score_rest is not None:
        fns, consts = _hoist(score_rest, "score", blocks_used)
        spec["score_mods"] = fns
        spec["score_float"] = tuple(bool(jnp.issubdtype(c.dtype, jnp.inexact)) for c in consts)
        ins["score_consts"] = tuple(jnp.asarray(c) for c in consts)
    if mask_rest is not None:
        fns, consts = _hoist(mask_rest, "mask", blocks_used)
        spec["mask_mods"] = fns
        spec["num_mask_consts"] = len(consts)
        ins["mask_consts"] = tuple(jnp.asarray(c) for c in consts)
    if mask_rest is not None or ops.block_mask is not None:
        _states(ins, spec, settings, ops, mask_rest, n, heads, q_len, kv_len, padded_q, padded_kv)
    spec = C.Spec(**spec)

    def kernel_out(out, lse):
        out = jnp.swapaxes(out, 1, 2) if mosaic else out
        out = out[:, :q_len, :, :v_dim]
        lse = lse[:, :, :q_len, 0]
        return adapters_common.unflatten_batch(out, batch_shape), adapters_common.unflatten_batch(
            lse, batch_shape
        )

    return spec, _layout(interpret, d_pad, mosaic), _flash.Inputs(**ins), kernel_out


def _lengths(ins, spec, ops, n: int) -> None:
    for name, lengths in (("q_len", ops.q_lengths), ("kv_len", ops.kv_lengths)):
        if lengths is not None:
            flat = adapters_common.flat_or_none(lengths, 0).astype(jnp.int32)
            ins[name] = jnp.broadcast_to(flat, (n,)).reshape(n, 1, 1)
            spec[name.replace("len", "lengths")] = True


def _segments(ins, spec, ops, document, n, q_len, kv_len, padded_q, padded_kv) -> None:
    """Segment ids (given, or a recognised :func:`jattn.mods.document`) as ``[N, Tq, 1]``
    and ``[N, 1, Tk]``, padded (padded keys are hidden by the length mask anyway)."""
    if ops.q_segments is not None:
        q_ids = adapters_common.flat_or_none(ops.q_segments, 1)
        kv_ids = adapters_common.flat_or_none(ops.kv_segments, 1)
    elif document is not None:
        q_ids, kv_ids = document.q_segments, document.kv_segments
    else:
        return
    q_ids = jnp.broadcast_to(q_ids.astype(jnp.int32), (n, q_len))
    kv_ids = jnp.broadcast_to(kv_ids.astype(jnp.int32), (n, kv_len))
    ins["q_seg"] = adapters_common.pad_axis(q_ids, 1, padded_q)[:, :, None]
    ins["kv_seg"] = adapters_common.pad_axis(kv_ids, 1, padded_kv)[:, None, :]
    spec["segments"] = True


def _dropout(ins, spec, ops, settings, n, heads, q_len, padded_q) -> None:
    """Row keys ``[Nr, Hr, Tq, 1]`` numbered as the dense path's mask rows
    (:func:`jattn._prng.keep_mask`: row-major over ``[batch..., heads, q_len]``, shared
    axes of size 1), the keep threshold and ``1 / keep``."""
    starts = adapters_common.dropout_row_starts(ops, settings, n, heads, q_len)
    rows = starts[:, :, None, None] + jax.lax.broadcasted_iota(jnp.uint32, (1, 1, padded_q, 1), 2)
    ins["key0"], ins["key1"] = _prng.row_keys(_prng.key_words(ops.dropout_rng), rows, unroll=True)
    keep_prob = 1.0 - ops.dropout_rate
    ins["threshold"] = _prng.keep_threshold(keep_prob).reshape(1, 1, 1)
    ins["inv_keep"] = (1.0 / jnp.asarray(keep_prob, jnp.float32)).reshape(1, 1, 1)
    spec["dropout"] = True


def _block_states(mask_mod, bm, *, n, num_heads, q_len, kv_len, block) -> jax.Array:
    """int8 ``[nq, nk]`` tile states at ``block`` (EMPTY / PARTIAL / FULL of
    :mod:`jattn.block_masks`), combined over batch rows and heads: the block mask's when it
    is given at that block, else built from ``mask_mod`` once per call."""
    if bm is None or (bm.block_q, bm.block_k) != block:
        bm = block_masks.block_mask(
            mask_mod, q_len=q_len, kv_len=kv_len, batch_shape=n, num_heads=num_heads,
            block_q=block[0], block_k=block[1],
        )  # fmt: skip
    needed, full = bm.tile_flags()
    states = jnp.where(full, block_masks.FULL, jnp.where(needed, block_masks.PARTIAL, 0))
    return states.astype(jnp.int8)


def _states(ins, spec, settings, ops, mask_rest, n, heads, q_len, kv_len, padded_q, padded_kv):
    """Block-mask tile states at the forward and backward tiles (EMPTY past the lengths):
    a block mask's, coarsened when the tiles are multiples of its blocks; else evaluated
    from the mask_mod once per call, if a part of it runs in the kernel as traced code
    (recognised parts skip their tiles by the band and the segment ids)."""
    bm = ops.block_mask
    for name, block in (("fwd_states", spec["fwd_block"]), ("bwd_states", spec["bwd_block"])):
        nq, nk = padded_q // block[0], padded_kv // block[1]
        given = None if bm is None else (bm.block_q, bm.block_k)
        if given is not None and block[0] % given[0] == 0 and block[1] % given[1] == 0:
            states = _block_states(
                settings.mask_mod, bm, n=n, num_heads=heads, q_len=q_len, kv_len=kv_len, block=given
            )
            needed, full = blockwise.coarsen(states, given, block, nq, nk)
            states = jnp.where(full, block_masks.FULL, jnp.where(needed, block_masks.PARTIAL, 0))
        elif mask_rest is not None:
            states = _block_states(
                settings.mask_mod, bm, n=n, num_heads=heads, q_len=q_len, kv_len=kv_len, block=block
            )
            pad = ((0, nq - states.shape[0]), (0, nk - states.shape[1]))
            states = jnp.pad(states, pad)
        else:
            return
        ins[name] = states.astype(jnp.int32)
    spec["states"] = True
