#!/usr/bin/env python
"""Run a convergence study (configs/study/*.yaml; format in hf_fp4/study.py) and summarise it.

    python scripts/study.py configs/study/recipes-50m.yaml [--out benchmarks/study-recipes-50m]
        [--parallel 4] [--gpus 0,1] [--summary-only]

Finished runs are skipped and interrupted ones resumed, so the same command continues a study.  Writes
results.json, table.md, val_curves.png and gaps.png into --out (runs under --out/runs).
"""
import argparse
import sys

from hf_fp4.study import load_study, run_study, summarize


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", help="study YAML")
    parser.add_argument("--out", help="study folder (default benchmarks/study-<name>)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (several may share a GPU)")
    parser.add_argument("--gpus", default=None, help="comma list of GPU ids; run k uses gpus[k %% len]")
    parser.add_argument("--summary-only", action="store_true", help="only rebuild results.json / table.md / plots")
    args = parser.parse_args(argv)
    out = args.out
    if out is None:
        import yaml
        from pathlib import Path

        out = f"benchmarks/study-{(yaml.safe_load(Path(args.study).read_text()) or {}).get('name') or Path(args.study).stem}"
    try:
        study = load_study(args.study, out)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    codes = {} if args.summary_only else run_study(study, out, args.parallel, args.gpus.split(",") if args.gpus else None)
    summarize(study, out)
    print(open(f"{out}/table.md").read())
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        print(f"failed runs: {', '.join(failed)} (rerun the same command to resume them)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
