"""LLM backends for data construction (moved from ``robustir/llm.py``; split by job in the next commit)."""

from .client import (MIN_ITEMS_FOR_RATE, Completion, Conversation, FailureTally, HFGenerator, LLMBackend, LLMCache,
                     LLMClient, LLMConfig, LLMStageConfig, LLMStats, Message, RateLimiter, as_messages, build_backend,
                     cache_key, check_failure_rate, endpoint_of, load_template, normalize_base_url, render_template,
                     stage_backend, strip_reasoning, write_failed_items)

__all__ = ["Completion", "Conversation", "FailureTally", "HFGenerator", "LLMBackend", "LLMCache", "LLMClient",
           "LLMConfig", "LLMStageConfig", "LLMStats", "MIN_ITEMS_FOR_RATE", "Message", "RateLimiter", "as_messages",
           "build_backend", "cache_key", "check_failure_rate", "endpoint_of", "load_template",
           "normalize_base_url", "render_template", "stage_backend", "strip_reasoning", "write_failed_items"]
