"""Pallas splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) behind jattn's call.

Splash attention is jax's TPU flash-attention kernel with block-sparse masks: a static
mask object (causal, local window, ...) is cut into blocks once, on the host, and blocks
it hides are never computed; segment ids and soft-capping are kernel options; grouped- and
multi-query attention read each key/value head once for all query heads that share it.

How jattn's call maps onto it:

* layout: splash takes one example ``q [H, Tq, D]``, ``k, v [K, Tk, D]`` (``[Tk, D]`` for
  multi-query); the adapter moves heads before the sequence and ``vmap``\\ s the batch
  (any number of batch dims, flattened);
* scale: splash does not scale; the adapter multiplies q by ``scale`` (in float32, then
  back to q's dtype) before the kernel;
* causal and window: a static mask (:func:`_static_mask`) over the padded lengths, with
  jattn's alignment (query ``i`` sees key ``j <= i``; the window is ``i-left .. i+right``);
* padding: both lengths are padded to a multiple of 128 (splash's lane width); the static
  mask hides padded keys, and padded queries attend nothing;
* lengths: folded into the segment ids: queries past ``q_length`` and keys past
  ``kv_length`` get two ids no real token has, so such a query attends nothing and such a
  key is seen by no one;
* fully masked query rows: splash would average the hidden keys (or divide 0 by 0 where a
  whole row of blocks is skipped); the adapter passes an attention *sink* (splash's extra
  per-head logit with a zero value) at -1e30, so a row that attends nothing sums to the
  sink alone and its output, lse and gradients are exactly zero, while in every other row
  ``exp(-1e30 - max)`` is exactly 0 and changes nothing;
* lse: not returned (``None``): splash gives its log-sum-exp only from a variant that
  cannot be differentiated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn import mods
from jattn._call import Operands, Settings
from jattn._util import round_up
from jattn.kernels import _common
from jattn.kernels._contract import KernelQuery

__all__ = ["LSE_HAS_GRADIENT", "NAME", "RETURNS_LSE", "attention", "available", "obstacle"]

Array = jax.Array

_LANES = 128  # splash's block sizes are multiples of the TPU lane width
_SINK = -1e30  # the logit of the sink that keeps empty rows at zero (see module docstring)
_DTYPES = ("bfloat16", "float32")
NAME = "splash"
RETURNS_LSE = False  # only splash's non-differentiable variant has it
LSE_HAS_GRADIENT = False


def available(platform: str) -> bool:
    """True on TPU, the one platform splash runs natively on (elsewhere: interpret mode)."""
    return platform == "tpu"


def obstacle(query: KernelQuery) -> str | None:
    """Why splash cannot honour this call (None: it can). Static: ``query`` only.

    Splash takes causal masks, windows, lengths, segment ids (separate query and key/value
    ids too), grouped- and multi-query attention, soft-capping, a value head size unlike
    the query's, any scale; it refuses mask and bias arrays, dropout, returned weights and
    dtypes other than bfloat16 and float32.
    """
    if not available(query.platform) and not query.interpret:
        return (
            f"it runs on TPU only, not on {query.platform} (set JATTN_PALLAS_INTERPRET=1 to "
            "run it in interpret mode, slowly, for tests)"
        )
    return _common.common_obstacle(query, dtypes=_DTYPES, kernel="splash")


def _block(padded_len: int) -> int:
    # The largest of 512 / 256 / 128 that divides the padded length: big blocks pay off on
    # TPU (fewer grid steps), and 512 is the size MaxText's defaults start from.
    for block in (512, 256, _LANES):
        if padded_len % block == 0:
            return block
    raise AssertionError(padded_len)  # padded lengths are multiples of _LANES


@functools.cache
def _mask_class():
    """A lazy splash ``Mask`` for causal / window / length bounds (built on first use).

    Defined on first use so that importing this module (and asking ``obstacle``) does not
    import the splash kernel. It subclasses splash's public ``Mask`` base: ``shape``, and
    ``__getitem__`` on a pair of slices returning that block as a numpy bool array, which
    is all that splash's mask processing asks of a mask; it is hashable by value so that
    splash's cache of processed masks (an ``lru_cache``) reuses it across calls.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    @dataclasses.dataclass(frozen=True)
    class StaticMask(splash.Mask):
        dims: tuple[int, int]  # padded (q_len, kv_len)
        q_len: int  # real lengths: queries and keys past them are hidden
        kv_len: int
        causal: bool
        left: int | None  # window: query i sees keys i-left .. i+right (None: unbounded)
        right: int | None

        @property
        def shape(self) -> tuple[int, int]:
            return self.dims

        def __getitem__(self, idx) -> np.ndarray:
            q_slice, kv_slice = idx
            q0, q1, _ = q_slice.indices(self.dims[0])
            k0, k1, _ = kv_slice.indices(self.dims[1])
            i = np.arange(q0, q1)[:, None]
            j = np.arange(k0, k1)[None, :]
            visible = (i < self.q_len) & (j < self.kv_len)
            if self.causal:
                visible &= j <= i
            if self.left is not None:
                visible &= j >= i - self.left
            if self.right is not None:
                visible &= j <= i + self.right
            return visible

    return StaticMask


def _segment_ids(q_segments, kv_segments, q_lengths, kv_lengths, tq: int, tk: int):
    """Segment ids ``[B, Tq]``, ``[B, Tk]`` that also hide what the lengths hide (or None).

    A query past its length gets id ``lo - 1`` and a key past its length ``lo - 2``, where
    ``lo`` is the smallest real id: no real token has either, and they differ, so such a
    query attends nothing and such a key is seen by no query.
    """
    if q_segments is None and q_lengths is None and kv_lengths is None:
        return None
    if q_segments is None:
        batch = (q_lengths if q_lengths is not None else kv_lengths).shape[0]
        q_ids = jnp.zeros((batch, tq), jnp.int32)
        kv_ids = jnp.zeros((batch, tk), jnp.int32)
    else:
        q_ids = q_segments.astype(jnp.int32)
        kv_ids = (q_segments if kv_segments is None else kv_segments).astype(jnp.int32)
    lo = jnp.minimum(q_ids.min(), kv_ids.min())
    q_valid = _common.lengths_valid(q_lengths, tq)
    kv_valid = _common.lengths_valid(kv_lengths, tk)
    if q_valid is not None:
        q_ids = jnp.where(q_valid, q_ids, lo - 1)
    if kv_valid is not None:
        kv_ids = jnp.where(kv_valid, kv_ids, lo - 2)
    return q_ids, kv_ids


def _kernel(num_heads: int, num_kv_heads: int, dims, tq, tk, is_causal, window, softcap, interpret):
    """The splash kernel object for these static settings (its masks processed on the host)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    left, right = (None, None) if window is None else window
    mask = _mask_class()(dims, tq, tk, is_causal, left, right)
    bq, bkv = _block(dims[0]), _block(dims[1])
    blocks = splash.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    make = splash.make_splash_mqa if num_kv_heads == 1 else splash.make_splash_mha
    return make(
        splash.MultiHeadMask([mask] * num_heads),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=softcap,
        interpret=interpret,
    )


def attention(
    q: Array, k: Array, v: Array, ops: Operands, settings: Settings, *, interpret: bool
) -> tuple[Array, None]:
    """Splash attention with jattn's semantics (see the module docstring for the mapping).

    Args:
      q: ``[batch..., Tq, H, D]``.
      k: ``[batch..., Tk, K, D]`` with ``H % K == 0``.
      v: ``[batch..., Tk, K, Dv]``.
      ops: the call's arrays: ``scale`` (a Python float or a traced scalar), the lengths
        ``[batch...]`` and the segment ids ``[batch..., Tq]`` / ``[batch..., Tk]`` are read
        (the rest is refused by :func:`obstacle`).
      settings: the call's options: ``is_causal``, ``window`` (``(left, right)``: query
        ``i`` sees keys ``i-left .. i+right``, ``right`` None: no bound) and a bare
        :func:`jattn.mods.softcap` ``score_mod`` (splash's ``attn_logits_soft_cap``).
      interpret: run the Pallas kernel in interpret mode (any backend, slow).

    Returns:
      ``(out, None)``: ``out [batch..., Tq, H, Dv]`` in q's dtype; no lse (see module doc).
    """
    scale, softcap = ops.scale, mods.native_softcap(settings.score_mod)
    q3, batch_shape = _common.flatten_batch(q, 3)
    k3, _ = _common.flatten_batch(k, 3)
    v3, _ = _common.flatten_batch(v, 3)
    _, tq, num_heads, _ = q3.shape
    tk, num_kv_heads = k3.shape[1:3]
    dims = (round_up(tq, _LANES), round_up(tk, _LANES))
    kernel = _kernel(
        num_heads, num_kv_heads, dims, tq, tk, settings.is_causal, settings.window, softcap,
        bool(interpret),
    )  # fmt: skip
    scaled = (q3.astype(jnp.float32) * scale).astype(q3.dtype)
    # [B, T, heads, D] -> [B, heads, T_padded, D]: splash's head-major layout.
    qh = _common.pad_axis(jnp.swapaxes(scaled, 1, 2), 2, dims[0])
    kh = _common.pad_axis(jnp.swapaxes(k3, 1, 2), 2, dims[1])
    vh = _common.pad_axis(jnp.swapaxes(v3, 1, 2), 2, dims[1])
    if num_kv_heads == 1:  # multi-query: splash's MQA kernel takes k, v as [B, Tk, D]
        kh, vh = kh[:, 0], vh[:, 0]
    sinks = jnp.full((num_heads,), _SINK, jnp.float32)
    ids = _segment_ids(
        _common.flat_or_none(ops.q_segments, 1),
        _common.flat_or_none(ops.kv_segments, 1),
        _common.flat_or_none(ops.q_lengths, 0),
        _common.flat_or_none(ops.kv_lengths, 0),
        tq,
        tk,
    )
    if ids is None:
        out = jax.vmap(lambda q_, k_, v_: kernel(q_, k_, v_, sinks=sinks))(qh, kh, vh)
    else:
        from jax.experimental.pallas.ops.tpu import splash_attention as splash

        # Padded positions are hidden by the static mask; their ids do not matter.
        q_ids = _common.pad_axis(ids[0], 1, dims[0])
        kv_ids = _common.pad_axis(ids[1], 1, dims[1])

        def one(q_, k_, v_, q_id, kv_id):
            return kernel(q_, k_, v_, segment_ids=splash.SegmentIds(q_id, kv_id), sinks=sinks)

        out = jax.vmap(one)(qh, kh, vh, q_ids, kv_ids)
    # [B, H, Tq_padded, Dv] -> [B, Tq, H, Dv]
    out = jnp.swapaxes(out[:, :, :tq], 1, 2)
    return _common.unflatten_batch(out, batch_shape), None
