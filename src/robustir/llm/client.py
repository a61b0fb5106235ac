"""LLM backends for data construction: any OpenAI-compatible chat endpoint, or a local Hugging Face model.

PEG (§Data construction) builds its fine-tuning data with an off-the-shelf LLM twice: to write questions for
short passages, and to remove retrieved negatives the LLM deems relevant to the query (false negatives).
Both stages talk to an LLM through one small interface, :class:`LLMBackend`::

    backend.complete([messages, messages, ...]) -> [reply or None, ...]

where ``messages`` is a chat conversation (``[{"role": "user", "content": "..."}]``) or a plain prompt string.
Two backends implement it:

* :class:`LLMClient` — the official ``openai`` client pointed at ``base_url``, so it works with vLLM, Ollama
  (``http://localhost:11434/v1``), llama.cpp server, OpenAI and anything compatible. The transport is the
  ``openai`` package's; the retries are this module's (the ``openai`` client is told not to retry): timeouts,
  connection errors and HTTP 408/409/429/5xx are retried ``llm.max_retries`` times, waiting what the server
  asks for in ``Retry-After`` / ``retry-after-ms`` or else an exponential backoff (0.5 s doubling, at most 8 s),
  never longer than ``llm.max_retry_wait`` seconds; every wait of a second or more is logged at INFO (logger
  ``robustir.llm``), with the server's request and the cap when it was cut. On top come what a long data job
  needs: a thread pool of ``llm.concurrency`` requests yielding replies in input order, a requests-per-minute
  :class:`RateLimiter` (retries wait for it too), asking again when a ``200`` reply has no usable text (same
  retry budget), and :class:`~robustir.errors.EndpointError` messages that say what to fix for mistakes no retry
  can fix (wrong ``/v1`` base URL, unknown model, missing key).
* :class:`HFGenerator` — a local ``transformers`` causal LM (chat template when the tokenizer has one), batched.

Both share :class:`LLMCache`, an sqlite3 (WAL) cache keyed by sha256 of (messages, model, sampling params),
written as soon as each reply arrives, so a re-run or a crash never pays for the same request twice.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import logging
import math
import os
import random
import re
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator, Literal, Sequence, Union
from urllib.parse import urlsplit

import openai

from ..errors import ConfigError, EndpointError
from ..validation import (Checked, Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt,
                         Range)

logger = logging.getLogger(__package__)

Message = dict[str, str]
Conversation = Union[str, Sequence[Message]]

# Statuses the openai client retries by itself; seeing one means the retries are used up.
_RETRIED_STATUS = {408, 409, 429}
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
# The openai client insists on a key; servers started without one (vLLM, Ollama) ignore whatever is sent.
_NO_KEY = "EMPTY"

@dataclass
class LLMConfig(Checked):
    """How to reach and sample from the LLM. Every field can be set from YAML or as ``llm.<field>=value``."""

    backend: Literal["openai", "hf"] = "openai"
    """``openai``: an OpenAI-compatible HTTP endpoint (vLLM, Ollama, OpenAI); ``hf``: a local transformers model."""
    base_url: str = "http://localhost:8000/v1"
    """API root, usually ending in ``/v1`` (vLLM :8000/v1, Ollama :11434/v1, OpenAI https://api.openai.com/v1)."""
    model: str = ""
    """Model name as the server knows it; for ``backend: hf`` the local model folder or Hub id."""
    api_key: str | None = None
    """The key itself (prefer ``api_key_env`` so keys stay out of config files)."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key."""
    temperature: Annotated[float, Range(ge=0, le=2)] = 0.7
    top_p: Annotated[float, Range(gt=0, le=1)] | None = None
    max_tokens: NonNegativeInt = 512
    """Reply length limit (``max_tokens`` in the request); 0 sends none."""
    seed: NonNegativeInt | None = None
    extra_body: dict = field(default_factory=dict)
    """Merged into every request body, e.g. ``{"chat_template_kwargs": {"enable_thinking": false}}`` for vLLM."""
    extra_headers: dict = field(default_factory=dict)
    system_prompt: str | None = None
    """Prepended as a system message to every conversation that has none."""
    timeout_s: PositiveFloat = 120.0
    """Seconds to wait for one reply."""
    max_retries: NonNegativeInt = 5
    """Retries per request after a timeout, connection error, HTTP 408/409/429/5xx or an unusable reply."""
    max_retry_wait: PositiveFloat = 60.0
    """Longest wait before one retry, in seconds: a longer ``Retry-After`` from the server is cut to this (and
    the cut is logged)."""
    concurrency: PositiveInt = 8
    """Requests in flight at once."""
    requests_per_minute: NonNegativeFloat = 0.0
    """Requests per minute at most; 0 = unlimited."""
    on_failure: Literal["raise", "skip"] = "raise"
    """After the retries: ``raise`` an EndpointError, or ``skip`` (the reply is ``None`` and the stage records it)."""
    max_consecutive_failures: NonNegativeInt = 20
    """Under ``skip``, this many failures in a row mean the endpoint is down: raise instead (0 = never)."""
    cache_path: str | None = None
    """sqlite file of finished replies (stages default to one next to their output); ``none`` disables caching."""
    # local Hugging Face backend only
    batch_size: PositiveInt = 8
    device: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(self.api_key_env) or None

    def redacted(self) -> dict:
        """The config as a dict, safe to write into reports (no key)."""
        out = {k: v for k, v in self.__dict__.items()}
        if out.get("api_key"):
            out["api_key"] = "***"
        return out


@dataclass
class Completion:
    """One reply: ``text`` is ``None`` when the request failed (``error`` says why) under ``on_failure: skip``."""

    text: str | None
    cached: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.text is not None


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


class LLMCache:
    """Persistent reply cache in one sqlite3 file (WAL mode, so shards in other processes may share it).

    Only successful replies are stored, each committed as soon as it arrives: a crash loses at most the
    requests that were still in flight.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(self.path), timeout=60.0, check_same_thread=False,
                                       isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a process crash
            self._db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, model TEXT, "
                             "reply TEXT NOT NULL, usage TEXT, created REAL)")
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"LLM cache {self.path}: cannot open ({exc}); delete the file or choose another "
                              f"cache_path") from None

    def get(self, key: str) -> Completion | None:
        with self._lock:
            row = self._db.execute("SELECT reply, usage FROM replies WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        usage = json.loads(row[1]) if row[1] else {}
        return Completion(row[0], cached=True, prompt_tokens=usage.get("prompt_tokens"),
                          completion_tokens=usage.get("completion_tokens"))

    def put(self, key: str, model: str, completion: Completion) -> None:
        usage = json.dumps({"prompt_tokens": completion.prompt_tokens,
                            "completion_tokens": completion.completion_tokens})
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?, ?)",
                             (key, model, completion.text, usage, time.time()))

    def delete(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM replies WHERE key = ?", (key,))

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM replies").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


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


class RateLimiter:
    """Spaces request starts at least ``60 / rpm`` seconds apart across all threads (0 = no limit).

    ``clock`` and ``sleep`` are injectable so tests run on a fake clock; :class:`LLMClient` passes its stop
    event's ``wait`` as ``sleep``, so closing the client cuts a wait short. The limit applies to every request
    this module sends, retries included.
    """

    def __init__(self, requests_per_minute: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        if requests_per_minute < 0:
            raise ConfigError(f"requests_per_minute must be >= 0 (0 = unlimited), got {requests_per_minute}")
        self.interval = 60.0 / requests_per_minute if requests_per_minute > 0 else 0.0
        self._clock = clock
        self._sleep = sleep
        self._next = -math.inf  # earliest start of the next request
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Claim the next free start slot; returns the seconds until it (0 when it is now)."""
        if self.interval <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            slot = max(now, self._next)  # idle time earns no burst: at most one start per interval
            self._next = slot + self.interval
        return slot - now

    def wait(self) -> float:
        """Block until this caller may start a request; returns the seconds waited."""
        delay = self.reserve()
        if delay > 0:
            self._sleep(delay)
        return delay


class _UnusableReply(Exception):
    """A ``200`` reply without usable text (not JSON, no choices, empty content): worth asking again."""


class LLMClient(LLMBackend):
    """Client for an OpenAI-compatible ``/chat/completions`` endpoint (vLLM, Ollama, llama.cpp, OpenAI)."""

    def __init__(self, config: LLMConfig, *, cache: LLMCache | None = None,
                 limiter: RateLimiter | None = None, sleep: Callable[[float], object] | None = None,
                 jitter: Callable[[], float] = random.random) -> None:
        """``limiter``, ``sleep`` (the wait before a retry; default: the stop event's ``wait``, so :meth:`close`
        cuts it short) and ``jitter`` (a number in [0, 1) that shortens a backoff by up to 25 %) are injectable
        so tests run on a fake clock."""
        if not config.model:
            raise ConfigError("llm.model is empty: give the model name the server serves (e.g. --model "
                              "Qwen/Qwen2.5-7B-Instruct for vLLM, --model qwen2.5:7b for Ollama)")
        # Keyword arguments of chat.completions.create besides model/messages; also part of the cache key.
        params: dict[str, Any] = {"temperature": config.temperature}
        if config.max_tokens > 0:  # 0 leaves the limit to the server (or to extra_body: max_completion_tokens)
            params["max_tokens"] = config.max_tokens
        if config.top_p is not None:
            params["top_p"] = config.top_p
        if config.seed is not None:
            params["seed"] = config.seed
        if config.extra_body:
            params["extra_body"] = config.extra_body
        super().__init__(config.model, params, cache=cache, on_failure=config.on_failure,
                         system_prompt=config.system_prompt)
        self.config = config
        self.base_url = normalize_base_url(config.base_url)
        self.url = f"{self.base_url}/chat/completions"
        local = urlsplit(self.base_url).hostname in _LOOPBACK
        self._openai = openai.OpenAI(
            base_url=self.base_url, api_key=config.resolved_api_key() or _NO_KEY, timeout=config.timeout_s,
            max_retries=0,  # retries are ours (_complete_one): capped, logged, rate limited, testable
            default_headers={str(k): str(v) for k, v in config.extra_headers.items()},
            # A local server must not be sent through an HTTP(S)_PROXY from the environment; remote ones may need it.
            http_client=openai.DefaultHttpxClient(trust_env=False) if local else None)
        for name in ("httpx", "httpx2"):  # the openai client's transport (by version) logs every request at INFO
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        self._pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="llm")
        self._stop = threading.Event()
        self._limiter = limiter or RateLimiter(config.requests_per_minute, sleep=self._stop.wait)
        self._sleep = sleep or self._stop.wait
        self._jitter = jitter
        self._failure_lock = threading.Lock()
        self._consecutive_failures = 0
        self._inflight: dict[str, Future] = {}  # cache key -> request on its way (duplicates share it)
        self._inflight_lock = threading.Lock()

    # -- public -------------------------------------------------------------------------------------------

    def stream(self, conversations: Iterable[Conversation]) -> Iterator[Completion]:
        # A sliding window of futures keeps `concurrency` requests busy while yielding in input order;
        # the window is a few times the concurrency so one slow request rarely stalls the others.
        window = max(16, 4 * self.config.concurrency)
        pending: deque[Future] = deque()
        source = iter(conversations)
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < window:
                    try:
                        conversation = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    pending.append(self._submit(conversation))
                if not pending:
                    return
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

    def preflight(self) -> list[str]:
        """Check the endpoint answers before a long run: GET ``{base_url}/models``, without retries.

        Raises :class:`EndpointError` when the server cannot be reached or rejects the key; logs a warning when
        the model is not among the served ones. Returns the served model ids (empty when not listed).
        """
        url = f"{self.base_url}/models"
        try:
            page = self._openai.with_options(max_retries=0, timeout=min(self.config.timeout_s, 30.0)).models.list()
            served = [str(getattr(m, "id", "")) for m in getattr(page, "data", None) or []]
        except openai.APIConnectionError as exc:  # also a timeout
            raise EndpointError(f"cannot reach the LLM endpoint {url}: {_cause(exc)}.\n"
                                f"  Fix: start the server (vLLM: `vllm serve MODEL`, Ollama: `ollama serve`) or "
                                f"correct --base-url (now {self.base_url!r})") from None
        except (openai.AuthenticationError, openai.PermissionDeniedError) as exc:
            raise EndpointError(self._explain(exc, attempts=1)[0]) from None
        except openai.APIStatusError as exc:
            logger.debug("GET %s -> %s; skipping the model check", url, exc.status_code)
            return []
        except (openai.APIError, ValueError, TypeError):  # answered, but not with a model list
            return []
        if served and self.model not in served:
            logger.warning("model %r is not among the models %s serves: %s", self.model, url, ", ".join(served[:20]))
        return served

    def close(self) -> None:
        # Wakes threads waiting on the rate limiter or before a retry so they give up; requests under way are
        # waited for, so their replies still reach the cache.
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._openai.close()
        super().close()

    # -- internals ----------------------------------------------------------------------------------------

    def _submit(self, conversation: Conversation) -> Future:
        messages = as_messages(conversation, self.system_prompt)
        key = cache_key(messages, self.model, self.params)
        hit = self._cached(key)
        if hit is not None:
            done: Future = Future()
            done.set_result(hit)
            return done
        with self._inflight_lock:
            twin = self._inflight.get(key)
            if twin is not None:  # the same request is already on its way: share its reply, do not pay twice
                self.stats.add(completions=1, cache_hits=1)
                return twin
            future = self._pool.submit(self._complete_one, messages, key)
            self._inflight[key] = future
        future.add_done_callback(lambda _, key=key: self._forget_inflight(key))
        return future

    def _forget_inflight(self, key: str) -> None:
        with self._inflight_lock:
            self._inflight.pop(key, None)

    def _complete_one(self, messages: list[Message], key: str) -> Completion:
        """One conversation, in at most ``max_retries + 1`` requests: transport trouble (timeouts, connection
        errors, HTTP 408/409/429/5xx) is retried after :meth:`_wait_before_retry`; a ``200`` reply without usable
        text is asked again at once. Both share the one budget."""
        budget = self.config.max_retries + 1
        attempts = 0
        while True:
            self._limiter.wait()
            if self._stop.is_set():
                return Completion(None, error="cancelled: the LLM client was closed")
            attempts += 1
            self.stats.add(requests=1, retries=int(attempts > 1))
            try:
                raw = self._openai.chat.completions.with_raw_response.create(model=self.model, messages=messages,
                                                                            **self.params)
            except openai.APIError as exc:
                if attempts < budget and _retryable(exc):
                    self._wait_before_retry(exc, attempts)
                    continue
                return self._fail(*self._explain(exc, attempts))
            try:
                completion = _reply_of(raw)
            except _UnusableReply as exc:
                if attempts < budget:
                    logger.debug("unusable LLM reply (%s); asking again", exc)
                    continue
                return self._fail(self._gave_up(attempts, str(exc)))
            self.stats.add(completions=1, prompt_tokens=completion.prompt_tokens or 0,
                           completion_tokens=completion.completion_tokens or 0)
            self._store(key, completion)
            with self._failure_lock:
                self._consecutive_failures = 0
            return completion

    def _wait_before_retry(self, exc: openai.APIError, attempts: int) -> float:
        """Sleep before retry number ``attempts`` and return the seconds waited.

        The wait is what the server asked for (``retry-after-ms`` / ``Retry-After``) or else an exponential
        backoff (0.5 s doubling per retry, at most 8 s, minus up to 25 % jitter), and never more than
        ``llm.max_retry_wait``. Waits of a second or more are logged at INFO, saying why and whether the server's
        request was cut.
        """
        cap = self.config.max_retry_wait
        response = getattr(exc, "response", None)
        asked = _retry_after(response.headers) if response is not None else None
        if asked:  # None or 0: no request from the server, back off instead
            wait = min(asked, cap)
            why = f"server said Retry-After {_seconds(asked)}"
            if asked > cap:
                why += f" (capped at max_wait: llm.max_retry_wait={_seconds(cap)})"
            if asked > 2 * cap:
                why += ("; the server asks for far longer than the cap, so this retry may be refused too: lower "
                        "llm.requests_per_minute or llm.concurrency, raise llm.max_retry_wait, or run later")
        else:
            wait = min(0.5 * 2.0 ** (attempts - 1), 8.0, cap) * (1 - 0.25 * self._jitter())
            why = f"{_failure_name(exc)} (backoff)"
        message = "waiting %s s before retry %d/%d of %s: %s"
        args = (_seconds(wait), attempts, self.config.max_retries, self.url, why)
        if wait >= 1:
            logger.info(message, *args)
        else:
            logger.debug(message, *args)
        if wait > 0:
            self._sleep(wait)
        return wait

    def _explain(self, exc: openai.APIError, attempts: int) -> tuple[str, bool]:
        """``(message, fatal)`` for a request the openai client gave up on; fatal = every request would fail."""
        config, base = self.config, self.base_url
        if isinstance(exc, openai.APITimeoutError):
            return self._gave_up(attempts, f"no reply within llm.timeout_s={config.timeout_s:g}s"), False
        if isinstance(exc, openai.APIConnectionError):
            return (f"cannot reach the LLM endpoint {self.url}: {_cause(exc)} ({attempts} attempt(s)).\n"
                    f"  Fix: start the server (vLLM: `vllm serve MODEL`, Ollama: `ollama serve`) or correct "
                    f"--base-url (now {base!r})"), False
        if not isinstance(exc, openai.APIStatusError):
            return self._gave_up(attempts, f"{type(exc).__name__}: {exc}"), False
        status, body = exc.status_code, _excerpt(exc.response.text) or "(empty body)"
        message = f"{exc.request.url} answered HTTP {status}: {body}"
        if status in _RETRIED_STATUS or status >= 500:  # the openai client's retries are used up
            wait = exc.response.headers.get("retry-after") if status == 429 else None
            hint = (f"; the server asked to wait {wait}s" if wait else "") + (
                "; set llm.requests_per_minute" if status == 429 else "")
            return self._gave_up(attempts, message, hint), False
        fatal = True
        if status in (401, 403):
            fix = (f"the endpoint rejected the API key: export {config.api_key_env}=<key> (or set llm.api_key / "
                   f"llm.api_key_env); local vLLM/Ollama servers need a key only if started with one")
        elif status == 404 and (getattr(exc, "code", None) == "model_not_found" or "model" in body.lower()):
            fix = (f"the server does not serve the model {config.model!r}: GET {base}/models lists the names "
                   f"it serves (pass one with --model or llm.model; for Ollama `ollama pull NAME` first)")
        elif status in (404, 405):
            fix = (f"check that base_url is the API root, usually ending in /v1 (vLLM http://localhost:8000/v1, "
                   f"Ollama http://localhost:11434/v1, OpenAI https://api.openai.com/v1; now {base!r}), and that "
                   f"the model {config.model!r} is served (GET {base}/models lists the names)")
        else:  # e.g. 400 prompt too long: this request only
            fatal = False
            fix = (f"the server refused this request: check the model name {config.model!r}, that prompt + "
                   f"max_tokens ({config.max_tokens}) fits the context window, and the extra_body options")
        return f"{message}\n  Fix: {fix}", fatal

    def _gave_up(self, attempts: int, last_error: str, hint: str = "") -> str:
        return (f"{self.url}: gave up after {attempts} attempt(s); last error: {last_error}.\n  Fix: check the "
                f"server is up and not overloaded; raise llm.timeout_s or llm.max_retries, or lower "
                f"llm.concurrency{hint}")

    def _fail(self, message: str, fatal: bool = False) -> Completion:
        self.stats.add(failures=1)
        if fatal or self.on_failure == "raise":
            raise EndpointError(message)
        with self._failure_lock:
            self._consecutive_failures += 1
            streak = self._consecutive_failures
        limit = self.config.max_consecutive_failures
        if limit and streak >= limit:
            raise EndpointError(f"{streak} LLM requests in a row failed, so the endpoint looks unusable; "
                                f"last error: {message}")
        logger.warning("LLM request failed, recorded and skipped: %s", message.splitlines()[0])
        return Completion(None, error=message.splitlines()[0])


def normalize_base_url(url: str) -> str:
    """Strip whitespace, trailing slashes and a pasted ``/chat/completions`` suffix from a base URL."""
    url = (url or "").strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"llm.base_url {url!r} must start with http:// or https:// "
                          f"(e.g. http://localhost:8000/v1)")
    for suffix in ("/chat/completions", "/completions"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url


def _reply_of(raw: Any) -> Completion:
    """The reply text and token counts of a raw chat-completions response; raises :class:`_UnusableReply`."""
    text = raw.http_response.text
    try:
        data = raw.parse()  # lenient: unexpected shapes come back as they are, checked below
    except (ValueError, openai.APIResponseValidationError):
        raise _UnusableReply(f"reply is not JSON: {_excerpt(text)}") from None
    choices = getattr(data, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise _UnusableReply(f"reply has no choices: {_excerpt(text)}")
    choice = choices[0]
    message = getattr(choice, "message", None)
    content = getattr(message, "content", None) if message is not None else getattr(choice, "text", None)
    if isinstance(content, list):  # some servers return content parts
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    if not isinstance(content, str) or not content.strip():
        reason = getattr(choice, "finish_reason", None)
        raise _UnusableReply(f"reply has empty content (finish_reason={reason!r})"
                             + ("; raise llm.max_tokens" if reason == "length" else ""))
    usage = getattr(data, "usage", None)
    return Completion(content, prompt_tokens=_as_int(getattr(usage, "prompt_tokens", None)),
                      completion_tokens=_as_int(getattr(usage, "completion_tokens", None)))


def _retryable(exc: openai.APIError) -> bool:
    """Worth another request: a timeout, a connection error, or HTTP 408/409/429/5xx (unless the server sends
    ``x-should-retry``, which is obeyed either way)."""
    if isinstance(exc, openai.APIConnectionError):  # also APITimeoutError
        return True
    if not isinstance(exc, openai.APIStatusError):
        return False
    header = exc.response.headers.get("x-should-retry")
    if header in ("true", "false"):
        return header == "true"
    return exc.status_code in _RETRIED_STATUS or exc.status_code >= 500


def _retry_after(headers: Any) -> float | None:
    """Seconds the server asks to wait: ``retry-after-ms``, else ``Retry-After`` (seconds or an HTTP date)."""
    try:
        value = float(headers.get("retry-after-ms"))
        if math.isfinite(value) and value >= 0:
            return value / 1000.0
    except (TypeError, ValueError):
        pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            value = email.utils.parsedate_to_datetime(raw).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return max(value, 0.0) if math.isfinite(value) else None


def _failure_name(exc: openai.APIError) -> str:
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return f"connection error ({_cause(exc)})"
    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}"
    return type(exc).__name__


def _seconds(value: float) -> str:
    """``60`` -> "60", ``0.02`` -> "0.02", ``7.126`` -> "7.13"."""
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _cause(exc: openai.APIError) -> str:
    """What went wrong below an openai connection error, e.g. ``ConnectError: [Errno 111] Connection refused``."""
    cause = exc.__cause__
    return f"{type(cause).__name__}: {cause}" if cause is not None and str(cause) else str(exc)


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


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _excerpt(text: str, limit: int = 300) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[:limit] + "..."


class HFGenerator(LLMBackend):
    """A local Hugging Face causal LM with the same interface as :class:`LLMClient` (batched, cached).

    Uses the tokenizer's chat template when it has one, else a plain ``role: content`` transcript.
    ``temperature == 0`` decodes greedily; otherwise samples with ``temperature``/``top_p``.
    """

    def __init__(self, model_path: str, *, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, batch_size: int = 8, device: str | None = None, dtype: str = "auto",
                 seed: int | None = None, cache: LLMCache | None = None, on_failure: str = "raise",
                 system_prompt: str | None = None, trust_remote_code: bool = False) -> None:
        import torch  # local imports: the HTTP path must not pay for torch/transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        params = {"temperature": temperature, "max_tokens": max_new_tokens, "top_p": top_p, "seed": seed}
        resolved = str(Path(model_path).resolve()) if Path(model_path).exists() else model_path
        super().__init__(f"hf:{resolved}", params, cache=cache, on_failure=on_failure, system_prompt=system_prompt)
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
            if dtype != "auto":
                kwargs["dtype"] = getattr(torch, dtype)
            self.lm = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(self.device).eval()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a causal LM from {model_path!r}: {exc}") from None
        self.tokenizer.padding_side = "left"  # decoder-only batches must be left-padded
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ConfigError(f"{model_path}: the tokenizer has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._torch = torch

    def render(self, conversation: Conversation) -> str:
        """The prompt text the model sees for one conversation."""
        messages = as_messages(conversation, self.system_prompt)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nassistant:"

    def stream(self, conversations: Iterable[Conversation]) -> Iterator[Completion]:
        batch: list[Conversation] = []
        for conversation in conversations:
            batch.append(conversation)
            if len(batch) == self.batch_size:
                yield from self._run_batch(batch)
                batch = []
        if batch:
            yield from self._run_batch(batch)

    def _run_batch(self, batch: list[Conversation]) -> list[Completion]:
        keys = [self.key_for(c) for c in batch]
        results: list[Completion | None] = [self._cached(k) for k in keys]
        todo = [i for i, r in enumerate(results) if r is None]
        if todo:
            self.stats.add(requests=len(todo))
            try:
                texts = self._generate([self.render(batch[i]) for i in todo])
            except (RuntimeError, ValueError) as exc:  # e.g. out of memory, prompt longer than the model allows
                self.stats.add(failures=len(todo))
                message = f"local model {self.model} failed on a batch of {len(todo)}: {exc}"
                if self.on_failure == "raise":
                    raise EndpointError(message + "\n  Fix: lower llm.batch_size or llm.max_tokens, or shorten "
                                                  "the passages") from None
                logger.warning("%s; recorded and skipped", message)
                texts = [None] * len(todo)
            for i, text in zip(todo, texts):
                if text is None:
                    results[i] = Completion(None, error="local generation failed")
                    continue
                completion = Completion(text)
                self.stats.add(completions=1)
                self._store(keys[i], completion)
                results[i] = completion
        return [r for r in results if r is not None]

    def _generate(self, prompts: list[str]) -> list[str]:
        torch = self._torch
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        inputs = self.tokenizer(prompts, return_tensors="pt", padding=True,
                                add_special_tokens=not has_template).to(self.device)
        sampling: dict[str, Any] = {"do_sample": self.temperature > 0}
        if self.temperature > 0:
            sampling.update(temperature=self.temperature, top_p=self.top_p)
            if self.seed is not None:
                torch.manual_seed(self.seed)
        with torch.no_grad():
            output = self.lm.generate(**inputs, max_new_tokens=self.max_new_tokens,
                                      pad_token_id=self.tokenizer.pad_token_id,
                                      eos_token_id=self.tokenizer.eos_token_id, **sampling)
        new_tokens = output[:, inputs["input_ids"].shape[1]:]  # left padding: prompts all end at the same column
        self.stats.add(prompt_tokens=int(inputs["attention_mask"].sum()),
                       completion_tokens=int((new_tokens != self.tokenizer.pad_token_id).sum()))
        return [t.strip() for t in self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def build_backend(config: LLMConfig, *, cache_path: str | Path | None = None) -> LLMBackend:
    """The backend ``config.backend`` names, with the cache at ``config.cache_path`` (else ``cache_path``)."""
    path = config.cache_path or cache_path
    cache = LLMCache(path) if path and str(path).lower() not in ("none", "off", "false") else None
    if config.backend == "hf":
        if not config.model:
            raise ConfigError("llm.model is empty: for backend hf give a local model folder or Hub id")
        return HFGenerator(config.model, max_new_tokens=config.max_tokens, temperature=config.temperature,
                           top_p=config.top_p if config.top_p is not None else 1.0, batch_size=config.batch_size,
                           device=config.device, dtype=config.dtype, seed=config.seed, cache=cache,
                           on_failure=config.on_failure, system_prompt=config.system_prompt,
                           trust_remote_code=config.trust_remote_code)
    return LLMClient(config, cache=cache)


# ----------------------------------------------------------------------------------------------- prompts

def render_template(template: str, values: dict[str, object]) -> str:
    """Replace ``{name}`` placeholders literally (other braces, e.g. JSON examples, are left alone).

    A line whose only variable content is an empty value (e.g. ``Title: {title}`` for a passage without a
    title) is left out, so prompts never show dangling labels.
    """
    lines = []
    for line in template.splitlines(keepends=True):
        names = [name for name in values if "{" + name + "}" in line]
        if names and all(str(values[name]).strip() == "" for name in names):
            continue
        for name in names:
            line = line.replace("{" + name + "}", str(values[name]))
        lines.append(line)
    return "".join(lines)


def load_template(path: str | Path, required: tuple[str, ...]) -> str:
    """Read a prompt template file and check it has the ``required`` placeholders."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"prompt template {path} not found")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"prompt template {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as "
                          "UTF-8") from None
    missing = [name for name in required if "{" + name + "}" not in text]
    if missing:
        raise ConfigError(f"prompt template {path}: missing placeholder(s) "
                          f"{', '.join('{' + m + '}' for m in missing)}; the passage would never reach the LLM")
    return text


# ------------------------------------------------------------------------------------------- LLM stages

@dataclass
class LLMStageConfig(Checked):
    """What every LLM stage takes (query generation, the judge): files, prompts and their language, sharding,
    the endpoint. The stages' configs extend it (:class:`robustir.queries.generate.GenerateConfig`,
    :class:`robustir.filtering.llm_judge.JudgeConfig`)."""

    input: str = ""
    """Input JSONL (passages for generation, training records for the judge)."""
    output: str = ""
    """JSONL to write (training records)."""
    prompt_template: str | None = None
    """Template file used for every item (its placeholders: see the stage); default: built-in English/Chinese."""
    prompt_template_zh: str | None = None
    """Template file for Chinese items when the language is chosen automatically."""
    language: Literal["auto", "en", "zh"] = "auto"
    """Prompt language; ``auto`` chooses per item by its share of CJK letters."""
    cjk_threshold: Fraction = 0.3
    """``auto``: items whose letters are at least this share CJK get the Chinese prompt."""
    max_passage_chars: PositiveInt = 4000
    """Passage text is cut to this many characters inside the prompt (the records keep the full text)."""
    shard: str | None = None
    """``I/N``: process shard I of N of the items (the output gets a ``.shard-I-of-N`` suffix)."""
    overwrite: bool = False
    """Start afresh instead of resuming."""
    progress: bool = True
    """Show a progress bar."""
    preflight: bool = True
    """Check the endpoint (its model list) before starting, for a fast clear error when it is unreachable."""
    max_failure_rate: Fraction = 0.5
    """The stage fails (and its output is not finished) when more than this share of its items failed: after the
    run, or as soon as 20 items were tried in this run (``MIN_ITEMS_FOR_RATE``). Items finished by earlier runs count in
    the share. 0 = any failure fails the stage; 1 = never."""
    llm: LLMConfig = field(default_factory=LLMConfig)
    """The endpoint; the reply cache defaults to ``OUT.llm-cache.sqlite`` (``llm.cache_path=none`` disables it)."""

    def templates(self, required: tuple[str, ...]) -> tuple[str | None, str | None]:
        """The prompt templates given as files, loaded and checked for the ``required`` placeholders."""
        return (load_template(self.prompt_template, required) if self.prompt_template else None,
                load_template(self.prompt_template_zh, required) if self.prompt_template_zh else None)


@contextmanager
def stage_backend(config: LLMStageConfig, output: str | Path) -> Iterator[LLMBackend]:
    """The stage's backend, with its reply cache next to ``output`` and, for an HTTP endpoint with
    ``preflight``, the endpoint and model checked before the first request; closed on exit."""
    from ..outputs import StageOutput

    backend = build_backend(config.llm, cache_path=StageOutput(output).llm_cache)
    with backend:
        if config.preflight and isinstance(backend, LLMClient):
            backend.preflight()
        yield backend


# ------------------------------------------------------------------------------------ failed items of a stage

MIN_ITEMS_FOR_RATE = 20
"""Items a run must have tried before ``max_failure_rate`` can stop it early (at the end it always applies)."""


def check_failure_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ConfigError(f"max_failure_rate must be a share between 0 and 1 (0.5 = half the items may fail), "
                          f"got {rate!r}")
    return float(rate)


@dataclass
class FailureTally:
    """Tried and failed items of one LLM-stage run, and the ``max_failure_rate`` rule that stops it.

    ``earlier`` counts items finished by earlier runs (resumed): they are part of the output, so they count in the
    share. ``reasons`` counts failures by kind (for the report); ``errors`` by message (for the error text).
    """

    stage: str
    unit: str
    max_rate: float
    endpoint: str = ""
    earlier: int = 0
    tried: int = 0
    failed: int = 0
    reasons: "Counter[str]" = field(default_factory=lambda: Counter())
    errors: "Counter[str]" = field(default_factory=lambda: Counter())

    def __post_init__(self) -> None:
        self.max_rate = check_failure_rate(self.max_rate)

    def success(self) -> None:
        self.tried += 1

    def failure(self, reason: str, error: str | None = None) -> None:
        self.tried += 1
        self.failed += 1
        self.reasons[reason] += 1
        self.errors[(error or reason).splitlines()[0] if (error or reason) else reason] += 1

    @property
    def rate(self) -> float:
        total = self.tried + self.earlier
        return self.failed / total if total else 0.0

    def check(self, *, final: bool, failed_path: str | Path | None = None) -> None:
        """Raise :class:`EndpointError` when the failed share is above ``max_rate`` (during the run only once
        :data:`MIN_ITEMS_FOR_RATE` items were tried)."""
        if not self.failed or (not final and self.tried < MIN_ITEMS_FOR_RATE) or self.rate <= self.max_rate:
            return
        total = self.tried + self.earlier
        error, count = self.errors.most_common(1)[0]
        when = "" if final else f", stopped after {self.tried} tried in this run"
        where = f" (llm.base_url/llm.model: {self.endpoint})" if self.endpoint else ""
        listed = f" and the failures listed in {failed_path}" if failed_path else ""
        raise EndpointError(
            f"{self.stage}: {self.failed} of {total} {self.unit} failed ({self.rate:.0%}, more than "
            f"max_failure_rate={self.max_rate:g}{when}); commonest error ({count}x): {error}. The output is not "
            f"finished; what did finish is kept for the next run.\n"
            f"  Fix: check the endpoint and model{where}{listed}, then re-run (failed {self.unit} are retried); "
            f"or raise max_failure_rate to accept more failures")

    def summary(self) -> str:
        """"3 failed (2 request failed, 1 unparseable reply)" style counts, or "" when none failed."""
        return ", ".join(f"{n} {reason}" for reason, n in self.reasons.most_common())


def endpoint_of(backend: Any) -> str:
    """``base_url`` and model of a backend, for error messages."""
    url = getattr(backend, "base_url", None)
    model = getattr(backend, "model", "")
    return f"{url} {model!r}" if url else repr(model)


def write_failed_items(path: str | Path, items: Iterable[dict], what: str) -> str | None:
    """Write the failed items of a stage to ``path`` (``OUT.failed.jsonl``) atomically, or remove it when there
    are none (the earlier failures were retried successfully). ``what`` names them in the warning ("passage(s)
    failed"). Returns the path when written."""
    from ..io import atomic_write

    path = Path(path)
    items = list(items)
    if not items:
        path.unlink(missing_ok=True)
        return None
    with atomic_write(path) as handle:
        for item in items:
            handle.write(json.dumps(item, ensure_ascii=False) + "\n")
    logger.warning("%d %s; listed in %s and retried on the next run", len(items), what, path)
    return str(path)
