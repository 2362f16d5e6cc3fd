"""Tiny model configs shared by the tests, and a CUDA training-step loop."""
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
