#!/usr/bin/env python
"""Run a convergence study and summarise it (hf_fp4.cli.study; `--help` for the options).

    python scripts/study.py configs/study/recipes-50m.yaml [--out DIR] [--parallel 4] [--gpus 0,1]
"""
import sys

from hf_fp4.cli import study

if __name__ == "__main__":
    sys.exit(study())
