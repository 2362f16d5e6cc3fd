"""Triton kernels of hf_fp4, shipped as ``hf_fp4.kernels`` (pyproject.toml maps this folder).

Never a top-level module named ``kernels``: that is Hugging Face's kernel-hub package, which transformers
(>= 5.25) installs and imports.  The card's top-level ``kernels/`` folder holds no ``__init__.py``, so a source
checkout on sys.path (``python -m hf_fp4`` from the repository root) makes it at most a namespace-package
candidate, and the import system takes the installed kernel hub -- a regular package -- before it.
"""
