"""torchrun worker for tests/test_fp4_gather.py: accelerate's own FSDP2 on CPU ranks with gloo.

    accelerate_fsdp2_worker.py OUT.json RECIPE FP4_ALL_GATHER   accelerate's FSDP2 preparation (fsdp2_prepare_model,
        the optimizer's parameters re-mapped to the shards by data pointer) of an FP4 Llama, a few steps; writes the
        mean losses and the gathered state dict's tensor types
    accelerate_fsdp2_worker.py pretrain ARGS...                 scripts/pretrain.py's trainer under FSDP2 (prepare,
        sharded checkpoints through accelerate's save_state / load_state, the gathered final export)
    accelerate_fsdp2_worker.py pretrain-fp4-eager ARGS...       the same, every FP4Linear run outside torch.compile's
        graph (as the FP4-gathered ones always are): a compiled run whose graphs are cut where FP4 all-gather's are

accelerate enables FSDP on GPUs only: the worker sets the distributed type to FSDP after constructing the
Accelerator (the one departure from a GPU run)."""
import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_fp4


def fsdp2_plugin() -> FullyShardedDataParallelPlugin:
    """configs/accelerate/fsdp2.yaml's plugin."""
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                          reshard_after_forward=True, state_dict_type="SHARDED_STATE_DICT")


def force_fsdp2(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # (read back by later calls)
    accelerator.state.fsdp_plugin = plugin


def pretrain(argv: list[str], fp4_eager: bool = False) -> int:
    """The trainer, every Accelerator it makes under FSDP2; fp4_eager: each FP4Linear outside the compiled graphs.

    A compiled block cut at its FP4 layers sums the gradients of a tensor that feeds several layers (q/k/v, gate/up)
    in the autograd engine's order instead of the graph's: FP32 rounding differs from the uncut block's, so the
    FP4 all-gather is compared with BF16 all-gather on the same cut."""
    if fp4_eager:
        from hf_fp4.nn.linear import FP4Linear

        FP4Linear._fp4_product = FP4Linear._gathered_product  # (torch.compiler.disable'd _product)
    original = Accelerator.__init__

    def init(self, *args, **kwargs):
        plugin = fsdp2_plugin()
        original(self, *args, fsdp_plugin=plugin, **kwargs)
        force_fsdp2(self, plugin)

    Accelerator.__init__ = init
    from hf_fp4.cli import pretrain as run

    return run(argv)


def main(out_path: str, recipe: str, fp4_all_gather: str):
    plugin = fsdp2_plugin()
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision="bf16")
    force_fsdp2(accelerator, plugin)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg, quantization_config=hf_fp4.FP4TrainConfig(recipe))
    left = hf_fp4.enable_fp4_all_gather(model, world_size=accelerator.num_processes) if fp4_all_gather == "1" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(3):
        ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(step))
        ids = ids.chunk(accelerator.num_processes)[accelerator.process_index]
        with accelerator.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / accelerator.num_processes)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        json.dump({"losses": losses, "state_types": sorted({type(v).__name__ for v in state.values()}),
                   "fsdp": type(model).__name__, "left": left}, open(out_path, "w"))


if __name__ == "__main__":
    if sys.argv[1].startswith("pretrain"):
        sys.exit(pretrain(sys.argv[2:], fp4_eager=sys.argv[1] == "pretrain-fp4-eager"))
    main(*sys.argv[1:])
