"""Tasks for the toy next-token demo: token windows generated in code, no downloads.

A task hands out windows ``[batch, context_length + 1]`` of token ids: the model reads
``window[:, :-1]`` and is trained to predict ``window[:, 1:]`` at every position.
The training batch of step ``s`` is a pure function of ``(seed, s)``, so the "data
position" of a run is just its step number and a resumed run sees exactly the data an
uninterrupted one would. Held-out windows come from a separate random stream (copy task)
or a separate slice of the text (text task).

* :class:`CopyTask` (the default): ``x_1 .. x_L SEP x_1 .. x_L`` with ``x_i`` uniform
  over ``num_symbols`` symbols. The first half cannot be predicted, the second half can
  be predicted exactly, so the best loss a causal model can reach (the entropy floor) is
  known in closed form.
* :class:`TextTask`: character-level windows of a user's text file (floor unknown).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["STREAMS", "CopyTask", "TextTask", "stream_key"]

# Every random number of a run comes from one of these independent streams of its seed.
STREAMS = {"train_data": 0, "eval_data": 1, "init": 2, "dropout": 3, "probe": 4}


def stream_key(seed: int, stream: str) -> jax.Array:
    """The key of stream ``stream`` (a name in :data:`STREAMS`) for ``seed``."""
    return jax.random.fold_in(jax.random.key(seed), STREAMS[stream])


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value


@partial(jax.jit, static_argnames=("batch_size", "prefix_len", "num_symbols"))
def _copy_windows(key, *, batch_size: int, prefix_len: int, num_symbols: int) -> jax.Array:
    # [B, L] random prefix, then the separator, then the prefix again: [B, 2L + 1]
    prefix = jax.random.randint(key, (batch_size, prefix_len), 0, num_symbols, dtype=jnp.int32)
    sep = jnp.full((batch_size, 1), num_symbols, dtype=jnp.int32)
    return jnp.concatenate([prefix, sep, prefix], axis=1)


@partial(jax.jit, static_argnames=("batch_size", "length"))
def _random_windows(tokens: jax.Array, key, *, batch_size: int, length: int) -> jax.Array:
    # [B] window starts, uniform over every start that fits in `tokens`
    starts = jax.random.randint(key, (batch_size,), 0, tokens.shape[0] - length + 1)
    # [B, length] gather of consecutive positions
    return tokens[starts[:, None] + jnp.arange(length)[None, :]]


@dataclasses.dataclass(frozen=True)
class CopyTask:
    """Copy a random prefix: ``x_1 .. x_L SEP x_1 .. x_L``.

    Symbols are ids ``0 .. num_symbols - 1``; the separator is ``num_symbols``, so the
    model's vocabulary has ``num_symbols + 1`` entries. A window has ``2L + 1`` tokens,
    the model reads ``2L`` of them (``context_length = 2L``) and predicts the next token
    at each of those ``2L`` positions:

    ============================  =====  ===========================================
    targets                       count  entropy given the past (nats)
    ============================  =====  ===========================================
    ``x_2 .. x_L`` (random)       L - 1  ``ln(num_symbols)`` each
    ``SEP`` (always at L + 1)     1      0
    ``x_1 .. x_L`` (the copy)     L      0
    ============================  =====  ===========================================

    so the entropy floor is ``(L - 1) ln(num_symbols) / (2L)`` nats per predicted token:
    no causal model can do better on average, and a perfect one reaches it exactly.

    Attributes:
      num_symbols: alphabet size ``V`` of the random prefix (>= 2).
      prefix_len: ``L``, the length of the prefix (>= 1).
      batch_size: windows per training batch.
      seed: data seed; the batch of step ``s`` depends on ``(seed, s)`` only.
    """

    num_symbols: int = 16
    prefix_len: int = 16
    batch_size: int = 32
    seed: int = 0

    name = "copy"

    def __post_init__(self):
        _check_int(self.num_symbols, "num_symbols", 2)
        _check_int(self.prefix_len, "prefix_len", 1)
        _check_int(self.batch_size, "batch_size", 1)

    @property
    def vocab_size(self) -> int:
        """Symbols plus the separator."""
        return self.num_symbols + 1

    @property
    def sep_id(self) -> int:
        return self.num_symbols

    @property
    def context_length(self) -> int:
        """Tokens the model reads per window: ``2L``."""
        return 2 * self.prefix_len

    @property
    def prompt_len(self) -> int:
        """Generation prompt ``x_1 .. x_L SEP``; the model must then write the copy."""
        return self.prefix_len + 1

    def target_entropies(self) -> np.ndarray:
        """Exact entropy (nats) of each target given everything before it, ``[2L]``.

        Entry ``t`` belongs to the target at window position ``t + 1``.
        """
        ent = np.zeros(self.context_length)
        # Targets x_2 .. x_L sit at window positions 1 .. L-1: uniform, independent of the past.
        ent[: self.prefix_len - 1] = math.log(self.num_symbols)
        return ent

    @property
    def entropy_floor(self) -> float:
        """Best achievable mean loss of a causal model: ``(L - 1) ln V / (2L)`` nats per token."""
        return float(np.mean(self.target_entropies()))

    def train_batch(self, step) -> jax.Array:
        """Training windows of step ``step`` (int or int array): ``[batch_size, 2L + 1]`` int32."""
        key = jax.random.fold_in(stream_key(self.seed, "train_data"), step)
        return _copy_windows(
            key,
            batch_size=self.batch_size,
            prefix_len=self.prefix_len,
            num_symbols=self.num_symbols,
        )

    def eval_set(self, num: int) -> jax.Array:
        """``num`` held-out windows ``[num, 2L + 1]`` from a stream training never uses."""
        _check_int(num, "num", 1)
        return _copy_windows(
            stream_key(self.seed, "eval_data"),
            batch_size=num,
            prefix_len=self.prefix_len,
            num_symbols=self.num_symbols,
        )

    def describe(self) -> dict:
        """The task's settings, as JSON-ready values (recorded with a run)."""
        return {"task": self.name, **dataclasses.asdict(self)}

    def token_labels(self) -> list[str]:
        """A printable label per token id (symbols as letters, the separator as ``|``)."""
        return [_symbol_label(i) for i in range(self.num_symbols)] + ["|"]


def _symbol_label(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return letters[i] if i < len(letters) else str(i)


@dataclasses.dataclass(frozen=True, eq=False)
class TextTask:
    """Character-level next-token prediction on a text.

    The vocabulary is the sorted set of characters of the text. The first
    ``1 - eval_fraction`` of the text is for training (random windows per step), the rest
    is held out. The entropy floor of natural text is unknown (``None``).

    Attributes:
      text: the training text.
      context_length: tokens the model reads per window.
      batch_size: windows per training batch.
      seed: data seed; the batch of step ``s`` depends on ``(seed, s)`` only.
      eval_fraction: share of the text held out for evaluation, at its end.
      source: where the text came from (a path), for the record only.
    """

    text: str = dataclasses.field(repr=False)
    context_length: int = 64
    batch_size: int = 32
    seed: int = 0
    eval_fraction: float = 0.1
    source: str = ""

    name = "text"
    entropy_floor = None

    def __post_init__(self):
        _check_int(self.context_length, "context_length", 2)
        _check_int(self.batch_size, "batch_size", 1)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}.")
        chars = sorted(set(self.text))
        lookup = {c: i for i, c in enumerate(chars)}
        encoded = np.fromiter((lookup[c] for c in self.text), dtype=np.int32, count=len(self.text))
        split = round(len(encoded) * (1.0 - self.eval_fraction))
        window = self.context_length + 1
        if min(split, len(encoded) - split) < window:
            need = math.ceil(window / min(self.eval_fraction, 1.0 - self.eval_fraction))
            raise ValueError(
                f"the text has {len(encoded)} characters; with context_length "
                f"{self.context_length} and eval_fraction {self.eval_fraction} it needs at "
                f"least {need} (each split must hold one window of {window}). Use a longer "
                "text or a smaller --context-length."
            )
        object.__setattr__(self, "_chars", chars)
        object.__setattr__(self, "_train", jnp.asarray(encoded[:split]))
        object.__setattr__(self, "_eval", jnp.asarray(encoded[split:]))

    @property
    def vocab_size(self) -> int:
        return len(self._chars)

    @property
    def prompt_len(self) -> int:
        """Generation continues held-out text from its first half."""
        return (self.context_length + 1) // 2

    def train_batch(self, step) -> jax.Array:
        """Training windows of step ``step``: ``[batch_size, context_length + 1]`` int32."""
        key = jax.random.fold_in(stream_key(self.seed, "train_data"), step)
        return _random_windows(
            self._train, key, batch_size=self.batch_size, length=self.context_length + 1
        )

    def eval_set(self, num: int) -> jax.Array:
        """``num`` windows ``[num, context_length + 1]`` from the held-out end of the text."""
        _check_int(num, "num", 1)
        return _random_windows(
            self._eval,
            stream_key(self.seed, "eval_data"),
            batch_size=num,
            length=self.context_length + 1,
        )

    def describe(self) -> dict:
        """The task's settings and a fingerprint of the text, as JSON-ready values."""
        return {
            "task": self.name,
            "source": self.source,
            "characters": len(self.text),
            "sha256": hashlib.sha256(self.text.encode("utf-8")).hexdigest(),
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "eval_fraction": self.eval_fraction,
        }

    def token_labels(self) -> list[str]:
        """Each character, with whitespace made visible."""
        return ["␣" if c == " " else c if c.isprintable() else repr(c)[1:-1] for c in self._chars]

    def decode(self, ids) -> str:
        return "".join(self._chars[int(i)] for i in np.asarray(ids).ravel())
