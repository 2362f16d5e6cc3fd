"""The training layers: recipes as data, the operand layer, one autograd function, FP4Linear and the swap.

`recipe` (Recipe -> LinearRecipe -> GemmSpec -> QuantSpec) -> `operands` (a LinearPlan per backend: the
form of each GEMM's operands; the torch.library operand and GEMM ops) -> `autograd` (FP4LinearFunction: the
three GEMMs) -> `linear` (FP4Linear: parameters, seeds, weight views) -> `swap` (nn.Linear -> FP4Linear as
the recipe's rules say).  Beside them: `lora_svd`, `attention` (FP4 attention), `experts` (MoE expert
GEMMs), `sharq`, `packing` (packed FP4 weights of a module), `compile` (regional torch.compile),
`diagnostics`.  The kernels (hf_fp4.kernels) sit below this layer and never import it.
"""
