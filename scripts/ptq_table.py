#!/usr/bin/env python
"""SmolLM2-135M: BF16 vs FP4 post-training quantization (nvfp4 / mxfp4 / ufp4, W4A16 and W4A4, with and
without Hadamard; nvfp4 with 1x16 weight blocks; nvfp4+SharQ) on the offline tasks and held-out perplexity.

    python scripts/ptq_table.py [--limit N] [--out benchmarks/smollm2-ptq] [--configs a,b] [--tasks t1,t2]
        [--ppl_tokens N] [--device auto|cpu|cuda] [--model_dir DIR --gguf FILE]

--limit: items per task (lm-eval's limit; 0 = the whole validation set).  --ppl_tokens: token-level perplexity
of the built-in corpus's held-out documents (sliding window 1024, stride 512, the first N tokens), as
`token_ppl`.  Rows already in OUT/results.json with the same limit, tasks and ppl_tokens are kept and not run
again, so the table can be built over several calls.  Writes results.json (command, versions, device, items
per task), table.md and accuracy.png (each task's accuracy per config, with lm-eval's standard errors).
"""
import argparse
import copy
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

import hf_fp4  # noqa: F401  (registers the quant method before any model loads)
from hf_fp4.extras import optional, versions
from hf_fp4.files import atomic_write_text
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


def accuracy_chart(rows: dict, path: Path) -> bool:
    """Grouped bars: each task's accuracy (acc_norm where it has one) per config, lm-eval's standard error as
    the error bar.  Returns False when matplotlib is missing (the table is still written)."""
    plt = optional("matplotlib.pyplot", "plot", "the accuracy chart")
    if plt is None:
        return False
    tasks = sorted({t for r in rows.values() for t, m in r.items() if isinstance(m, dict)
                    and ("acc_norm" in m or "acc" in m)})
    if not tasks:
        return False
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(tasks) * max(1, len(rows)) / 4), 4.5))
    width = 0.8 / len(rows)
    for i, (name, res) in enumerate(rows.items()):
        keys = [("acc_norm" if "acc_norm" in res.get(t, {}) else "acc") for t in tasks]
        values = [res.get(t, {}).get(k, float("nan")) for t, k in zip(tasks, keys)]
        errors = [res.get(t, {}).get("stderr", {}).get(k, 0.0) for t, k in zip(tasks, keys)]
        ax.bar([j + i * width for j in range(len(tasks))], values, width, yerr=errors, capsize=2, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks, rotation=20)
    ax.set_ylabel("accuracy (acc_norm where defined), ± standard error")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=1000, help="items per task; 0: every item")
    p.add_argument("--batch_size", default="16")
    p.add_argument("--out", default="benchmarks/smollm2-ptq")
    p.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    p.add_argument("--tasks", default=TASKS, help="comma list of lm-eval tasks ('' for none)")
    p.add_argument("--ppl_tokens", type=int, default=0, help="token-level perplexity on this many held-out tokens")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--model_dir", help="a folder holding the SmolLM2 GGUF (default: fetched into the cache)")
    p.add_argument("--gguf", help="the GGUF file in --model_dir")
    args = p.parse_args()
    wanted = args.configs.split(",")
    unknown = sorted(set(wanted) - {c[0] for c in CONFIGS})
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; valid: {', '.join(c[0] for c in CONFIGS)}")
    tasks = [t for t in args.tasks.split(",") if t]
    limit = args.limit or None
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.manual_seed(0)
    model_dir, gguf = (Path(args.model_dir), args.gguf) if args.model_dir else fetch_smollm2()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # rows measured earlier with the same protocol are kept (the table may be built over several calls)
    protocol = {"limit": limit, "tasks": tasks, "ppl_tokens": args.ppl_tokens}
    previous = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    rows = previous.get("results", {}) if previous.get("protocol") == protocol else {}
    items = previous.get("items", {}) if rows else {}
    texts = heldout_corpus_texts() if args.ppl_tokens else None
    base, tok = load_model(str(model_dir), gguf)
    base = base.to(device)
    for name, preset, hadamard, size, options in CONFIGS:
        if name not in wanted or name in rows:
            continue
        t0 = time.time()
        model = copy.deepcopy(base)
        if preset:
            post_training_quantize(model, preset, hadamard, size, freeze=True, **options)  # W quantized once
        result = run_lm_eval(model, tok, tasks, limit, int(args.batch_size)) if tasks else {}
        for task, metrics in result.items():
            items[task] = metrics.pop("items", items.get(task))
        if args.ppl_tokens:
            result["token_ppl"] = token_perplexity(model, tok, texts, 1024, 512, args.ppl_tokens)
        rows[name] = result
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
        del model
        meta = {"date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv),
                "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                "versions": versions("torch", "transformers", "lm_eval", "hf_fp4"), "model": f"{model_dir.name}/{gguf}", "protocol": protocol, "items": items,
                "results": rows}
        atomic_write_text(out / "results.json", json.dumps(meta, indent=2))
        atomic_write_text(out / "table.md", markdown_table(rows))
    accuracy_chart(rows, out / "accuracy.png")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
