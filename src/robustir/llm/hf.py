"""A local Hugging Face causal LM behind the :class:`~robustir.llm.base.LLMBackend` interface."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..errors import ConfigError, EndpointError
from .base import Completion, Conversation, LLMBackend, as_messages
from .cache import LLMCache

logger = logging.getLogger(__package__)


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

