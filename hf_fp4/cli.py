"""Command lines that ship with the package (so they work from an installed wheel, and a study can launch
its runs without the repository's scripts/ folder): ``python -m hf_fp4 pretrain|study ...``.  The files in
scripts/ are thin wrappers around these."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PRETRAIN_USAGE = """Pretrain a causal LM with an hf_fp4 recipe.

    accelerate launch scripts/pretrain.py --config configs/tiny-cpu.yaml [--output_dir DIR]
        [--resume] [--overwrite] [key=value ...]        (plain `python scripts/pretrain.py` works too,
                                                         and `python -m hf_fp4 pretrain ...`)

Overrides are dotted keys with YAML values: recipe=nvfp4 model.hidden_size=256 recipe_options.lora_svd_rank=8
"""

STUDY_USAGE = """Run a convergence study (configs/study/*.yaml; format in hf_fp4/train/study.py) and summarise it.

    python scripts/study.py configs/study/recipes-50m.yaml [--out benchmarks/study-recipes-50m]
        [--parallel 4] [--gpus 0,1] [--summary-only]

Finished runs are skipped and interrupted ones resumed, so the same command continues a study.  Writes
results.json, table.md, val_curves.png and gaps.png into --out (runs under --out/runs).
"""


def pretrain(argv=None) -> int:
    import hf_fp4  # noqa: F401  (registers the quant method)
    from .train.config import load_config
    from .train.trainer import train

    parser = argparse.ArgumentParser(description=PRETRAIN_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (configs/*.yaml)")
    parser.add_argument("--output_dir", help="run directory (overrides output_dir)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run in output_dir first")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come before or after the flags
    overrides = list(args.overrides) + ([f"output_dir={args.output_dir}"] if args.output_dir else [])
    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    train(cfg, resume=args.resume, overwrite=args.overwrite)  # ends by printing where everything is
    return 0


def study(argv=None) -> int:
    import yaml

    from .train.study import load_study, run_study, summarize

    parser = argparse.ArgumentParser(description=STUDY_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", help="study YAML")
    parser.add_argument("--out", help="study folder (default benchmarks/study-<name>)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (several may share a GPU)")
    parser.add_argument("--gpus", default=None, help="comma list of GPU ids; run k uses gpus[k %% len]")
    parser.add_argument("--summary-only", action="store_true", help="only rebuild results.json / table.md / plots")
    parser.add_argument("--only", default=None,
                        help="comma list of run labels or <label>-s<seed> names: run these alone (the rest wait)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="tokenise the unfinished runs' data and stop (a GPU machine's CPUs, while its GPU is busy)")
    args = parser.parse_args(argv)
    out = args.out
    if out is None:
        name = (yaml.safe_load(Path(args.study).read_text()) or {}).get("name") or Path(args.study).stem
        out = f"benchmarks/study-{name}"
    try:
        spec = load_study(args.study, out)
        codes = {} if args.summary_only else run_study(spec, out, args.parallel,
                                                        args.gpus.split(",") if args.gpus else None,
                                                        only=args.only.split(",") if args.only else None,
                                                        prepare_only=args.prepare_only)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    if args.prepare_only:
        return 0
    summarize(spec, out)
    print((Path(out) / "table.md").read_text())
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        print(f"failed runs: {', '.join(failed)} (rerun the same command to resume them)")
        return 1
    return 0


COMMANDS = {"pretrain": pretrain, "study": study}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m hf_fp4 {{{'|'.join(COMMANDS)}}} [args]  (got {argv[:1] or 'nothing'})",
              file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
