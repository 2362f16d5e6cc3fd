#!/usr/bin/env python
"""Compare pretraining runs: python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] --out compare.png

Writes one PNG of train/validation loss curves and prints (and writes, with --table) a markdown table of
the final validation loss and its relative gap to the bf16 run.
"""
import argparse
from pathlib import Path

from hf_fp4.compare import comparison_table, load_run, plot_runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", default="compare.png", help="PNG of the loss curves")
    parser.add_argument("--table", help="also write the markdown table here")
    args = parser.parse_args(argv)
    runs = [load_run(r) for r in args.runs]
    plot_runs(runs, args.out)
    table = comparison_table(runs)
    if args.table:
        Path(args.table).write_text(table)
    print(table)
    print(f"curves -> {args.out}")


if __name__ == "__main__":
    main()
