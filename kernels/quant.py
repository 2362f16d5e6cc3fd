"""Triton quantization and GEMM kernels (hf_fp4.kernels)."""
