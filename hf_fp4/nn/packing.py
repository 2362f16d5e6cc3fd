"""Loading packed FP4 exports: buffers for the stored codes and scales, unpacked after loading."""
from __future__ import annotations

import torch
from torch import nn

from ..numerics.formats import ELEMENT_BITS
from ..numerics.quantize import QuantizedTensor
from ..numerics.scales import ScaleRule

PACKED_KEYS = ("weight_packed", "weight_scale", "weight_tensor_scale")


def packed_shapes(module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the stored tensors of one FP4Linear's fprop weight operand."""
    gemm_spec = module.recipe.fprop
    spec = gemm_spec.rhs
    n, k = module.out_features, module.in_features
    if gemm_spec.hadamard.enabled:
        k += -k % gemm_spec.hadamard.size
    br, bc = spec.block
    mp, kp = n + (-n % br), k + (-k % bc)
    per_byte = 2 if ELEMENT_BITS[spec.grid] == 4 else 1
    shapes = {"weight_packed": ((mp, kp // per_byte), torch.uint8),
              "weight_scale": ((mp // br, kp // bc), torch.float32 if spec.scale is ScaleRule.FP32 else torch.uint8)}
    if spec.scale is ScaleRule.UE4M3_FP32:
        shapes["weight_tensor_scale"] = ((1,), torch.float32)
    return shapes


def expect_packed_weight(module) -> None:
    """Before loading: replace `weight` by buffers the checkpoint's packed tensors load into."""
    if module.recipe.fprop.rhs is None:
        return
    device = module.weight.device
    del module._parameters["weight"]
    for key, (shape, dtype) in packed_shapes(module).items():
        module.register_buffer(key, torch.empty(shape, dtype=dtype, device=device))


def stored_scales(scales: torch.Tensor, spec) -> torch.Tensor:
    """Block scales as loaded (bytes, or FP32) viewed in the spec's scale dtype."""
    if spec.scale in (ScaleRule.E8M0_FLOOR, ScaleRule.E8M0_CEIL):
        return scales.view(torch.float8_e8m0fnu)
    if spec.scale is ScaleRule.UE4M3_FP32:
        return scales.view(torch.float8_e4m3fn)
    return scales


def unpack_weight(module) -> None:
    """After loading: the stored operand becomes a frozen weight; the buffers go away."""
    if "weight_packed" not in module._buffers:
        return
    spec = module.recipe.fprop.rhs
    scales = stored_scales(module.weight_scale, spec)
    tensor_scale = module.weight_tensor_scale.reshape(()) if "weight_tensor_scale" in module._buffers else None
    n = module.out_features
    k = module.weight_packed.shape[1] * (2 if ELEMENT_BITS[spec.grid] == 4 else 1)
    q = QuantizedTensor(module.weight_packed, scales, tensor_scale, torch.Size((n, k)), spec)
    for key in PACKED_KEYS:
        module._buffers.pop(key, None)
    _freeze(module, q)


def freeze_weight(module) -> None:
    """In memory, what a packed export's reload gives: `weight` becomes the fprop operand Q(W R) (stored once,
    not re-quantized by every forward), frozen, for inference.  A layer whose fprop weight is unquantized is
    left as it is."""
    if module.frozen_weight:
        return
    q = module.quantized_fprop_weight()
    if q is not None:
        _freeze(module, q)


def _freeze(module, q: QuantizedTensor) -> None:
    parts = q.tensor_core_parts()
    if parts is not None:  # the tensor-core GEMMs of inference (FP4Linear._frozen_product, SharQ's) take the
        # weight in parts: BF16 values and the FP32 tensor decode (buffers: they follow .to())
        module.register_buffer("frozen_w_values", parts[0], persistent=False)
        module.register_buffer("frozen_w_decode", parts[1], persistent=False)
    module.weight = nn.Parameter(q.dequantize(), requires_grad=False)
    module.frozen_weight = True
