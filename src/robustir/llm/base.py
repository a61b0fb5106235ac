"""What every LLM backend shares: the :class:`LLMBackend` interface, replies (:class:`Completion`), counters
(:class:`LLMStats`), conversations (:func:`as_messages`), the reply-cache key and :func:`strip_reasoning`."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence, Union

from ..errors import ConfigError
from .cache import Completion  # the unit the cache stores; re-exported here for the backends

if TYPE_CHECKING:
    from .cache import LLMCache

Message = dict[str, str]
Conversation = Union[str, Sequence[Message]]


@dataclass
class LLMStats:
    """Counters for the summary line and report; updated from worker threads under a lock."""

    completions: int = 0
    cache_hits: int = 0
    requests: int = 0
    retries: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def as_messages(conversation: Conversation, system_prompt: str | None = None) -> list[Message]:
    """Normalise a prompt string or a message list to a chat message list (adding ``system_prompt`` if absent)."""
    if isinstance(conversation, str):
        messages = [{"role": "user", "content": conversation}]
    else:
        messages = [dict(m) for m in conversation]
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ConfigError(f"a chat message must be a dict with 'role' and 'content', got {m!r}")
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def cache_key(messages: Sequence[Message], model: str, params: dict) -> str:
    """sha256 of the canonical JSON of (messages, model, sampling params): equal requests share one entry."""
    blob = json.dumps({"messages": list(messages), "model": model, "params": params},
                      sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class LLMBackend(ABC):
    """What a stage needs from an LLM: ordered, streamed, cached chat completions."""

    def __init__(self, model: str, params: dict, *, cache: LLMCache | None = None,
                 on_failure: str = "raise", system_prompt: str | None = None) -> None:
        if on_failure not in ("raise", "skip"):
            raise ConfigError(f"on_failure must be 'raise' or 'skip', got {on_failure!r}")
        self.model = model
        self.params = params
        self.cache = cache
        self.on_failure = on_failure
        self.system_prompt = system_prompt
        self.stats = LLMStats()

    def key_for(self, conversation: Conversation) -> str:
        return cache_key(as_messages(conversation, self.system_prompt), self.model, self.params)

    def complete(self, conversations: Iterable[Conversation]) -> list[str | None]:
        """Reply text per conversation, in order; ``None`` marks a failure under ``on_failure: skip``."""
        return [c.text for c in self.stream(conversations)]

    @abstractmethod
    def stream(self, conversations: Iterable[Conversation]) -> Iterator[Completion]:
        """Yield one :class:`Completion` per conversation, in input order, consuming the input lazily."""

    def forget(self, conversation: Conversation) -> None:
        """Drop a cached reply (e.g. one a stage could not use), so the next run asks again."""
        if self.cache is not None:
            self.cache.delete(self.key_for(conversation))

    def _cached(self, key: str) -> Completion | None:
        if self.cache is None:
            return None
        hit = self.cache.get(key)
        if hit is not None:
            self.stats.add(completions=1, cache_hits=1)
        return hit

    def _store(self, key: str, completion: Completion) -> None:
        if self.cache is not None and completion.text is not None:
            self.cache.put(key, self.model, completion)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> "LLMBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



_THINK = re.compile(r"<think(?:ing)?>.*?</think(?:ing)?>", re.S | re.I)


def strip_reasoning(reply: str) -> str:
    """Remove the ``<think>...</think>`` block reasoning models (Qwen3, DeepSeek-R1) put before their answer."""
    text = _THINK.sub("", reply)
    lowered = text.lower()
    for closing in ("</think>", "</thinking>"):
        if closing in lowered:  # opening tag was part of the prompt (chat template): keep what follows
            text = text[lowered.rindex(closing) + len(closing):]
            lowered = text.lower()
    return text.strip()

