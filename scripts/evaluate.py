#!/usr/bin/env python
"""Evaluate a model on offline lm-eval tasks (hf_fp4 checkpoints load as FP4 models).

    python scripts/evaluate.py --model DIR --tasks hellaswag,piqa [--limit N] [--batch_size auto]
        [--gguf FILE] [--quantize PRESET [--hadamard deterministic]] --output results.json

Offline tasks: hellaswag, piqa, arc_easy, arc_challenge, winogrande, boolq, openbookqa, sciq, lambada,
corpus_ppl (held-out built-in corpus). --hub_tasks passes other names to lm-eval (needs hub access).
Writes JSON and a markdown table next to it (.md).
"""
import argparse
import sys

import torch

import hf_fp4  # noqa: F401  (registers the quant method before any model is loaded)
from hf_fp4.release.evaluation import load_model, post_training_quantize, run_lm_eval, write_results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tasks", default="hellaswag,piqa,arc_easy,arc_challenge,winogrande,boolq,openbookqa,sciq,lambada")
    p.add_argument("--limit", type=int)
    p.add_argument("--batch_size", default="auto")
    p.add_argument("--gguf", help="a GGUF file inside --model")
    p.add_argument("--quantize", help="post-training quantize with this preset (fprop, RTN) before evaluating")
    p.add_argument("--hadamard", default="none", help="with --quantize: none | deterministic | random_fixed")
    p.add_argument("--hub_tasks", action="store_true")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    try:
        model, tok = load_model(args.model, args.gguf)
        if args.quantize:
            post_training_quantize(model, args.quantize, args.hadamard, freeze=True)  # inference: W quantized once
        if torch.cuda.is_available():
            model.cuda()
        bs = int(args.batch_size) if args.batch_size.isdigit() else args.batch_size
        results = run_lm_eval(model, tok, args.tasks.split(","), args.limit, bs, args.hub_tasks)
    except (FileNotFoundError, ValueError, ImportError) as err:
        p.exit(2, f"error: {err}\n")
    name = args.quantize + ("+H" if args.hadamard != "none" else "") if args.quantize else "model"
    write_results(args.output, results, {"name": name, "model": args.model, "quantize": args.quantize,
                                         "hadamard": args.hadamard, "limit": args.limit})
    print(open(args.output.rsplit(".", 1)[0] + ".md").read())


if __name__ == "__main__":
    sys.exit(main())
