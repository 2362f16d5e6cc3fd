#!/usr/bin/env python
"""SmolLM2-135M: BF16 vs FP4 post-training quantization (nvfp4 / mxfp4 / ufp4, W4A16 and W4A4, with and
without Hadamard; nvfp4 with 1x16 weight blocks; nvfp4+SharQ) on the offline tasks and held-out perplexity.

    python scripts/ptq_table.py [--limit N] [--out benchmarks/smollm2-ptq] [--configs a,b] [--tasks t1,t2]
        [--ppl_tokens N]     token-level perplexity of the built-in corpus's held-out documents (sliding
                             window 1024, stride 512, the first N tokens), as `token_ppl`
"""
import argparse
import copy
import datetime
import json
import time
from pathlib import Path

import torch

import hf_fp4  # noqa: F401
from hf_fp4.release.evaldata import heldout_corpus_texts
from hf_fp4.release.evaluation import load_model, markdown_table, post_training_quantize, run_lm_eval, token_perplexity
from hf_fp4.release.models import fetch_smollm2

# Rows: (name, preset, Hadamard, Hadamard size, post_training_quantize options).  Plain names quantize weights
# and activations in fprop (W4A4; the names of earlier tables), " W4A16" the weights alone; nvfp4's weights
# are 16x16 tiles unless "W 1x16"; ufp4's preset has a random Hadamard, "(no H)" switches it off.
CONFIGS = [("bf16", None, "none", 16, {})]
for _name, _p, _h, _size in (("nvfp4", "nvfp4", "none", 16), ("nvfp4+H16", "nvfp4", "deterministic", 16),
                             ("mxfp4", "mxfp4", "none", 32), ("mxfp4+H32", "mxfp4", "deterministic", 32),
                             ("ufp4 (no H)", "ufp4", "none", 16), ("ufp4+RHT16", "ufp4", "random_fixed", 16)):
    CONFIGS += [(_name, _p, _h, _size, {}), (f"{_name} W4A16", _p, _h, _size, {"weights_only": True})]
CONFIGS += [("nvfp4 W 1x16", "nvfp4", "none", 16, {"weight_blocks": "1d"}),
            ("nvfp4+SharQ", "nvfp4", "none", 16, {"sharq": True})]
TASKS = "hellaswag,piqa,arc_easy,arc_challenge,winogrande,boolq,openbookqa,sciq,lambada,corpus_ppl"


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--batch_size", default="16")
    p.add_argument("--out", default="benchmarks/smollm2-ptq")
    p.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    p.add_argument("--tasks", default=TASKS, help="comma list of lm-eval tasks ('' for none)")
    p.add_argument("--ppl_tokens", type=int, default=0, help="token-level perplexity on this many held-out tokens")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir, gguf = fetch_smollm2()
    base, tok = load_model(str(model_dir), gguf)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    wanted = args.configs.split(",")
    texts = heldout_corpus_texts() if args.ppl_tokens else None
    unknown = sorted(set(wanted) - {c[0] for c in CONFIGS})
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; valid: {', '.join(c[0] for c in CONFIGS)}")
    for name, preset, hadamard, size, options in CONFIGS:
        if name not in wanted:
            continue
        t0 = time.time()
        model = copy.deepcopy(base)
        if preset:
            post_training_quantize(model, preset, hadamard, size, **options)
        tasks = [t for t in args.tasks.split(",") if t]
        rows[name] = run_lm_eval(model, tok, tasks, args.limit, int(args.batch_size)) if tasks else {}
        if args.ppl_tokens:
            rows[name]["token_ppl"] = token_perplexity(model, tok, texts, 1024, 512, args.ppl_tokens)
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
        (out / "results.json").write_text(json.dumps({"date": datetime.date.today().isoformat(), "limit": args.limit,
                                                       "command": "python " + " ".join(__import__("sys").argv),
                                                       "model": f"{model_dir}/{gguf}", "results": rows}, indent=2))
        (out / "table.md").write_text(markdown_table(rows))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
