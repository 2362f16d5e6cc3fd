"""The large built-in corpus, ``dataset: builtin-large``: enough unique text for a single-epoch study.

Two parts, every file de-duplicated by content (sha1 of the normalised text), sources and licences recorded:

* **Prose** -- the small built-in corpus (books, speeches: hf_fp4.train.data) plus Debian packages of English text
  fetched with the system's own client (`apt-get download`, so mirror settings apply): four dictionaries
  (GCIDE from Webster's 1913, WordNet, FOLDOC, the Jargon File), Perl's and Python's documentation.  Their
  `.deb` archives are cached in ``$HF_FP4_CACHE/archives``; a machine without a registry uses that folder
  carried from one with it.
* **Code** -- the source and documentation files of the Python environment that builds the corpus
  (site-packages) and the system's C/C++ headers (``/usr/include``): a few hundred MB of real code that needs
  no transfer.  It depends on the machine, so `manifest()` records the distributions and versions, the file
  count and a hash of the file list (and the shards' fingerprint includes that hash).

The validation split is held out by document like every other dataset (hf_fp4.train.data.is_validation).
"""
from __future__ import annotations

import gzip
import hashlib
import html.parser
import io
import multiprocessing
import os
import re
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from ..files import apt_download

CODE_SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt", ".h", ".hpp", ".hh", ".cuh")
MAX_FILE_BYTES = 1 << 20   # larger files are generated tables or data, not written text
DICT_CHUNK_CHARS = 200_000  # the dictionary is one 40 MB file: documents of whole entries


@dataclass(frozen=True)
class DebSource:
    package: str
    members: str    # regex over paths inside the package
    licence: str
    reader: str     # "text" | "html" | "dict"


DEB_SOURCES = (
    DebSource("dict-gcide", r"usr/share/dictd/gcide\.dict\.dz$",
              "GPL-2+ (GCIDE: GNU Collaborative International Dictionary of English, from Webster's 1913)", "dict"),
    DebSource("dict-wn", r"usr/share/dictd/wn\.dict\.dz$", "WordNet 3.0 licence (Princeton University)", "dict"),
    DebSource("dict-foldoc", r"usr/share/dictd/foldoc\.dict\.dz$",
              "GFDL-1.1+ (Free On-line Dictionary of Computing)", "dict"),
    DebSource("dict-jargon", r"usr/share/dictd/jargon\.dict\.dz$", "Public domain (the Jargon File)", "dict"),
    DebSource("perl-doc", r"usr/share/perl/[^/]+/pod/[^/]+\.pod$", "GPL-1+ or Artistic (Perl documentation)",
              "text"),
    DebSource("python3.11-doc", r"usr/share/doc/python3\.11/html/.+\.html$", "PSF-2.0 (Python documentation)",
              "html"),
)


def fetch_debs(archives: Path) -> list[Path]:
    """Every prose package's .deb (what a machine without a registry needs carried, with the small corpus)."""
    return [apt_download(source.package, archives) for source in DEB_SOURCES]


def deb_data(path: Path) -> tarfile.TarFile:
    """The data tarball of a .deb (an `ar` archive: debian-binary, control.tar.*, data.tar.*)."""
    raw = path.read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise ValueError(f"{path}: not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(raw):
        name, size = raw[pos:pos + 16].decode().strip().rstrip("/"), int(raw[pos + 48:pos + 58])
        pos += 60
        if name.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(raw[pos:pos + size]))
        pos += size + (size & 1)
    raise ValueError(f"{path}: no data.tar member")


class _HtmlText(html.parser.HTMLParser):
    """The text of a Sphinx page's main body (navigation, scripts and styles dropped)."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self.skip += 1
        elif tag in ("p", "div", "li", "pre", "h1", "h2", "h3", "h4", "tr", "br", "dt", "dd"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self.skip -= 1

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_text(page: str) -> str:
    start = page.find('role="main"')
    end = page.find('class="sphinxsidebar"', start)
    body = page[start if start >= 0 else 0:end if end > start else len(page)]
    parser = _HtmlText()
    parser.feed(body[body.find(">") + 1:] if start >= 0 else body)
    text = re.sub(r"[ \t]+\n", "\n", "".join(parser.parts))
    return re.sub(r"\n{3,}", "\n\n", text).replace("\u00b6", "").strip()


_HEADWORD = re.compile(r"\n(?=\S)")  # a dictd entry starts with its headword at the start of a line


def dictionary_documents(text: str, doc_id: str) -> Iterator[tuple[str, str]]:
    """Split a dictd text into documents of about DICT_CHUNK_CHARS, each a run of whole entries."""
    start, n = 0, 0
    while start < len(text):
        found = _HEADWORD.search(text, start + DICT_CHUNK_CHARS)
        end = found.start() if found else len(text)
        yield f"{doc_id}#{n}", text[start:end].strip()
        start, n = end + 1, n + 1


def deb_documents(source: DebSource, archives: Path) -> Iterator[tuple[str, str]]:
    pattern = re.compile(source.members)
    with deb_data(apt_download(source.package, archives)) as tar:
        members = [m for m in sorted(tar.getmembers(), key=lambda m: m.name)
                   if m.isfile() and pattern.search(m.name)]
        ids = [f"{source.package}/{m.name.lstrip('./')}" for m in members]
        raws = (tar.extractfile(m).read() for m in members)
        if source.reader == "dict":
            for doc_id, raw in zip(ids, raws):
                yield from dictionary_documents(gzip.decompress(raw).decode("utf-8", errors="replace"), doc_id)
        elif source.reader == "html":  # Python's HTML parser, the slowest reader: the pages on every core
            yield from zip(ids, ordered_map(_page_text, raws))
        else:
            yield from zip(ids, (raw.decode("utf-8", errors="replace") for raw in raws))


def _page_text(raw: bytes) -> str:
    return html_text(raw.decode("utf-8", errors="replace"))


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ordered_map(fn, items: Iterator, chunksize: int = 8) -> Iterator:
    """fn over items in order, on every core of this machine where processes can fork (the corpus is the same
    document for document: only the order of the work changes), else here.  fn must be a module-level function.
    Python's documentation pages through html.parser: 7.3 -> 3.7 s on 2 cores."""
    workers = usable_cores()
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(fn, items)
        return
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        yield from pool.imap(fn, items, chunksize)


# ----------------------------------------------------------------------------------------------
# Code of this machine
def code_roots() -> list[tuple[str, Path]]:
    """(label, directory): the environment's site-packages and the system headers, where they exist."""
    roots = {("site-packages", Path(sysconfig.get_paths()[key])) for key in ("purelib", "platlib")}
    roots.add(("include", Path("/usr/include")))
    return sorted((label, path) for label, path in roots if path.is_dir())


@lru_cache(maxsize=None)
def code_files() -> tuple[tuple[str, Path], ...]:
    """(doc_id, path) of every code/documentation file under code_roots(), sorted (the file list is hashed)."""
    files = []
    for label, root in code_roots():
        # os.walk, not Path.rglob: the same walk (symlinked folders not entered), 2.6 -> 1.4 s over this machine's
        # site-packages and headers (36k files kept)
        for folder, _, names in os.walk(root):
            for name in names:
                path = Path(folder, name)
                if path.suffix in CODE_SUFFIXES and not path.is_symlink() and path.is_file():
                    size = path.stat().st_size
                    if 0 < size <= MAX_FILE_BYTES:
                        files.append((f"{label}/{path.relative_to(root)}", path))
    return tuple(sorted(files))


def code_documents() -> Iterator[tuple[str, str]]:
    for doc_id, path in code_files():
        yield doc_id, path.read_text(encoding="utf-8", errors="replace")


def distributions() -> list[dict[str, str]]:
    from importlib import metadata

    seen = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name") or "?"
        seen[name.lower()] = {"name": name, "version": dist.version,
                              "licence": dist.metadata.get("License-Expression") or
                              (dist.metadata.get("License") or "").split("\n")[0][:100]}
    return sorted(seen.values(), key=lambda d: d["name"].lower())


def code_fingerprint() -> str:
    """A hash of the code part's file list (ids and sizes): changes when the machine's environment does."""
    h = hashlib.sha1()
    for doc_id, path in code_files():
        h.update(f"{doc_id}\0{path.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
def iter_large_corpus(archives: Path, small_corpus: Iterator[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """(doc_id, text) of the whole corpus, prose first, each distinct text once."""
    seen: set[bytes] = set()

    def unique(docs):
        for doc_id, text in docs:
            text = text.replace("\r\n", "\n").strip()
            digest = hashlib.sha1(text.encode("utf-8", errors="replace")).digest()
            if text and digest not in seen:
                seen.add(digest)
                yield doc_id, text

    yield from unique(small_corpus)
    for source in DEB_SOURCES:
        yield from unique(deb_documents(source, archives))
    yield from unique(code_documents())


def manifest(archives: Path) -> dict:
    """What the corpus was built from: the prose packages (versions from the archive names) and licences, the
    machine's Python distributions, the code file count and the file-list hash."""
    debs = [{"package": s.package, "archive": apt_download(s.package, archives).name, "licence": s.licence,
             "client": "apt-get download"} for s in DEB_SOURCES]
    return {"prose": debs, "code": {"roots": [f"{label}: {path}" for label, path in code_roots()],
                                    "files": len(code_files()), "file_list_sha1": code_fingerprint(),
                                    "python": sys.version.split()[0], "distributions": distributions(),
                                    "licences": "each distribution's own (listed); system headers: their "
                                                "Debian packages' (/usr/share/doc/*/copyright)"}}
