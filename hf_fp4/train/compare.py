"""Compare pretraining runs: loss curves (PNG) and a markdown table of the gap to the bf16 run."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from ..extras import require


def load_run(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a pretrain.py output_dir?)")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    cfg_path = run_dir / "train_config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text()) if cfg_path.exists() else {}
    return {"name": run_dir.name, "recipe": cfg.get("recipe", "?"), "records": records}


def final_val_loss(run: dict) -> float | None:
    vals = [r["val_loss"] for r in run["records"] if r.get("val_loss") is not None]
    return vals[-1] if vals else None


def comparison_table(runs: list[dict]) -> str:
    base = next((final_val_loss(r) for r in runs if r["recipe"] == "bf16"), None)
    lines = ["| run | recipe | steps | final train loss | final val loss | gap to bf16 |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        train = [r for r in run["records"] if r.get("loss") is not None]
        val = final_val_loss(run)
        gap = f"{100 * (val - base) / base:+.2f}%" if base is not None and val is not None else "n/a"
        lines.append(f"| {run['name']} | {run['recipe']} | {train[-1]['step'] if train else 0} | "
                     f"{train[-1]['loss']:.4f} | {val:.4f} | {gap} |" if train and val is not None else
                     f"| {run['name']} | {run['recipe']} | - | - | - | n/a |")
    return "\n".join(lines) + "\n"


def plot_runs(runs: list[dict], path: str | Path) -> None:
    """Train and validation loss curves of runs, as a PNG (needs the 'plot' extra)."""
    matplotlib = require("matplotlib", "plot", "plotting loss curves")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        train = [(r["step"], r["loss"]) for r in run["records"] if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in run["records"] if r.get("val_loss") is not None]
        label = f"{run['name']} ({run['recipe']})"
        if train:
            ax_train.plot(*zip(*train), label=label, linewidth=1)
        if val:
            ax_val.plot(*zip(*val), marker="o", label=label)
    for ax, title in ((ax_train, "train loss"), (ax_val, "validation loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
