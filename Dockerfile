# robustir serve in a container: OpenAI-compatible embeddings, /search, /documents and /v1/rerank over an index folder.
#
#   docker build -t robustir-serve .
#   docker run --rm -p 8080:8080 -e ROBUSTIR_API_KEY=secret \
#       -v "$PWD/runs/scifact-index:/index" -v "$PWD/runs/peg/model:/model:ro" robustir-serve
#   # with a reranker: add -v "$PWD/my-reranker:/reranker:ro" and, after the image name,
#   #   --model /model --rerank-model /reranker
#
# The index (built by `robustir index`) is mounted at /index, read-write: POST/DELETE /documents write to it. The
# model is mounted, not baked in: the folder the index was built with, at /model (the server checks its files
# against the index's manifest and refuses another model). Nothing is downloaded at run time (HF_HUB_OFFLINE): a hub
# id as --model or --rerank-model is an error, mount the folder (a Hugging Face cache snapshot folder works).
# Arguments after the image name replace the default "--model /model" and go to `robustir serve` (any of its flags).
# The process runs as uid 1000: the mounted index must be writable by it (or run with --user "$(id -u):$(id -g)").
# Listening on 0.0.0.0 inside the container; set ROBUSTIR_API_KEY (or --api-key) before publishing the port.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/tmp/huggingface \
    TOKENIZERS_PARALLELISM=false

WORKDIR /opt/robustir

# torch first, the CPU build at the version constraints.txt pins (PyPI's Linux wheel pulls the CUDA libraries, GBs);
# robustir's install below then keeps it (scripts/setup.sh does the same)
COPY constraints.txt ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu -c constraints.txt torch

COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install -c constraints.txt . \
    && python -c "import torch, robustir; assert not torch.version.cuda, torch.__version__; print('robustir', robustir.__version__, 'torch', torch.__version__)"

RUN useradd --create-home --uid 1000 robustir
USER robustir
WORKDIR /home/robustir

# robustir serve's default port (robustir.serving.config.DEFAULT_PORT)
EXPOSE 8080
# /health needs no API key; the model loads before the port opens, so allow it time to start
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4)"]

ENTRYPOINT ["robustir", "serve", "--index", "/index", "--host", "0.0.0.0", "--port", "8080"]
CMD ["--model", "/model"]
