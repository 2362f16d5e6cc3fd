"""Export to GGUF (llama.cpp): MXFP4-trained linear weights bit for bit, everything else as asked.

GGUF's MXFP4 type is the OCP format our `mxfp4` recipes train in: blocks of 32 E2M1 codes along K with one
E8M0 scale.  ggml stores a block as the scale byte followed by 16 bytes whose low nibbles hold elements 0-15
and high nibbles elements 16-31; its value table is E2M1 doubled and its scale decodes to 2^(e - 128), so
code c with scale byte e means exactly what our code c with scale 2^(e - 127) means.  The export repacks our
codes and scales into that layout: no rounding at all.  A linear layer qualifies when its fprop weight
operand is E2M1 with E8M0 scales on 1x32 blocks along K, without an fprop Hadamard or LoRA-SVD term (those
weights are the product of more than one tensor); the others are written as their dequantized weight
Q(W R) R^T (+ B A) in the fallback type, which is lossy only by that type's rounding (BF16 by default).

GGUF's NVFP4 type keeps the per-16 E4M3 block scales but has no per-tensor FP32 scale, so our two-level
NVFP4 (block scale x tensor scale) does not fit it exactly; NVFP4 recipes go out dequantized.

Llama-family models only (what llama.cpp's `llama` architecture and transformers' GGUF loader share);
Q and K rows are permuted to llama.cpp's rotary layout, as llama.cpp's own converter does.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..nn import lora_svd
from ..nn.swap import fp4_modules
from ..extras import require
from ..files import atomic_file
from ..numerics.formats import Grid
from ..numerics.scales import ScaleRule

GGUF_TYPES = ("mxfp4", "bf16", "f32")
ARCHS = ("llama",)


def gguf_names(layers: dict) -> set[str]:
    """The GGUF tensor names of FP4Linear layers (by their module names)."""
    import gguf

    n_blocks = 1 + max((int(n.split("layers.")[1].split(".")[0]) for n in layers if "layers." in n), default=0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_blocks)
    return {names.get_name(f"{n}.weight", try_suffixes=(".weight",)) for n in layers}


def mxfp4_lossless(recipe) -> bool:
    """Whether a LinearRecipe's fprop weight operand is GGUF MXFP4 as it is (see the module docstring)."""
    spec = recipe.fprop.rhs
    return (spec is not None and spec.grid is Grid.E2M1 and spec.block == (1, 32)
            and spec.scale in (ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL) and not recipe.fprop.hadamard.enabled
            and recipe.lora_svd_rank == 0)


def mxfp4_exact(module) -> bool:
    """Whether the layer's fprop weight operand is GGUF MXFP4 as it is (see the module docstring)."""
    return mxfp4_lossless(module.recipe) and not lora_svd.has_factors(module) and not module.frozen_weight


def gguf_note(recipe) -> str:
    """What `scripts/export.py --format gguf` makes of a LinearRecipe's linear weights (model cards)."""
    if recipe is not None and mxfp4_lossless(recipe):
        return ("`scripts/export.py --format gguf` writes the decoder linear weights as GGUF MXFP4 tensors bit for "
                "bit: the E2M1 codes and E8M0 scales this model trained with, repacked for llama.cpp.")
    why = ("the weights are BF16" if recipe is None or recipe.fprop.rhs is None else
           "its fprop weights are not E2M1 with E8M0 scales on 1x32 blocks without a Hadamard or LoRA-SVD term, "
           "and GGUF has no type that holds them exactly (GGUF's NVFP4 lacks the per-tensor FP32 scale)")
    return (f"`scripts/export.py --format gguf` writes the decoder linear weights in the type asked for "
            f"(`--gguf_type`, BF16 by default) from their dequantized values: {why}.")


def mxfp4_blocks(codes: torch.Tensor, scales: torch.Tensor, k: int) -> np.ndarray:
    """Our packed codes [N, K/2] (low nibble = even element) and E8M0 scales [N, K/32] -> ggml MXFP4 bytes
    [N, K/32 * 17]: per block the scale byte, then byte j = element j | element j + 16 << 4."""
    n = codes.shape[0]
    nib = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(n, -1)[:, :k]  # one code per element
    nib = nib.reshape(n, k // 32, 2, 16)
    qs = nib[:, :, 0] | (nib[:, :, 1] << 4)  # [N, K/32, 16]
    e = scales.view(torch.uint8)[:, : k // 32].reshape(n, k // 32, 1)
    return torch.cat([e, qs], dim=-1).reshape(n, -1).contiguous().numpy()


def permute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half row order -> llama.cpp's interleaved order (rows only; a row's blocks stay whole)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(writer, gguf, config, tokenizer) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or
                                    (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer is None:
        return
    vocab = tokenizer.get_vocab()
    tokens = [""] * config.vocab_size
    for tok, i in vocab.items():
        if i < len(tokens):
            tokens[i] = tok
    special = set(tokenizer.all_special_ids)
    tokens = [t or f"[PAD{i}]" for i, t in enumerate(tokens)]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = backend.to_str() if backend is not None else None
    import json
    merges = json.loads(model)["model"].get("merges", []) if model else []
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges]
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("pad_token_id", writer.add_pad_token_id)):
        if getattr(tokenizer, attr, None) is not None:
            add(getattr(tokenizer, attr))


def export_gguf(model, tokenizer, output, gguf_type: str = "mxfp4", overwrite: bool = False) -> Path:
    """Write model (an hf_fp4 training model, Llama family) as one GGUF file; see the module docstring.

    gguf_type: "mxfp4" (qualifying FP4 linears bit for bit, the rest in BF16), "bf16" or "f32" (all
    dequantized).  Norms are always F32 (llama.cpp's convention)."""
    gguf = require("gguf", "eval", "--format gguf")
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"unknown gguf_type {gguf_type!r}; valid: {', '.join(GGUF_TYPES)}")
    config = model.config
    if config.model_type not in ARCHS:
        raise ValueError(f"GGUF export supports {', '.join(ARCHS)} models, not {config.model_type!r}")
    output = Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite to replace it")
    fp4 = fp4_modules(model)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    with atomic_file(output) as tmp:  # a crash leaves no half-written file
        writer = gguf.GGUFWriter(str(tmp), "llama")
        _write_metadata(writer, gguf, config, tokenizer)
        float_type = gguf.GGMLQuantizationType.F32 if gguf_type == "f32" else gguf.GGMLQuantizationType.BF16
        seen, exact, lossy = set(), 0, []
        for hf_name, tensor in model.state_dict().items():
            if lora_svd.is_factor(hf_name) or hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if tensor.data_ptr() in seen and config.tie_word_embeddings and hf_name.endswith("lm_head.weight"):
                continue  # tied: llama.cpp reuses token_embd
            seen.add(tensor.data_ptr())
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ValueError(f"no GGUF name for {hf_name}")
            module = fp4.get(hf_name.removesuffix(".weight"))
            heads = (config.num_attention_heads if ".attn_q." in name else
                     config.num_key_value_heads if ".attn_k." in name else None)
            if module is not None and gguf_type == "mxfp4" and mxfp4_exact(module):
                q = module.quantized_fprop_weight()
                n, k = module.out_features, module.in_features
                codes, scales = q.codes[:n], q.scales[:n]
                if heads:
                    codes, scales = permute_rotary_rows(codes, heads), permute_rotary_rows(scales.view(torch.uint8), heads)
                writer.add_tensor(name, mxfp4_blocks(codes.cpu(), scales.cpu(), k),
                                  raw_dtype=gguf.GGMLQuantizationType.MXFP4)  # shape from the bytes per row
                exact += 1
                continue
            if module is not None:
                lossy.append(hf_name.removesuffix(".weight"))
            w = (module.dequantized_weight() if module is not None else tensor).detach().float().cpu()
            if heads:
                w = permute_rotary_rows(w, heads)
            kind = gguf.GGMLQuantizationType.F32 if w.dim() == 1 else float_type
            data = gguf.quants.quantize(w.numpy(), kind) if kind != gguf.GGMLQuantizationType.F32 else w.numpy()
            writer.add_tensor(name, data, raw_dtype=kind)
        kind_name = "F32" if gguf_type == "f32" else "BF16"
        print(f"hf_fp4: GGUF: {exact} FP4 linear layer(s) as MXFP4, bit for bit"
              + (f"; {len(lossy)} dequantized to {kind_name} (their fprop weight is not E2M1 + E8M0 on 1x32 blocks "
                 f"without Hadamard / LoRA-SVD, or --gguf_type asked for it), e.g. {lossy[0]}" if lossy else ""))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return output
