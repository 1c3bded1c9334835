"""The book's configuration dicts, checked once and held as frozen dataclasses.

Each model takes the dict the book's PyTorch class takes, with the same keys:

* GPT-2 (chapter 4, ``GPT_CONFIG_124M``): ``vocab_size, context_length, emb_dim, n_heads,
  n_layers, drop_rate, qkv_bias``;
* Llama 3 (``llms_from_scratch.llama3``, ``LLAMA32_CONFIG_1B``): ``vocab_size,
  context_length, emb_dim, n_heads, n_layers, hidden_dim, n_kv_groups, rope_base, dtype,
  rope_freq`` (``rope_freq`` None or the Llama 3 scaling dict);
* Qwen3 (``llms_from_scratch.qwen3``, ``QWEN_CONFIG_06_B``): ``vocab_size,
  context_length, emb_dim, n_heads, n_layers, hidden_dim, head_dim, qk_norm, n_kv_groups,
  rope_base, dtype`` (``head_dim`` None means ``emb_dim // n_heads``).

``dtype`` may be the book's torch dtype (``torch.bfloat16``; read by name, torch is never
imported), a numpy/JAX dtype or its name. A missing or unknown key, or a value of the
wrong type or range, is a ValueError/TypeError naming the key; a dict of another
architecture is named as such.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jattn import rope

__all__ = ["GPTConfig", "Llama3Config", "Qwen3Config", "config_from_book", "parse_dtype"]

# Keys only one architecture's dict has: used to say what a wrong dict looks like.
_SIGNATURE_KEYS = {
    "gpt2": ("drop_rate", "qkv_bias"),
    "llama3": ("rope_freq",),
    "qwen3": ("qk_norm", "head_dim"),
}
_ARCH_NAMES = {"gpt2": "GPT-2", "llama3": "Llama 3", "qwen3": "Qwen3"}


def parse_dtype(dtype, key: str = "cfg['dtype']"):
    """A float dtype from the book's torch dtype (by name), a numpy/JAX dtype or a name.

    None means float32 (PyTorch's default). Raises a TypeError naming ``key`` for anything
    else, and a ValueError for float64 while ``jax_enable_x64`` is off.
    """
    if dtype is None:
        return jnp.dtype(jnp.float32)
    if type(dtype).__module__ == "torch":  # torch.bfloat16 -> 'bfloat16', without importing torch
        dtype = str(dtype).removeprefix("torch.")
    try:
        parsed = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{key} must be a float dtype (torch.bfloat16, jnp.float32, 'bfloat16', "
            f"...), got {dtype!r}."
        ) from None
    if not jnp.issubdtype(parsed, jnp.floating):
        raise TypeError(f"{key} must be a float dtype, got {parsed}.")
    if jax.dtypes.canonicalize_dtype(parsed) != parsed:
        raise ValueError(
            f"{key}={parsed} needs 64-bit mode (jax.config.update('jax_enable_x64', "
            "True)), or use float32 / bfloat16."
        )
    return parsed


def _int(cfg: Mapping, key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"cfg[{key!r}] must be an int, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"cfg[{key!r}] must be >= 1, got {value}.")
    return int(value)


def _bool(cfg: Mapping, key: str) -> bool:
    value = cfg[key]
    if not isinstance(value, bool):
        raise TypeError(f"cfg[{key!r}] must be True or False, got {value!r}.")
    return value


def _looks_like(keys) -> str | None:
    """The architecture whose signature keys the dict has, if exactly one."""
    found = [arch for arch, sig in _SIGNATURE_KEYS.items() if any(k in keys for k in sig)]
    return found[0] if len(found) == 1 else None


def _check_keys(cfg, cls) -> None:
    """Exactly the book's keys of ``cls``; otherwise a ValueError naming what is wrong."""
    what = _ARCH_NAMES[cls.arch]
    if not isinstance(cfg, Mapping):
        raise TypeError(
            f"cfg must be the book's {what} configuration dict (keys {list(cls.book_keys)}), "
            f"got {type(cfg).__name__}."
        )
    missing = [k for k in cls.book_keys if k not in cfg]
    unknown = sorted(str(k) for k in cfg if k not in cls.book_keys)
    if not missing and not unknown:
        return
    hint = ""
    other = _looks_like(cfg)
    if other is not None and other != cls.arch:
        hint = (
            f" It looks like a {_ARCH_NAMES[other]} config (it has "
            f"{[k for k in _SIGNATURE_KEYS[other] if k in cfg]}): use arch={other!r}."
        )
    elif cls.arch == "qwen3" and "num_experts" in cfg:
        hint = " Qwen3's mixture-of-experts models (num_experts, ...) are not supported."
    raise ValueError(
        f"cfg for {what} must have exactly the keys {list(cls.book_keys)}; missing {missing}, "
        f"unknown {unknown}.{hint}"
    )


def _check_heads(emb_dim: int, n_heads: int, n_kv_groups: int | None, *, split: bool) -> None:
    if split and emb_dim % n_heads:
        raise ValueError(
            f"cfg['emb_dim'] ({emb_dim}) must be divisible by cfg['n_heads'] ({n_heads}): each "
            "head gets emb_dim // n_heads features."
        )
    if n_kv_groups is not None and n_heads % n_kv_groups:
        raise ValueError(
            f"cfg['n_heads'] ({n_heads}) must be a multiple of cfg['n_kv_groups'] "
            f"({n_kv_groups}): each key/value group serves n_heads // n_kv_groups query heads."
        )


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Chapter 4's ``GPT_CONFIG_124M`` keys. Build with :meth:`from_book`."""

    arch: ClassVar[str] = "gpt2"
    book_keys: ClassVar[tuple[str, ...]] = (
        "vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias",
    )  # fmt: skip

    vocab_size: int
    context_length: int
    emb_dim: int
    n_heads: int
    n_layers: int
    drop_rate: float
    qkv_bias: bool

    @classmethod
    def from_book(cls, cfg: Mapping) -> GPTConfig:
        """Checks the book's dict (see the module docstring) and returns the config."""
        if isinstance(cfg, cls):
            return cfg
        _check_keys(cfg, cls)
        ints = {k: _int(cfg, k) for k in cls.book_keys[:5]}
        rate = cfg["drop_rate"]
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
            raise TypeError(f"cfg['drop_rate'] must be a float in [0, 1), got {rate!r}.")
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(f"cfg['drop_rate'] must be in [0, 1), got {rate}.")
        _check_heads(ints["emb_dim"], ints["n_heads"], None, split=True)
        return cls(**ints, drop_rate=float(rate), qkv_bias=_bool(cfg, "qkv_bias"))

    def to_book(self) -> dict:
        """The book's dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Llama3Config:
    """``llms_from_scratch.llama3``'s config keys. Build with :meth:`from_book`."""

    arch: ClassVar[str] = "llama3"
    book_keys: ClassVar[tuple[str, ...]] = (
        "vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim",
        "n_kv_groups", "rope_base", "dtype", "rope_freq",
    )  # fmt: skip

    vocab_size: int
    context_length: int
    emb_dim: int
    n_heads: int
    n_layers: int
    hidden_dim: int
    n_kv_groups: int
    rope_base: float
    dtype: Any
    rope_freq: rope.FreqConfig | None

    @classmethod
    def from_book(cls, cfg: Mapping) -> Llama3Config:
        """Checks the book's dict (see the module docstring) and returns the config."""
        if isinstance(cfg, cls):
            return cfg
        _check_keys(cfg, cls)
        ints = {k: _int(cfg, k) for k in cls.book_keys[:7]}
        _check_heads(ints["emb_dim"], ints["n_heads"], ints["n_kv_groups"], split=True)
        settings = _rope_settings(cfg, cfg["rope_freq"], ints["emb_dim"] // ints["n_heads"])
        return cls(
            **ints,
            rope_base=settings.theta_base,
            dtype=parse_dtype(cfg["dtype"]),
            rope_freq=settings.freq_config,
        )

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.n_heads

    @property
    def rope(self) -> rope.RoPE:
        return rope.RoPE(self.rope_base, self.rope_freq)

    def to_book(self) -> dict:
        """The book's dict (``dtype`` as a JAX dtype, ``rope_freq`` as a dict)."""
        out = dataclasses.asdict(self)
        out["rope_freq"] = None if self.rope_freq is None else self.rope_freq.to_book()
        return out


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """``llms_from_scratch.qwen3``'s config keys (dense models). Build with :meth:`from_book`."""

    arch: ClassVar[str] = "qwen3"
    book_keys: ClassVar[tuple[str, ...]] = (
        "vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim",
        "head_dim", "qk_norm", "n_kv_groups", "rope_base", "dtype",
    )  # fmt: skip

    vocab_size: int
    context_length: int
    emb_dim: int
    n_heads: int
    n_layers: int
    hidden_dim: int
    head_dim: int
    qk_norm: bool
    n_kv_groups: int
    rope_base: float
    dtype: Any

    @classmethod
    def from_book(cls, cfg: Mapping) -> Qwen3Config:
        """Checks the book's dict (see the module docstring) and returns the config.

        ``head_dim=None`` (the book's default) becomes ``emb_dim // n_heads``.
        """
        if isinstance(cfg, cls):
            return cfg
        _check_keys(cfg, cls)
        ints = {k: _int(cfg, k) for k in cls.book_keys[:6]}
        n_kv_groups = _int(cfg, "n_kv_groups")
        explicit = cfg["head_dim"] is not None
        _check_heads(ints["emb_dim"], ints["n_heads"], n_kv_groups, split=not explicit)
        head_dim = _int(cfg, "head_dim") if explicit else ints["emb_dim"] // ints["n_heads"]
        settings = _rope_settings(cfg, None, head_dim)
        return cls(
            **ints,
            head_dim=head_dim,
            qk_norm=_bool(cfg, "qk_norm"),
            n_kv_groups=n_kv_groups,
            rope_base=settings.theta_base,
            dtype=parse_dtype(cfg["dtype"]),
        )

    @property
    def rope(self) -> rope.RoPE:
        return rope.RoPE(self.rope_base)

    def to_book(self) -> dict:
        """The book's dict (``dtype`` as a JAX dtype; ``head_dim`` always explicit)."""
        return dataclasses.asdict(self)


def _rope_settings(cfg: Mapping, freq_config, head_dim: int) -> rope.RoPE:
    """``RoPE`` from ``cfg['rope_base']`` and the scaling dict, errors naming the cfg keys."""
    if head_dim % 2:
        raise ValueError(
            f"the head dimension ({head_dim}) must be even for RoPE: pick emb_dim / n_heads "
            "(or cfg['head_dim']) even."
        )
    try:
        return rope.RoPE(cfg["rope_base"], freq_config)
    except (TypeError, ValueError) as e:
        key = "rope_freq" if "freq_config" in str(e) else "rope_base"
        raise type(e)(f"cfg[{key!r}]: {e}") from None


_CONFIGS = {"gpt2": GPTConfig, "llama3": Llama3Config, "qwen3": Qwen3Config}


def config_from_book(arch: str, cfg: Mapping):
    """The config dataclass of ``arch`` (``'gpt2'``, ``'llama3'``, ``'qwen3'``) from the book's dict."""
    if arch not in _CONFIGS:
        raise ValueError(f"arch must be one of {list(_CONFIGS)}, got {arch!r}.")
    return _CONFIGS[arch].from_book(cfg)
