"""torchrun worker for tests/test_distributed.py: FSDP2 (fully_shard) on CPU ranks with gloo.

Trains a tiny FP4 Llama a few steps with the global batch split across ranks and writes the losses
(and the gathered final weights) for comparison with one process.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_fp4


def count_all_gather_bytes() -> dict:
    """Counts the bytes FSDP2's all-gathers receive (their output tensors): torch 2.13 calls
    dist.all_gather_single, earlier versions dist.all_gather_into_tensor."""
    counts = {"per_call": []}
    for name in ("all_gather_single", "all_gather_into_tensor"):
        inner = getattr(dist, name, None)
        if inner is None:
            continue

        def counted(output, input, *args, _inner=inner, **kwargs):
            counts["per_call"].append(output.numel() * output.element_size())
            return _inner(output, input, *args, **kwargs)

        setattr(dist, name, counted)
    return counts


def main(out_path: str, recipe: str, fp4_all_gather: str = "0", param_dtype: str = "fp32", steps: int = 4):
    """fp4_all_gather "1": hf_fp4.enable_fp4_all_gather before fully_shard; param_dtype "bf16": FSDP2 mixed
    precision (parameters gathered and used in BF16, as on the GPU)."""
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg, quantization_config=hf_fp4.FP4TrainConfig(recipe))
    left = {}
    if fp4_all_gather == "1":
        left = hf_fp4.enable_fp4_all_gather(model)
    gathered = count_all_gather_bytes()
    if distributed:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if param_dtype == "bf16" else None)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (4, 33), generator=g)  # the global batch
        local = ids.chunk(world)[rank]
        logits = model(input_ids=local[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), local[:, 1:].reshape(-1))
        loss.backward()  # FSDP2 averages gradients over ranks (reduce-scatter)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    if distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    if rank == 0:
        w = state["model.layers.0.mlp.up_proj.weight"]
        json.dump({"losses": losses, "w_sum": float(w.double().sum()), "w_abs": float(w.double().abs().sum()),
                   "w_bits": w.float().view(torch.int32).tolist(), "fp4_layers": len(hf_fp4.fp4_modules(model)),
                   "all_gather_bytes": gathered, "left_in_high_precision": left}, open(out_path, "w"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
