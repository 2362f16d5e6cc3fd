"""Tiny model configs shared by the tests."""
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
