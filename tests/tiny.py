"""Tiny model configs shared by the tests, a CUDA training-step loop, and the live-tensor census of the
CUDA-graph-pool tests."""
import gc
import sys

import torch
from transformers import LlamaConfig, Qwen2Config

VOCAB = 256


def tiny_config(arch: str = "llama", layers: int = 2):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(arch)


def cuda_train_steps(model, batches):
    """One training step of `model` under BF16 autocast per batch of token ids (each marked as a new CUDA-graph
    step): yields each step's loss, the gradients left in the model."""
    for ids in batches:
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        yield loss.detach()


def clear_package_caches() -> None:
    """Empty every functools cache of the hf_fp4 package, as in a fresh process (a cache filled by an earlier test
    would hide a tensor that a first call keeps)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("hf_fp4"):
            for obj in list(vars(module).values()):
                if callable(getattr(obj, "cache_clear", None)):
                    obj.cache_clear()


def live_tensors() -> dict[int, torch.Tensor]:
    """Every tensor the garbage collector can see, by id (after a collection)."""
    gc.collect()
    return {id(o): o for o in gc.get_objects() if torch.is_tensor(o)}
