"""Triton kernels of hf_fp4, shipped as ``hf_fp4.kernels`` (see pyproject.toml's package-dir).

This folder must never be imported as a top-level module named ``kernels``: that name belongs to
Hugging Face's kernel-hub package, which transformers imports when it finds it.
"""
if __name__ == "kernels":  # pragma: no cover - guards a source checkout on sys.path
    raise ImportError("this folder is hf_fp4.kernels; install hf-fp4 and import hf_fp4.kernels")
