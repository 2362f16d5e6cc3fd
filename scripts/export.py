#!/usr/bin/env python
"""Export a trained model: python scripts/export.py --model DIR --format {fp4,bf16,compressed-tensors,gguf} --output OUT

fp4: packed FP4 safetensors, reloaded by from_pretrained after `import hf_fp4`; bf16: a dequantized
standard checkpoint; compressed-tensors: NVFP4 weights for vLLM / llm-compressor (nvfp4-style recipes);
gguf: one .gguf file for llama.cpp (MXFP4-trained linears bit for bit; --gguf_type).
Also writes OUT/README.md (model card) unless --no_card or gguf.
"""
import argparse
import sys

import hf_fp4  # noqa: F401
from hf_fp4.release.export import FORMATS, export_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--output", required=True)
    p.add_argument("--dtype", default="bfloat16", help="bf16 format: the saved dtype (bfloat16 or float32)")
    p.add_argument("--gguf_type", default="mxfp4", help="gguf format: mxfp4 (MXFP4-trained linears bit for bit, "
                   "the rest BF16), bf16 or f32; --output names the .gguf file")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--eval_results", help="results.json of scripts/evaluate.py for the model card")
    p.add_argument("--no_card", action="store_true")
    args = p.parse_args(argv)
    try:
        report = export_model(args.model, args.format, args.output, args.overwrite, args.dtype, args.gguf_type)
        if not args.no_card and args.format != "gguf":
            from hf_fp4.release.model_card import write_model_card
            write_model_card(args.output, args.model, args.format, args.eval_results)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as err:
        p.exit(2, f"error: {err}\n")
    print(f"{report['format']}: {report['bytes'] / 1e6:.2f} MB ({report['ratio_vs_bf16']:.3f} of BF16's "
          f"{report['bf16_bytes'] / 1e6:.2f} MB); converted linear layers: "
          f"{report['linear_bits_per_param']:.2f} bits/parameter -> {report['path']}")


if __name__ == "__main__":
    sys.exit(main())
