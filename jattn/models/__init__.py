"""The book's later models in Flax NNX, built on jattn's attention module.

* :class:`GPTModel` — chapter 4's GPT (GPT-2 architecture);
* :class:`Llama3Model` — the book's Llama 3 / 3.1 / 3.2;
* :class:`Qwen3Model` — the book's Qwen3 (dense models).

Each takes the book's configuration dict (the same keys as its PyTorch class), returns
logits ``[batch..., T, vocab_size]`` from ``model(token_ids)``, and decodes with a KV cache
(``model.init_cache(batch_shape, capacity)``, then ``model(chunk, decode=True)``).

* :func:`from_book` ``(arch, cfg, state_dict)`` builds a model and loads the book's
  PyTorch ``state_dict()`` (torch tensors or numpy arrays; torch is never imported);
  :func:`to_book_state_dict` goes back.
* :func:`generate` ``(model, token_ids, max_new_tokens, temperature, top_k, key)``
  generates with the KV cache in one compiled program; ``window=`` decodes through
  rolling caches (sliding-window attention), so Llama 3 / Qwen3 can run past the context.
* :func:`generate_many` ``(model, prompts, max_new_tokens, slots=, eos_id=)`` serves many
  prompts of different lengths by continuous batching over a paged KV cache
  (:mod:`jattn.models.serving`, :mod:`jattn.paged`).
  rolling caches (sliding-window attention), so Llama 3 / Qwen3 can run past the context;
  ``eos_id=`` stops rows at a stop token; :func:`generate_stream` yields tokens as they come.
* ``model(tokens, segment_ids=, positions=)`` trains on packed rows (:func:`jattn.pack`):
  no attention across documents, positions restarting per document.
"""

from jattn.models.base import LanguageModel
from jattn.models.configs import GPTConfig, Llama3Config, Qwen3Config, config_from_book
from jattn.models.generation import generate, generate_stream
from jattn.models.gpt2 import GPTModel
from jattn.models.llama3 import Llama3Model
from jattn.models.qwen3 import Qwen3Model
from jattn.models.serving import ServingStats, generate_many
from jattn.models.weights import book_keys, detect_arch, from_book, to_book_state_dict

__all__ = [
    "GPTConfig",
    "GPTModel",
    "LanguageModel",
    "Llama3Config",
    "Llama3Model",
    "Qwen3Config",
    "Qwen3Model",
    "ServingStats",
    "book_keys",
    "config_from_book",
    "detect_arch",
    "from_book",
    "generate",
    "generate_many",
    "generate_stream",
    "to_book_state_dict",
]
