#!/usr/bin/env bash
# The planted-noise benchmark's decisive cells on a lent GPU machine, several runs at once on the one GPU.
#
#   bash ../shared/gpu/bundle.sh $CLI_WHEELS  # here, once: wheels, the model and SciFact into .gpu/, with
#     CLI_WHEELS="cyclopts attrs docstring-parser rich rich-rst docutils markdown-it-py mdurl pygments"
#     (robustir's configs name their command-line flags with cyclopts, so importing them needs it)
#   bash bench/noise_gpu.sh proxy|gpu [noise-bench overrides...]     # there, from the project root
#
# proxy: the cpu-long preset (the CPU proxy's budget, run on the GPU for its 3 seeds), gpu: the gpu preset.
# Each phase is one resumable `robustir noise-bench --jobs N` call; what finished is in $OUT/<phase>.jsonl and
# $OUT/<phase>.md even when LIMIT (seconds) cuts it short. Settings: JOBS (default 12), LIMIT (default 480),
# SEEDS (default "1 2 3"); overrides (key=value) go before the grid's flags.
set -u
phase=${1:?proxy or gpu}; shift
source "${SETUP:-.gpu/setup.sh}" >/dev/null  # SETUP: another environment script (a dry run here)
W=${W:-$T/nb}; OUT=${OUT:-$W/out}; mkdir -p "$W" "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
run() {  # one noise-bench call over the grid given, into $W/$phase
  python3 -m robustir.cli.main noise-bench --data "$D" --model "$M" --output "$W/$phase" --jobs "${JOBS:-12}" \
    --no-plots "$@" 2>&1 | grep -E "noise-bench:|Error|error" | grep -v "^noise-bench: results in"
}
end=$((SECONDS + ${LIMIT:-480}))
case $phase in  # most decisive first: what a cut-short phase leaves out is at the end
  proxy) grid=("--preset cpu-long --rates 0 0.4 --methods infonce peg st robust"
               "--preset cpu-long --rates 0 0.2 --methods infonce robust") ;;
  gpu)   grid=("--preset gpu --rates 0 0.4 --methods infonce robust" "--preset gpu --rates 0 0.4 --methods peg st"
               "--preset gpu --rates 0 0.2 --methods infonce robust") ;;
  *) echo "phase: proxy or gpu" >&2; exit 2 ;;
esac
for cell in "${grid[@]}"; do
  left=$((end - SECONDS)); [ $left -gt 10 ] || break
  # shellcheck disable=SC2086
  timeout $left bash -c "$(declare -f run); phase=$phase W=$W D=$D M=$M JOBS=${JOBS:-12}; \
    run $* $cell --kinds fp-random fp-hard --seeds ${SEEDS:-1 2 3}"
done
cp "$W/$phase/results.jsonl" "$OUT/$phase.jsonl" 2>/dev/null
python3 - "$W/$phase/results.jsonl" "$OUT/$phase.md" <<'EOF'
import json, sys
from pathlib import Path
from robustir.robustness.bench import write_table
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()] if Path(sys.argv[1]).exists() else []
print(write_table(rows, Path(sys.argv[2]), ["fp-random", "fp-hard"]) if rows else "no finished run")
EOF
