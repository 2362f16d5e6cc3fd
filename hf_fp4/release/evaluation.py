"""Downstream evaluation with lm-evaluation-harness, hf_fp4-aware (the quant method is registered first).

Plain lm-eval on an hf_fp4 checkpoint fails or silently runs in high precision; here the model is
loaded after `import hf_fp4`, so `from_pretrained` restores FP4Linear with the saved recipe, or a BF16
model is post-training quantized in memory (`quantize=preset`: fprop operands RTN, optional Hadamard).
"""
from __future__ import annotations

import dataclasses

import datetime
import json
import math
from pathlib import Path
from typing import Any

import torch

from .evaldata import PREFIX, build_tasks, heldout_corpus_texts, resolve_tasks
from ..hf.quantizer import FP4TrainConfig, apply_fp4_config

from ..extras import require


def load_model(model_dir: str, gguf_file: str | None = None, dtype: torch.dtype = torch.float32):
    """A causal LM and its tokenizer from an HF directory (hf_fp4 checkpoints included) or a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not path.exists():
        raise FileNotFoundError(f"model directory {model_dir} not found")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if gguf_file:
        require("gguf", "eval", "reading a GGUF file")
    if not gguf_file and not (path / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory "
                                "(for a GGUF file pass --gguf FILE)")
    if gguf_file and not (path / gguf_file).exists():
        raise FileNotFoundError(f"{path / gguf_file} not found")
    if gguf_file:
        check_gguf_architecture(path / gguf_file)
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    if not gguf_file and not weights:
        raise FileNotFoundError(f"{model_dir} has a config.json but no weights (*.safetensors / *.bin): a partial "
                                "or interrupted checkpoint; export or save it again")
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    except Exception as err:
        raise ValueError(f"no usable tokenizer in {model_dir}: {err}. Save one with "
                         "tokenizer.save_pretrained(model_dir)") from err
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    except ValueError as err:
        if gguf_file:
            raise ValueError(f"transformers cannot load {gguf_file}: {err}. Its GGUF loader supports a fixed "
                             "list of architectures; convert the model with llama.cpp's tools first") from err
        raise
    return model.eval(), tok


def check_gguf_architecture(gguf_path: Path) -> None:
    """Fail before loading anything when transformers' GGUF loader does not know the file's architecture
    (transformers' own metadata parser decides; its error otherwise surfaces as a tokenizer failure)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    try:
        load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    except ValueError as err:
        if "architecture" not in str(err):
            raise
        known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # mapping keys, not models
        raise ValueError(f"transformers cannot load {gguf_path.name}: {err} Its GGUF loader reads these "
                         f"architectures: {', '.join(known)}; convert the model "
                         "with llama.cpp's tools, or load it from a Hugging Face directory") from err


def post_training_quantize(model, preset: str, hadamard: str = "none", hadamard_size: int = 16,
                           sharq: bool = False, weights_only: bool = False, weight_blocks: str | None = None,
                           freeze: bool = False):
    """FP4 inference emulation in memory: every decoder linear quantizes x and W (RTN) in fprop (W4A4);
    weights_only: W alone (W4A16); sharq: the activations as SharQ's backbone + residual (hf_fp4.nn.sharq);
    weight_blocks "1d" / "2d": the weight's blocks (nvfp4: 1x16 / 16x16).  freeze: each linear's weight
    becomes its quantized operand once (hf_fp4.nn.packing.freeze_weight: the same products as a packed export
    reloaded, without re-quantizing W on every forward; inference only)."""
    if sharq and weights_only:
        raise ValueError("SharQ quantizes activations: it has no weights-only (W4A16) form")
    extra = {"activation_scheme": "sharq"} if sharq else {}
    if weight_blocks is not None:
        extra["weight_blocks"] = weight_blocks
    config = FP4TrainConfig(preset, gemms=("fprop",), hadamard=hadamard, hadamard_size=hadamard_size, **extra)
    if weights_only:
        recipe = config.get_recipe()
        linear = dataclasses.replace(recipe.linear, fprop=dataclasses.replace(recipe.linear.fprop, lhs=None))
        config = FP4TrainConfig(dataclasses.replace(recipe, linear=linear))
    model = apply_fp4_config(model, config)
    if freeze:
        from ..nn.packing import freeze_weight
        from ..nn.swap import fp4_modules
        for module in fp4_modules(model).values():
            freeze_weight(module)
    return model


def run_lm_eval(model, tokenizer, tasks: list[str], limit: int | None = None, batch_size: str | int = "auto",
                hub_tasks: bool = False, bootstrap_iters: int = 1000) -> dict[str, dict[str, Any]]:
    """task -> {metric: value, ..., "stderr": {metric: standard error}} (lm-eval's: closed form for means,
    `bootstrap_iters` resamples for perplexities)."""
    lm_eval = require("lm_eval", "eval", "running lm-eval tasks (scripts/evaluate.py)")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    names = resolve_tasks(tasks, hub_tasks)
    include = build_tasks(heldout_texts=heldout_corpus_texts() if PREFIX + "corpus_ppl" in names else None)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
              device=str(next(model.parameters()).device))
    out = lm_eval.simple_evaluate(model=lm, tasks=names, limit=limit, task_manager=TaskManager(include_path=str(include)),
                                  log_samples=False, bootstrap_iters=bootstrap_iters)
    results = {}
    for task, metrics in out["results"].items():
        clean, stderr = {}, {}
        for key, value in metrics.items():
            name = key.split(",")[0]
            if not isinstance(value, (int, float)) or name.startswith(("alias", "sample_")):
                continue  # lm-eval writes "N/A" where it has no standard error
            if name.endswith("_stderr"):
                stderr[name.removesuffix("_stderr")] = float(value)
            else:
                clean[name] = float(value)
        if stderr:
            clean["stderr"] = stderr
        counted = out.get("n-samples", {}).get(task)
        if counted:  # items scored (after --limit) and in the whole split
            clean["items"] = {"scored": int(counted["effective"]), "available": int(counted["original"])}
        results[task.removeprefix(PREFIX)] = clean
    return results


@torch.no_grad()
def token_perplexity(model, tokenizer, texts: list[str], window: int = 1024, stride: int = 512,
                     max_tokens: int | None = None) -> dict[str, float]:
    """Token-level perplexity of the concatenated texts (joined by the EOS token), sliding window: each window
    of `window` tokens advances by `stride` and scores only the tokens no earlier window scored (the first
    scores all of its own), so every token is predicted once with at least window - stride tokens of context
    (except the first window's).  Returns {"perplexity", "nll", "tokens"}."""
    sep = tokenizer.eos_token or "\n\n"
    ids = tokenizer(sep.join(texts), return_tensors="pt", add_special_tokens=False).input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    device = next(model.parameters()).device
    total, count, scored_to = 0.0, 0, 0
    for start in range(0, max(1, len(ids) - 1), stride):
        end = min(start + window, len(ids))
        chunk = ids[start:end].to(device)[None]
        logits = model(chunk).logits[0, :-1].float()
        targets = chunk[0, 1:]
        first = max(scored_to - start, 0)  # positions (as targets at index i + 1) not scored before
        nll = torch.nn.functional.cross_entropy(logits[first:], targets[first:], reduction="sum")
        total, count = total + float(nll), count + (len(targets) - first)
        scored_to = end - 1
        if end == len(ids):
            break
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}


PRIMARY = {"lambada": ("acc", "perplexity"), "corpus_ppl": ("word_perplexity", "bits_per_byte"),
           "token_ppl": ("perplexity", "tokens")}


def markdown_table(rows: dict[str, dict[str, dict[str, float]]]) -> str:
    """rows: config name -> task -> metrics; acc_norm where a task has it, else acc / perplexities, each with
    its standard error (± ...) when the results carry one."""
    tasks = sorted({t for res in rows.values() for t in res})
    cols = []
    for t in tasks:
        metrics = next(iter(r[t] for r in rows.values() if t in r))
        keys = PRIMARY.get(t, ("acc_norm",) if "acc_norm" in metrics else ("acc",))
        cols += [(t, k) for k in keys]
    lines = ["| config | " + " | ".join(f"{t} {k}" for t, k in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, res in rows.items():
        cells = [f"{res[t][k]:.4f}" + (f" ± {res[t]['stderr'][k]:.4f}" if k in res[t].get("stderr", {}) else "")
                 if t in res and k in res[t] else "-" for t, k in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(path: str | Path, results: dict[str, Any], meta: dict[str, Any]) -> None:
    import lm_eval

    payload = {"date": datetime.date.today().isoformat(), "lm_eval": lm_eval.__version__, **meta,
               "results": results}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))
    Path(path).with_suffix(".md").write_text(markdown_table({meta.get("name", "model"): results}))
