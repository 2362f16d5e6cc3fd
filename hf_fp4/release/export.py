"""Export a trained hf_fp4 model: packed FP4, dequantized standard checkpoint, or compressed-tensors NVFP4.

* `fp4`: each FP4Linear's fprop weight operand Q(W R) (R the fprop Hadamard, if any) as packed codes,
  block scales and the FP32 tensor scale (`<layer>.weight_packed`, `.weight_scale`, `.weight_tensor_scale`);
  config.json carries the recipe with `packed: true`. `from_pretrained` (after `import hf_fp4`) unpacks it
  into a frozen weight and gives logits identical to the fake-quantized model.
* `bf16`: a plain checkpoint (no quantization_config) whose linear weights are the dequantized operands
  rotated back, Q(W R) R^T (+ B A for LoRA-SVD), MoE experts' 3D weights likewise expert by expert: plain
  transformers loads it without hf_fp4.  `fp4` packs MoE experts too: per projection, the experts' operands
  stacked (`<proj>_packed`, `<proj>_scale`, `<proj>_tensor_scale`).
* `compressed-tensors`: NVFP4 weights in the layout of the `compressed-tensors` package (vLLM,
  llm-compressor): `weight_packed` (two E2M1 codes a byte, low nibble first), `weight_scale` (E4M3, one
  per 1x16 group; a 16x16 tile's scale is repeated on its 16 rows), `weight_global_scale` (= s_enc), with
  an `NVFP4A16` quantization_config (weights only: our activation scales are dynamic, not calibrated).
  Only recipes whose fprop weight is E2M1 with UE4M3 + FP32 scales on 1x16 or 16x16 blocks, without an
  fprop Hadamard or LoRA-SVD, can be written this way (nvfp4, and custom recipes like it).

Every export is written to a temporary folder next to the output and renamed into place.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..nn import lora_svd
from ..nn.swap import fp4_modules
from ..nn.experts import dequantized_experts_weight, experts_modules, packed_experts
from ..numerics.formats import Grid
from ..extras import require
from ..files import atomic_dir
from ..hf.quantizer import FP4TrainConfig
from ..numerics.scales import ScaleRule

FORMATS = ("fp4", "bf16", "compressed-tensors", "gguf")


def _dedup_state_dict(model) -> dict[str, torch.Tensor]:
    """model.state_dict() without tied duplicates (the loader re-ties them)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().cpu()
    return out


def write_dir_atomically(output: Path, overwrite: bool, write) -> Path:
    """write(folder) into a temporary folder that then becomes `output` in one rename (hf_fp4.files.atomic_dir)."""
    with atomic_dir(output, overwrite) as tmp:
        write(tmp)
    return Path(output)


def _save_common(model, tokenizer, config_dict: dict, state: dict, path: Path) -> None:
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)


def _plain_config(model) -> dict:
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    return cfg


def export_fp4(model, tokenizer, output, overwrite=False) -> Path:
    fp4 = fp4_modules(model)
    if not fp4:
        raise ValueError("not an hf_fp4 model: no FP4Linear layers (train or convert one first)")
    state = _dedup_state_dict(model)
    for name, module in fp4.items():
        if module.recipe.fprop.rhs is None or module.frozen_weight:
            continue
        q = module.quantized_fprop_weight()
        del state[f"{name}.weight"]
        state[f"{name}.weight_packed"] = q.codes.cpu()
        state[f"{name}.weight_scale"] = q.scales.view(torch.uint8).cpu() if q.scales.dtype != torch.float32 \
            else q.scales.cpu()
        if q.tensor_scale is not None:
            state[f"{name}.weight_tensor_scale"] = q.tensor_scale.reshape(1).cpu()
    for name, module in experts_modules(model).items():  # MoE experts: stacked per-expert operands
        if hasattr(module, "hf_fp4") and module.hf_fp4.recipe.fprop.rhs is not None and not module.hf_fp4.frozen:
            for proj in module.hf_fp4.projections:
                del state[f"{name}.{proj}"]
            state.update({f"{name}.{key}": t for key, t in packed_experts(module).items()})
    qc = model.config.quantization_config
    qc = qc if isinstance(qc, FP4TrainConfig) else FP4TrainConfig.from_dict(qc)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {**qc.to_dict(), "packed": True}
    return write_dir_atomically(output, overwrite, lambda p: _save_common(model, tokenizer, cfg, state, p))


def export_bf16(model, tokenizer, output, overwrite=False, dtype=torch.bfloat16) -> Path:
    state = _dedup_state_dict(model)
    for name, module in fp4_modules(model).items():
        state[f"{name}.weight"] = module.dequantized_weight().to(dtype).cpu()
        for extra in lora_svd.FACTORS:
            state.pop(f"{name}.{extra}", None)
    for name, module in experts_modules(model).items():  # MoE experts: each expert's weight operand
        if hasattr(module, "hf_fp4") and module.hf_fp4.recipe.quantized:
            for proj in module.hf_fp4.projections:
                state[f"{name}.{proj}"] = dequantized_experts_weight(module, proj).to(dtype).cpu()
                for factor in lora_svd.expert_factor_names(proj):  # folded into the weight above
                    state.pop(f"{name}.{factor}", None)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    cfg = _plain_config(model)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    return write_dir_atomically(output, overwrite, lambda p: _save_common(model, tokenizer, cfg, state, p))


def check_compressed_tensors(model) -> None:
    problems = []
    for name, m in fp4_modules(model).items():
        spec = m.recipe.fprop.rhs
        if spec is None:
            continue
        if spec.grid is not Grid.E2M1 or spec.scale is not ScaleRule.UE4M3_FP32 or spec.block[1] != 16:
            problems.append(f"{name}: weight format {spec.grid.value}/{spec.scale.value}/{spec.block}")
        elif m.recipe.fprop.hadamard.enabled or lora_svd.has_factors(m) or m.frozen_weight:
            problems.append(f"{name}: fprop Hadamard, LoRA-SVD or a packed weight")
        elif m.in_features % 16:
            problems.append(f"{name}: in_features {m.in_features} not a multiple of 16")
    if problems:
        raise ValueError("compressed-tensors holds NVFP4 weights only (E2M1, UE4M3 + FP32 scales, 1x16 or "
                         "16x16 blocks, no Hadamard or LoRA-SVD on fprop); this model cannot be written that "
                         f"way: {problems[:3]}. Export with --format fp4 or bf16 instead.")


def export_compressed_tensors(model, tokenizer, output, overwrite=False) -> Path:
    require("compressed_tensors", "eval", "--format compressed-tensors")
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    check_compressed_tensors(model)
    state = _dedup_state_dict(model)
    ignore = []
    for name, m in fp4_modules(model).items():
        if m.recipe.fprop.rhs is None:
            ignore.append(name)
            continue
        q = m.quantized_fprop_weight()
        n, k = m.out_features, m.in_features
        scales = q.scales.float() if q.spec.block[0] == 1 else q.scales.float().repeat_interleave(16, 0)
        del state[f"{name}.weight"]
        state[f"{name}.weight_packed"] = q.codes[:n, : k // 2].contiguous().cpu()
        state[f"{name}.weight_scale"] = scales[:n, : k // 16].to(torch.float8_e4m3fn).contiguous().cpu()
        state[f"{name}.weight_global_scale"] = torch.reciprocal(q.tensor_scale).reshape(1).float().cpu()
    converted = set(fp4_modules(model))
    ignore += [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and n not in converted]
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="nvfp4-pack-quantized",
                            quantization_status="compressed", ignore=sorted(ignore))
    cfg = _plain_config(model)
    # dequantize: transformers expands the NVFP4 weights at load time, in the model's dtype.  Left compressed,
    # compressed-tensors decompresses them in BF16 at every forward, which fails for a float32 model (the
    # default load).  vLLM reads the scheme and ignores the flag.
    cfg["quantization_config"] = {**json.loads(qc.model_dump_json()), "dequantize": True}
    return write_dir_atomically(output, overwrite, lambda p: _save_common(model, tokenizer, cfg, state, p))


def _stored_bytes(path: Path, fmt: str, layers) -> tuple[int, int]:
    """(file bytes, bytes of the converted linear layers' tensors) of an export."""
    if fmt == "gguf":
        import gguf
        from .gguf_export import gguf_names

        names = gguf_names(layers)
        tensors = gguf.GGUFReader(str(path)).tensors
        return path.stat().st_size, sum(int(t.n_bytes) for t in tensors if t.name in names)
    from safetensors import safe_open

    stored = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.rsplit(".", 1)[0] in layers:
                t = f.get_tensor(key)
                stored += t.numel() * t.element_size()
    return (path / "model.safetensors").stat().st_size, stored


def export_model(model_dir: str, fmt: str, output: str, overwrite: bool = False, dtype: str = "bfloat16",
                 gguf_type: str = "mxfp4") -> dict:
    """Load model_dir (after `import hf_fp4`) and export it; returns sizes for the report."""
    from .evaluation import load_model

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    model, tok = load_model(model_dir)
    if fmt == "fp4":
        path = export_fp4(model, tok, output, overwrite)
    elif fmt == "bf16":
        path = export_bf16(model, tok, output, overwrite, getattr(torch, dtype))
    elif fmt == "gguf":
        from .gguf_export import export_gguf
        path = export_gguf(model, tok, output, gguf_type, overwrite)
    else:
        path = export_compressed_tensors(model, tok, output, overwrite)
    n_params = sum(p.numel() for p in model.parameters())
    layers = fp4_modules(model)
    linear = sum(m.weight.numel() for m in layers.values())
    size, stored = _stored_bytes(Path(path), fmt, layers)
    return {"path": str(path), "format": fmt, "bytes": size, "bf16_bytes": 2 * n_params,
            "ratio_vs_bf16": size / (2 * n_params), "fp4_linear_params": linear,
            "linear_bits_per_param": 8 * stored / max(1, linear)}
