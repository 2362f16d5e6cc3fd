"""Triton kernels of hf_fp4, shipped as ``hf_fp4.kernels`` (pyproject.toml maps this folder).

Never a top-level module named ``kernels``: that is Hugging Face's kernel-hub package, which
transformers probes for and imports.  A source checkout on sys.path (``python -c ...`` from the
repository root) makes this folder importable as ``kernels``; then it presents itself as an empty
namespace package (no ``__version__``, no ``__file__``), which transformers treats as "not installed".
"""
if __name__ == "kernels":  # pragma: no cover - only from a source checkout on sys.path
    __file__ = None
