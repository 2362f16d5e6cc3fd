"""Optional extras stay optional: one place that imports them and says which extra a feature needs.

    plt = optional("matplotlib.pyplot", "plot", "the loss-curve PNG")   # None (and a one-line note) if absent
    lm_eval = require("lm_eval", "eval", "scripts/evaluate.py")          # ImportError naming the extra if absent

The extras are pyproject.toml's: plot (matplotlib), tensorboard, eval (lm-eval, compressed-tensors, gguf).
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType


def _hint(extra: str | None, module: str) -> str:
    return f"pip install 'hf-fp4[{extra}]'" if extra else f"pip install {module.split('.')[0]}"


def require(module: str, extra: str | None, feature: str) -> ModuleType:
    """Import `module` for a feature the user asked for, or raise ImportError saying which extra enables it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{feature} needs {module.split('.')[0]}, which is not installed: "
                          f"{_hint(extra, module)}") from err


def versions(*modules: str) -> dict[str, str]:
    """Python's version and each named package's that imports (for results files: what produced a number)."""
    import platform

    out = {"python": platform.python_version()}
    for name in modules:
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001  (a missing or broken optional package is simply not listed)
            continue
    return out


def source_digest(root: str | None = None) -> str:
    """A short SHA-256 of the Python sources under `root` (hf_fp4's package folder by default), in path order: which
    code produced a run (the package version stays 0.1.0 across changes that alter numerics, such as a GEMM's
    accumulation order)."""
    import hashlib
    from pathlib import Path

    base = Path(root) if root is not None else Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(base.rglob("*.py")):
        digest.update(path.relative_to(base).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def optional(module: str, extra: str | None, feature: str) -> ModuleType | None:
    """Import `module` for a feature that can be skipped; if it is missing, print one line and return None."""
    try:
        return importlib.import_module(module)
    except ImportError:
        print(f"hf_fp4: {feature} skipped: {module.split('.')[0]} is not installed ({_hint(extra, module)})",
              file=sys.stderr)
        return None
