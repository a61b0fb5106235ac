"""The client for any OpenAI-compatible chat endpoint (:class:`LLMClient`) and its rate limiter.

:class:`LLMClient` is the official ``openai`` client pointed at ``base_url``, so it works with vLLM, Ollama
(``http://localhost:11434/v1``), llama.cpp server, OpenAI and anything compatible. Transport and retries are the
``openai`` client's (``max_retries=llm.max_retries``): it retries timeouts, connection errors and HTTP
408/409/429/5xx (``x-should-retry`` overrides), waiting what the server asks in ``retry-after-ms`` /
``Retry-After`` or else 0.5 s doubling up to 8 s. Two seams add what a long data job needs on top, without a
retry loop of ours (see :class:`_OpenAI`): an httpx ``request`` event hook runs before every request, retries
included, and waits for the requests-per-minute :class:`RateLimiter`; the wait before each retry is cut to
``llm.max_retry_wait``, logged at INFO (logger ``robustir.llm``) with its reason when a second or more, and spent
on the client's stop event, so :meth:`LLMClient.close` cuts it short. Besides: a thread pool of
``llm.concurrency`` requests yielding replies in input order, asking again when a ``200`` reply has no usable text,
and :class:`~robustir.errors.EndpointError` messages that say what to fix (wrong ``/v1`` base URL, unknown
model, missing key, retries used up).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit

import openai

from ..errors import ConfigError, EndpointError
from .base import Completion, Conversation, LLMBackend, Message, as_messages, cache_key
from .cache import LLMCache
from .config import LLMConfig

logger = logging.getLogger(__package__)

# Statuses the openai client retries by itself; seeing one means the retries are used up.
_RETRIED_STATUS = {408, 409, 429}
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
# The openai client insists on a key; servers started without one (vLLM, Ollama) ignore whatever is sent.
_NO_KEY = "EMPTY"


class _Cancelled(openai.OpenAIError):
    """Raised by the request hook once the client is closed; an ``OpenAIError``, so the openai client does not
    retry it."""


class _OpenAI(openai.OpenAI):
    """The ``openai`` client with its retries as they are, and its wait before a retry handed to ``on_wait``.

    Checked in ``openai/_base_client.py`` (openai 3.57): ``request`` retries timeouts, connection errors and the
    statuses ``_should_retry`` accepts (408/409/429/5xx, ``x-should-retry`` obeyed, no retry when ``Retry-After``
    asks for more than 2 minutes); before each retry ``_sleep_for_retry`` takes the wait from
    ``_calculate_retry_timeout`` (``retry-after-ms`` / ``Retry-After`` up to 2 minutes, else 0.5 s doubling up to
    8 s minus up to 25 % jitter), logs "Retrying request in N seconds" without a reason and ``time.sleep``s it,
    which nothing can cut short or a test replace. ``_calculate_retry_timeout`` is the seam: it runs once per
    retry, just before that sleep, inside the ``except`` of the failed attempt. This override keeps the library's
    wait and passes it, the server's ``Retry-After`` and the retry number to ``on_wait``, which caps, logs and
    spends it; the library then sleeps the 0 returned here. (An httpx ``response`` hook could log too, but it
    sees neither the wait the library will choose nor timeouts and connection errors.)
    """

    on_wait: Callable[[float, float | None, int, int], None] | None = None
    """``(wait, asked, retry, max_retries)``; unset on copies made by ``with_options`` (preflight: no retries)."""

    def _calculate_retry_timeout(self, remaining_retries: int, options: Any, response_headers: Any = None) -> float:
        wait = super()._calculate_retry_timeout(remaining_retries, options, response_headers)
        if self.on_wait is None:
            return wait
        retries = options.get_max_retries(self.max_retries)
        self.on_wait(wait, self._parse_retry_after_header(response_headers), retries - remaining_retries + 1,
                     retries)
        return 0.0


class RateLimiter:
    """Spaces request starts at least ``60 / rpm`` seconds apart across all threads (0 = no limit).

    ``clock`` and ``sleep`` are injectable so tests run on a fake clock; :class:`LLMClient` passes its stop
    event's ``wait`` as ``sleep``, so closing the client cuts a wait short, and waits in an httpx request hook,
    so the limit applies to every request the openai client sends, its retries included.
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
                 limiter: RateLimiter | None = None, sleep: Callable[[float], object] | None = None) -> None:
        """``limiter`` and ``sleep`` (the wait before a retry; default: the stop event's ``wait``, so :meth:`close`
        cuts it short) are injectable so tests run on a fake clock."""
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
        self._pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="llm")
        self._stop = threading.Event()
        self._limiter = limiter or RateLimiter(config.requests_per_minute, sleep=self._stop.wait)
        self._sleep = sleep or self._stop.wait
        self._local = threading.local()  # .attempts: requests sent for the conversation this thread works on
        local = urlsplit(self.base_url).hostname in _LOOPBACK
        self._openai = _OpenAI(
            base_url=self.base_url, api_key=config.resolved_api_key() or _NO_KEY, timeout=config.timeout_s,
            max_retries=config.max_retries, default_headers={str(k): str(v) for k, v in config.extra_headers.items()},
            # A local server must not be sent through an HTTP(S)_PROXY from the environment; remote ones may need it.
            http_client=openai.DefaultHttpxClient(trust_env=not local,
                                                  event_hooks={"request": [self._before_request]}))
        self._openai.on_wait = self._wait_before_retry
        # The transport (httpx or httpx2, by openai version) logs every request at INFO, and the openai client each
        # retry (with the 0 s _OpenAI leaves it); _wait_before_retry logs the real wait and why.
        for name in ("httpx", "httpx2", "openai"):
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
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
        # Wakes threads waiting on the rate limiter or before a retry so they give up (the request hook raises
        # _Cancelled); requests under way are waited for, so their replies still reach the cache.
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

    def _before_request(self, request: Any) -> None:
        """httpx ``request`` event hook: runs before every request the openai client sends, its retries included."""
        self._limiter.wait()
        if self._stop.is_set():
            raise _Cancelled("the LLM client was closed")
        self._local.attempts = getattr(self._local, "attempts", 0) + 1

    def _complete_one(self, messages: list[Message], key: str) -> Completion:
        """One conversation. The openai client retries transport failures; a ``200`` reply without usable text is
        asked again at once while the conversation has had at most ``max_retries`` requests (retries included)."""
        self._local.attempts = 0
        try:
            while True:
                try:
                    raw = self._openai.chat.completions.with_raw_response.create(
                        model=self.model, messages=messages, **self.params)
                    completion = _reply_of(raw)
                except _UnusableReply as exc:
                    if self._local.attempts <= self.config.max_retries:
                        logger.debug("unusable LLM reply (%s); asking again", exc)
                        continue
                    return self._fail(self._gave_up(self._local.attempts, str(exc)))
                except openai.OpenAIError as exc:
                    if self._stop.is_set():
                        return Completion(None, error="cancelled: the LLM client was closed")
                    return self._fail(*self._explain(exc, self._local.attempts))
                break
        finally:
            self.stats.add(requests=self._local.attempts, retries=max(self._local.attempts - 1, 0))
        self.stats.add(completions=1, prompt_tokens=completion.prompt_tokens or 0,
                       completion_tokens=completion.completion_tokens or 0)
        self._store(key, completion)
        with self._failure_lock:
            self._consecutive_failures = 0
        return completion

    def _wait_before_retry(self, wait: float, asked: float | None, retry: int, retries: int) -> None:
        """Spend the openai client's ``wait`` before retry number ``retry``, cut to ``llm.max_retry_wait``.

        Waits of a second or more are logged at INFO with why: the failure, what the server asked for
        (``asked``, from ``Retry-After``) and whether the cap cut it. Runs inside the openai client's ``except``
        block, so ``sys.exc_info`` is the failure.
        """
        cap = self.config.max_retry_wait
        why = _failure_name(sys.exc_info()[1])
        why += f", server said Retry-After {_seconds(asked)}" if asked and asked > 0 else " (backoff)"
        if wait > cap:
            why += f" (capped at max_wait: llm.max_retry_wait={_seconds(cap)})"
            wait = cap
        if asked and asked > 2 * cap:
            why += ("; the server asks for far longer than the cap, so this retry may be refused too: lower "
                    "llm.requests_per_minute or llm.concurrency, raise llm.max_retry_wait, or run later")
        message = "waiting %s s before retry %d/%d of %s: %s"
        (logger.info if wait >= 1 else logger.debug)(message, _seconds(wait), retry, retries, self.url, why)
        if wait > 0:
            self._sleep(wait)

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
            wait = exc.response.headers.get("retry-after")
            hint = (f"; the server asked to wait {wait}s" if wait else "") + (
                "; set llm.requests_per_minute" if status == 429 else "")
            if attempts == 1 and config.max_retries:
                hint += ("; it was not retried: the server sent x-should-retry: false or a Retry-After longer than "
                         "the openai client waits (2 minutes), so run later")
            return self._gave_up(attempts, message, hint), False
        fatal = True
        if status in (401, 403):
            fix = (f"the endpoint rejected the API key: export {config.api_key_env}=<key> (or set llm.api_key / "
                   f"llm.api_key_env); local vLLM/Ollama servers need a key only if started with one")
        elif "robustir serve" in body:  # an embeddings server, e.g. --base-url given robustir serve's address
            fix = (f"{base} is robustir serve, an embeddings server, not an LLM: point --base-url (llm.base_url) at "
                   f"the LLM's OpenAI-compatible endpoint (vLLM http://localhost:8000/v1, Ollama "
                   f"http://localhost:11434/v1)")
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


def _failure_name(exc: BaseException | None) -> str:
    """What failed, from the transport exception the openai client is about to retry."""
    response = getattr(exc, "response", None)  # httpx.HTTPStatusError
    if response is not None:
        return f"HTTP {response.status_code}"
    if exc is None:
        return "failure"
    if "timeout" in type(exc).__name__.lower():  # httpx.ReadTimeout, ConnectTimeout, ...
        return "timeout"
    return f"connection error ({type(exc).__name__}: {exc})"


def _seconds(value: float) -> str:
    """``60`` -> "60", ``0.02`` -> "0.02", ``7.126`` -> "7.13"."""
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _cause(exc: openai.APIError) -> str:
    """What went wrong below an openai connection error, e.g. ``ConnectError: [Errno 111] Connection refused``."""
    cause = exc.__cause__
    return f"{type(cause).__name__}: {cause}" if cause is not None and str(cause) else str(exc)



def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _excerpt(text: str, limit: int = 300) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[:limit] + "..."

