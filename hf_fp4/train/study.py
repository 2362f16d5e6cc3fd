"""Convergence studies: many pretraining runs from one YAML, resumable, summarised as a gap table and plots.

A study file (configs/study/*.yaml)::

    name: recipes-50m
    base: ../bench-50m.yaml            # a pretrain config (relative to the study file)
    overrides: {max_steps: 2000}       # applied to every run
    seeds: [0]                         # default seeds of a run
    runs:
      - {recipe: bf16, seeds: [0, 1, 2]}
      - {recipe: nvfp4}
      - {label: nvfp4-lora8, recipe: nvfp4, recipe_options: {lora_svd_rank: 8}}
      - {label: nvfp4-late-bf16-fprop, recipe: nvfp4, precision_schedule: [{at: 0.85, bf16: [fprop]}]}
    claims:                            # the papers' claims, each as "label `better` ends below label `worse`"
      - {claim: "UFP4's uniform grid beats E2M1", source: "UFP4 (2026)", paper: "lower gap than E2M1",
         better: ufp4, worse: nvfp4}
    goal: 0.5                          # optional: "the best FP4 label within 0.5% of bf16" (goal_verdict)

Each run entry is a set of TrainConfig keys (plus `label`, default the recipe, and `seeds`); every run's
config is validated before the first one starts.  `run_study` tokenises each dataset the runs need once,
then runs them as `python -m hf_fp4 pretrain` subprocesses, several at once (one GPU each when GPUs are
given), skipping finished runs and resuming interrupted ones; `summarize` writes results.json, table.md (gap to bf16
with two standard errors, each claim's verdict, the goal's, and the labels that beat bf16 beyond the noise) and
the plots into the study folder.
"""
from __future__ import annotations

import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .compare import load_run
from ..files import atomic_write_text
from .data import prepare_data
from ..extras import optional, require
from .config import TrainConfig
from .corpus import usable_cores

STUDY_KEYS = {"name", "base", "overrides", "seeds", "runs", "claims", "goal"}
CLAIM_KEYS = {"claim", "source", "paper", "better", "worse"}


@dataclass(frozen=True)
class StudyRun:
    name: str      # <label>-s<seed>: the run's folder under runs/
    label: str     # what the table groups by (seeds of one label are averaged)
    seed: int
    config: dict   # the full pretrain config
    replica: int = 0  # the seed's position in its run's seed list: every run's first seed is run first


@dataclass(frozen=True)
class Study:
    name: str
    runs: tuple[StudyRun, ...]
    claims: tuple[dict, ...] = ()
    goal: float | None = None  # % of bf16's final validation loss the best FP4 label should come within


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_study(path: str | Path, out: str | Path) -> Study:
    """Parse and validate a study file; run folders go under `out`/runs."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"study file {path} not found")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - STUDY_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown study key(s) {sorted(unknown)}; valid: {', '.join(sorted(STUDY_KEYS))}")
    if not spec.get("runs"):
        raise ValueError(f"{path}: a study needs a non-empty `runs` list")
    base: dict[str, Any] = {}
    if spec.get("base"):
        base_path = (path.parent / spec["base"]).resolve()
        if not base_path.exists():
            raise FileNotFoundError(f"{path}: base config {base_path} not found")
        base = yaml.safe_load(base_path.read_text()) or {}
    base = _merge(base, spec.get("overrides") or {})
    runs, names = [], set()
    for i, entry in enumerate(spec["runs"]):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: runs[{i}] must be a mapping of config keys, got {entry!r}")
        entry = dict(entry)
        label = str(entry.pop("label", entry.get("recipe", base.get("recipe", "bf16"))))
        seeds = entry.pop("seeds", spec.get("seeds", [0]))
        for replica, seed in enumerate(seeds):
            name = f"{label}-s{seed}"
            if name in names:
                raise ValueError(f"{path}: two runs are named {name!r}; give one a `label`")
            names.add(name)
            config = _merge(base, {**entry, "seed": seed, "output_dir": str(Path(out) / "runs" / name)})
            try:
                TrainConfig.from_dict(config)
            except (ValueError, FileNotFoundError) as err:
                raise type(err)(f"{path}: run {name}: {err}") from err
            runs.append(StudyRun(name, label, seed, config, replica))
    goal = spec.get("goal")
    if goal is not None and (isinstance(goal, bool) or not isinstance(goal, (int, float)) or goal <= 0):
        raise ValueError(f"{path}: goal must be a positive percentage of bf16's loss (e.g. 0.5), got {goal!r}")
    return Study(str(spec.get("name") or path.stem), tuple(runs), _claims(path, spec.get("claims") or [], runs),
                 None if goal is None else float(goal))


def _claims(path: Path, claims: list, runs: list[StudyRun]) -> tuple[dict, ...]:
    """Validate the `claims` entries: the keys, and that `better` and `worse` name labels of the study."""
    labels = sorted({r.label for r in runs})
    out = []
    for i, c in enumerate(claims):
        if not isinstance(c, dict) or set(c) - CLAIM_KEYS or not {"claim", "better", "worse"} <= set(c):
            raise ValueError(f"{path}: claims[{i}] must be a mapping with claim, better, worse (and source, paper)")
        for key in ("better", "worse"):
            if c[key] not in labels:
                raise ValueError(f"{path}: claims[{i}].{key}={c[key]!r} is no run label; labels: {', '.join(labels)}")
        out.append(dict(c))
    return tuple(out)


RESULT = "result.json"  # written by run_study when a run exits cleanly: the run's row of results.json


def run_state(run_dir: Path, max_steps: int) -> str:
    """'done' (metrics up to max_steps, and final/ exported or the study's result.json written: a run folder
    committed without its weights stays done), 'partial' (something to resume) or 'new'."""
    metrics = run_dir / "metrics.jsonl"
    if ((run_dir / "final").exists() or (run_dir / RESULT).exists()) and metrics.exists():
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line]
        if steps and steps[-1] >= max_steps:
            return "done"
    return "partial" if metrics.exists() or (run_dir / "checkpoints").exists() else "new"


def run_study(study: Study, out: str | Path, parallel: int = 1, gpus: list[str] | None = None,
              launcher: list[str] | None = None, poll_s: float = 0.5,
              only: list[str] | None = None, prepare_only: bool = False) -> dict[str, int]:
    """Run every unfinished run (`parallel` at a time; run k gets GPU gpus[k % len(gpus)] when given) and
    return their exit codes (0 for the ones already done).  A failed run does not stop the others.  Every
    label's first seed goes before any second one, so a study stopped half-way has covered the most labels.
    only: these labels or run names (<label>-s<seed>) alone, e.g. the runs that fit a machine's remaining time.
    prepare_only: tokenise the unfinished runs' data and return (no run starts): a GPU machine prepares the corpus
    on its CPUs while a benchmark has its GPU (scripts/device_study.sh prep)."""
    out = Path(out)
    if only:
        known = {r.label for r in study.runs} | {r.name for r in study.runs}
        if unknown := [o for o in only if o not in known]:
            raise ValueError(f"unknown run label(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(dict.fromkeys(r.label for r in study.runs))} (or <label>-s<seed>)")
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    codes, queue, active = {}, [], {}
    for run in study.runs:
        if only and run.label not in only and run.name not in only:
            continue
        state = run_state(Path(run.config["output_dir"]), run.config.get("max_steps", TrainConfig.max_steps))
        if state == "done":
            codes[run.name] = 0
            print(f"study: {run.name} finished earlier, skipped")
            continue
        cfg_path = out / "configs" / f"{run.name}.yaml"
        cfg_path.write_text(yaml.safe_dump(run.config, sort_keys=False))
        queue.append((run, cfg_path, state))
    queue.sort(key=lambda item: item[0].replica)
    # the data once, here: runs started together would each tokenise the same corpus
    keys = {}
    for run, _, _ in queue:
        key = _data_key(run.config)
        keys[json.dumps(key, sort_keys=True, default=str)] = key
    for text, key in keys.items():
        print(f"study: preparing data {text}", flush=True)
        prepare_data(*key)
    if prepare_only:
        return codes
    runs = {run.name: run for run in study.runs}
    slots = list(range(max(1, parallel)))
    while queue or active:
        while queue and slots:
            run, cfg_path, state = queue.pop(0)
            slot = slots.pop(0)
            env = dict(os.environ)
            for var in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):  # the cores shared out
                env.setdefault(var, str(threads_per_run(parallel)))
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(gpus[slot % len(gpus)])
            cmd = [*(launcher or [sys.executable]), "-m", "hf_fp4", "pretrain", "--config", str(cfg_path)]
            cmd += ["--resume"] if state == "partial" else []
            log = open(out / "logs" / f"{run.name}.log", "a")
            print(f"study: {'resuming' if state == 'partial' else 'starting'} {run.name}"
                  + (f" on GPU {env['CUDA_VISIBLE_DEVICES']}" if gpus else ""), flush=True)
            active[run.name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), slot, log)
        time.sleep(poll_s)
        for name, (proc, slot, log) in list(active.items()):
            if proc.poll() is not None:
                log.close()
                codes[name] = proc.returncode
                if proc.returncode == 0 and (result := _run_result(runs[name])) is not None:
                    atomic_write_text(Path(runs[name].config["output_dir"]) / RESULT, json.dumps(result, indent=1))
                slots.append(slot)
                del active[name]
                print(f"study: {name} {'finished' if proc.returncode == 0 else f'FAILED ({proc.returncode})'}"
                      + ("" if proc.returncode == 0 else f", see {out / 'logs' / (name + '.log')}"), flush=True)
    return codes


def threads_per_run(parallel: int) -> int:
    """CPU threads for each of `parallel` runs side by side (their OMP_NUM_THREADS and inductor's compile workers,
    TORCHINDUCTOR_COMPILE_THREADS, unless the caller set them): the cores this process may use shared out.  Each run
    otherwise starts a thread per core, and OpenMP's spinning waits make oversubscribed CPU work crawl: LoRA-SVD's
    splits at model build (70 SVDs, 6 s alone on 2 cores) took 85-91 s in each of three processes side by side,
    11 s with one thread each; five fs-lora16 runs on a 16-core GPU machine had built no model after 15 minutes
    (session 32)."""
    return max(1, usable_cores() // max(1, parallel))


def _data_key(config: dict) -> tuple:
    cfg = TrainConfig.from_dict(config)
    return cfg.dataset, cfg.tokenizer, cfg.vocab_size, cfg.val_fraction


def _run_result(run: StudyRun) -> dict | None:
    run_dir = Path(run.config["output_dir"])
    if not (run_dir / "metrics.jsonl").exists():
        return None
    records = load_run(run_dir)["records"]
    info_path = run_dir / "run_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    train = [r for r in records if r.get("loss") is not None]
    val = [[r["step"], r["val_loss"]] for r in records if r.get("val_loss") is not None]
    tokens = records[-1].get("tokens") if records else None
    available = info.get("train_tokens_available")
    return {"run": run.name, "label": run.label, "recipe": run.config.get("recipe", "bf16"), "seed": run.seed,
            "recipe_options": run.config.get("recipe_options", {}),
            "precision_schedule": run.config.get("precision_schedule", []),
            "steps": records[-1]["step"] if records else 0, "max_steps": run.config.get("max_steps"),
            "tokens_trained": tokens, "unique_tokens_available": available,
            "epochs": round(tokens / available, 4) if tokens and available else None,
            "final_train_loss": train[-1]["loss"] if train else None,
            "final_val_loss": val[-1][1] if val else None, "val_curve": val,
            "device": info.get("device"), "hf_fp4_source": info.get("hf_fp4_source"),
            # throughput as the run saw it (runs sharing a GPU slow each other: compare within one study)
            "median_tokens_per_s": round(statistics.median(speeds)) if (speeds := [
                r["tokens_per_s"] for r in records if r.get("tokens_per_s")]) else None}


def _by_label(results: list[dict]) -> dict[str, list[dict]]:
    """The runs with a final validation loss, grouped by label (the seeds of one label together)."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        if r["final_val_loss"] is not None:
            groups.setdefault(r["label"], []).append(r)
    return groups


def _mean(runs: list[dict]) -> float:
    return statistics.mean(r["final_val_loss"] for r in runs)


def _half_range(runs: list[dict]) -> float:
    vals = [r["final_val_loss"] for r in runs]
    return (max(vals) - min(vals)) / 2


def seed_std(groups: dict[str, list[dict]]) -> tuple[float, int] | None:
    """The per-run standard deviation of the final validation loss from seed to seed, pooled over every label with
    two seeds or more (sum of squared deviations from each label's mean over the degrees of freedom), and those
    degrees of freedom; None where no label has two seeds."""
    ss = dof = 0.0
    for runs in groups.values():
        if len(runs) > 1:
            mean = _mean(runs)
            ss += sum((r["final_val_loss"] - mean) ** 2 for r in runs)
            dof += len(runs) - 1
    return (math.sqrt(ss / dof), int(dof)) if dof else None


def _two_se(std: float, n_a: int, n_b: int) -> float:
    """Two standard errors of the difference of two labels' means over n_a and n_b seeds (runs independent, each
    with the pooled per-run std): a difference within it is not a measured one (~95%)."""
    return 2 * std * math.sqrt(1 / n_a + 1 / n_b)


def _gap(runs: list[dict], base: list[dict], std: tuple[float, int] | None) -> tuple[float, float | None]:
    """A label's gap to bf16's mean and two standard errors of it (_two_se of the pooled seed std), both in % of
    bf16's mean; None for the latter without a seed std."""
    base_mean = _mean(base)
    return (100 * (_mean(runs) - base_mean) / base_mean,
            100 * _two_se(std[0], len(runs), len(base)) / base_mean if std else None)


def paired_gap(runs: list[dict], base: list[dict]) -> tuple[float, float | None, int] | None:
    """A label's gap to bf16 seed by seed, over the seeds both ran: the mean of (loss - bf16's loss of the same
    seed) / bf16's, in %, two standard errors of that mean from the spread of the per-seed differences (None below
    two seeds), and the number of seeds; None without a common seed.  The same seed means the same initial weights
    and batch order, so what a seed does to both runs cancels in the difference (fp4-recipes-large: one bf16 seed
    stalls ~1000 steps longer than the others and ends 3% higher), which the unpaired gap counts as noise."""
    by_seed = {r.get("seed"): r["final_val_loss"] for r in base if r.get("seed") is not None}
    diffs = [100 * (r["final_val_loss"] - by_seed[r["seed"]]) / by_seed[r["seed"]] for r in runs
             if r.get("seed") in by_seed]
    if not diffs:
        return None
    two_se = 2 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return statistics.mean(diffs), two_se, len(diffs)


def _paired_cell(runs: list[dict], base: list[dict] | None) -> str:
    paired = paired_gap(runs, base) if base else None
    if paired is None:
        return "-"
    mean, two_se, n = paired
    return f"{mean:+.2f}%" + (f" ± {two_se:.2f}%" if two_se is not None else "") + f" ({n} seed{'s' * (n > 1)})"


def gap_table(results: list[dict]) -> str:
    """Mean final validation loss per label (± half the range over seeds), its gap to bf16's mean and two standard
    errors of that gap (the pooled seed std, seed_std), and a note on the seed noise."""
    groups = _by_label(results)
    base = groups.get("bf16")
    base_mean = _mean(base) if base else None
    spread = _half_range(base) if base else None
    noise = seed_std(groups)
    lines = ["| label | recipe | seeds | tokens trained | epochs | final val loss | gap to bf16 | ± 2 SE | "
             "same-seed gap to bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    for label, runs in groups.items():
        mean, half = _mean(runs), _half_range(runs)
        pct, two_se = _gap(runs, base, noise) if base else (None, None)
        gap = f"{pct:+.2f}%" if base else "n/a"
        se = f"± {two_se:.2f}%" if two_se is not None and label != "bf16" else "-"
        epochs = runs[0]["epochs"]
        lines.append(f"| {label} | {runs[0]['recipe']} | {len(runs)} | {runs[0]['tokens_trained'] or '-'} | "
                     f"{epochs if epochs is not None else '-'} | {mean:.4f} ± {half:.4f} | {gap} | {se} | "
                     f"{_paired_cell(runs, base) if label != 'bf16' else '-'} |")
    note = (f"\nbf16 seed spread: ± {spread:.4f} ({100 * spread / base_mean:.2f}% of its mean) over {len(base)} "
            "seed(s); a gap inside it is not a measured difference.\n" if base else "\nNo bf16 run: no gaps.\n")
    if noise and base_mean:
        note += (f"Per-run seed std, pooled over the labels with two seeds or more: {noise[0]:.4f} "
                 f"({100 * noise[0] / base_mean:.2f}% of bf16's mean, {noise[1]} degrees of freedom); ± 2 SE is two "
                 "standard errors of a label's gap (its seeds and bf16's): a gap inside it is not a measured "
                 "difference.\n")
    if base:
        note += ("The same-seed gap compares each run with bf16's run of the same seed (same initial weights and "
                 "batch order) and averages over the seeds both have; its ± 2 SE comes from the spread of those "
                 "per-seed differences (two seeds or more).\n")
    return "\n".join(lines) + "\n" + note


def claim_verdicts(results: list[dict], claims: tuple[dict, ...]) -> list[dict]:
    """Each claim "`better` ends below `worse`" against the measured means: the difference (worse - better,
    in % of bf16's mean) and a verdict -- reproduced / contradicted beyond two standard errors of the difference
    (the pooled per-run seed std, seed_std, over each side's seeds), within them ("within seed noise"),
    "holds / fails (one seed)" where no label has two seeds yet, or "not run"."""
    groups = _by_label(results)
    base = groups.get("bf16")
    base_mean = _mean(base) if base else None
    std = seed_std(groups)
    out = []
    for c in claims:
        row = {**c, "difference_pct": None, "verdict": "not run"}
        if c["better"] in groups and c["worse"] in groups:
            mean = {k: _mean(groups[c[k]]) for k in ("better", "worse")}
            ref = base_mean or mean["worse"]
            diff = 100 * (mean["worse"] - mean["better"]) / ref
            noise = (100 * _two_se(std[0], len(groups[c["better"]]), len(groups[c["worse"]])) / ref
                     if std else None)
            if noise is None:
                verdict = "holds (one seed)" if diff > 0 else "fails (one seed)"
            else:
                verdict = "reproduced" if diff > noise else "contradicted" if diff < -noise else "within seed noise"
            row.update(difference_pct=round(diff, 3), noise_pct=None if noise is None else round(noise, 3),
                       verdict=verdict)
        out.append(row)
    return out


def claims_table(verdicts: list[dict]) -> str:
    lines = ["| claim | source | paper | better / worse | ours: worse - better (% of bf16) | verdict |",
             "|---|---|---|---|---|---|"]
    for v in verdicts:
        ours = "-" if v["difference_pct"] is None else f"{v['difference_pct']:+.2f}%" + (
            f" (± 2 SE {v['noise_pct']:.2f}%)" if v.get("noise_pct") is not None else "")
        lines.append(f"| {v['claim']} | {v.get('source', '')} | {v.get('paper', '')} | {v['better']} / {v['worse']} "
                     f"| {ours} | {v['verdict']} |")
    return "\n".join(lines) + "\n"


def beyond_bf16(results: list[dict]) -> list[str]:
    """Labels whose mean final validation loss is below bf16's by more than two standard errors of the difference
    (seed_std): a 4-bit recipe should not beat bf16, so each needs an explanation (issue 11)."""
    groups = _by_label(results)
    base, std = groups.get("bf16"), seed_std(groups)
    if not base or std is None:
        return []
    flagged = []
    for label, runs in groups.items():
        gap, two_se = _gap(runs, base, std)
        if label != "bf16" and gap < -two_se:
            flagged.append(label)
    return flagged


def goal_verdict(results: list[dict], goal_pct: float) -> dict | None:
    """Whether the best non-bf16 label (lowest mean final validation loss) is within goal_pct % of bf16's mean:
    "met" when its gap plus two standard errors (seed_std) is at most goal_pct, "missed" when its gap minus two
    standard errors is above it, else "not measurable yet" (also with no seed spread); None without bf16 or
    another label.  Where the best label and bf16 share two seeds or more, the gap and its two standard errors are
    the same-seed ones (paired_gap; "basis" says which).  (The best is picked from the same runs, a bias toward
    "met" that its own seeds shrink.)"""
    groups = _by_label(results)
    base = groups.get("bf16")
    others = {k: v for k, v in groups.items() if k != "bf16"}
    if not base or not others:
        return None
    best = min(others, key=lambda k: _mean(others[k]))
    gap, two_se = _gap(others[best], base, seed_std(groups))
    basis = "means"
    paired = paired_gap(others[best], base)
    if paired is not None and paired[1] is not None:  # two common seeds or more: the same-seed differences
        gap, two_se, basis = paired[0], paired[1], f"same seed ({paired[2]} seeds)"
    verdict = ("not measurable yet" if two_se is None else "met" if gap + two_se <= goal_pct
               else "missed" if gap - two_se > goal_pct else "not measurable yet")
    return {"goal_pct": goal_pct, "best": best, "gap_pct": round(gap, 3),
            "two_se_pct": None if two_se is None else round(two_se, 3), "basis": basis, "verdict": verdict}


def summarize(study: Study, out: str | Path) -> dict:
    """results.json, table.md and (with matplotlib) val_curves.png and gaps.png in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = [r for r in (_run_result(run) for run in study.runs) if r is not None]
    verdicts = claim_verdicts(results, study.claims)
    beating = beyond_bf16(results)
    goal = goal_verdict(results, study.goal) if study.goal is not None else None
    summary = {"study": study.name, "runs": results, "claims": verdicts, "beyond_bf16_noise": beating, "goal": goal}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    text = f"# Study {study.name}\n\n" + gap_table(results)
    if beating:
        text += ("\n**Below bf16 by more than two standard errors** (a 4-bit recipe should not be; explain or report "
                 f"unexplained): {', '.join(beating)}\n")
    if goal:
        se = "" if goal["two_se_pct"] is None else f" ± {goal['two_se_pct']:.2f}% (2 SE)"
        text += (f"\n**Goal: the best FP4 label within {goal['goal_pct']:g}% of bf16** -- {goal['best']}, "
                 f"{goal['gap_pct']:+.2f}%{se}, from the {goal['basis']}: {goal['verdict']}.\n")
    if verdicts:
        text += "\n## Claims\n\n" + claims_table(verdicts)
    (out / "table.md").write_text(text)
    if results and optional("matplotlib", "plot", "the study's plots"):
        _plot(results, out)
    return summary


def _plot(results: list[dict], out: Path) -> None:
    matplotlib = require("matplotlib", "plot", "the study's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r["val_curve"]:
            ax.plot(*zip(*r["val_curve"]), marker=".", linewidth=1, label=r["run"])
    ax.set(xlabel="step", ylabel="validation loss", title="validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "val_curves.png", dpi=120)
    plt.close(fig)
    groups = _by_label(results)
    if "bf16" not in groups:
        return
    std = seed_std(groups)
    gaps = [_gap(runs, groups["bf16"], std) for runs in groups.values()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(groups), [gap for gap, _ in gaps], yerr=[two_se or 0.0 for _, two_se in gaps], capsize=4)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(ylabel="final val loss gap to bf16 (%)",
           title="gap to bf16 (error bars: 2 standard errors, pooled seed std)")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(out / "gaps.png", dpi=120)
    plt.close(fig)
