"""Weight converters: the book's PyTorch state dicts -> Linen, Linen <-> NNX, wrapper <-> split.

The parameter trees of :mod:`jattn.linen` and :mod:`jattn.nnx` use the book's names, so
each PyTorch tensor of the chapter's classes maps to one leaf:

* ``W_query`` (``SelfAttention_v1``'s raw matrix) -> ``W_query``, as is;
* ``W_query.weight`` -> ``W_query/kernel``, transposed; ``W_query.bias`` -> ``W_query/bias``;
* ``out_proj.weight`` -> ``out_proj/kernel``, transposed; ``out_proj.bias`` -> ``out_proj/bias``
  (none, as the book's ``GroupedQueryAttention``: a module with ``out_bias=False``);
* ``heads.{i}.W_query.weight`` -> ``heads_{i}/W_query/kernel``, transposed (and so on);
* ``mask`` and ``heads.{i}.mask`` (registered buffers) are ignored: jattn builds masks.

(``W_key`` and ``W_value`` as ``W_query``.) A PyTorch ``nn.Linear.weight`` is
``[out_features, in_features]``; a Flax kernel is ``[in_features, out_features]``.

The classes of the book's bonus notebook
``ch03/02_bonus_efficient-multihead-attention/mha-implementations.ipynb`` load into a
:class:`jattn.linen.MultiHeadAttention` (``W_query``, ``W_key``, ``W_value``, ``out_proj``,
each ``{kernel, bias}``; no Q/K/V bias when the class had ``qkv_bias=False``):

* ``Ch03_MHA``: the chapter's ``MultiHeadAttention`` keys, mapped as above.
* ``Ch03_MHA_Wrapper`` (``heads.{i}.W_query.weight`` ..., ``out_proj.weight``,
  ``out_proj.bias``): head ``i``'s ``[d_out, d_in]`` weights become columns
  ``i*d_out ... (i+1)*d_out - 1`` of the fused kernels (transposed), ``out_proj`` as is.
  Load into ``MultiHeadAttention(num_heads * d_out, context_length, dropout, num_heads)``.
* ``MultiHeadAttentionCombinedQKV``, ``MHAPyTorchScaledDotProduct``,
  ``MHAPyTorchSDPAWithoutFlash``, ``MHAPyTorchFlexAttention`` (``qkv.weight``
  ``[3 * d_out, d_in]``, ``qkv.bias``, ``proj.weight``, ``proj.bias``): their forward views
  ``qkv`` as ``(b, T, 3, num_heads, head_dim)`` and unbinds queries, keys, values along
  the ``3``, so rows ``0 ... d_out - 1`` are ``W_query``, the next ``d_out`` ``W_key``, the
  last ``d_out`` ``W_value`` (each transposed; ``qkv.bias`` split alike);
  ``proj`` -> ``out_proj``.
* ``MHAEinsum`` (raw ``W_query``, ``W_key``, ``W_value`` of shape ``[d_in, d_out]``, used as
  ``einsum('bnd,do->bno', x, W)``; ``bias_q``, ``bias_k``, ``bias_v``; ``out_proj.*``):
  ``W_query`` -> ``W_query/kernel`` as is (not transposed), ``bias_q`` -> ``W_query/bias``
  (``_k``, ``_v`` alike), ``out_proj`` as the chapter's.
* ``MHAPyTorchClass`` (``multihead_attn.in_proj_weight`` ``[3 * d_out, d_out]``,
  ``multihead_attn.out_proj.weight``, ``proj.weight``, ``proj.bias``): ``in_proj_weight``
  splits into query, key, value thirds as ``qkv.weight`` (``nn.MultiheadAttention`` does
  the same); the class has TWO output projections, ``nn.MultiheadAttention``'s
  ``out_proj`` then its own ``proj``, and jattn's module one, so they are folded exactly
  into ``out_proj``: ``W = W_proj @ W_out``, ``b = W_proj @ b_out + b_proj`` (``b_out`` is 0
  when ``nn.MultiheadAttention`` has no bias), computed in float64. The class reads inputs of
  width ``d_out`` (``nn.MultiheadAttention(embed_dim=d_out)``), so ``d_in == d_out``.
  With ``qkv_bias=True`` it also sets ``add_bias_kv=True``: ``multihead_attn.bias_k`` and
  ``bias_v`` are an extra key/value token that every query attends to, which jattn's
  module does not have, so such a state dict raises rather than load into something that
  computes otherwise (``in_proj_bias`` and ``out_proj.bias`` without them load).

Every layout is told apart by its keys, and no two layouts with the same keys need
different mappings, so no argument selects one. Note on ``MHAPyTorchSDPAWithoutFlash``: the
notebook passes its ``mask`` buffer ``triu(ones, diagonal=1).bool()`` to
``scaled_dot_product_attention``, where True means *attend*, so the class as written attends
to strictly later tokens (rasbt/LLMs-from-scratch issue #1061); its weights are the same as
the other ``qkv`` classes', and jattn's causal module computes what the section intends.

Nothing here imports torch: pass ``model.state_dict()`` (tensors go through ``.numpy()``,
bfloat16 ones through ``.float()``) or any mapping of the same keys to numpy arrays.
:func:`to_numpy` is that conversion of one value, with its checks (floats, finite);
:func:`jattn.models.from_book` uses it too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn import _checks

__all__ = [
    "from_flax_attention",
    "from_torch_state_dict",
    "linen_to_nnx",
    "nnx_to_linen",
    "split_to_wrapper",
    "to_numpy",
    "wrapper_to_split",
]

_PROJECTIONS = ("W_query", "W_key", "W_value")
_LINEAR_KEY = re.compile(r"^(?:heads\.(\d+)\.)?(W_query|W_key|W_value)\.(weight|bias)$")
_OUT_PROJ_KEY = re.compile(r"^out_proj\.(weight|bias)$")
_BUFFER_KEY = re.compile(r"^(?:heads\.\d+\.)?mask$")


# ----------------------------------------------------------------------------------------
# PyTorch -> Linen
# ----------------------------------------------------------------------------------------


def to_numpy(value, key: str) -> np.ndarray:
    """One value of a state dict as a checked float numpy array (torch is never imported).

    A torch tensor is read with ``.detach().cpu().numpy()``; a bfloat16 tensor, which numpy
    cannot hold, through ``.float()`` first (exact: every bfloat16 is a float32). Numpy
    arrays (``ml_dtypes.bfloat16`` included) and array-likes are taken as they are.

    Args:
      value: a tensor or array-like.
      key: its key in the state dict, for error messages (``state_dict[key]``).

    Returns:
      A numpy array of a floating dtype, all finite.

    Raises:
      TypeError: a value that is not an array, or does not hold floats.
      ValueError: NaN or Inf values.
    """
    name = f"state_dict[{key!r}]"
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu()
        if str(getattr(value, "dtype", "")) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    try:
        array = np.asarray(value)
    except Exception as e:
        raise TypeError(
            f"{name} cannot be converted to a numpy array ({e}). Pass numpy arrays or tensors."
        ) from None
    if not jnp.issubdtype(array.dtype, jnp.floating):  # also accepts ml_dtypes' bfloat16
        raise TypeError(f"{name} must hold floats, got dtype {array.dtype}.")
    finite = np.isfinite(array if array.dtype.itemsize >= 4 else array.astype(np.float32))
    if not np.all(finite):
        raise ValueError(
            f"{name} holds NaN or Inf values: the checkpoint is corrupt or was saved from a "
            "diverged run."
        )
    return array


def _torch_key(path: tuple[str, ...]) -> str:
    """The book's PyTorch key of a Linen path, for error messages."""
    names = []
    for part in path:
        if part.startswith("heads_"):
            names.append(f"heads.{part[len('heads_') :]}")
        else:
            names.append({"kernel": "weight"}.get(part, part))
    return ".".join(names)


def _linear_group(arrays: dict[str, np.ndarray], prefix: str, out_proj: bool) -> dict:
    """Checks one set of Q/K/V (and out_proj) nn.Linear tensors; returns its Linen params.

    Args:
      arrays: PyTorch key -> array, keys relative to ``prefix``.
      prefix: ``''`` or ``'heads.{i}.'``, for messages.
      out_proj: whether ``out_proj.weight`` (and ``out_proj.bias``, when given) are expected.
    """
    names = [*_PROJECTIONS, "out_proj"] if out_proj else list(_PROJECTIONS)
    for name in names:
        if f"{name}.weight" not in arrays:
            raise ValueError(f"state_dict is missing key {prefix}{name}.weight.")
    with_bias = [name for name in _PROJECTIONS if f"{name}.bias" in arrays]
    if with_bias and len(with_bias) != len(_PROJECTIONS):
        absent = next(name for name in _PROJECTIONS if name not in with_bias)
        raise ValueError(
            f"state_dict is missing key {prefix}{absent}.bias: the book's qkv_bias=True gives "
            "all three of W_query, W_key and W_value a bias, or none of them."
        )

    d_in = None
    params: dict[str, Any] = {}
    for name in names:
        weight = arrays[f"{name}.weight"]
        if weight.ndim != 2:
            raise ValueError(
                f"state_dict[{prefix}{name}.weight] must be 2-D [out_features, in_features] "
                f"(nn.Linear.weight), got shape {weight.shape}."
            )
        if name != "out_proj":
            d_in = weight.shape[1] if d_in is None else d_in
            if weight.shape[1] != d_in:
                raise ValueError(
                    f"state_dict[{prefix}{name}.weight] has in_features {weight.shape[1]}, but "
                    f"{prefix}W_query.weight has {d_in}: all projections read the same input."
                )
        params[name] = {"kernel": np.ascontiguousarray(weight.T)}
        bias = arrays.get(f"{name}.bias")
        if bias is not None:
            if bias.shape != (weight.shape[0],):
                raise ValueError(
                    f"state_dict[{prefix}{name}.bias] must have shape ({weight.shape[0]},) to "
                    f"match {prefix}{name}.weight {weight.shape}, got {bias.shape}."
                )
            params[name]["bias"] = bias

    d_q = params["W_query"]["kernel"].shape[1]
    d_kv = params["W_key"]["kernel"].shape[1]
    if params["W_value"]["kernel"].shape[1] != d_kv:
        raise ValueError(
            f"state_dict[{prefix}W_value.weight] must have as many rows as {prefix}W_key.weight "
            f"({d_kv}), got shape {arrays['W_value.weight'].shape}."
        )
    # Single-head classes need d_kv == d_q; grouped-query attention needs d_q % d_kv == 0.
    if (not out_proj and d_kv != d_q) or (out_proj and d_q % d_kv):
        raise ValueError(
            f"state_dict[{prefix}W_key.weight] has {d_kv} rows, which does not fit "
            f"{prefix}W_query.weight's {d_q} rows."
        )
    if out_proj and arrays["out_proj.weight"].shape != (d_q, d_q):
        raise ValueError(
            f"state_dict[out_proj.weight] must have shape ({d_q}, {d_q}) (d_out = rows of "
            f"W_query.weight), got {arrays['out_proj.weight'].shape}."
        )
    return params


def _raw_group(arrays: dict[str, np.ndarray]) -> dict:
    """SelfAttention_v1's three raw ``[d_in, d_out]`` matrices."""
    shape = None
    for name in _PROJECTIONS:
        if name not in arrays:
            raise ValueError(f"state_dict is missing key {name} (SelfAttention_v1 layout).")
        w = arrays[name]
        shape = w.shape if shape is None else shape
        if w.ndim != 2 or w.shape != shape:
            raise ValueError(
                f"state_dict[{name}] must be a 2-D [d_in, d_out] matrix shaped like W_query "
                f"{shape}, got shape {w.shape}."
            )
    return {name: arrays[name] for name in _PROJECTIONS}


def _check_module(module, api: str, what: str = "module") -> None:
    """``api``: ``'nnx'`` (an NNX module) or ``'any'`` (Linen or NNX)."""
    ok = isinstance(module, nnx.Module) or (api == "any" and isinstance(module, nn.Module))
    if not ok:
        kind = "a jattn.nnx module" if api == "nnx" else "a jattn.linen or jattn.nnx module"
        raise TypeError(
            f"{what} must be {kind} (constructed, e.g. jattn.nnx.MultiHeadAttention(d_in, "
            f"d_out, context_length, dropout, num_heads, rngs=nnx.Rngs(0))), got "
            f"{type(module).__name__}."
        )


def _expected_params(module, d_in: int) -> dict:
    """A Linen ``module``'s params for inputs of width ``d_in`` (abstract init), or an NNX one's."""
    if isinstance(module, nnx.Module):
        return nnx.to_pure_dict(nnx.state(module, nnx.Param))
    # Only the classes with dropout take (and, with dropout > 0, need) `deterministic`.
    kwargs = {"deterministic": True} if hasattr(module, "dropout") else {}
    x = jax.ShapeDtypeStruct((1, d_in), jnp.float32)
    variables = jax.eval_shape(lambda x: module.init(jax.random.key(0), x, **kwargs), x)
    # A tree of jax.ShapeDtypeStruct; unbox the nn.Partitioned boxes model_axis= adds.
    return nn.unbox(variables["params"])


def _shape(leaf) -> tuple[int, ...]:
    """Shape of an array or ShapeDtypeStruct; a tuple is taken to be a shape already."""
    return (
        leaf
        if isinstance(leaf, tuple)
        else tuple(np.shape(leaf) if not hasattr(leaf, "shape") else leaf.shape)
    )


def _torch_shapes(tree: Mapping) -> dict:
    """Leaf shapes as PyTorch has them (``nn.Linear.weight`` is the transposed kernel)."""
    flat = _flatten(tree)
    return _unflatten(
        {p: _shape(v)[::-1] if p[-1] == "kernel" else _shape(v) for p, v in flat.items()}
    )


def _flatten(tree: Mapping, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, (*prefix, str(k))))
        else:
            out[(*prefix, str(k))] = v
    return out


def _unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def _match_tree(got: Mapping, expected: Mapping, describe, what: str) -> None:
    """Raises a ValueError naming the first leaf missing, unexpected or of the wrong shape.

    Args:
      got: nested dict of arrays or shapes (tuples).
      expected: nested dict of arrays, ShapeDtypeStructs or shapes.
      describe: path tuple -> the key to name in messages.
      what: what ``got`` is, for messages.
    """
    got_flat, exp_flat = _flatten(got), _flatten(expected)
    for path in exp_flat:
        if path not in got_flat:
            raise ValueError(f"{what} is missing key {describe(path)}.")
    for path, value in got_flat.items():
        if path not in exp_flat:
            raise ValueError(
                f"{what} has unexpected key {describe(path)}; the module has "
                f"{sorted(describe(p) for p in exp_flat)}."
            )
        shape, expected_shape = _shape(value), _shape(exp_flat[path])
        if shape != expected_shape:
            raise ValueError(
                f"{what}[{describe(path)}] has shape {shape}, the module expects {expected_shape}."
            )


# ----------------------------------------------------------------------------------------
# The bonus notebook's layouts (ch03/02_bonus_efficient-multihead-attention)
# ----------------------------------------------------------------------------------------


def _require(arrays: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    if key not in arrays:
        raise ValueError(f"state_dict is missing key {key}.")
    return arrays[key]


def _dense(arrays, weight_key: str, bias_key: str | None, shape: tuple, what: str) -> dict:
    """One ``nn.Linear``'s Linen params; ``bias_key=None``: a Linear without bias."""
    weight = _require(arrays, weight_key)
    if weight.shape != shape:
        raise ValueError(
            f"state_dict[{weight_key}] must have shape {shape} ({what}), got {weight.shape}."
        )
    layer = {"kernel": np.ascontiguousarray(weight.T)}
    if bias_key is not None:
        bias = _require(arrays, bias_key)
        if bias.shape != (shape[0],):
            raise ValueError(
                f"state_dict[{bias_key}] must have shape ({shape[0]},) to match {weight_key} "
                f"{shape}, got {bias.shape}."
            )
        layer["bias"] = bias
    return layer


def _split_thirds(arrays, weight_key: str, bias_key: str, what: str) -> tuple[dict, int, int]:
    """A stacked ``[3 * d_out, d_in]`` Q/K/V weight (and bias) -> W_query, W_key, W_value.

    The notebook's forward views the projection as ``(b, T, 3, num_heads, head_dim)`` and
    unbinds queries, keys, values along the ``3``; ``nn.MultiheadAttention`` chunks its
    ``in_proj`` the same way. So the thirds are whole projections, in that order, and the
    head split inside each third is the chapter's (``view(b, T, num_heads, head_dim)``).

    Returns:
      ``({'W_query': {kernel, bias?}, ...}, d_out, d_in)``.
    """
    weight = _require(arrays, weight_key)
    if weight.ndim != 2:
        raise ValueError(
            f"state_dict[{weight_key}] must be 2-D [3 * d_out, d_in] ({what}), got shape "
            f"{weight.shape}."
        )
    rows, d_in = weight.shape
    if rows % 3:
        raise ValueError(
            f"state_dict[{weight_key}] has {rows} rows, which is not divisible by 3: {what} "
            "stacks the query, key and value rows, d_out each. Pass the tensor unchanged "
            "from the module's state_dict()."
        )
    d_out = rows // 3
    bias = arrays.get(bias_key)
    if bias is not None and bias.shape != (rows,):
        raise ValueError(
            f"state_dict[{bias_key}] must have shape ({rows},) to match {weight_key} "
            f"{weight.shape}, got {bias.shape}."
        )
    params: dict[str, Any] = {}
    for i, name in enumerate(_PROJECTIONS):  # the unbind order: queries, keys, values
        third = slice(i * d_out, (i + 1) * d_out)
        params[name] = {"kernel": np.ascontiguousarray(weight[third].T)}  # [d_in, d_out]
        if bias is not None:
            params[name]["bias"] = bias[third]
    return params, d_out, d_in


def _compose(first: Mapping, second: Mapping) -> dict:
    """One Dense layer equal to ``second(first(x))``, in float64, cast back once.

    ``(x @ k1 + b1) @ k2 + b2 = x @ (k1 @ k2) + (b1 @ k2 + b2)``; in PyTorch's terms
    ``W = W2 @ W1`` and ``b = W2 @ b1 + b2``. ``first`` may have no bias (zero).
    """
    dtype = np.result_type(first["kernel"], second["kernel"], second["bias"])
    k1, k2 = (np.asarray(layer["kernel"], np.float64) for layer in (first, second))
    b1 = np.asarray(first.get("bias", np.zeros(k1.shape[1])), np.float64)
    return {
        "kernel": (k1 @ k2).astype(dtype),  # [d_out, d_out]
        "bias": (b1 @ k2 + np.asarray(second["bias"], np.float64)).astype(dtype),
    }


def _load_combined_qkv(arrays: dict[str, np.ndarray]) -> dict:
    """MultiHeadAttentionCombinedQKV, MHAPyTorchScaledDotProduct, ...SDPAWithoutFlash, ...Flex."""
    what = "qkv = nn.Linear(d_in, 3 * d_out)"
    params, d_out, _ = _split_thirds(arrays, "qkv.weight", "qkv.bias", what)
    params["out_proj"] = _dense(
        arrays,
        "proj.weight",
        "proj.bias",
        (d_out, d_out),
        f"proj = nn.Linear(d_out, d_out), d_out = {d_out} = rows of qkv.weight / 3",
    )
    return params


def _load_einsum(arrays: dict[str, np.ndarray]) -> dict:
    """MHAEinsum: raw ``[d_in, d_out]`` matrices (``x @ W``), ``bias_q/k/v``, ``out_proj``."""
    bias_names = ("bias_q", "bias_k", "bias_v")
    shape = None
    params: dict[str, Any] = {}
    for name in _PROJECTIONS:
        weight = _require(arrays, name)
        shape = weight.shape if shape is None else shape
        if weight.ndim != 2 or weight.shape != shape:
            raise ValueError(
                f"state_dict[{name}] must be a 2-D [d_in, d_out] matrix shaped like W_query "
                f"{shape} (MHAEinsum's nn.Parameter, used as x @ {name}), got {weight.shape}."
            )
        params[name] = {"kernel": weight}  # already [d_in, d_out]: no transpose
    d_out = shape[1]
    present = [b for b in bias_names if b in arrays]
    if present and len(present) != len(bias_names):
        absent = next(b for b in bias_names if b not in present)
        raise ValueError(
            f"state_dict is missing key {absent}: MHAEinsum(qkv_bias=True) has bias_q, bias_k "
            "and bias_v, qkv_bias=False none of them."
        )
    if present:  # all three (checked above)
        for name, bias_name in zip(_PROJECTIONS, bias_names, strict=True):
            if arrays[bias_name].shape != (d_out,):
                raise ValueError(
                    f"state_dict[{bias_name}] must have shape ({d_out},) to match {name} {shape}, "
                    f"got {arrays[bias_name].shape}."
                )
            params[name]["bias"] = arrays[bias_name]
    params["out_proj"] = _dense(
        arrays,
        "out_proj.weight",
        "out_proj.bias",
        (d_out, d_out),
        f"out_proj = nn.Linear(d_out, d_out), d_out = {d_out} = columns of W_query",
    )
    return params


def _load_torch_mha(arrays: dict[str, np.ndarray]) -> dict:
    """MHAPyTorchClass: ``nn.MultiheadAttention``'s in/out projections, then ``proj``."""
    prefix = "multihead_attn."
    for key in (f"{prefix}bias_k", f"{prefix}bias_v"):
        if key in arrays:
            raise ValueError(
                f"state_dict has key {key!r}: MHAPyTorchClass(qkv_bias=True) builds "
                "nn.MultiheadAttention(add_bias_kv=True), which appends a learned key/value "
                "token that every query attends to. jattn's MultiHeadAttention has no such "
                "token, so these weights cannot be loaded exactly; train with qkv_bias=False "
                "(or nn.MultiheadAttention(bias=True, add_bias_kv=False), which loads)."
            )
    w_key, b_key = f"{prefix}in_proj_weight", f"{prefix}in_proj_bias"
    out_bias = f"{prefix}out_proj.bias"
    params, d, d_in = _split_thirds(arrays, w_key, b_key, "nn.MultiheadAttention's in_proj_weight")
    if d_in != d:
        raise ValueError(
            f"state_dict[{w_key}] must have shape (3 * embed_dim, embed_dim): "
            f"nn.MultiheadAttention projects inputs of width embed_dim, got {arrays[w_key].shape}."
        )
    if (b_key in arrays) != (out_bias in arrays):
        absent, present = (out_bias, b_key) if b_key in arrays else (b_key, out_bias)
        raise ValueError(
            f"state_dict is missing key {absent}: nn.MultiheadAttention(bias=True) has both "
            f"in_proj_bias and out_proj.bias, bias=False neither ({present} is given)."
        )
    inner = _dense(
        arrays,
        f"{prefix}out_proj.weight",
        out_bias if out_bias in arrays else None,
        (d, d),
        "nn.MultiheadAttention's out_proj, embed_dim x embed_dim",
    )
    outer = _dense(arrays, "proj.weight", "proj.bias", (d, d), "proj = nn.Linear(d_out, d_out)")
    # Two output projections in a row; jattn's module has one: fold them exactly.
    params["out_proj"] = _compose(inner, outer)
    return params


def _load_ch03_wrapper(arrays: dict[str, np.ndarray]) -> dict:
    """Ch03_MHA_Wrapper: CausalAttention heads side by side, then ``out_proj``."""
    linear: dict[int, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        if m := _LINEAR_KEY.match(key):
            head, name, kind = m.groups()
            linear.setdefault(int(head), {})[f"{name}.{kind}"] = value
    heads = _heads_params(linear)  # not empty: _notebook_layout saw a heads.{i}.* key
    names = list(heads)
    # Head i's [d_in, d_head] kernel -> columns i*d_head ... of the fused [d_in, H*d_head].
    params: dict[str, Any] = {
        proj: {
            leaf: np.concatenate([heads[n][proj][leaf] for n in names], axis=-1)
            for leaf in heads[names[0]][proj]
        }
        for proj in _PROJECTIONS
    }
    width = params["W_query"]["kernel"].shape[1]
    params["out_proj"] = _dense(
        arrays,
        "out_proj.weight",
        "out_proj.bias",
        (width, width),
        f"out_proj = nn.Linear(d_out * num_heads, d_out * num_heads) for {len(names)} heads "
        f"of width {width // len(names)}",
    )
    return params


def _num_heads(arrays: Mapping[str, np.ndarray]) -> int:
    return len({m.group(1) for k in arrays if (m := re.match(r"^heads\.(\d+)\.", k))})


def _widths(shapes: Mapping[tuple[str, ...], tuple[int, ...]], classes: str):
    """``(d_in, d_out, qkv_bias)`` of a MultiHeadAttention's param shapes."""
    d_in, d_out = shapes[("W_query", "kernel")]
    d_kv = shapes[("W_key", "kernel")][1]
    if d_kv != d_out:
        raise ValueError(
            f"The module has grouped-query attention (W_key {d_kv} wide, W_query {d_out}), "
            f"but {classes} have as many key/value heads as query heads: build the module "
            "without num_kv_heads."
        )
    return d_in, d_out, ("W_query", "bias") in shapes


def _combined_qkv_keys(d_in: int, d: int, bias: bool, num_heads: int) -> dict:
    keys = {"qkv.weight": (3 * d, d_in), "proj.weight": (d, d), "proj.bias": (d,)}
    return keys | ({"qkv.bias": (3 * d,)} if bias else {})


def _einsum_keys(d_in: int, d: int, bias: bool, num_heads: int) -> dict:
    keys = {name: (d_in, d) for name in _PROJECTIONS}
    keys |= {f"bias_{n}": (d,) for n in "qkv"} if bias else {}
    return keys | {"out_proj.weight": (d, d), "out_proj.bias": (d,)}


def _torch_mha_keys(d_in: int, d: int, bias: bool, num_heads: int) -> dict:
    if d_in != d:
        raise ValueError(
            f"The module has d_in={d_in} and d_out={d}, but MHAPyTorchClass's "
            "nn.MultiheadAttention(embed_dim=d_out) reads inputs of width d_out: build the "
            "module with d_in == d_out."
        )
    keys = {"multihead_attn.in_proj_weight": (3 * d, d), "multihead_attn.out_proj.weight": (d, d)}
    if bias:
        keys |= {"multihead_attn.in_proj_bias": (3 * d,), "multihead_attn.out_proj.bias": (d,)}
    return keys | {"proj.weight": (d, d), "proj.bias": (d,)}


def _ch03_wrapper_keys(d_in: int, d: int, bias: bool, num_heads: int) -> dict:
    keys = {}
    for i in range(num_heads):
        for name in _PROJECTIONS:
            keys[f"heads.{i}.{name}.weight"] = (d // num_heads, d_in)
            keys |= {f"heads.{i}.{name}.bias": (d // num_heads,)} if bias else {}
    return keys | {"out_proj.weight": (d, d), "out_proj.bias": (d,)}


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A parameter layout of the bonus notebook's classes."""

    classes: str  # the notebook classes that have it, for messages
    pattern: re.Pattern  # the keys it holds (besides mask buffers)
    listing: str  # those keys, for messages
    load: Callable[[dict[str, np.ndarray]], dict]  # arrays -> MultiHeadAttention params
    # (d_in, d_out, qkv_bias, num_heads) of a module -> the key shapes it needs
    keys_for: Callable[[int, int, bool, int], dict[str, tuple[int, ...]]]


_COMBINED_QKV = _Layout(
    "MultiHeadAttentionCombinedQKV, MHAPyTorchScaledDotProduct, MHAPyTorchSDPAWithoutFlash "
    "and MHAPyTorchFlexAttention",
    re.compile(r"^(?:qkv|proj)\.(?:weight|bias)$"),
    "qkv.weight, qkv.bias, proj.weight, proj.bias",
    _load_combined_qkv,
    _combined_qkv_keys,
)
_EINSUM = _Layout(
    "MHAEinsum",
    re.compile(r"^(?:W_query|W_key|W_value|bias_[qkv]|out_proj\.weight|out_proj\.bias)$"),
    "W_query, W_key, W_value, bias_q, bias_k, bias_v, out_proj.weight, out_proj.bias",
    _load_einsum,
    _einsum_keys,
)
_TORCH_MHA = _Layout(
    "MHAPyTorchClass",
    re.compile(
        r"^(?:multihead_attn\.(?:in_proj_weight|in_proj_bias|out_proj\.weight|out_proj\.bias"
        r"|bias_k|bias_v)|proj\.weight|proj\.bias)$"
    ),
    "multihead_attn.in_proj_weight, multihead_attn.in_proj_bias, "
    "multihead_attn.out_proj.weight, multihead_attn.out_proj.bias, proj.weight, proj.bias",
    _load_torch_mha,
    _torch_mha_keys,
)
_CH03_WRAPPER = _Layout(
    "Ch03_MHA_Wrapper",
    re.compile(
        r"^(?:heads\.\d+\.(?:W_query|W_key|W_value)\.(?:weight|bias)|out_proj\.(?:weight|bias))$"
    ),
    "heads.{i}.W_query.weight, heads.{i}.W_query.bias (and W_key, W_value), "
    "out_proj.weight, out_proj.bias",
    _load_ch03_wrapper,
    _ch03_wrapper_keys,
)
_NOTEBOOK_LAYOUTS = (_COMBINED_QKV, _EINSUM, _TORCH_MHA, _CH03_WRAPPER)


def _notebook_layout(arrays: Mapping[str, np.ndarray]) -> _Layout | None:
    """The bonus notebook's layout of these keys, or None for the chapter's own classes.

    Raises:
      ValueError: a key of another layout among them.
    """
    keys = set(arrays)
    out_proj = bool(keys & {"out_proj.weight", "out_proj.bias"})
    chapter_linear = any(_LINEAR_KEY.match(k) for k in keys)
    if any(k.startswith("multihead_attn.") for k in keys):
        layout = _TORCH_MHA
    elif keys & {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}:
        layout = _COMBINED_QKV
    elif keys & {"bias_q", "bias_k", "bias_v"} or (
        keys & set(_PROJECTIONS) and out_proj and not chapter_linear
    ):
        layout = _EINSUM  # raw matrices beside out_proj: SelfAttention_v1 has no out_proj
    elif out_proj and all(k.startswith("heads.") or _OUT_PROJ_KEY.match(k) for k in keys):
        layout = _CH03_WRAPPER if _num_heads(arrays) else None
    else:
        layout = None
    if layout is not None:
        for key in sorted(keys):
            if not layout.pattern.match(key):
                raise ValueError(
                    f"state_dict has key {key!r} beside keys of the bonus notebook's "
                    f"{layout.classes}, which hold {layout.listing} (and a mask buffer): pass "
                    "the state dict of one module."
                )
    return layout


def _check_notebook_module(layout: _Layout, arrays, params: Mapping, module) -> None:
    """Checks a notebook layout's keys and shapes against a MultiHeadAttention ``module``."""
    flat = {p: _shape(v) for p, v in _flatten(_expected_params(module, _d_in(params))).items()}
    if {p[0] for p in flat} != {*_PROJECTIONS, "out_proj"}:
        raise ValueError(
            f"state_dict holds {layout.classes} weights, which load into a jattn "
            f"MultiHeadAttention; the module is a {type(module).__name__} with parameters "
            f"{sorted('/'.join(p) for p in flat)}."
        )
    num_heads, given = getattr(module, "num_heads", None), _num_heads(arrays)
    if layout is _CH03_WRAPPER and given != num_heads:
        raise ValueError(
            f"state_dict has {given} heads (heads.0 ... heads.{given - 1}), the module has "
            f"num_heads={num_heads}: "
            "Ch03_MHA_Wrapper(d_in, d_out, ..., num_heads=H) loads into "
            "MultiHeadAttention(H * d_out, ..., num_heads=H)."
        )
    expected = layout.keys_for(*_widths(flat, layout.classes), num_heads)
    got = {key: value.shape for key, value in arrays.items()}
    _match_tree(got, expected, lambda path: path[0], "state_dict")


# ----------------------------------------------------------------------------------------
# The entry
# ----------------------------------------------------------------------------------------


def _known_key(key: str) -> bool:
    return bool(
        key in _PROJECTIONS
        or _LINEAR_KEY.match(key)
        or _OUT_PROJ_KEY.match(key)
        or any(layout.pattern.match(key) for layout in _NOTEBOOK_LAYOUTS)
    )


def _read_state_dict(state_dict: Mapping) -> dict[str, np.ndarray]:
    """The parameters as numpy arrays, mask buffers dropped; an unknown key raises."""
    arrays = {}
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise ValueError(f"state_dict has a non-string key {key!r}.")
        if _BUFFER_KEY.match(key):
            continue  # the book's registered causal-mask buffer; jattn builds masks itself
        if not _known_key(key):
            raise ValueError(
                f"state_dict has unknown key {key!r}. Expected the book's keys: W_query, "
                "W_query.weight, W_query.bias (and W_key, W_value), out_proj.weight, "
                "out_proj.bias, heads.{i}.W_query.weight, ..., or those of the bonus notebook "
                "mha-implementations.ipynb: qkv.weight, qkv.bias, proj.weight, proj.bias; "
                "bias_q, bias_k, bias_v; multihead_attn.in_proj_weight, "
                "multihead_attn.in_proj_bias, multihead_attn.out_proj.weight, "
                "multihead_attn.out_proj.bias (buffers named mask are ignored)."
            )
        arrays[key] = to_numpy(value, key)
    return arrays


def _heads_params(linear: Mapping[int, dict[str, np.ndarray]]) -> dict:
    """``{'heads_{i}': params}`` of heads 0 ... n-1 (each checked, all the same shapes)."""
    heads = sorted(linear)
    for i in range(len(heads)):
        if i not in heads:
            raise ValueError(f"state_dict is missing key heads.{i}.W_query.weight.")
    params = {f"heads_{i}": _linear_group(linear[i], f"heads.{i}.", False) for i in heads}
    first = jax.tree.map(np.shape, params["heads_0"])
    for i in heads[1:]:
        shapes = jax.tree.map(np.shape, params[f"heads_{i}"])
        if shapes != first:
            raise ValueError(
                f"state_dict heads.{i}.* shapes {shapes} differ from heads.0.* {first}: "
                "every head of the wrapper has the same shapes."
            )
    return params


def _chapter_params(arrays: dict[str, np.ndarray]) -> dict:
    """Params of the chapter's classes (SelfAttention_v1 ... MultiHeadAttention)."""
    raw = {k: v for k, v in arrays.items() if k in _PROJECTIONS}
    linear: dict[int | None, dict[str, np.ndarray]] = {}  # head index (None: top level)
    for key, value in arrays.items():
        if m := _LINEAR_KEY.match(key):
            head, name, kind = m.groups()
            head = None if head is None else int(head)
            linear.setdefault(head, {})[f"{name}.{kind}"] = value
        elif m := _OUT_PROJ_KEY.match(key):
            linear.setdefault(None, {})[f"out_proj.{m.group(1)}"] = value
    if raw and linear:
        key = next(iter(raw))
        raise ValueError(
            f"state_dict mixes SelfAttention_v1's raw {key!r} with nn.Linear keys; pass the "
            "state dict of one module."
        )
    heads = {h: group for h, group in linear.items() if h is not None}
    if raw:
        return _raw_group(raw)
    if heads:
        if None in linear:
            top = sorted(linear[None], key=lambda k: k.startswith("out_proj"))
            raise ValueError(
                f"state_dict has key {top[0]!r} beside heads.{{i}}.* keys: the book's "
                "MultiHeadAttentionWrapper has no parameters outside its heads (the bonus "
                "notebook's Ch03_MHA_Wrapper has out_proj.weight and out_proj.bias)."
            )
        return _heads_params(heads)
    if linear:
        top = linear[None]
        return _linear_group(top, "", "out_proj.weight" in top or "out_proj.bias" in top)
    raise ValueError("state_dict holds no attention parameters (is it empty?).")


def _d_in(params: Mapping) -> int:
    """Input width of loaded params (a raw matrix or a kernel is ``[d_in, d_out]``)."""
    w_query = (params["heads_0"] if "heads_0" in params else params)["W_query"]
    return np.shape(w_query["kernel"] if isinstance(w_query, Mapping) else w_query)[0]


def from_torch_state_dict(state_dict: Mapping[str, Any], module=None) -> dict:
    """Linen variables ``{'params': ...}`` from a state dict of the book's PyTorch classes.

    The layout is recognised from the keys (the module docstring lists every mapping):
    ``heads.{i}.*`` is a ``MultiHeadAttentionWrapper``; ``out_proj.*`` a
    ``MultiHeadAttention``; a raw ``W_query`` a ``SelfAttention_v1``; ``W_query.weight`` a
    ``SelfAttention_v2`` or a ``CausalAttention`` (same parameters). The bonus notebook's
    classes load into a ``MultiHeadAttention``: ``heads.{i}.*`` with ``out_proj.*``
    (``Ch03_MHA_Wrapper``), ``qkv.*`` with ``proj.*`` (``MultiHeadAttentionCombinedQKV``,
    ``MHAPyTorchScaledDotProduct``, ``MHAPyTorchSDPAWithoutFlash``,
    ``MHAPyTorchFlexAttention``), raw ``W_query`` with ``out_proj.*`` (``MHAEinsum``),
    ``multihead_attn.*`` with ``proj.*`` (``MHAPyTorchClass``, its two output projections
    folded into one). Buffers (``mask``, ``heads.{i}.mask``) are ignored. The result also
    loads into :mod:`jattn.nnx` modules through :func:`linen_to_nnx`.

    Args:
      state_dict: PyTorch key -> array-like (numpy arrays, or torch tensors, which are
        read with ``.detach().cpu().numpy()``; torch is never imported here).
      module: optional ``jattn.linen`` module (or constructed ``jattn.nnx`` module) the
        weights are for; when given, every parameter's shape is checked against it
        (d_in for NNX, d_out, num_heads, qkv_bias, GQA). It is not modified.

    Returns:
      ``{'params': {...}}`` with the book's names, ``nn.Linear`` weights transposed.

    Raises:
      ValueError: an unknown or missing key, a wrong shape (each names the key), keys of
        two layouts together, or weights jattn's modules cannot hold exactly
        (``nn.MultiheadAttention``'s ``bias_k``/``bias_v``).
      TypeError: a value that is not a float array, or ``module`` not a jattn module.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of PyTorch keys to arrays (model.state_dict()), "
            f"got {type(state_dict).__name__}."
        )
    arrays = _read_state_dict(state_dict)
    layout = _notebook_layout(arrays)
    params = _chapter_params(arrays) if layout is None else layout.load(arrays)
    if module is not None:
        _check_module(module, "any")
        if layout is None:
            _match_tree(
                _torch_shapes(params),
                _torch_shapes(_expected_params(module, _d_in(params))),
                _torch_key,
                "state_dict",
            )
        else:
            _check_notebook_module(layout, arrays, params, module)
    return {"params": jax.tree.map(jnp.asarray, params)}


# ----------------------------------------------------------------------------------------
# Linen <-> NNX
# ----------------------------------------------------------------------------------------


def _params_of(variables, what: str = "variables") -> Mapping:
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise ValueError(
            f"{what} must be Linen variables {{'params': {{...}}}} (what module.init returns), "
            f"got {type(variables).__name__} with keys "
            f"{list(variables) if isinstance(variables, Mapping) else '-'}."
        )
    return variables["params"]


def linen_to_nnx(variables: Mapping, module: nnx.Module) -> nnx.Module:
    """Loads Linen variables into a constructed NNX module of the same class, and returns it.

    Values are cast to the dtypes of the module's parameters (its ``param_dtype``).

    Args:
      variables: ``{'params': ...}`` of a ``jattn.linen`` module (or from
        :func:`from_torch_state_dict`).
      module: a ``jattn.nnx`` module built with the same sizes, e.g.
        ``jattn.nnx.MultiHeadAttention(d_in, d_out, ..., rngs=nnx.Rngs(0))``.

    Returns:
      ``module``, updated in place.

    Raises:
      ValueError: a missing or unexpected parameter, or a shape mismatch (naming its path).
    """
    params = _params_of(variables)
    _check_module(module, "nnx")
    state = nnx.state(module, nnx.Param)
    current = nnx.to_pure_dict(state)
    _match_tree(params, current, "/".join, "variables['params']")
    for path, value in _flatten(params).items():
        dtype = jnp.asarray(value).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"variables['params'][{'/'.join(path)}] must hold floats, got dtype {dtype}."
            )
    cast = jax.tree.map(lambda new, old: jnp.asarray(new, dtype=old.dtype), dict(params), current)
    nnx.replace_by_pure_dict(state, cast)
    nnx.update(module, state)
    return module


def nnx_to_linen(module: nnx.Module) -> dict:
    """Linen variables ``{'params': ...}`` holding an NNX module's parameters (same names)."""
    _check_module(module, "nnx")
    return {"params": nnx.to_pure_dict(nnx.state(module, nnx.Param))}


# ----------------------------------------------------------------------------------------
# Wrapper <-> split (the chapter's claim that both constructions compute the same thing)
# ----------------------------------------------------------------------------------------


def _head_names(params: Mapping) -> list[str]:
    n = len([k for k in params if re.fullmatch(r"heads_\d+", str(k))])
    names = [f"heads_{i}" for i in range(n)]
    if n == 0 or set(params) != set(names):
        raise ValueError(
            f"variables['params'] must be MultiHeadAttentionWrapper params with keys "
            f"heads_0 ... heads_{{n-1}} only, got keys {sorted(params)}."
        )
    return names


def wrapper_to_split(variables: Mapping) -> dict:
    """``MultiHeadAttention`` variables that compute what a ``MultiHeadAttentionWrapper`` does.

    Head ``i``'s ``[d_in, d_out]`` kernels become columns ``i*d_out ... (i+1)*d_out - 1`` of
    the fused ``[d_in, num_heads*d_out]`` kernels; ``out_proj`` is the identity with zero
    bias. Load the result into
    ``MultiHeadAttention(num_heads * d_out, context_length, dropout, num_heads, qkv_bias)``.

    Args:
      variables: ``{'params': {'heads_0': ..., ...}}`` of a wrapper.

    Returns:
      ``{'params': {'W_query', 'W_key', 'W_value', 'out_proj'}}``.
    """
    params = _params_of(variables)
    names = _head_names(params)
    fused: dict[str, Any] = {}
    for proj in _PROJECTIONS:
        leaves = params[names[0]][proj].keys()
        # [d_in, num_heads * d_out] kernels, [num_heads * d_out] biases
        fused[proj] = {
            leaf: jnp.concatenate([jnp.asarray(params[n][proj][leaf]) for n in names], axis=-1)
            for leaf in leaves
        }
    kernel = fused["W_query"]["kernel"]
    width = kernel.shape[-1]
    fused["out_proj"] = {
        "kernel": jnp.eye(width, dtype=kernel.dtype),  # [width, width]: passes heads through
        "bias": jnp.zeros((width,), kernel.dtype),
    }
    return {"params": fused}


def split_to_wrapper(
    variables: Mapping, num_heads: int, num_kv_heads: int | None = None
) -> tuple[dict, dict]:
    """Wrapper variables and the ``out_proj`` to apply after them, equal to a ``MultiHeadAttention``.

    Query head ``h`` takes columns ``h*head_dim ... (h+1)*head_dim - 1`` of ``W_query``; its
    key/value head is ``h // (num_heads // num_kv_heads)`` (copied into every head that
    shares it). ``MultiHeadAttention(d_out, ..., num_heads)`` then equals
    ``Dense(d_out).apply(out_proj, MultiHeadAttentionWrapper(head_dim, ..., num_heads)
    .apply(wrapper, x))``.

    Args:
      variables: ``{'params': ...}`` of a ``MultiHeadAttention``.
      num_heads: its ``num_heads`` (the parameters alone do not tell it).
      num_kv_heads: its ``num_kv_heads``; default ``num_heads``.

    Returns:
      ``(wrapper_variables, out_proj_variables)``, both ``{'params': ...}``.

    Raises:
      ValueError: params that are not a MultiHeadAttention's, or head counts that do not
        divide its widths.
    """
    params = _params_of(variables)
    missing = [k for k in (*_PROJECTIONS, "out_proj") if k not in params]
    if missing:
        raise ValueError(
            f"variables['params'] must be MultiHeadAttention params; missing {missing}."
        )
    num_heads = _checks.size(num_heads, "num_heads")
    num_kv_heads = num_heads if num_kv_heads is None else _checks.size(num_kv_heads, "num_kv_heads")
    d_out = np.shape(params["W_query"]["kernel"])[-1]
    d_kv = np.shape(params["W_key"]["kernel"])[-1]
    if num_heads < 1 or d_out % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must be >= 1 and divide d_out ({d_out}).")
    head_dim = d_out // num_heads
    if num_kv_heads < 1 or num_heads % num_kv_heads or d_kv != num_kv_heads * head_dim:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}) and give "
            f"W_key's width {d_kv} = num_kv_heads * head_dim ({head_dim})."
        )
    groups = num_heads // num_kv_heads

    def columns(leaf, head):  # [..., head_dim] slice of a kernel or bias
        return jnp.asarray(leaf)[..., head * head_dim : (head + 1) * head_dim]

    wrapper = {}
    for h in range(num_heads):
        source = {"W_query": h, "W_key": h // groups, "W_value": h // groups}
        wrapper[f"heads_{h}"] = {
            proj: {leaf: columns(v, source[proj]) for leaf, v in params[proj].items()}
            for proj in _PROJECTIONS
        }
    return {"params": wrapper}, {"params": dict(params["out_proj"])}


# ----------------------------------------------------------------------------------------
# flax's attention modules -> MultiHeadAttention
# ----------------------------------------------------------------------------------------

_FLAX_PROJECTIONS = {"query": "W_query", "key": "W_key", "value": "W_value"}


def _flax_params(params: Mapping) -> dict[str, dict[str, np.ndarray]]:
    """``{'query': {'kernel': ..., 'bias'?: ...}, ...}`` as float numpy arrays."""
    params = params.get("params", params) if isinstance(params, Mapping) else params
    if not isinstance(params, Mapping):
        raise TypeError(
            "params must be the parameters of flax's MultiHeadDotProductAttention (Linen: "
            "variables['params']; NNX: nnx.to_pure_dict(nnx.state(module, nnx.Param))), got "
            f"{type(params).__name__}."
        )
    extra = sorted(set(params) - {*_FLAX_PROJECTIONS, "out"})
    if extra:
        raise ValueError(
            f"params has entries jattn's MultiHeadAttention has no place for: {extra}. "
            "(flax's normalize_qk uses LayerNorm, jattn's qk_norm RMSNorm: they differ.)"
        )
    out = {}
    for name in (*_FLAX_PROJECTIONS, "out"):
        group = params.get(name)
        if not isinstance(group, Mapping) or "kernel" not in group:
            raise ValueError(
                f"params needs '{name}/kernel' (flax's MultiHeadDotProductAttention has "
                f"query, key, value and out), got keys {sorted(params)}."
            )
        out[name] = {k: to_numpy(v, f"{name}/{k}") for k, v in group.items()}
    return out


def from_flax_attention(params: Mapping) -> dict:
    """Linen variables of :class:`jattn.linen.MultiHeadAttention` from flax's attention.

    flax's ``nn.MultiHeadDotProductAttention`` / ``nnx.MultiHeadAttention`` keep
    ``query``, ``key``, ``value`` kernels ``[d_in, heads, head_dim]`` (biases ``[heads,
    head_dim]``) and ``out`` ``[heads, head_dim, d_out]``; jattn's module keeps the same
    weights flattened over ``(heads, head_dim)``, head ``h`` at features ``h * head_dim``
    on (``W_query [d_in, heads * head_dim]``, ..., ``out_proj [heads * head_dim,
    d_out]``), so the two compute the same function. Build the module to match flax's:
    ``MultiHeadAttention(d_out, context_length, dropout, num_heads, qkv_bias=use_bias,
    head_dim=head_dim, out_bias=use_bias, is_causal=False)`` (flax's modules have no causal
    mask unless one is passed; jattn's are causal by default) and, for flax's dropout,
    ``broadcast_dropout=True``. For NNX, load the result with :func:`linen_to_nnx`.

    Args:
      params: flax's parameters: Linen ``variables`` or ``variables['params']``, or NNX's
        ``nnx.to_pure_dict(nnx.state(module, nnx.Param))``.

    Returns:
      ``{'params': {'W_query': {'kernel', 'bias'?}, 'W_key': ..., 'W_value': ...,
      'out_proj': ...}}``.

    Raises:
      ValueError: a missing projection, entries jattn has no place for (flax's
        ``normalize_qk`` LayerNorms), or kernels whose shapes disagree.
    """
    flax_params = _flax_params(params)
    q_kernel = flax_params["query"]["kernel"]
    if q_kernel.ndim != 3:
        raise ValueError(
            f"query/kernel must be [d_in, num_heads, head_dim], got shape {q_kernel.shape}."
        )
    d_in, num_heads, head_dim = q_kernel.shape
    converted = {}
    for name, target in _FLAX_PROJECTIONS.items():
        group = flax_params[name]
        if group["kernel"].shape[0] != d_in or group["kernel"].ndim != 3:
            raise ValueError(
                f"{name}/kernel must be [d_in={d_in}, num_kv_heads, head_dim={head_dim}] "
                f"(self-attention), got shape {group['kernel'].shape}."
            )
        # [d_in, heads, head_dim] -> [d_in, heads * head_dim]; bias alike
        converted[target] = {"kernel": group["kernel"].reshape(d_in, -1)}
        if "bias" in group:
            converted[target]["bias"] = group["bias"].reshape(-1)
    out = flax_params["out"]
    if out["kernel"].shape[:2] != (num_heads, head_dim):
        raise ValueError(
            f"out/kernel must be [num_heads={num_heads}, head_dim={head_dim}, d_out], got "
            f"shape {out['kernel'].shape}."
        )
    # [heads, head_dim, d_out] -> [heads * head_dim, d_out]
    converted["out_proj"] = {"kernel": out["kernel"].reshape(num_heads * head_dim, -1)}
    if "bias" in out:
        converted["out_proj"]["bias"] = out["bias"]
    return {"params": converted}
