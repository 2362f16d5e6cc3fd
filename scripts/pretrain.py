#!/usr/bin/env python
"""Pretrain a causal LM with an hf_fp4 recipe.

    accelerate launch scripts/pretrain.py --config configs/tiny-cpu.yaml [--output_dir DIR]
        [--resume] [--overwrite] [key=value ...]        (plain `python scripts/pretrain.py` works too)

Overrides are dotted keys with YAML values: recipe=nvfp4 model.hidden_size=256 recipe_options.lora_svd_rank=8
"""
import argparse
import sys

import hf_fp4  # noqa: F401  (registers the quant method)
from hf_fp4.train_config import load_config
from hf_fp4.trainer import train


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":
    sys.exit(main())
