#!/usr/bin/env python
"""FSDP2 benchmark across GPUs (issues 17 and 18): tokens/s per GPU, all-gather bytes and time, with and without
FP4 weight all-gather, torchao's float8 all-gather beside it.  Launch once per GPU count:

    torchrun --nproc_per_node N scripts/bench_fsdp.py --model bench-50m,llama-1b \\
        --impls bf16,hf_fp4:nvfp4,hf_fp4:nvfp4+fp4ag,torchao_fp8_tensorwise+fp8ag [--out benchmarks]

Each impl trains `--steps` steps of a fixed per-GPU batch (weak scaling) under fully_shard per decoder layer with
BF16 mixed precision (FP32 master weights and gradient reduction), eagerly or (":compiled") with each decoder block
compiled.  Measured per step: wall time (CUDA
events), the bytes FSDP2's all-gathers receive (dist.all_gather_single / all_gather_into_tensor, counted) and the
GPU time of its all-gather kernels (torch.profiler).  Rank 0 adds its records to benchmarks/multi-gpu-<date>.json
(runs of other GPU counts kept) and rewrites multi-gpu-<date>.md: per model and impl, tokens/s per GPU for each GPU
count, the scaling efficiency against one GPU, and the all-gather bytes and time per step.
NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1) unless the environment says otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

for _key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_key, "0" if _key == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import LLAMA_1B, bench50m_model, md_table, torchao_float8  # noqa: E402

import hf_fp4  # noqa: E402
from hf_fp4.extras import versions as package_versions  # noqa: E402
from hf_fp4.nn.recipe import PRESET_NAMES  # noqa: E402

QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256)


def models(names: list[str], quick: bool) -> dict[str, tuple[dict, int, int]]:
    """{name: (LlamaConfig kwargs, per-GPU batch, sequence length)}."""
    if quick:
        return {"quick-tiny": (QUICK, 2, 32)}
    out = {}
    for n in names:
        if n == "llama-1b":
            out[n] = (LLAMA_1B, 4, 2048)
        elif n == "bench-50m":
            model_cfg, cfg = bench50m_model()
            kwargs = {k: v for k, v in model_cfg.items() if k != "model_type"}
            out[n] = ({**kwargs, "vocab_size": int(cfg["vocab_size"])}, int(cfg["batch_size"]), int(cfg["seq_len"]))
        else:
            raise SystemExit(f"unknown model {n!r}; valid: bench-50m, llama-1b")
    return out


def check_impls(impls: list[str]) -> None:
    """Unknown impl names end the run before any GPU time is spent, naming the valid ones."""
    valid = ["bf16", "bf16:compiled"] + [f"hf_fp4:{p}{o}" for p in PRESET_NAMES if p != "bf16"
                                         for o in ("", ":compiled", "+fp4ag")] + [
        f"torchao_fp8_{s}{o}" for s in ("tensorwise", "rowwise") for o in ("", "+fp8ag", ":compiled", "+fp8ag:compiled")]
    if unknown := [i for i in impls if i not in valid]:
        raise SystemExit(f"unknown impl(s) {', '.join(unknown)}; valid: {', '.join(valid)}")


def count_all_gathers() -> list[int]:
    """The bytes each FSDP2 all-gather receives, appended per call (its output tensor)."""
    calls: list[int] = []
    for name in ("all_gather_single", "all_gather_into_tensor"):
        inner = getattr(dist, name, None)
        if inner is not None:
            def counted(output, input, *args, _inner=inner, **kwargs):
                calls.append(output.numel() * output.element_size())
                return _inner(output, input, *args, **kwargs)

            setattr(dist, name, counted)
    return calls


def build(impl: str, cfg_kwargs: dict, dev: str):
    """The model of an impl under fully_shard: "bf16", "hf_fp4:<preset>[+fp4ag]", "torchao_fp8_<scaling>[+fp8ag]";
    ":compiled": each decoder block torch.compile'd (hf_fp4.compile_model, no CUDA graphs) before sharding."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    impl, compiled = impl.removesuffix(":compiled"), impl.endswith(":compiled")
    name, _, option = impl.partition("+")
    cfg = LlamaConfig(**cfg_kwargs)
    if name.startswith("hf_fp4:"):
        quant = hf_fp4.FP4TrainConfig(name.removeprefix("hf_fp4:"))
        model = AutoModelForCausalLM.from_config(cfg, quantization_config=quant).to(dev)
    else:
        model = AutoModelForCausalLM.from_config(cfg).to(dev)
    left = {}
    if option == "fp4ag":
        left = hf_fp4.enable_fp4_all_gather(model)
    if name.startswith("torchao_fp8_"):
        model = torchao_float8(model, name.removeprefix("torchao_fp8_"), fsdp_all_gather=option == "fp8ag")
        if model is None:
            return None, cfg, left
    if compiled:
        hf_fp4.compile_model(model, "default")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, cfg, left


def all_gather_kernel_ms(prof) -> float:
    """GPU time of the all-gather kernels in a profile (ms)."""
    events = [e for e in prof.events() if "allgather" in e.name.lower().replace("_", "")]
    return sum(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0) for e in events) / 1e3


def bench(impl, label, cfg_kwargs, batch, seq, steps, dev, world, calls) -> dict | None:
    model, cfg, left = build(impl, cfg_kwargs, dev)
    if model is None:
        return None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev) for _ in range(3)]
    fp4_gather = "+fp4ag" in impl

    def step(i):
        ids = batches[i % len(batches)]
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fp4_gather:  # as the trainer does: the next gathers' amaxes in one all-reduce
            hf_fp4.precompute_fp4_amax(model)

    for i in range(3):  # warm-up (kernels, allocator, FP4 all-gather's split decision)
        step(i)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    del calls[:]
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    sync()
    seconds = (time.perf_counter() - t0) / steps
    bytes_per_step = sum(calls) / steps
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(2):
            step(i)
        sync()
    record = {"model": label, "impl": impl, "gpus": world, "tokens_per_step_per_gpu": batch * seq,
              "step_ms": round(seconds * 1e3, 2), "tokens_per_s_per_gpu": round(batch * seq / seconds),
              "all_gather_bytes_per_step": int(bytes_per_step),
              "all_gather_ms_per_step": round(all_gather_kernel_ms(prof) / 2, 3) if dev == "cuda" else None,
              "layers_left_in_high_precision": len(left)}
    del model, opt
    if dev == "cuda":
        torch.cuda.empty_cache()
    return record


def render(runs: list[dict]) -> str:
    text = []
    for label in dict.fromkeys(r["model"] for r in runs):
        rows = []
        mine = [r for r in runs if r["model"] == label]
        for impl in dict.fromkeys(r["impl"] for r in mine):
            by_gpus = {r["gpus"]: r for r in mine if r["impl"] == impl}
            one = by_gpus.get(1)
            for n, r in sorted(by_gpus.items()):
                eff = f"{r['tokens_per_s_per_gpu'] / one['tokens_per_s_per_gpu']:.0%}" if one else "-"
                ms = r["all_gather_ms_per_step"]
                rows.append([impl, n, f"{r['tokens_per_s_per_gpu']:,}", eff,
                             f"{r['all_gather_bytes_per_step'] / 2**20:.3g}", f"{ms:.2f}" if ms is not None else "-",
                             r["layers_left_in_high_precision"]])
        text.append(md_table(f"FSDP2, {label}, {mine[0]['tokens_per_step_per_gpu']} tokens per GPU per step "
                             "(weak scaling), BF16 mixed precision",
                             ["impl", "GPUs", "tokens/s per GPU", "scaling vs 1 GPU", "all-gather MiB / step",
                              "all-gather GPU ms / step", "FP4 layers gathered in BF16"], rows))
    return "\n".join(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-50m", help="comma list of bench-50m, llama-1b")
    parser.add_argument("--impls", default="bf16,hf_fp4:nvfp4,hf_fp4:nvfp4+fp4ag",
                        help="comma list: bf16, hf_fp4:<preset>[+fp4ag], torchao_fp8_<tensorwise|rowwise>[+fp8ag]")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a tiny model (a CPU smoke test with gloo)")
    parser.add_argument("--out", default="benchmarks")
    args = parser.parse_args()
    check_impls(args.impls.split(","))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    calls = count_all_gathers()
    date = datetime.date.today().isoformat()
    stem = Path(args.out) / f"multi-gpu-{date}{'-quick' if args.quick else ''}"
    runs = []
    for label, (cfg_kwargs, batch, seq) in models(args.model.split(","), args.quick).items():
        for impl in args.impls.split(","):
            record = bench(impl, label, cfg_kwargs, batch, seq, args.steps, dev, world, calls)
            if record is not None and rank == 0:
                runs.append(record)
                print(record, flush=True)
    if rank == 0:
        stem.parent.mkdir(parents=True, exist_ok=True)
        path = stem.with_suffix(".json")
        old = json.loads(path.read_text()) if path.exists() else {"runs": [], "commands": []}
        keep = [r for r in old["runs"] if r["gpus"] != world or (r["model"], r["impl"]) not in
                {(n["model"], n["impl"]) for n in runs}]
        results = {"device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
                   "versions": package_versions("torch", "triton", "transformers", "hf_fp4", "torchao"),
                   "date": date, "commands": old["commands"] + [f"torchrun --nproc_per_node {world} "
                                                                 + " ".join(sys.argv)],
                   "runs": keep + runs}
        path.write_text(json.dumps(results, indent=1))
        header = (f"# hf_fp4 FSDP2 benchmark, {date}\n\n- device: {results['device']}\n- versions: "
                  f"{results['versions']}\n" + "".join(f"- command: `{c}`\n" for c in results["commands"]) + "\n")
        stem.with_suffix(".md").write_text(header + render(results["runs"]))
        print(f"-> {path}, {stem.with_suffix('.md')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
