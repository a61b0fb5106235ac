"""The settings of ``robustir serve`` (kept apart from the app so that ``robustir --help`` does not import FastAPI)."""

from __future__ import annotations

from typing import Annotated

from ..errors import ConfigError
from ..precision import Precision
from ..validation import config_dataclass, NonNegativeFloat, PositiveInt, Range

__all__ = ["ServeConfig"]


@config_dataclass
class ServeConfig:
    """How ``robustir serve`` serves: where it listens, who may call it, how it batches and what it accepts."""

    host: str = "127.0.0.1"
    """Address to listen on; 127.0.0.1 = this machine only (0.0.0.0 exposes it)"""
    port: Annotated[int, Range(ge=0, le=65535)] = 8000
    """TCP port."""
    api_key: str | None = None
    """Required as "Authorization: Bearer KEY" when set (or env ROBUSTIR_API_KEY)"""
    served_model_name: str | None = None
    """The model name clients send; default: the model folder's name."""
    device: str = "auto"
    """Where the model runs: auto (first GPU if any, else CPU), cpu, cuda, cuda:N."""
    precision: Precision = "auto"
    """Auto: bf16 where native (GPU, AMX/AVX512-BF16 CPU), else fp32."""
    max_batch_size: PositiveInt = 64
    """Texts batched together at most."""
    max_wait_ms: NonNegativeFloat = 5.0
    """How long the first request of a batch waits for others to join it."""
    workers: PositiveInt | None = None
    """Batches encoded at once; default: 1 on a GPU; CPU: 1 in fp32, one per CPU in bf16."""
    encode_batch_size: PositiveInt | None = None
    """Texts per forward pass (length-sorted); default: 16 CPU, batch GPU."""
    max_inputs_per_request: PositiveInt = 2048
    """Texts in one request (embeddings input or search queries)"""
    max_chars_per_input: PositiveInt = 32768
    """Characters of one text."""
    max_body_bytes: PositiveInt = 16 << 20
    """Request body size (larger: 413)"""
    max_top_k: PositiveInt = 1000
    """Largest top_k a search may ask for."""
    matryoshka_dims: list[int] | None = None
    """Dimensions the model was trained to be cut to (enables "dimensions")"""

    def validate(self) -> "ServeConfig":
        for dim in self.matryoshka_dims or []:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ConfigError(f"matryoshka_dims: {dim!r} is not a dimension (an integer >= 1)")
        return self
