"""Training report: loss curves, loss statistics (PEG's t / sigma / w_q, CCR's terms) and the
similarity distributions of positives, hard negatives and in-batch negatives at start and end; with a mixture of
training sources, the loss per source (``report.json``: ``per_source: {name: {steps, mean_loss}}``, over the logged
steps)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

STAT_KEYS = ("t", "sigma", "mean_w_q", "share_scaled_negatives", "pos_sim", "neg_sim", "accuracy", "ccr", "nce")


def _read_log(path: Path) -> tuple[list[dict], list[dict]]:
    steps, evals = [], []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            (evals if any(k.startswith("eval_") for k in record) else steps).append(record)
    return steps, evals


def _smooth(values: list[float], weight: float = 0.8) -> list[float]:
    """Exponential moving average (as TensorBoard's smoothing), so the trend shows through batch noise."""
    out, last = [], None
    for value in values:
        last = value if last is None else weight * last + (1 - weight) * value
        out.append(last)
    return out


def per_source_losses(steps: list[dict]) -> dict[str, dict[str, float]]:
    """``{source: {"steps": logged steps, "mean_loss": their mean loss}}`` from the log lines of a mixture run
    (each names its step's ``source``); empty for a run on one source."""
    sums: dict[str, list[float]] = {}
    for record in steps:
        if "source" in record and "loss" in record:
            sums.setdefault(record["source"], []).append(float(record["loss"]))
    return {name: {"steps": len(losses), "mean_loss": sum(losses) / len(losses)} for name, losses in sums.items()}


def write_training_report(output: str | Path) -> Path:
    """Write ``report.png`` and ``report.html`` into a training output folder; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output)
    steps, evals = _read_log(out / "train_log.jsonl")
    sims = json.loads((out / "similarities.json").read_text()) if (out / "similarities.json").exists() else {}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    if steps:
        x = [r["step"] for r in steps]
        ax.plot(x, [r["loss"] for r in steps], label="loss", lw=0.8, alpha=0.35, color="tab:blue")
        ax.plot(x, _smooth([r["loss"] for r in steps]), label="loss (smoothed)", lw=2, color="tab:blue")
        for key, color in (("nce", "tab:orange"), ("ccr", "tab:purple")):
            if key in steps[0]:
                ax.plot(x, _smooth([r[key] for r in steps]), label=f"{key} (smoothed)", lw=1.5, color=color)
        if evals:
            twin = ax.twinx()
            twin.plot([r["step"] for r in evals], [r["eval_ndcg@10"] for r in evals], "o-", color="black",
                      label="eval ndcg@10")
            twin.set_ylabel("eval NDCG@10")
        ax.legend(loc="upper right")
    ax.set(title="training loss", xlabel="step")
    ax = axes[0][1]
    if steps:
        x = [r["step"] for r in steps]
        for key in STAT_KEYS:
            if key in steps[0] and key not in ("nce", "ccr"):
                ax.plot(x, [r[key] for r in steps], label=key, lw=1)
        ax.legend(loc="best", fontsize=8)
    ax.set(title="loss statistics (per step)", xlabel="step")
    for ax, moment in ((axes[1][0], "start"), (axes[1][1], "end")):
        data = sims.get(moment, {})
        for key, color in (("positive", "tab:green"), ("hard_negative", "tab:red"),
                           ("in_batch_negative", "tab:gray"), ("removed", "tab:orange")):
            values = data.get(key)
            if values:
                ax.hist(values, bins=50, range=(-0.2, 1.0), alpha=0.5, density=True, color=color,
                        label=f"{key.replace('_', ' ')} (mean {sum(values) / len(values):.3f})")
        ax.set(title=f"cosine similarity at {moment} of training", xlabel="cos(q, p)", ylabel="density")
        if data:
            ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    png = out / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    metrics = json.loads((out / "eval_metrics.json").read_text()) if (out / "eval_metrics.json").exists() else {}
    table = ""
    if metrics.get("model"):
        keys = [k for k in ("ndcg@10", "mrr@10", "recall@10", "recall@100", "map@100") if k in metrics["model"]]
        head = "".join(f"<th>{k}</th>" for k in keys)
        body = "".join(
            f"<tr><td>{name}</td>" + "".join(f"<td>{100 * m[k]:.2f}</td>" for k in keys) + "</tr>"
            for name, m in (("base", metrics.get("base") or {}), ("trained", metrics["model"])) if m)
        table = f"<table border=1 cellpadding=4><tr><th>model</th>{head}</tr>{body}</table>"
    per_source = per_source_losses(steps)
    if per_source:
        rows = "".join(f"<tr><td>{html.escape(name)}</td><td>{v['steps']}</td><td>{v['mean_loss']:.4f}</td></tr>"
                       for name, v in per_source.items())
        table += ("<h2>Loss per training source (logged steps)</h2><table border=1 cellpadding=4>"
                  f"<tr><th>source</th><th>steps</th><th>mean loss</th></tr>{rows}</table>")
    from ..io import write_json

    write_json(out / "report.json", {"steps": len(steps), "per_source": per_source})
    config = (out / "training_config.json").read_text() if (out / "training_config.json").exists() else "{}"
    image = base64.b64encode(png.read_bytes()).decode()
    (out / "report.html").write_text(
        f"<html><head><meta charset='utf-8'><title>robustir training report</title></head><body>"
        f"<h1>Training report: {html.escape(str(out))}</h1>{table}"
        f"<img src='data:image/png;base64,{image}' style='max-width:100%'>"
        f"<h2>Configuration</h2><pre>{html.escape(config)}</pre></body></html>", encoding="utf-8")
    return png
