"""LLM backends for data construction: any OpenAI-compatible chat endpoint, or a local Hugging Face model.

PEG (§Data construction) builds its fine-tuning data with an off-the-shelf LLM twice: to write questions for
short passages, and to remove retrieved negatives the LLM deems relevant to the query (false negatives).
Both stages talk to an LLM through one small interface, :class:`LLMBackend`::

    backend.complete([messages, messages, ...]) -> [reply or None, ...]

where ``messages`` is a chat conversation (``[{"role": "user", "content": "..."}]``) or a plain prompt string.

Modules, one job each:

* ``config`` — :class:`LLMConfig`, the ``llm:`` settings.
* ``base`` — :class:`LLMBackend`, :class:`Completion`, :class:`LLMStats`, :func:`as_messages`, :func:`cache_key`,
  :func:`strip_reasoning`.
* ``cache`` — :class:`LLMCache`, an sqlite3 (WAL) cache keyed by sha256 of (messages, model, sampling params),
  written as soon as each reply arrives, so a re-run or a crash never pays for the same request twice.
* ``client`` — :class:`LLMClient` for OpenAI-compatible endpoints (vLLM, Ollama, llama.cpp, OpenAI): the
  ``openai`` client with its own retries, plus a wait cap, logged waits and the :class:`RateLimiter` on every
  request.
* ``hf`` — :class:`HFGenerator`, a local ``transformers`` causal LM (chat template when the tokenizer has one),
  batched.
* ``stages`` — what the LLM stages share: prompt templates, :class:`LLMStageConfig`, :func:`build_backend` /
  :func:`stage_backend`, :class:`FailureTally` and :func:`write_failed_items`.

Everything is importable from ``robustir.llm``; the package logs as ``robustir.llm``.
"""

from .base import (Completion, Conversation, LLMBackend, LLMStats, Message, as_messages, cache_key,
                   strip_reasoning)
from .cache import LLMCache
from .client import LLMClient, RateLimiter, normalize_base_url
from .config import LLMConfig
from .hf import HFGenerator
from .stages import (MIN_ITEMS_FOR_RATE, FailureTally, LLMStageConfig, build_backend, llm_step, run_llm_step,
                     check_failure_rate, endpoint_of, load_template, render_template, stage_backend, write_failed_items)

__all__ = ["Completion", "Conversation", "FailureTally", "HFGenerator", "LLMBackend", "LLMCache", "LLMClient",
           "LLMConfig", "LLMStageConfig", "LLMStats", "MIN_ITEMS_FOR_RATE", "Message", "RateLimiter", "as_messages",
           "build_backend", "cache_key", "check_failure_rate", "endpoint_of", "llm_step", "load_template",
           "normalize_base_url", "render_template", "run_llm_step", "stage_backend", "strip_reasoning", "write_failed_items"]
