#!/usr/bin/env bash
# The test suite, exactly as CI runs it (.ci/run calls this script on a clean clone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
