"""A Hugging Face encoder turned into a text-embedding model.

* pooling: ``cls`` (BGE / PEG convention) or ``mean`` (sentence-transformers MiniLM);
* L2 normalisation; separate max lengths and instruction prefixes for queries and passages;
* batched encoding sorted by length (less padding), in the precision of :mod:`robustir.precision`, progress bar;
* saved as a sentence-transformers folder, so ``SentenceTransformer(path)`` loads it unchanged
  (the query instruction becomes the ST prompt named ``"query"``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, Iterable, Iterator, Literal, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import ConfigError
from ..io import write_json
from ..validation import config_dataclass, PositiveInt
from ..runs import Artifact, fingerprint

if TYPE_CHECKING:
    from .batching import TokenBlock

logger = logging.getLogger(__name__)

Pooling = Literal["cls", "mean"]
TextKind = Literal["query", "passage"]
CONFIG_NAME = "robustir_config.json"
#: texts :meth:`Encoder.encode` tokenizes, sorts by length and batches together (bounds tokenizer memory); a caller
#: that encodes a corpus piece by piece in blocks of this size at multiples of it gets the very same embeddings
ENCODE_BLOCK = 100_000


@config_dataclass
class EncoderConfig:
    """How texts become vectors. Stored as ``robustir_config.json`` inside a saved model."""

    pooling: Pooling = "cls"
    """Sentence vector: the [CLS] token or the mean of the tokens."""
    normalize: bool = True
    """Unit-length vectors (cosine similarity)."""
    query_max_length: PositiveInt = 64
    """Queries are cut to this many tokens."""
    passage_max_length: PositiveInt = 256
    """Passages are cut to this many tokens."""
    query_instruction: str = ""
    """Prefix added to every query (BGE style)."""
    passage_instruction: str = ""
    """Prefix added to every passage."""

    def max_length(self, kind: TextKind) -> int:
        return self.query_max_length if kind == "query" else self.passage_max_length

    def instruction(self, kind: TextKind) -> str:
        return self.query_instruction if kind == "query" else self.passage_instruction

    def with_instruction(self, texts: Iterable[str], kind: TextKind, instruction: str | None = None) -> list[str]:
        """``texts`` as the model reads them: each preceded by ``instruction``, or when that is None by this config's
        instruction for ``kind`` (``"query"``; anything else is a passage); ``""`` adds nothing.

        The one place robustir adds an instruction (encoding, training batches, serving's token counts, the
        sentence-transformers baseline), so a model is trained on, and queried with, the same text."""
        prefix = self.instruction(kind) if instruction is None else instruction
        return [prefix + t for t in texts] if prefix else list(texts)


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_model_folder(path: Path, what: str = "model") -> Path:
    """Raise a clear :class:`ConfigError` unless ``path`` holds a Hugging Face model (config.json + weights)."""
    if not (path / "config.json").is_file() or not any((path / name).is_file() for name in WEIGHT_FILES):
        present = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())[:8]
        missing = "config.json" if not (path / "config.json").is_file() else "weights"
        if (path / "model" / "config.json").is_file():
            raise ConfigError(f"{what} folder {path} holds no model; it looks like a run folder: did you mean "
                              f"{path / 'model'}?")
        raise ConfigError(
            f"{what} folder {path} holds no model (no {missing}; it has: {', '.join(present) or 'nothing'}). A model "
            "folder has config.json, weights (model.safetensors or pytorch_model.bin) and the tokenizer files, as "
            "written by `robustir train` (in its model/ folder), `save_pretrained` or `SentenceTransformer.save`")
    return path


def model_load_errors() -> tuple[type[BaseException], ...]:
    """What transformers and safetensors raise for a damaged model folder (config, weights or tokenizer unreadable)."""
    from safetensors import SafetensorError

    return (OSError, ValueError, SafetensorError)


def cannot_load(path: str | os.PathLike, exc: BaseException, what: str = "model") -> ConfigError:
    """The one-line error for a model folder that has the files but cannot be loaded."""
    detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    detail = detail if len(detail) <= 200 else detail[:200] + "..."
    return ConfigError(f"{what} folder {path} cannot be loaded ({type(exc).__name__}: {detail}); its files look "
                       "damaged or incomplete: save or download the model again")


def looks_local(name: str) -> bool:
    """True when ``name`` can only mean a local path: absolute, ``./``/``~``-relative, more than one ``/`` (a hub
    id is ``name`` or ``owner/name``), or its first component exists here (``runs/model`` when ``runs/`` does)."""
    if name.startswith((".", "/", "~", "\\")) or os.sep != "/" and os.sep in name:
        return True
    parts = name.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).exists())


def resolve_model_path(name_or_path: str | os.PathLike, what: str = "model") -> Path:
    """A local model folder (checked: :func:`check_model_folder`); a name that can only be a local path
    (:func:`looks_local`) and does not exist is an error; anything else is a Hugging Face hub id, downloaded (or
    found in the local HF cache)."""
    name = str(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return check_model_folder(path, what)
    if path.exists():
        raise ConfigError(f"{what} {name!r} is a file; pass the model folder")
    if looks_local(name):
        raise ConfigError(f"{what} folder {name!r} does not exist (it is a local path, so it is not tried as a "
                          "Hugging Face hub id); check the path")
    logger.info("%s %r is not a local folder: trying it as a Hugging Face hub id", what, name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name))
    except Exception as exc:  # the hub client raises many types: turn them into one clear message
        raise ConfigError(
            f"{what} {name!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Fix: pass a local model folder, "
            "or download it once while online (the HF cache is used offline with HF_HUB_OFFLINE=1)") from None


def max_positions(transformer_config: Any, tokenizer: Any = None) -> int | None:
    """Tokens the model can take (absolute position embeddings), or None when unbounded (relative positions).

    This is the hard limit: a length above it would index past the position embeddings. The tokenizer's
    ``model_max_length`` is only a hint (sentence-transformers writes the length it was trained at there, e.g.
    128 for a model whose positions go to 512): :func:`default_length_limit` applies it to defaults only."""
    positions = getattr(transformer_config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return None
    if getattr(transformer_config, "model_type", "") in ("roberta", "xlm-roberta", "camembert", "longformer"):
        positions -= 2  # positions start after the padding index
    return positions


def default_length_limit(transformer_config: Any, tokenizer: Any = None) -> int | None:
    """The cap for a *default* length: the model's positions, or the tokenizer's ``model_max_length`` when lower."""
    positions = max_positions(transformer_config)
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit and (positions is None or limit < positions):
        return limit
    return positions


#: encoder-decoder families whose encoder robustir runs alone (model_type -> transformers encoder-only class), as
#: sentence-transformers' own Transformer module does: a T5 folder (full or encoder-only) loads as its encoder
ENCODER_ONLY_CLASSES = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}


def is_encoder_decoder(transformer_config: Any) -> bool:
    """True for an encoder-decoder checkpoint (T5 and the like), read from its config."""
    return bool(getattr(transformer_config, "is_encoder_decoder", False)) or \
        getattr(transformer_config, "model_type", "") in ENCODER_ONLY_CLASSES


def load_transformer(path: str | os.PathLike) -> nn.Module:
    """The network behind the embeddings: ``AutoModel`` for an encoder-only model; for an encoder-decoder of the T5
    family its encoder alone (``T5EncoderModel``: from a full ``T5ForConditionalGeneration`` folder the decoder
    weights are left out), since ``AutoModel`` would build the whole seq2seq model, whose forward needs decoder
    inputs. Another encoder-decoder is a :class:`ConfigError`."""
    import transformers
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(path)
    if not is_encoder_decoder(config):
        return AutoModel.from_pretrained(path)
    name = ENCODER_ONLY_CLASSES.get(getattr(config, "model_type", ""))
    if name is None:
        raise ConfigError(f"model {path} is an encoder-decoder of type {config.model_type!r}; robustir embeds with "
                          f"the encoder of the T5 family only ({', '.join(ENCODER_ONLY_CLASSES)}) or with "
                          "encoder-only models (BERT, RoBERTa, MiniLM, ...)")
    return getattr(transformers, name).from_pretrained(path)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); the model folder looks damaged: save or download the "
                          "model again") from None


def config_from_folder(path: Path) -> EncoderConfig:
    """Read pooling / normalisation / lengths / prompts from a robustir or sentence-transformers folder."""
    own = _read_json(path / CONFIG_NAME)
    if own:
        known = {f.name for f in fields(EncoderConfig)}
        return EncoderConfig(**{k: v for k, v in own.items() if k in known})
    config = EncoderConfig()
    modules = _read_json(path / "modules.json") if (path / "modules.json").exists() else []
    if modules:
        for module in modules:
            kind = module.get("type", "")
            if kind.endswith("Pooling"):
                pooling = _read_json(path / module.get("path", "") / "config.json")
                if pooling.get("pooling_mode_mean_tokens"):
                    config.pooling = "mean"
                elif pooling.get("pooling_mode_cls_token"):
                    config.pooling = "cls"
                else:
                    mode = pooling.get("pooling_mode")
                    if mode in ("cls", "mean"):
                        config.pooling = mode
                    else:
                        raise ConfigError(f"{path}: pooling {pooling} is not supported (use cls or mean)")
        config.normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
        st = _read_json(path / "sentence_bert_config.json")
        if "max_seq_length" in st:
            config.passage_max_length = int(st["max_seq_length"])
        prompts = _read_json(path / "config_sentence_transformers.json").get("prompts") or {}
        config.query_instruction = prompts.get("query", "")
        config.passage_instruction = prompts.get("document", prompts.get("passage", ""))
    # queries get the model's own length (sentence-transformers' max_seq_length), as sentence-transformers does; a
    # stage that wants shorter queries asks for them (length_options); from_pretrained caps both at the model's limit
    config.query_max_length = config.passage_max_length
    return config


DEFAULT_QUERY_LENGTH, DEFAULT_PASSAGE_LENGTH = 64, 256  # tokens a stage uses when no length is given


def length_options(query_max_length: int | None, passage_max_length: int | None) -> dict[str, Any]:
    """:meth:`Encoder.from_pretrained` keywords for a stage's ``query/passage_max_length`` fields: a given length
    is used as asked (and refused above the model's limit); None means the stage default (64 / 256 tokens),
    capped at the model's limit."""
    return {"query_max_length": query_max_length or DEFAULT_QUERY_LENGTH,
            "passage_max_length": passage_max_length or DEFAULT_PASSAGE_LENGTH,
            "capped": [key for key, value in (("query_max_length", query_max_length),
                                              ("passage_max_length", passage_max_length)) if value is None]}


def _st_module_classes() -> tuple[type, type, type]:
    """sentence-transformers' Transformer, Pooling and Normalize classes (6.x module paths; older: ``models``)."""
    try:
        from sentence_transformers.base.modules.normalize import Normalize
        from sentence_transformers.base.modules.transformer import Transformer
        from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Normalize, Pooling, Transformer
    return Transformer, Pooling, Normalize


class Encoder(nn.Module):
    """Text encoder: ``forward(features) -> (n, d)`` for training, :meth:`encode` for inference."""

    def __init__(self, transformer: nn.Module, tokenizer, config: EncoderConfig | None = None,
                 source: str = "") -> None:
        super().__init__()
        self.transformer = transformer
        self.tokenizer = tokenizer
        self.config = config or EncoderConfig()
        self.source = source
        # (weights version key, bf16/fp16 copy of the transformer) for fast inference; a tuple, so that
        # nn.Module does not register the copy as a sub-module (it never enters state_dict)
        self._half_cache: tuple | None = None
        # (id(tokenizer), max length) -> (that tokenizer, its FastTokens or None: one the fast path cannot mirror)
        self._fast_tokens: dict[tuple[int, int], tuple[Any, Any]] = {}

    # ------------------------------------------------------------------ loading / saving
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *, capped: Iterable[str] = (),
                        device: str | torch.device | None = None, **overrides) -> "Encoder":
        """Load a HF model folder, a sentence-transformers folder, a robustir folder or a hub id (a T5-family
        folder loads as its encoder alone, :func:`load_transformer`).

        ``overrides`` are :class:`EncoderConfig` fields (``pooling="mean"``, ``query_instruction=...``);
        ``None`` values are ignored. A max length above what the model takes is an error when it was given in
        ``overrides`` -- unless its key is in ``capped`` (a default of the caller's) -- and is capped otherwise.
        ``device``: where the encoder runs (``auto``, ``cpu``, ``cuda``, ``cuda:N``: :func:`robustir.device.
        resolve_device`, checked before the weights load); None leaves it on the CPU.
        """
        from transformers import AutoTokenizer

        target = None
        if device is not None:
            from ..device import resolve_device

            target = resolve_device(device)
        path = resolve_model_path(name_or_path)
        config = config_from_folder(path)
        unknown = set(overrides) - {f.name for f in fields(EncoderConfig)}
        if unknown:
            raise ConfigError(f"unknown encoder option(s) {sorted(unknown)}")
        config = replace(config, **{key: value for key, value in overrides.items() if value is not None})  # checked
        if config.pooling not in ("cls", "mean"):
            raise ConfigError(f"pooling must be 'cls' or 'mean', got {config.pooling!r}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            transformer = load_transformer(path)  # a T5 folder: its encoder alone
        except ConfigError:  # an architecture robustir cannot embed with: its own message, not "damaged"
            raise
        except model_load_errors() as exc:
            raise cannot_load(path, exc) from None
        hard, soft = max_positions(transformer.config), default_length_limit(transformer.config, tokenizer)
        for key in ("query_max_length", "passage_max_length"):
            asked = overrides.get(key) is not None and key not in capped  # asked for: say so; a default: cap it
            limit = hard if asked else soft
            if limit is None or getattr(config, key) <= limit:
                continue
            if asked:
                raise ConfigError(f"{key} = {getattr(config, key)} is above what model {name_or_path} takes "
                                  f"({limit} tokens); use at most {limit}")
            logger.info("%s: %s %d capped at the model's limit of %d tokens", name_or_path, key, getattr(config, key),
                        limit)
            config = replace(config, **{key: limit})
        encoder = cls(transformer, tokenizer, config, source=str(name_or_path))
        return encoder.to(target) if target is not None else encoder

    def save(self, path: str | os.PathLike, model_card: str | None = None) -> Path:
        """Save as a sentence-transformers folder that ``SentenceTransformer(path)`` loads as this encoder.

        The transformer goes to the root the way sentence-transformers' own ``Transformer`` module saves it (HF
        ``save_pretrained`` of the weights and the tokenizer, plus ``sentence_bert_config.json``); the pooling and
        normalisation are sentence-transformers' own ``Pooling`` / ``Normalize`` modules, written by their ``save``;
        ``modules.json`` names each module by its class. The transformer module is not instantiated: that would load
        the weights a second time (sentence-transformers' ``Transformer`` always loads from a path).
        """
        transformer_cls, pooling_cls, normalize_cls = _st_module_classes()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.transformer.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        write_json(path / "sentence_bert_config.json",
                   {"max_seq_length": self.config.passage_max_length, "do_lower_case": False})
        modules = [(transformer_cls, "")]
        steps = [(pooling_cls(self.dim, pooling_mode=self.config.pooling), "1_Pooling")]
        if self.config.normalize:
            steps.append((normalize_cls(), "2_Normalize"))
        for module, folder in steps:
            (path / folder).mkdir(exist_ok=True)
            module.save(str(path / folder))
            modules.append((type(module), folder))
        write_json(path / "modules.json", [{"idx": i, "name": str(i), "path": folder,
                                            "type": f"{cls.__module__}.{cls.__name__}"}
                                           for i, (cls, folder) in enumerate(modules)])
        import sentence_transformers
        import transformers

        from .. import __version__

        prompts = {}
        if self.config.query_instruction:
            prompts["query"] = self.config.query_instruction
        if self.config.passage_instruction:
            prompts["document"] = self.config.passage_instruction
        write_json(path / "config_sentence_transformers.json", {
            "__version__": {"robustir": __version__, "sentence_transformers": sentence_transformers.__version__,
                            "transformers": transformers.__version__, "pytorch": torch.__version__},
            "model_type": "SentenceTransformer",
            "prompts": prompts,
            "default_prompt_name": None,
            "similarity_fn_name": "cosine" if self.config.normalize else "dot",
        })
        write_json(path / CONFIG_NAME, asdict(self.config))
        if model_card:
            (path / "README.md").write_text(model_card, encoding="utf-8")
        return path

    # ------------------------------------------------------------------ properties
    @property
    def dim(self) -> int:
        return int(self.transformer.config.hidden_size)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def fingerprint(self) -> str:
        """Cheap content hash of the weights and settings, used to key embedding caches.

        The HF pooler (``pooler.*``) is left out: the encoder pools the last hidden states itself, and a folder
        without pooler weights (a masked-LM checkpoint) gets a random one at every load, which changed the key at
        every load and so never reused a cache.

        The sums are numpy's, in float64 on one thread: torch's multi-threaded ``sum`` rounds differently with the
        thread count (measured: the bundled model's key changed between ``torch.set_num_threads(1)`` and ``2``), so a
        cache made on one machine, or with other thread settings, was silently encoded again."""
        digest = hashlib.sha256(json.dumps(asdict(self.config), sort_keys=True).encode())
        with torch.no_grad():
            for name, param in self.transformer.state_dict().items():
                if name.startswith("pooler.") or ".pooler." in name:
                    continue
                flat = param.detach().to("cpu", torch.float64).numpy().ravel()
                stats = np.array([flat.sum(), np.abs(flat).sum(), flat[:: max(1, flat.size // 64)].sum()])
                digest.update(name.encode())
                digest.update(stats.tobytes())
        return digest.hexdigest()[:16]

    # ------------------------------------------------------------------ training path
    def tokenize(self, texts: Sequence[str], kind: TextKind, max_length: int | None = None,
                 instruction: str | None = None) -> dict[str, Tensor]:
        from .tokens import head_texts

        limit = max_length or self.config.max_length(kind)
        texts = head_texts(self.tokenizer, self.config.with_instruction(texts, kind, instruction), limit)
        return self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt", max_length=limit)

    def pool(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        if self.config.pooling == "cls":
            return hidden[:, 0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        device = self.device
        # on CUDA the copy does not block: training batches (and GradCache's chunks, views of them) come pinned from
        # the input pipeline, so it overlaps; on the CPU nothing changes
        features = {k: v.to(device, non_blocking=device.type == "cuda") for k, v in features.items()}
        hidden = self.transformer(**features).last_hidden_state
        embeddings = self.pool(hidden, features["attention_mask"])
        if self.config.normalize:
            embeddings = nn.functional.normalize(embeddings.float(), dim=-1)
        return embeddings

    # ------------------------------------------------------------------ inference path
    def _inference_transformer(self, precision: str) -> nn.Module:
        """The transformer to run inference with: itself (``fp32``), or a bfloat16 / float16 copy.

        A full low-precision copy is faster than autocast on CPU (no per-op weight casts: ~1.7x vs ~1.5x over
        fp32 for MiniLM with native bf16) at cosine >= 0.9999 to fp32; on a GPU the copy lives there too. The copy
        is rebuilt whenever a weight changed (tensor version counters move on every in-place update, e.g. an
        optimizer step), when the encoder moved to another device (``.to`` swaps tensors without moving their
        counters) and when another precision is asked for.
        """
        if precision == "fp32":
            return self.transformer
        from ..precision import precision_dtype

        key = (id(self.transformer), str(self.device), precision,
               tuple(p._version for p in self.transformer.parameters()))
        if self._half_cache is None or self._half_cache[0] != key:
            self._half_cache = None  # free the stale copy before making the new one
            import copy

            clone = copy.deepcopy(self.transformer).to(precision_dtype(precision)).eval()
            self._half_cache = (key, clone)
        return self._half_cache[1]

    def resolve_precision(self, precision: str | None = "fp32", bf16: bool | None = None) -> str:
        """The precision ``encode`` runs in on this encoder's device (:func:`robustir.precision.resolve_precision`);
        ``bf16=True`` is the older spelling of ``precision="bf16"``."""
        from ..precision import resolve_precision

        return resolve_precision("bf16" if bf16 else precision, self.device)

    def encode(self, texts: Sequence[str], kind: TextKind = "passage", *, batch_size: int = 64,
               precision: str | None = "fp32", bf16: bool | None = None, show_progress: bool | None = None,
               max_length: int | None = None, instruction: str | None = None, desc: str | None = None,
               tokenize_threads: int | None = None) -> np.ndarray:
        """Embed ``texts`` → float32 array ``(n, d)`` in input order.

        Texts are tokenized once, sorted by token count and batched, so each batch pads to similar
        lengths. ``precision`` (:mod:`robustir.precision`: ``auto``, ``fp32``, ``bf16``, ``fp16``; ``bf16=True`` is
        an alias of ``precision="bf16"``) is the dtype of the forward pass, run on a copy of the weights in that
        dtype; ``auto`` is bf16 only where the device computes it natively. Pooling and normalisation stay in
        float32.

        Input path (:mod:`robustir.models.batching`): a fast tokenizer's ids come as arrays from ``tokenize_threads``
        threads at once (default: torch's thread count), batches are padded by numpy on a background thread ahead
        of the model, and the vectors come back from the device once per block; the vectors are the very ones the
        tokenizer call + ``tokenizer.pad`` path gave (same batches, same tensors).
        """
        if tokenize_threads is not None and (isinstance(tokenize_threads, bool) or
                                             not isinstance(tokenize_threads, int) or tokenize_threads < 1):
            raise ConfigError(f"tokenize_threads = {tokenize_threads!r} is out of range: it must be an integer >= 1")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size = {batch_size!r} is out of range: it must be an integer >= 1")
        if max_length is not None and max_length < 1:
            raise ConfigError(f"max_length = {max_length!r} is out of range: it must be >= 1")
        n = len(texts)
        out = np.zeros((n, self.dim), dtype=np.float32)
        if n == 0:
            return out
        limit = max_length or self.config.max_length(kind)
        show = n >= 2000 if show_progress is None else show_progress
        plural = "queries" if kind == "query" else f"{kind}s"
        bar = tqdm(total=math.ceil(n / batch_size), desc=desc or f"encode {plural}", disable=not show, unit="batch")
        blocks = self._token_blocks(texts, kind, limit, instruction, tokenize_threads)
        try:
            for start, tokens in blocks:
                out[start:start + len(tokens)] = self._encode_tokens(
                    tokens, batch_size=batch_size, precision=precision, bf16=bf16, on_batch=lambda: bar.update(1))
        finally:
            blocks.close()  # stops the tokenizing thread now, also when the model raised
            bar.close()
        return out

    def _token_blocks(self, texts: Sequence[str], kind: TextKind, limit: int, instruction: str | None,
                      threads: int | None) -> Generator[tuple[int, TokenBlock], None, None]:
        """``(start, token ids)`` of each :data:`ENCODE_BLOCK` texts (bounds tokenizer memory); the next block is
        tokenized on a background thread while the model encodes this one."""
        from .batching import FastTokens, TokenBlock, prefetch

        key = (id(self.tokenizer), limit)
        if self._fast_tokens.get(key, (None,))[0] is not self.tokenizer:  # once per tokenizer and length (~ms)
            self._fast_tokens[key] = (self.tokenizer, FastTokens.create(self.tokenizer, limit))
        fast = self._fast_tokens[key][1]
        threads = max(1, threads or torch.get_num_threads())

        def blocks() -> Iterator[tuple[int, TokenBlock]]:
            for start in range(0, len(texts), ENCODE_BLOCK):
                chunk = texts[start:start + ENCODE_BLOCK]
                if fast is None:  # a tokenizer the fast path cannot mirror: its own call
                    ids = self.token_ids(chunk, kind, max_length=limit, instruction=instruction)
                    yield start, TokenBlock.from_lists(ids)
                else:
                    yield start, fast.encode(self.config.with_instruction(chunk, kind, instruction), threads)

        return prefetch(blocks(), depth=1 if len(texts) > ENCODE_BLOCK else 0)

    def token_ids(self, texts: Sequence[str], kind: TextKind = "passage", *, max_length: int | None = None,
                  instruction: str | None = None, tokenizer: Any = None) -> list[list[int]]:
        """The token ids :meth:`encode` feeds the model for ``texts``: instruction added, special tokens included,
        cut at ``max_length`` (default: this config's length for ``kind``), unpadded. ``tokenizer``: a copy of this
        encoder's to call instead (a fast tokenizer must not be called from two threads at once)."""
        from .tokens import head_texts  # a long text is cut before it is tokenized (memory): same ids

        limit = max_length or self.config.max_length(kind)
        tokenizer = tokenizer or self.tokenizer
        texts = head_texts(tokenizer, self.config.with_instruction(texts, kind, instruction), limit)
        return tokenizer(texts, truncation=True, max_length=limit, padding=False, return_attention_mask=False,
                         return_token_type_ids=False)["input_ids"]

    def encode_ids(self, ids: Sequence[Sequence[int]], *, batch_size: int = 64, precision: str | None = "fp32",
                   bf16: bool | None = None, on_batch: Any = None, pad_to_multiple_of: int | None = None
                   ) -> np.ndarray:
        """Embed already tokenized texts (:meth:`token_ids`) → float32 ``(n, d)`` in input order: sorted by length,
        ``batch_size`` per forward pass, each batch padded to its longest row (rounded up to ``pad_to_multiple_of``:
        fewer distinct shapes, which a long-lived server needs to keep its memory flat). ``robustir serve``
        tokenizes each request once, before it joins a shared batch, and runs the batch through here."""
        from .batching import TokenBlock

        return self._encode_tokens(TokenBlock.from_lists(ids), batch_size=batch_size, precision=precision, bf16=bf16,
                                   on_batch=on_batch, pad_to_multiple_of=pad_to_multiple_of)

    @torch.inference_mode()
    def _encode_tokens(self, tokens: TokenBlock, *, batch_size: int, precision: str | None, bf16: bool | None,
                       on_batch: Any = None, pad_to_multiple_of: int | None = None) -> np.ndarray:
        """The vectors of ``tokens`` in input order. Rows go longest first, ``batch_size`` a batch, each padded
        (:func:`~robustir.models.batching.padded_batch`) on a background thread ahead of the model, in pinned
        memory and copied without blocking on CUDA; the vectors stay on the device and come back in one copy."""
        from .batching import padded_batch, prefetch

        n = len(tokens)
        if not n:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self.tokenizer.pad_token_id is None:
            raise ConfigError(f"the tokenizer of {self.source or 'this model'} has no padding token; batches of "
                              "texts of different lengths cannot be made: set tokenizer.pad_token")
        was_training = self.training
        self.eval()
        device = self.device
        cuda = device.type == "cuda"
        transformer = self._inference_transformer(self.resolve_precision(precision, bf16))
        order = tokens.by_length()
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        batches = (padded_batch(tokens, order[b:b + batch_size], self.tokenizer.pad_token_id,
                                multiple=pad_to_multiple_of, left=left, pin=cuda)
                   for b in range(0, n, batch_size))
        vectors = torch.empty((n, self.dim), dtype=torch.float32, device=device)
        ready = prefetch(batches, depth=2 if n > batch_size else 0)
        try:
            done = 0
            for batch in ready:
                features = {k: v.to(device, non_blocking=cuda) for k, v in batch.items()}
                hidden = transformer(**features).last_hidden_state
                emb = self.pool(hidden.float(), features["attention_mask"])
                if self.config.normalize:
                    emb = nn.functional.normalize(emb, dim=-1)
                vectors[done:done + len(emb)] = emb
                done += len(emb)
                if on_batch is not None:
                    on_batch()
        finally:
            ready.close()  # stops the batching thread now, also when the model raised
            self.train(was_training)
        out = np.empty((n, self.dim), dtype=np.float32)
        out[order] = vectors.cpu().numpy()
        return out

    def encode_corpus(self, passages: Sequence[str], *, cache_dir: str | os.PathLike | None = None,
                      **kwargs) -> np.ndarray:
        """Like :meth:`encode` for passages, reusing ``cache_dir/<key>.npy`` when the same model, settings
        and texts were encoded before (the key hashes all three)."""
        if cache_dir is None:
            return self.encode(passages, "passage", **kwargs)
        cache = self.corpus_cache_file(passages, cache_dir, **kwargs)
        if reusable_corpus_cache(cache):
            return np.load(cache, allow_pickle=False)
        emb = self.encode(passages, "passage", **kwargs)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp.npy")
        np.save(tmp, emb)
        os.replace(tmp, cache)
        entry = corpus_cache_entry(cache)
        entry.start(fingerprint("corpus-embeddings", {"key": cache.stem}))
        entry.finish({"rows": int(emb.shape[0])}, checksums=True)
        return emb

    def corpus_cache_file(self, passages: Iterable[str], cache_dir: str | os.PathLike, **kwargs) -> Path:
        """Where :meth:`encode_corpus` keeps the embeddings of ``passages`` (read once, in order, to hash them)
        encoded with ``kwargs``: ``cache_dir/<model>-<texts>-<settings>.npy``."""
        digest = hashlib.sha256()
        for text in passages:
            digest.update(text.encode("utf-8", "surrogatepass"))
            digest.update(b"\0")
        settings = {k: kwargs.get(k) for k in ("max_length", "instruction")}
        settings["precision"] = self.resolve_precision(kwargs.get("precision", "fp32"), kwargs.get("bf16"))
        key = f"{self.fingerprint()}-{digest.hexdigest()[:16]}-" + hashlib.sha256(
            json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
        return Path(cache_dir) / f"{key}.npy"


#: the corpus-embedding caches' checksums are verified on use up to this size; larger files (a 100M-passage
#: corpus is hundreds of GB) are checked by size, since re-hashing them on every use (about 2 GB/s here) would cost
#: minutes each time
CACHE_CHECKSUM_LIMIT = 4 << 30


def corpus_cache_entry(path: Path) -> Artifact:
    """The record (:class:`robustir.runs.Artifact`) of one corpus-embedding cache file, shared by
    :meth:`Encoder.encode_corpus` and dense mining (either reuses the other's)."""
    return Artifact(path, what="corpus-embedding cache", checksum_limit=CACHE_CHECKSUM_LIMIT)


def reusable_corpus_cache(path: Path) -> bool:
    """True when the corpus-embedding cache file ``path`` is complete and matches its record. A file that does not
    (damaged, or written without a record) is removed with one warning, to be encoded again; the record of an
    encoding under way (no file yet) is kept, for it to resume."""
    check = corpus_cache_entry(path).check()
    if check.reusable:
        logger.info("reusing cached corpus embeddings %s", path)
        return True
    if path.exists():
        logger.warning("cached corpus embeddings %s do not match their record (%s): encoding again", path,
                       "; ".join(check.problems) or "no complete record")
        path.unlink()
    return False
