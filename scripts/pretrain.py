#!/usr/bin/env python
"""Pretrain a causal LM with an hf_fp4 recipe (hf_fp4.cli.pretrain; `--help` for the options).

    accelerate launch scripts/pretrain.py --config configs/tiny-cpu.yaml [--output_dir DIR]
        [--resume] [--overwrite] [key=value ...]
"""
import sys

from hf_fp4.cli import pretrain

if __name__ == "__main__":
    sys.exit(pretrain())
