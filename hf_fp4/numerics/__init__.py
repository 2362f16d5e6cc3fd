"""The reference: the spec of every bit (RESEARCH.md's formats, scale rules, rounding, Hadamard transforms).

Pure PyTorch, importing nothing above it: `formats` (grids and codes), `scales` (block and tensor scale
rules), `spec` (QuantSpec), `quantize` (the reference quantizer), `hadamard`, `philox` (the kernels' SR
generator), and the data types the kernels share with it: `qtensor` (QuantizedTensor) and `operand_plan`
(OperandPlan, Operand).  Every Triton kernel in hf_fp4.kernels is tested against these bit for bit.
"""
