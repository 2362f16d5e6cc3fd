"""Files: the cache, atomic writes and package downloads -- one helper each, used by every layer above.

* `atomic_write_text` / `atomic_file` / `atomic_dir` write next to the target and rename once, so a crash
  leaves the old file or folder (or none), never a half-written one; `replace_dir` is the rename step alone,
  for writers that fill the temporary folder collectively (the trainer's checkpoints on several ranks).
* `pip_download` / `npm_pack` / `apt_download` fetch a package with its registry's own client, so a user's
  mirror and proxy settings apply; the project never hard-codes a registry URL.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator


def cache_dir() -> Path:
    """$HF_FP4_CACHE, default ~/.cache/hf_fp4: fetched packages, corpora, token shards, eval tasks, models."""
    return Path(os.environ.get("HF_FP4_CACHE", Path.home() / ".cache" / "hf_fp4"))


# ----------------------------------------------------------------------------------------------
# Atomic writes
def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; renamed onto `path` when the block ends without an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def replace_dir(tmp: Path, path: Path) -> None:
    """Put the finished folder `tmp` at `path`, removing what was there (the one step that is not atomic is
    the removal of the old folder; the new one appears in one rename)."""
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(path: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`, moved to `path` when the block ends without an error
    (an existing `path` is refused unless overwrite=True); on an error the temporary folder goes."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass --overwrite to replace it")
    tmp = _temporary(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Package downloads, each with its registry's own client
def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if result.returncode != 0:
        raise RuntimeError(f"could not fetch {what} ({' '.join(cmd[:3])} ...): {result.stderr.strip()[-500:]}")


def pip_download(package: str, version: str, dest: Path, source: bool = False) -> Path:
    """`pip download --no-deps package==version` into dest (the sdist with source=True), unless a file of
    it is there already; returns the downloaded wheel or archive."""
    dest = Path(dest)
    prefixes = tuple(f"{stem}-{version}" for stem in {package.replace("-", "_").lower(), package.lower()})
    suffixes = (".tar.gz", ".zip") if source else (".whl",)

    def found() -> list[Path]:
        return sorted(p for p in dest.glob("*") if p.name.lower().startswith(prefixes) and p.name.endswith(suffixes))

    if not found():
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        cmd += ["--no-binary", ":all:", "--no-build-isolation"] if source else []
        _run(cmd + [f"{package}=={version}", "-d", str(dest)], f"{package}=={version}")
    files = found()
    if not files:
        raise RuntimeError(f"{package}=={version}: pip download left no {'sdist' if source else 'wheel'} in {dest}")
    return files[0]


def npm_pack(package: str, version: str, dest: Path) -> Path:
    """`npm pack package@version` into dest; returns the .tgz."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"fetching {package} needs `npm`: install Node.js")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _run([npm, "pack", "--silent", f"{package}@{version}", "--pack-destination", str(dest)], f"{package}@{version}")
    stem = package.lstrip("@").replace("/", "-")
    found = sorted(p for p in dest.iterdir() if p.name.startswith(f"{stem}-{version}") and p.name.endswith(".tgz"))
    if not found:
        raise RuntimeError(f"{package}: no archive found in {dest} after npm pack")
    return found[0]


def apt_download(package: str, dest: Path) -> Path:
    """The package's .deb in dest, fetched with `apt-get download` when it is not there yet."""
    dest = Path(dest)
    found = sorted(dest.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    apt = shutil.which("apt-get")
    if apt is None:
        raise RuntimeError(f"no apt-get here and no {package}_*.deb in {dest} (the Debian package {package}): "
                           f"fetch it once on a machine with apt-get and carry {dest}")
    dest.mkdir(parents=True, exist_ok=True)
    _run([apt, "download", package], package, cwd=dest)
    found = sorted(dest.glob(f"{package}_*.deb"))
    if not found:
        raise RuntimeError(f"apt-get download {package} left no .deb in {dest}")
    return found[-1]
