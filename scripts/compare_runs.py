#!/usr/bin/env python
"""Compare pretraining runs: python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] --out compare.png

Writes one PNG of train/validation loss curves and prints (and writes, with --table) a markdown table of
the final validation loss and its relative gap to the bf16 run.
"""
import argparse
from pathlib import Path

from hf_fp4.train.compare import comparison_table, load_run, plot_runs
from hf_fp4.extras import optional


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", help="PNG of the loss curves (default compare.png; needs the 'plot' extra)")
    parser.add_argument("--table", help="also write the markdown table here")
    args = parser.parse_args(argv)
    runs = [load_run(r) for r in args.runs]
    out = args.out
    if out is None and optional("matplotlib", "plot", "the loss-curve PNG"):
        out = "compare.png"
    if out is not None:  # asked for explicitly: refused with the install line if matplotlib is missing
        try:
            plot_runs(runs, out)
        except ImportError as err:
            parser.exit(2, f"error: {err}\n")
    table = comparison_table(runs)
    if args.table:
        Path(args.table).write_text(table)
    print(table)
    if out is not None:
        print(f"curves -> {out}")


if __name__ == "__main__":
    main()
