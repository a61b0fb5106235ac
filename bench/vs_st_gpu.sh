#!/usr/bin/env bash
# Issue 38's grid on a lent GPU machine: robustir's InfoNCE variants beside sentence-transformers MNRL, both presets,
# chosen on the dev split (200 held-out SciFact train queries) and then scored on test, every run its own process,
# JOBS of them at a time on the one GPU.
#
#   bash ../shared/gpu/bundle.sh              # here, once: wheels, the model and SciFact into .gpu/
#   bash bench/vs_st_gpu.sh                   # there, from the project root
#
# Each run is one `python bench/vs_st.py --seeds S --sides X` into its own folder (vs_st.py keeps finished runs),
# most decisive first: gpu-preset dev, gpu-preset test, cpu-preset dev, cpu-preset test. What finished when LIMIT
# (seconds) cuts the grid short is in $OUT/vs_st_gpu.jsonl and $OUT/vs_st_gpu.md. Settings: JOBS (default 12; 8 at
# most for the gpu preset on an 80 GB card: a run holds about 8 GB), LIMIT (default 450), SEEDS (default "1 2 3"),
# PRESETS (default "gpu cpu"), SPLITS (default "dev test"), VARIANTS (names below), SET (budget
# overrides for vs_st.py --set, a dry run), SETUP (another environment script, for a dry run here).
set -u
source "${SETUP:-.gpu/setup.sh}" >/dev/null
W=${W:-$T/vs}; OUT=${OUT:-$W/out}; mkdir -p "$W" "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
declare -A OPTIONS=(
  [base]='{}'
  [symmetric]='{"symmetric": true}'
  [gte]='{"denominator": "gte"}'
  [fnmargin]='{"false_negative_margin": 0.1}'
  [gte_fnmargin]='{"denominator": "gte", "false_negative_margin": 0.1}'
  [tau03]='{"temperature": 0.03}'
  [tau07]='{"temperature": 0.07}'
)
declare -A RECIPE=(  # goal 2: robustir's own mining and budget (vs_st.py --robustir-mining / --robustir-set)
  [dense]='--robustir-mining dense'
  [dense_k7]='--robustir-mining dense --robustir-set num_negatives=7'
)
VARIANTS=${VARIANTS:-"base symmetric gte fnmargin gte_fnmargin"}
jobs=$W/jobs.txt; : > "$jobs"
for preset in ${PRESETS:-gpu cpu}; do
  for split in ${SPLITS:-dev test}; do
    for seed in ${SEEDS:-1 2 3}; do
      [ "$split" = test ] && echo "$preset $split $seed st" >> "$jobs"
      for variant in $VARIANTS; do echo "$preset $split $seed $variant" >> "$jobs"; done
    done
  done
done
one() {  # preset split seed variant: one vs_st.py run in its own folder, its log beside it
  local preset=$1 split=$2 seed=$3 variant=$4 dev=() sides=(--sides robustir) opts='{}'
  [ "$split" = dev ] && dev=(--dev 200)
  local recipe=()
  if [ "$variant" = st ]; then sides=(--sides st); elif [ -n "${OPTIONS[$variant]:-}" ]; then opts=${OPTIONS[$variant]}; fi
  [ -n "${RECIPE[$variant]:-}" ] && read -r -a recipe <<< "${RECIPE[$variant]}"
  local out=$W/runs/$variant-$preset-$split-s$seed
  mkdir -p "$out"
  # shellcheck disable=SC2086
  python3 bench/vs_st.py --preset "$preset" "${dev[@]}" --seeds "$seed" "${sides[@]}" --robustir-options "$opts" \
    "${recipe[@]}" --data "$D" --model "$M" --output "$out" ${SET:+--set $SET} > "$out/log.txt" 2>&1 \
    && echo "done $variant $preset $split seed $seed" || { echo "FAILED $variant $preset $split seed $seed"; tail -5 "$out/log.txt"; }
}
export -f one; export W D M SET
export OPTIONS_DECL; OPTIONS_DECL="$(declare -p OPTIONS RECIPE)"
export OMP_NUM_THREADS=1 RAYON_RS_NUM_CPUS=${RAYON_RS_NUM_CPUS:-2}
start=$SECONDS
timeout "${LIMIT:-450}" xargs -a "$jobs" -P "${JOBS:-12}" -L 1 bash -c 'eval "$OPTIONS_DECL"; one "$@"' _
echo "grid: $((SECONDS - start)) s for $(wc -l < "$jobs") runs (JOBS=${JOBS:-12})"
python3 - "$W/runs" "$OUT" "$VARIANTS" <<'EOF'
import json, statistics, sys
from pathlib import Path
runs, out, variants = Path(sys.argv[1]), Path(sys.argv[2]), ["st"] + sys.argv[3].split()
rows = []
for path in sorted(runs.glob("*/*/results.jsonl")):
    variant, preset, split, seed = path.parent.parent.name.rsplit("-", 3)
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append({**json.loads(line), "variant": variant, "preset": preset, "split": split})
(out / "vs_st_gpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
lines = ["| preset | split | variant | seeds | NDCG@10 mean ± std | per seed | vs base | vs ST | train s |",
         "|---|---|---|---:|---:|---|---:|---:|---:|"]
def scores(preset, split, variant):
    found = sorted((r["seed"], 100 * r["metrics"]["ndcg@10"], r["train_seconds"]) for r in rows
                   if (r["preset"], r["split"], r["variant"]) == (preset, split, variant))
    return [s for _, s, _ in found], [t for _, _, t in found]
for preset in dict.fromkeys(r["preset"] for r in rows):
    for split in ("dev", "test"):
        base, _ = scores(preset, split, "base")
        st, _ = scores(preset, split, "st")
        for variant in variants:
            values, seconds = scores(preset, split, variant)
            if not values:
                continue
            mean = statistics.mean(values)
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            vs = lambda ref: f"{mean - statistics.mean(ref):+.2f}" if ref and len(ref) == len(values) else ""
            lines.append(f"| {preset} | {split} | {variant} | {len(values)} | {mean:.2f} ± {std:.2f} | "
                         f"{' / '.join(f'{v:.2f}' for v in values)} | {vs(base) if variant != 'base' else ''} | "
                         f"{vs(st) if variant != 'st' else ''} | {statistics.median(seconds):.0f} |")
(out / "vs_st_gpu.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
