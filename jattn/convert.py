"""Weight converters: the book's PyTorch state dicts -> Linen, Linen <-> NNX, wrapper <-> split.

The parameter trees of :mod:`jattn.linen` and :mod:`jattn.nnx` use the book's names, so
each PyTorch tensor maps to one leaf:

* ``W_query`` (``SelfAttention_v1``'s raw matrix) -> ``W_query``, as is;
* ``W_query.weight`` -> ``W_query/kernel``, transposed; ``W_query.bias`` -> ``W_query/bias``;
* ``out_proj.weight`` -> ``out_proj/kernel``, transposed; ``out_proj.bias`` -> ``out_proj/bias``;
* ``heads.{i}.W_query.weight`` -> ``heads_{i}/W_query/kernel``, transposed (and so on);
* ``mask`` and ``heads.{i}.mask`` (registered buffers) are ignored: jattn builds masks.

(``W_key`` and ``W_value`` as ``W_query``.) A PyTorch ``nn.Linear.weight`` is
``[out_features, in_features]``; a Flax kernel is ``[in_features, out_features]``.

Nothing here imports torch: pass ``model.state_dict()`` (tensors go through ``.numpy()``)
or any mapping of the same keys to numpy arrays.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn import _checks

__all__ = [
    "from_torch_state_dict",
    "linen_to_nnx",
    "nnx_to_linen",
    "split_to_wrapper",
    "wrapper_to_split",
]

_PROJECTIONS = ("W_query", "W_key", "W_value")
_LINEAR_KEY = re.compile(r"^(?:heads\.(\d+)\.)?(W_query|W_key|W_value)\.(weight|bias)$")
_OUT_PROJ_KEY = re.compile(r"^out_proj\.(weight|bias)$")
_BUFFER_KEY = re.compile(r"^(?:heads\.\d+\.)?mask$")


# ----------------------------------------------------------------------------------------
# PyTorch -> Linen
# ----------------------------------------------------------------------------------------


def _to_numpy(key: str, value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except Exception as e:
        raise TypeError(
            f"state_dict[{key!r}] cannot be converted to a numpy array ({e}). Pass numpy "
            "arrays or CPU tensors; convert bfloat16 tensors with `.float()` first."
        ) from None
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(f"state_dict[{key!r}] must hold floats, got dtype {array.dtype}.")
    if not np.all(np.isfinite(array)):
        raise ValueError(
            f"state_dict[{key!r}] holds NaN or Inf values: the checkpoint is corrupt or was "
            "saved from a diverged run."
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
      out_proj: whether ``out_proj.weight`` and ``out_proj.bias`` are expected.
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
    if out_proj and "out_proj.bias" not in arrays:
        raise ValueError(f"state_dict is missing key {prefix}out_proj.bias.")

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
    return variables["params"]  # a tree of jax.ShapeDtypeStruct


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


def from_torch_state_dict(state_dict: Mapping[str, Any], module=None) -> dict:
    """Linen variables ``{'params': ...}`` from a state dict of the book's PyTorch classes.

    The layout is recognised from the keys: ``heads.{i}.*`` is a
    ``MultiHeadAttentionWrapper``; ``out_proj.*`` a ``MultiHeadAttention``; a raw
    ``W_query`` a ``SelfAttention_v1``; ``W_query.weight`` a ``SelfAttention_v2`` or a
    ``CausalAttention`` (same parameters). Buffers (``mask``, ``heads.{i}.mask``) are
    ignored. The result also loads into :mod:`jattn.nnx` modules through
    :func:`linen_to_nnx`.

    Args:
      state_dict: PyTorch key -> array-like (numpy arrays, or torch tensors, which are
        read with ``.detach().cpu().numpy()``; torch is never imported here).
      module: optional ``jattn.linen`` module (or constructed ``jattn.nnx`` module) the
        weights are for; when given, every parameter's shape is checked against it
        (d_in for NNX, d_out, num_heads, qkv_bias, GQA). It is not modified.

    Returns:
      ``{'params': {...}}`` with the book's names, ``nn.Linear`` weights transposed.

    Raises:
      ValueError: an unknown or missing key, a wrong shape (each names the key).
      TypeError: a value that is not a float array.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of PyTorch keys to arrays (model.state_dict()), "
            f"got {type(state_dict).__name__}."
        )
    raw: dict[str, np.ndarray] = {}
    linear: dict[int | None, dict[str, np.ndarray]] = {}  # head index (None: top level)
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise ValueError(f"state_dict has a non-string key {key!r}.")
        if _BUFFER_KEY.match(key):
            continue  # the book's registered causal-mask buffer; jattn builds masks itself
        if key in _PROJECTIONS:
            raw[key] = _to_numpy(key, value)
        elif m := _LINEAR_KEY.match(key):
            head, name, kind = m.groups()
            head = None if head is None else int(head)
            linear.setdefault(head, {})[f"{name}.{kind}"] = _to_numpy(key, value)
        elif m := _OUT_PROJ_KEY.match(key):
            linear.setdefault(None, {})[f"out_proj.{m.group(1)}"] = _to_numpy(key, value)
        else:
            raise ValueError(
                f"state_dict has unknown key {key!r}. Expected the book's keys: W_query, "
                "W_query.weight, W_query.bias (and W_key, W_value), out_proj.weight, "
                "out_proj.bias, heads.{i}.W_query.weight, ... (buffers named mask are ignored)."
            )
    if raw and linear:
        key = next(iter(raw))
        raise ValueError(
            f"state_dict mixes SelfAttention_v1's raw {key!r} with nn.Linear keys; pass the "
            "state dict of one module."
        )
    heads = sorted(h for h in linear if h is not None)
    if raw:
        params = _raw_group(raw)
    elif heads:
        if None in linear:
            key = f"{next(iter(linear[None]))}"
            raise ValueError(
                f"state_dict has key {key!r} beside heads.{{i}}.* keys: the book's "
                "MultiHeadAttentionWrapper has no parameters outside its heads."
            )
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
    elif linear:
        top = linear[None]
        params = _linear_group(top, "", "out_proj.weight" in top or "out_proj.bias" in top)
    else:
        raise ValueError("state_dict holds no attention parameters (is it empty?).")

    if module is not None:
        _check_module(module, "any")
        w_query = (params["heads_0"] if heads else params)["W_query"]
        d_in = np.shape(w_query if raw else w_query["kernel"])[0]
        _match_tree(
            _torch_shapes(params),
            _torch_shapes(_expected_params(module, d_in)),
            _torch_key,
            "state_dict",
        )
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
    num_kv_heads = (
        num_heads if num_kv_heads is None else _checks.size(num_kv_heads, "num_kv_heads")
    )
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
