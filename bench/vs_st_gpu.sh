#!/usr/bin/env bash
# Issue 38's grid on a lent GPU machine: robustir's InfoNCE variants beside sentence-transformers MNRL, both presets,
# chosen on the dev split (200 held-out SciFact train queries) and then scored on test, every run its own process,
# JOBS of them at a time on the one GPU.
#
#   bash ../shared/gpu/bundle.sh $CLI_WHEELS  # here, once: wheels, the model and SciFact into .gpu/, with
#     CLI_WHEELS="cyclopts attrs docstring-parser rich rich-rst docutils markdown-it-py mdurl pygments"
#     (robustir's configs name their command-line flags with cyclopts, so importing them needs it)
#   bash bench/vs_st_gpu.sh                   # there, from the project root
#
# Each run is one `python bench/vs_st.py --seeds S --sides X` into its own folder (vs_st.py keeps finished runs),
# most decisive first: gpu-preset dev, gpu-preset test, cpu-preset dev, cpu-preset test. What finished when LIMIT
# (seconds) cuts the grid short is in $OUT/vs_st_gpu.jsonl and $OUT/vs_st_gpu.md. Settings: JOBS (default 12; 8 at
# most for the gpu preset on an 80 GB card: a run holds about 8 GB), LIMIT (default 450), SEEDS (default "1 2 3"),
# PRESETS (default "gpu cpu"), SPLITS (default "dev test"), VARIANTS (names below), SET (budget
# overrides for vs_st.py --set, a dry run), SETUP (another environment script, for a dry run here), WEIGHTS (WiSE-FT:
# every robustir model is also scored moved back toward the base model by each W, vs_st.py --robustir-base-weight;
# variant "name@W" in the table), HELDOUT (BEIR folders never used for a choice: bench/heldout.py then scores the
# base model, every test-split model and its WEIGHTS copies on them, $OUT/heldout-*.jsonl; carry them, e.g.
# `tar -cJf .gpu/heldout.tar.xz -C ../shared/data medline cisi cacm`, which this script unpacks to $T/heldout),
# TEST_ONLY (variants run on the test split only: goal 2's recipes, not chosen on dev).
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
  # twice the in-batch negatives through GradCache (chunks of 64 rows: a batch-64 run's memory), the same rows, so
  # half the steps; at the same lr, and at twice the lr (the linear scaling rule)
  [b128]='--robustir-chunk-size 64 --robustir-set batch_size=128'
  [b128_lr4]='--robustir-chunk-size 64 --robustir-set batch_size=128 lr=4e-5'
  [e6]='--robustir-set epochs=6'                          # ST's wall clock: robustir trains ~20 % faster a step
  [dense_e6]='--robustir-mining dense --robustir-set epochs=6'   # its own mining and ST's wall clock
)
VARIANTS=${VARIANTS:-"base symmetric gte fnmargin gte_fnmargin"}
jobs=$W/jobs.txt; : > "$jobs"
for preset in ${PRESETS:-gpu cpu}; do
  for split in ${SPLITS:-dev test}; do
    for seed in ${SEEDS:-1 2 3}; do
      [ "$split" = test ] && echo "$preset $split $seed st" >> "$jobs"
      for variant in $VARIANTS; do
        [ "$split" = dev ] && [[ " ${TEST_ONLY:-} " == *" $variant "* ]] && continue
        echo "$preset $split $seed $variant" >> "$jobs"
      done
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
  local weights=()
  [ "$variant" != st ] && [ -n "${WEIGHTS:-}" ] && read -r -a weights <<< "--robustir-base-weight $WEIGHTS"
  python3 bench/vs_st.py --preset "$preset" "${dev[@]}" --seeds "$seed" "${sides[@]}" --robustir-options "$opts" \
    "${recipe[@]}" "${weights[@]}" --data "$D" --model "$M" --output "$out" ${SET:+--set $SET} > "$out/log.txt" 2>&1 \
    && echo "done $variant $preset $split seed $seed" || { echo "FAILED $variant $preset $split seed $seed"; tail -5 "$out/log.txt"; }
}
export -f one; export W D M SET WEIGHTS=${WEIGHTS:-}
export OPTIONS_DECL; OPTIONS_DECL="$(declare -p OPTIONS RECIPE)"
export OMP_NUM_THREADS=1 RAYON_RS_NUM_CPUS=${RAYON_RS_NUM_CPUS:-2}
start=$SECONDS
timeout "${LIMIT:-450}" xargs -a "$jobs" -P "${JOBS:-12}" -L 1 bash -c 'eval "$OPTIONS_DECL"; one "$@"' _
echo "grid: $((SECONDS - start)) s for $(wc -l < "$jobs") runs (JOBS=${JOBS:-12})"
if [ -n "${HELDOUT:-}" ]; then  # held-out sets: base, ST and every robustir test model (and its WEIGHTS copies)
  [ -f .gpu/heldout.tar.xz ] && { mkdir -p "$T/heldout"; tar -xJf .gpu/heldout.tar.xz -C "$T/heldout"; }
  sets=(); for name in $HELDOUT; do [ -d "$name" ] && sets+=("$name") || sets+=("$T/heldout/$name"); done
  start=$SECONDS
  for preset in ${PRESETS:-gpu cpu}; do
    for variant in st $VARIANTS; do
      for weight in 0 ${WEIGHTS:-}; do
        [ "$variant" = st ] && [ "$weight" != 0 ] && continue
        models=()
        for seed in ${SEEDS:-1 2 3}; do
          for folder in "$W"/runs/"$variant-$preset-test-s$seed"/"$preset"/*-seed"$seed"; do
            [ "$weight" = 0 ] && m=$folder/model || m=$folder/base-$weight
            [ -d "$m" ] && models+=("$m")
          done
        done
        [ ${#models[@]} -gt 0 ] || continue
        timeout "${HELDOUT_LIMIT:-200}" python3 bench/heldout.py --models "${models[@]}" --base "$M" --data "${sets[@]}" \
          --preset "$preset" --output "$OUT/heldout-$preset-$variant-w$weight.jsonl" > "$W/heldout-$preset-$variant-w$weight.txt" 2>&1 &
      done
    done
  done
  wait
  echo "held-out: $((SECONDS - start)) s"
  for f in "$W"/heldout-*.txt; do echo "== $(basename "$f" .txt)"; grep -E " fine-tuned |Error" "$f"; done
fi
python3 - "$W/runs" "$OUT" "$VARIANTS" "${WEIGHTS:-}" <<'EOF'
import json, statistics, sys
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
variants = ["st"] + [v + (f"@{w}" if w else "") for v in sys.argv[3].split() for w in [""] + sys.argv[4].split()]
rows = []
for path in sorted(runs.glob("*/*/results.jsonl")):
    variant, preset, split, seed = path.parent.parent.name.rsplit("-", 3)
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            name = variant + (f"@{row['base_weight']:g}" if row.get("base_weight") is not None else "")
            rows.append({**row, "variant": name, "preset": preset, "split": split})
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
