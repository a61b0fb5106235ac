"""``robustir serve``: an OpenAI-compatible embeddings server, with search over an index built by ``robustir index``.

Examples::

    robustir serve --model runs/peg/model                                   # POST /v1/embeddings on 127.0.0.1:8080
    robustir serve --index runs/index --api-key "$KEY" --port 9000          # + POST /search (the index's model),
                                                                            # POST|DELETE /documents, GET /documents/ID
    robustir serve --index runs/index --rerank-model path/to/cross-encoder  # POST /v1/rerank, /search rerank: true
    robustir serve --index runs/index --device cuda --max-batch-size 256    # precision auto: bf16 on Ampere+
    robustir serve --default-input-type query                               # for LangChain / LlamaIndex queries

Clients: ``openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key=KEY).embeddings.create(model=NAME,
input=[...])``; ``extra_body={"input_type": "query"}`` applies the model's query instruction. Routes, limits, error
codes, metrics: :mod:`robustir.serving.app`; LangChain and LlamaIndex: README.
"""

from __future__ import annotations

import logging
from typing import Annotated

from ..errors import ConfigError
from ..serving.config import ServeConfig
from .common import (CONFIG, EncoderOverrides, StorageOption, encoder_options, model_or_default, stage_config,
                     storage_options)


def command(*, model: str | None = None, index: str | None = None, storage_option: StorageOption = (),
            encoder: Annotated[EncoderOverrides | None, CONFIG] = None,
            config: Annotated[ServeConfig | None, CONFIG] = None) -> int:
    """OpenAI-compatible embeddings and search server (FastAPI).

    The encoder settings (--pooling, --query-instruction, ...) go without --index: an index brings its own.

    Parameters
    ----------
    model
        model folder or hub id (default: the index's model, else the bundled all-MiniLM-L6-v2)
    index
        index folder built by robustir index, or s3://bucket/prefix (enables POST /search and POST|DELETE
        /documents, GET /documents/ID)
    """
    from ..serving.app import create_app
    from ..serving.server import serve

    config = stage_config(ServeConfig).validate()
    options = encoder_options()
    model = model if index else model_or_default(model)
    if index and model is not None and not model.strip():
        raise ConfigError("--model is empty; name the model folder, or leave --model out to use the index's model")
    key = config.resolved_api_key()  # an empty key is refused here, before the model loads
    key = config.resolved_read_api_key() or key
    if config.host not in ("127.0.0.1", "localhost", "::1") and not key:
        logging.getLogger(__name__).warning("listening on %s without --api-key: anyone who can reach this address "
                                            "can use the server", config.host)
    storage = storage_options(storage_option)
    if storage and not index:
        raise ConfigError("--storage-option goes with --index s3://...")
    app = create_app(model, index, config, encoder_options=options, storage_options=storage)
    opened = app.state.server.index
    print(f"robustir serve: model {app.state.server.name} ({app.state.server.encoder.source}), "
          + (f"index {opened.path} ({opened.count} documents), " if opened is not None else "no index, ")
          + f"{app.state.server.describe()}, http://{config.host}:{config.port}/v1"
          + (" (API key required)" if key else ""),
          flush=True)
    serve(app, config.host, config.port)
    return 0

