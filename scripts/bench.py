#!/usr/bin/env python
"""Side-by-side GPU benchmark: quantization bandwidth, linear fwd+bwd, end-to-end train steps.

    python scripts/bench.py [--quick] [--out DIR]

Prints one table per part and writes benchmarks/results-<date>.md (device, versions, command). CUDA
events, warm-up, medians over fresh random inputs.  Ratios are measured side by side in this run.
"""
import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import hf_fp4
from hf_fp4 import FP4Linear, QuantSpec, preset
from hf_fp4.recipe import PRESET_NAMES

FP4_PRESETS = [p for p in PRESET_NAMES if p != "bf16"]


def timed(fn, make_inputs, warmup=3, reps=10):
    """Median milliseconds of fn(*inputs) over reps fresh inputs, CUDA events when on GPU."""
    cuda = torch.cuda.is_available()
    times = []
    for i in range(warmup + reps):
        args = make_inputs()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn(*args)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def table(title, header, rows):
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    return text


def bench_quantization(dev, n):
    from hf_fp4.kernels.quant import triton_quantize

    cases = [("nvfp4", {}), ("mxfp4", {}), ("mxfp4_2d_up", {}), ("ufp4 + RHT-16", {"hadamard": 16}),
             ("mxfp4 SR", {"sr": True}), ("nvfp4 transposed", {"transpose": True})]
    make = lambda: (torch.randn(n, n, device=dev, dtype=torch.bfloat16),)  # noqa: E731
    copy_ms = timed(lambda x: x.clone(), make)
    copy_bytes = 2 * n * n * 2
    gbs = lambda nbytes, ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
    rows = [["device copy (bf16 read + write)", f"{copy_ms:.3f}", f"{gbs(copy_bytes, copy_ms):.0f}", "100%", "-"]]
    for label, opts in cases:
        name = label.split()[0]
        spec = QuantSpec.preset(name)
        if opts.get("sr"):
            import dataclasses
            spec = dataclasses.replace(spec, rounding="stochastic")
        kw = {k: v for k, v in opts.items() if k in ("hadamard", "transpose")}
        ms = timed(lambda x: triton_quantize(x, spec, seed=1, **kw), make)
        moved = n * n * 2 + n * n * spec.bits_per_value / 8  # read bf16 once, write codes + scales
        eager = timed(lambda x: hf_fp4.quantize(x, spec, seed=1), make, warmup=1, reps=3) if label in (
            "nvfp4", "mxfp4") else None
        rows.append([label, f"{ms:.3f}", f"{gbs(moved, ms):.0f}", f"{gbs(moved, ms) / gbs(copy_bytes, copy_ms):.0%}",
                     f"{eager / ms:.1f}x" if eager else "-"])
    text = table(f"Quantization of a {n}x{n} bf16 tensor (ms, GB/s; % of copy bandwidth = bytes/s ratio)",
                 ["kernel", "ms", "GB/s", "% of copy", "vs eager reference"], rows)
    sweep = []
    for bm, bk, warps in [(32, 64, 4), (64, 128, 8), (256, 64, 8)]:
        row = [f"{bm}x{bk}, {warps} warps"]
        for name, kw in (("mxfp4", {}), ("nvfp4", {}), ("nvfp4", {"transpose": True})):
            spec = QuantSpec.preset(name)
            ms = timed(lambda x: triton_quantize(x, spec, tile=(bm, bk, warps), **kw), make)
            row.append(f"{ms:.3f}")
        sweep.append(row)
    return text + table("Tile sweep (ms)", ["tile", "mxfp4", "nvfp4", "nvfp4 transposed"], sweep)


def bench_linear(dev, tokens, shapes):
    rows = []
    for k, n in shapes:
        x_make = lambda: (torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True),  # noqa: E731
                          torch.randn(tokens, n, device=dev, dtype=torch.bfloat16))
        base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)

        def step(layer):
            def run(x, dy):
                layer(x).backward(dy)
            return run

        bf16_ms = timed(step(base), x_make)
        row = [f"{k}x{n}", f"{bf16_ms:.2f}"]
        for name in ["reference:nvfp4"] + FP4_PRESETS:
            backend, _, recipe = name.rpartition(":")
            layer = FP4Linear.from_linear(nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16),
                                          preset(recipe).linear, name="bench")
            layer.backend = backend or "triton"
            reps = 3 if backend == "reference" else 10
            ms = timed(step(layer), x_make, warmup=1 if backend else 3, reps=reps)
            row.append(f"{ms:.2f} ({bf16_ms / ms:.2f}x)")
        rows.append(row)
    return table(f"Linear forward + backward, {tokens} tokens (ms; speed vs bf16 nn.Linear)",
                 ["K x N", "bf16"] + ["eager ref. nvfp4"] + FP4_PRESETS, rows)


def bench_end_to_end(dev, cfg_kwargs, batch, seq, steps):
    from transformers import AutoModelForCausalLM, LlamaConfig

    rows = []
    results = {}
    for name in ["bf16"] + FP4_PRESETS + ["reference:nvfp4"]:
        backend, _, recipe = name.rpartition(":")
        torch.manual_seed(0)
        cfg = LlamaConfig(**cfg_kwargs)
        model = AutoModelForCausalLM.from_config(cfg, quantization_config=hf_fp4.FP4TrainConfig(recipe)).to(dev)
        for m in hf_fp4.fp4_modules(model).values():
            m.backend = backend or "auto"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
        make = lambda: (torch.randint(0, cfg.vocab_size, (batch, seq), device=dev),)  # noqa: E731

        def step(ids):
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        n = 2 if backend == "reference" else steps
        ms = timed(step, make, warmup=2, reps=n)
        results[name] = batch * seq / (ms / 1e3)
        del model, opt
        if dev == "cuda":
            torch.cuda.empty_cache()
    for name, tps in results.items():
        rows.append([name, f"{tps:,.0f}", f"{tps / results['bf16']:.2f}x",
                     f"{tps / results['reference:nvfp4']:.1f}x"])
    params = "~1.1B" if cfg_kwargs["hidden_size"] >= 2048 else "small"
    return table(f"End-to-end train step, Llama {params} ({cfg_kwargs['hidden_size']}d x "
                 f"{cfg_kwargs['num_hidden_layers']}L), {batch}x{seq} tokens, bf16 autocast, AdamW",
                 ["recipe", "tokens/s", "vs bf16", "vs eager reference nvfp4"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    parser.add_argument("--out", default="benchmarks", help="folder for results-<date>.md")
    parser.add_argument("--parts", default="quant,linear,e2e")
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    parts = args.parts.split(",")
    date = datetime.date.today().isoformat()
    device = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu"
    import transformers
    import triton
    header = (f"# hf_fp4 benchmark, {date}\n\n- device: {device}\n- torch {torch.__version__}, triton "
              f"{triton.__version__}, transformers {transformers.__version__}, python {platform.python_version()}\n"
              f"- command: `python {' '.join(sys.argv)}`\n\n")
    out = [header]
    if args.quick:
        sizes = dict(n=256, tokens=128, shapes=[(128, 128)], e2e=dict(hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256), batch=2,
                     seq=32, steps=2)
    else:
        sizes = dict(n=8192, tokens=8192, shapes=[(4096, 4096), (4096, 14336), (14336, 4096)],
                     e2e=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048),
                     batch=4, seq=2048, steps=5)
    if "quant" in parts:
        out.append(bench_quantization(dev, sizes["n"]))
    if "linear" in parts:
        out.append(bench_linear(dev, sizes["tokens"], sizes["shapes"]))
    if "e2e" in parts:
        out.append(bench_end_to_end(dev, sizes["e2e"], sizes["batch"], sizes["seq"], sizes["steps"]))
    path = Path(args.out) / f"results-{date}{'-quick' if args.quick else ''}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
