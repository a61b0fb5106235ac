"""``llm:`` settings: how to reach and sample from the LLM (:class:`LLMConfig`)."""

from __future__ import annotations

import os
from dataclasses import field
from typing import Annotated, Literal

from ..validation import (cli, config_dataclass, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Range,
                          Seed)
from ..runs import operational


@config_dataclass
class LLMConfig:
    """How to reach and sample from the LLM. Every field can be set from YAML or as ``llm.<field>=value``."""

    backend: Literal["openai", "hf"] = "openai"
    """``openai``: an OpenAI-compatible HTTP endpoint (vLLM, Ollama, OpenAI); ``hf``: a local transformers model."""
    base_url: str = "http://localhost:8000/v1"
    """API root, usually ending in ``/v1`` (vLLM :8000/v1, Ollama :11434/v1, OpenAI https://api.openai.com/v1)."""
    model: str = ""
    """Model name as the server knows it; for ``backend: hf`` the local model folder or Hub id."""
    api_key: str | None = None
    """The key itself (prefer ``api_key_env`` so keys stay out of config files)."""
    api_key_env: str = operational("OPENAI_API_KEY")
    """Environment variable holding the API key."""
    temperature: Annotated[float, Range(ge=0, le=2)] = 0.7
    """Sampling temperature (0: greedy)."""
    top_p: Annotated[float, Range(gt=0, le=1)] | None = None
    """Nucleus sampling share; None = the server's default."""
    max_tokens: NonNegativeInt = 512
    """Reply length limit (``max_tokens`` in the request); 0 sends none."""
    seed: Seed | None = None
    """Sampling seed sent with each request (servers that honour it reply the same every run)."""
    extra_body: dict = field(default_factory=dict)
    """Merged into every request body, e.g. ``{"chat_template_kwargs": {"enable_thinking": false}}`` for vLLM."""
    extra_headers: dict = field(default_factory=dict)
    """Added to the HTTP headers of every request (e.g. a gateway's routing or auth header)."""
    system_prompt: str | None = None
    """Prepended as a system message to every conversation that has none."""
    timeout_s: Annotated[PositiveFloat, cli("timeout")] = operational(120.0)
    """Seconds to wait for one reply."""
    max_retries: NonNegativeInt = operational(5)
    """Retries per request (by the openai client) after a timeout, connection error or HTTP 408/409/429/5xx; a
    reply without usable text is asked again while the request has had at most this many retries."""
    max_retry_wait: PositiveFloat = operational(60.0)
    """Longest wait before one retry, in seconds: a longer ``Retry-After`` from the server (the openai client obeys
    up to 2 minutes and does not retry when asked for more) is cut to this, and the cut is logged."""
    concurrency: PositiveInt = operational(8)
    """Requests in flight at once."""
    requests_per_minute: Annotated[NonNegativeFloat, cli("rpm")] = operational(0.0)
    """Requests per minute at most; 0 = unlimited."""
    on_failure: Literal["raise", "skip"] = "raise"
    """After the retries: ``raise`` an EndpointError, or ``skip`` (the reply is ``None`` and the stage records it)."""
    max_consecutive_failures: NonNegativeInt = operational(20)
    """Under ``skip``, this many failures in a row mean the endpoint is down: raise instead (0 = never)."""
    cache_path: Annotated[str | None, cli("cache")] = operational(None)
    """sqlite file of finished replies (stages default to one next to their output); ``none`` disables caching."""
    # local Hugging Face backend only
    batch_size: PositiveInt = operational(8)
    """Backend hf: prompts generated together."""
    device: str | None = operational(None)
    """Backend hf: where the model runs (None: the first GPU if there is one, else the CPU)."""
    dtype: str = "auto"
    """Backend hf: weight dtype (auto, float32, bfloat16, float16)."""
    trust_remote_code: bool = False
    """Backend hf: run the model folder's own code (only for folders you trust)."""

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(self.api_key_env) or None

    def redacted(self) -> dict:
        """The config as a dict, safe to write into reports (no key)."""
        out = {k: v for k, v in self.__dict__.items()}
        if out.get("api_key"):
            out["api_key"] = "***"
        return out

