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


def main(out_path: str, recipe: str, steps: int = 4):
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg, quantization_config=hf_fp4.FP4TrainConfig(recipe))
    if distributed:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
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
                   "fp4_layers": len(hf_fp4.fp4_modules(model))}, open(out_path, "w"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
