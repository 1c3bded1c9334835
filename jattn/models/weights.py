"""Loading the book's PyTorch weights into the NNX models, and saving them back.

The models use the book's names, so a PyTorch key maps to an NNX parameter path one to
one: ``.`` becomes a path separator, list indices stay, and the leaf is renamed:

* ``*.weight`` of an ``nn.Linear`` -> ``*/kernel``, transposed (PyTorch keeps
  ``[out_features, in_features]``, Flax ``[in_features, out_features]``);
* ``*.weight`` of an ``nn.Embedding`` -> ``*/embedding``;
* norms: chapter 4's ``scale``/``shift`` and Qwen3's ``scale`` stay; Llama 3's
  ``torch.nn.RMSNorm`` ``weight`` -> ``scale``;
* buffers are ignored: chapter 3's causal ``att.mask`` (jattn builds masks on the fly)
  and the RoPE tables ``cos``/``sin`` (computed from the config).

The expected keys and shapes come from the model the config describes, so a state dict is
checked completely before anything is loaded: a dict of another architecture is named as
such, a missing or unexpected key is named (with the config entry it points to), and a
wrong shape names the key, the shape found and the shape expected.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn import convert
from jattn.models.base import LanguageModel
from jattn.models.configs import config_from_book
from jattn.models.gpt2 import GPTModel
from jattn.models.llama3 import Llama3Model
from jattn.models.qwen3 import Qwen3Model

__all__ = ["MODELS", "book_keys", "detect_arch", "from_book", "to_book_state_dict"]

MODELS = {"gpt2": GPTModel, "llama3": Llama3Model, "qwen3": Qwen3Model}
_NAMES = {"gpt2": "GPT-2 (chapter 4 GPTModel)", "llama3": "Llama 3", "qwen3": "Qwen3"}
_BUFFERS = {
    "gpt2": re.compile(r"^trf_blocks\.\d+\.att\.mask$"),
    "llama3": re.compile(r"^(cos|sin)$"),
    "qwen3": re.compile(r"^(cos|sin)$"),
}


# ----------------------------------------------------------------------------------------
# Key mapping
# ----------------------------------------------------------------------------------------


def _book_key(arch: str, path: tuple) -> tuple[str, bool]:
    """The PyTorch key of an NNX parameter path, and whether the array is transposed."""
    *parents, leaf = (str(p) for p in path)
    prefix = ".".join(parents)
    if leaf == "kernel":
        return f"{prefix}.weight", True
    if leaf == "embedding" or (leaf == "scale" and arch == "llama3"):
        return f"{prefix}.weight", False
    return f"{prefix}.{leaf}", False


def book_keys(model_or_abstract: LanguageModel) -> dict[str, tuple[tuple, tuple[int, ...], bool]]:
    """``{pytorch_key: (nnx_path, pytorch_shape, transposed)}`` for every parameter of a model."""
    arch = model_or_abstract.cfg.arch
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model_or_abstract, nnx.Param)):
        key, transposed = _book_key(arch, path)
        shape = tuple(var.shape)
        out[key] = (path, shape[::-1] if transposed else shape, transposed)
    return out


def detect_arch(keys) -> str | None:
    """Which layout a state dict's keys have: ``'gpt2'``, ``'llama3'``, ``'qwen3'``,
    ``'attention'`` (a chapter-3 module), ``'huggingface'``, or None."""
    keys = {str(k) for k in keys}

    def has(pattern):
        return any(re.fullmatch(pattern, k) for k in keys)

    if "pos_emb.weight" in keys or has(r"trf_blocks\.\d+\.ff\.layers\.\d+\.weight"):
        return "gpt2"
    if has(r"trf_blocks\.\d+\.ff\.fc1\.weight") or has(r"final_norm\.(weight|scale)"):
        if has(r"(trf_blocks\.\d+\.norm1|final_norm)\.weight"):
            return "llama3"
        if has(r"(trf_blocks\.\d+\.norm1|final_norm)\.scale"):
            return "qwen3"
    if has(r"model\.(embed_tokens|layers\.\d+\..*)\.weight") or "lm_head.weight" in keys:
        return "huggingface"
    if has(r"(heads\.\d+\.)?(W_query|W_key|W_value)(\.weight)?"):
        return "attention"
    return None


def _check_arch(arch: str, state_dict: Mapping) -> None:
    found = detect_arch(state_dict)
    if found is None or found == arch:
        return
    if found == "attention":
        raise ValueError(
            "state_dict holds a single chapter-3 attention module (keys W_query.weight, ...), "
            "not a whole model: load it with jattn.convert.from_torch_state_dict."
        )
    if found == "huggingface":
        raise ValueError(
            "state_dict has Hugging Face keys (model.embed_tokens.weight, model.layers.*): load "
            "them into the book's PyTorch model first (llms_from_scratch's "
            "load_weights_into_llama / load_weights_into_qwen) and pass model.state_dict()."
        )
    example = next((k for k in state_dict if detect_arch([k]) == found), next(iter(state_dict)))
    raise ValueError(
        f"state_dict looks like a {_NAMES[found]} state dict (e.g. key {example!r}), not "
        f"{_NAMES[arch]}: call from_book({found!r}, cfg, state_dict) with that model's config."
    )


def _hint(key: str, cfg, missing: bool) -> str:
    """Which config entry a missing or unexpected key points to."""
    m = re.match(r"trf_blocks\.(\d+)\.", key)
    if m and not missing and int(m.group(1)) >= cfg.n_layers:
        return f" The state dict has more blocks than cfg['n_layers'] = {cfg.n_layers}."
    if re.search(r"att\.(W_query|W_key|W_value)\.bias$", key):
        return f" Check cfg['qkv_bias'] (it is {cfg.qkv_bias})."
    if re.search(r"att\.(q_norm|k_norm)\.", key):
        return f" Check cfg['qk_norm'] (it is {cfg.qk_norm})."
    if m and missing:
        return f" Check cfg['n_layers'] (it is {cfg.n_layers})."
    return ""


def _check_keys_and_shapes(arch: str, cfg, state_dict: Mapping, expected: dict) -> None:
    buffers = _BUFFERS[arch]
    for key in state_dict:
        if not isinstance(key, str):
            raise ValueError(f"state_dict has a non-string key {key!r}.")
    unknown = [k for k in state_dict if k not in expected and not buffers.match(k)]
    if unknown:
        raise ValueError(
            f"state_dict has unexpected key {unknown[0]!r}"
            + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            + f" for {_NAMES[arch]} with this config.{_hint(unknown[0], cfg, False)}"
        )
    missing = [k for k in expected if k not in state_dict]
    if missing:
        raise ValueError(
            f"state_dict is missing key {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f" for {_NAMES[arch]} with this config.{_hint(missing[0], cfg, True)}"
        )
    for key in state_dict:  # in the state dict's (the book's) order
        if key not in expected:
            continue
        shape, found = expected[key][1], tuple(np.shape(state_dict[key]))
        if found != shape:
            raise ValueError(
                f"state_dict[{key!r}] has shape {found}, but the config gives {shape} "
                "(PyTorch layout: nn.Linear weights are [out_features, in_features])."
            )


# ----------------------------------------------------------------------------------------
# Loading and saving
# ----------------------------------------------------------------------------------------


def _nested(flat: dict[tuple, jax.Array]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def from_book(
    arch: str, cfg: Mapping, state_dict: Mapping, *, key=None, **model_kwargs
) -> LanguageModel:
    """Builds ``arch``'s model from the book's config and loads the book's state dict.

    Args:
      arch: ``'gpt2'`` (chapter 4's ``GPTModel``), ``'llama3'`` or ``'qwen3'``.
      cfg: the book's config dict (the same keys as its PyTorch class takes).
      state_dict: ``model.state_dict()`` of the book's PyTorch model (tensors are read with
        ``.detach().cpu().numpy()``; torch is never imported) or a dict of numpy arrays
        with its keys (e.g. from an ``.npz``).
      key: ``jax.random`` key (or int seed) for the dropout streams (GPT-2 with
        ``drop_rate > 0``); default 0.
      **model_kwargs: further constructor options of the model (e.g.
        ``attention_implementation``, GPT-2's ``deterministic``).

    Returns:
      The model, its parameters equal to the state dict's (cast to the parameter dtype).

    Raises:
      ValueError: an unknown arch; a config with wrong keys or values; a state dict of
        another architecture; a missing or unexpected key; a wrong shape (naming the key).
      TypeError: a state dict that is not a mapping, values that are not float arrays.
    """
    if arch not in MODELS:
        raise ValueError(f"arch must be one of {list(MODELS)}, got {arch!r}.")
    config = config_from_book(arch, cfg)
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of the book's PyTorch keys to arrays "
            f"(model.state_dict()), got {type(state_dict).__name__}."
        )
    _check_arch(arch, state_dict)
    model_cls = MODELS[arch]
    key = jax.random.key(0) if key is None else key
    key = jax.random.key(key) if isinstance(key, int) else key

    def build(key):
        return model_cls(config, rngs=nnx.Rngs(key), **model_kwargs)

    abstract = nnx.eval_shape(lambda: build(key))
    expected = book_keys(abstract)
    _check_keys_and_shapes(arch, config, state_dict, expected)

    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    dtypes = {path: var.dtype for path, var in nnx.to_flat_state(params)}
    loaded = {}
    for book_key, (path, _, transposed) in expected.items():
        array = convert.to_numpy(state_dict[book_key], book_key)
        loaded[path] = jnp.asarray(array.T if transposed else array, dtypes[path])
    nnx.replace_by_pure_dict(params, _nested(loaded))
    # The rest (dropout streams) for real; jit drops the random parameter init unused here.
    rest = jax.jit(lambda key: nnx.state(build(key), nnx.Not(nnx.Param)))(key)
    return nnx.merge(graphdef, params, rest)


def to_book_state_dict(model: LanguageModel) -> dict[str, np.ndarray]:
    """The model's parameters as the book's PyTorch model's ``state_dict()`` (numpy arrays).

    Includes chapter 3's ``att.mask`` buffers for GPT-2, so that
    ``book_model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})`` loads
    strictly. bfloat16 parameters stay bfloat16 (``ml_dtypes``; convert with
    ``.astype(np.float32)`` before ``torch.from_numpy``).
    """
    if not isinstance(model, LanguageModel):
        raise TypeError(
            f"model must be a jattn.models model (GPTModel, Llama3Model, Qwen3Model), got "
            f"{type(model).__name__}."
        )
    arch, cfg = model.cfg.arch, model.cfg
    values = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out = {}
    for key, (path, _, transposed) in book_keys(model).items():
        array = np.asarray(values[path].get_value())
        out[key] = np.array(array.T if transposed else array)  # a writable copy, as torch wants
    if arch == "gpt2":
        mask = np.triu(np.ones((cfg.context_length, cfg.context_length), np.float32), 1)
        for i in range(cfg.n_layers):
            out[f"trf_blocks.{i}.att.mask"] = mask
    return out
