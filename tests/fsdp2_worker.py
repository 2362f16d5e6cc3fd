"""torchrun worker for tests/test_distributed.py: FSDP2 (fully_shard) on CPU ranks with gloo.

Trains a tiny FP4 Llama a few steps with the global batch split across ranks and writes the losses
(and the gathered final weights) for comparison with one process.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

import hf_fp4


def count_all_gather_bytes() -> dict:
    """Counts the bytes FSDP2's all-gathers receive (their output tensors): torch 2.13 calls
    dist.all_gather_single, earlier versions dist.all_gather_into_tensor; and the all-reduce calls."""
    counts = {"per_call": [], "all_reduce": 0}
    inner_reduce = dist.all_reduce

    def all_reduce(*args, **kwargs):
        counts["all_reduce"] += 1
        return inner_reduce(*args, **kwargs)

    dist.all_reduce = all_reduce
    for name in ("all_gather_single", "all_gather_into_tensor"):
        inner = getattr(dist, name, None)
        if inner is None:
            continue

        def counted(output, input, *args, _inner=inner, **kwargs):
            counts["per_call"].append(output.numel() * output.element_size())
            return _inner(output, input, *args, **kwargs)

        setattr(dist, name, counted)
    return counts


def config(arch: str):
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
    if arch == "qwen3_moe":  # 4 experts, top 2: the experts' 3D weights sharded along the experts
        return Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=64,
                              decoder_sparse_step=1, head_dim=16, **common)
    return LlamaConfig(intermediate_size=128, **common)


def build(recipe: str, fp4_all_gather: str, param_dtype: str, distributed: bool, checkpointing: str = "0",
          arch: str = "llama", compile_backend: str = ""):
    torch.manual_seed(0)
    cfg = config(arch)
    model = AutoModelForCausalLM.from_config(cfg, quantization_config=hf_fp4.FP4TrainConfig(recipe))
    if checkpointing == "1":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    left = hf_fp4.enable_fp4_all_gather(model) if fp4_all_gather == "1" else {}
    if compile_backend:
        for layer in model.model.layers:
            layer.compile(backend=compile_backend)
    if distributed:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if param_dtype == "bf16" else None)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), left


def steps(model, opt, first: int, last: int, rank: int, world: int, distributed: bool,
          precompute: str = "0") -> list[float]:
    losses = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, 256, (4, 33), generator=g)  # the global batch of this step
        local = ids.chunk(world)[rank]
        logits = model(input_ids=local[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), local[:, 1:].reshape(-1))
        loss.backward()  # FSDP2 averages gradients over ranks (reduce-scatter)
        opt.step()
        opt.zero_grad()
        if precompute == "1" or (precompute == "once" and step == 0):
            hf_fp4.precompute_fp4_amax(model)
        mean = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    return losses


def main(out_path: str, recipe: str, fp4_all_gather: str = "0", param_dtype: str = "fp32", n_steps: str = "4",
         checkpointing: str = "0", arch: str = "llama", compile_backend: str = "", precompute: str = "0"):
    """Trains n_steps, writing a sharded checkpoint (torch.distributed.checkpoint: model, optimizer) half-way, then
    resumes a fresh model from it and trains the second half again (distributed runs).  fp4_all_gather "1":
    hf_fp4.enable_fp4_all_gather before fully_shard; param_dtype "bf16": FSDP2 mixed precision (parameters
    gathered and used in BF16, as on the GPU)."""
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    n_steps = int(n_steps)
    model, opt, left = build(recipe, fp4_all_gather, param_dtype, distributed, checkpointing, arch, compile_backend)
    gathered = count_all_gather_bytes()
    losses = steps(model, opt, 0, n_steps // 2, rank, world, distributed, precompute)
    resumed = []
    if distributed:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        ckpt = os.path.join(os.path.dirname(os.path.abspath(out_path)), f"ckpt-{os.path.basename(out_path)}")
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=ckpt)
        rng = hf_fp4.rng_state_dict(model)
    losses += steps(model, opt, n_steps // 2, n_steps, rank, world, distributed, precompute)
    per_call = list(gathered["per_call"])  # this run's all-gathers (not the resumed one's below)
    all_reduces = gathered["all_reduce"]
    if distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        fresh, fresh_opt, _ = build(recipe, fp4_all_gather, param_dtype, distributed, checkpointing, arch, compile_backend)
        model_sd, opt_sd = get_state_dict(fresh, fresh_opt)
        loaded = {"model": model_sd, "optim": opt_sd}
        dcp.load(loaded, checkpoint_id=ckpt)
        set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        hf_fp4.load_rng_state_dict(fresh, rng)
        resumed = steps(fresh, fresh_opt, n_steps // 2, n_steps, rank, world, distributed, precompute)
    else:
        state = model.state_dict()
    if rank == 0:
        w = state["model.layers.0.mlp.experts.down_proj" if arch == "qwen3_moe" else "model.layers.0.mlp.up_proj.weight"]
        json.dump({"losses": losses, "resumed": resumed, "w_sum": float(w.double().sum()),
                   "w_abs": float(w.double().abs().sum()), "w_bits": w.float().view(torch.int32).flatten().tolist(),
                   "fp4_layers": len(hf_fp4.fp4_modules(model)), "all_gather_bytes": per_call,
                   "all_reduces": all_reduces,
                   "state_types": sorted({type(v).__name__ for v in state.values()}),
                   "local_shapes": {n: list(getattr(p, "_local_tensor", p).shape) for n, p in model.named_parameters()
                                    if n.endswith("layers.0.mlp.experts.down_proj")},
                   "left_in_high_precision": left}, open(out_path, "w"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
