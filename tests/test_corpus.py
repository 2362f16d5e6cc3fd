"""The large built-in corpus (hf_fp4.train.corpus): Debian archives read without dpkg, prose and code documents,
de-duplication, the machine-dependent part fingerprinted, and the errors a machine without apt-get gets."""
import gzip
import io
import tarfile

import pytest

from hf_fp4.train import corpus
from hf_fp4.train import data
from hf_fp4.train.config import TrainConfig


def make_deb(path, files: dict[str, bytes]):
    """A .deb as dpkg writes it: an ar archive of debian-binary, control.tar.xz and data.tar.xz."""
    def tar_xz(members):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tar:
            for name, raw in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
        return buf.getvalue()

    out = b"!<arch>\n"
    for name, raw in (("debian-binary", b"2.0\n"), ("control.tar.xz", tar_xz({"./control": b"Package: x\n"})),
                      ("data.tar.xz", tar_xz(files))):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(raw):<10}`\n".encode() + raw
        out += b"\n" if len(raw) % 2 else b""
    path.write_bytes(out)


PAGE = ('<html><head><script>var x = 1;</script></head><body><div class="nav">Navigation</div>'
        '<div class="body" role="main"><h1>Tutorial\u00b6</h1><p>Python is <em>easy</em> to learn.</p>'
        '<pre>print("hi")</pre></div><div class="sphinxsidebar">Search</div></body></html>')
DICT = "".join(f"Word{i} \\Word{i}\\, n.\n   Meaning number {i}.\n   [1913 Webster]\n\n" for i in range(2000))


@pytest.fixture
def debs(tmp_path, monkeypatch):
    archives = tmp_path / "archives"
    archives.mkdir()
    make_deb(archives / "dict-gcide_1.0_all.deb", {"./usr/share/dictd/gcide.dict.dz": gzip.compress(DICT.encode())})
    make_deb(archives / "perl-doc_5.36_all.deb", {"./usr/share/perl/5.36.0/pod/perlintro.pod": b"=head1 NAME\n\nperlintro",
                                                   "./usr/share/perl/5.36.0/other.txt": b"not matched"})
    make_deb(archives / "python3.11-doc_3.11_all.deb", {"./usr/share/doc/python3.11/html/tutorial.html": PAGE.encode()})
    code = tmp_path / "site"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "a.py").write_text("def f():\n    return 1\n")
    (code / "pkg" / "copy_of_a.py").write_text("def f():\n    return 1\n")  # same text: kept once
    (code / "pkg" / "README.md").write_text("# pkg\nWhat it does.\n")
    (code / "pkg" / "data.bin").write_bytes(b"\0" * 10)  # not a code or text suffix
    (code / "pkg" / "huge.py").write_text("x = 1\n" * (corpus.MAX_FILE_BYTES // 6 + 1))  # generated, skipped
    monkeypatch.setattr(corpus, "code_roots", lambda: [("site-packages", code)])
    corpus.code_files.cache_clear()
    yield archives, code
    corpus.code_files.cache_clear()


def test_the_large_corpus_reads_prose_packages_and_this_machines_code_once_each(debs, monkeypatch):
    archives, _ = debs
    monkeypatch.setattr(corpus, "DICT_CHUNK_CHARS", 10_000)
    small = [("small/book", "Call me Ishmael."), ("small/again", "Call me Ishmael.")]
    docs = dict(corpus.iter_large_corpus(archives, iter(small)))
    gcide = [k for k in docs if k.startswith("dict-gcide/")]
    assert "small/book" in docs and "small/again" not in docs  # duplicates by content go, the first id stays
    assert len(DICT) // 10_000 <= len(gcide) <= len(DICT) // 10_000 + 1, len(gcide)  # documents of ~10 kB
    chunks = [docs[k] for k in sorted(gcide, key=lambda k: int(k.split("#")[1]))]
    assert "\n\n".join(chunks) == DICT.strip()  # nothing lost at the chunk borders
    assert all(c.startswith("Word") and c.endswith("[1913 Webster]") for c in chunks)  # whole entries
    assert docs["perl-doc/usr/share/perl/5.36.0/pod/perlintro.pod"].startswith("=head1 NAME")
    assert not any(k.endswith("other.txt") for k in docs)
    page = docs["python3.11-doc/usr/share/doc/python3.11/html/tutorial.html"]
    assert "Python is easy to learn." in page and 'print("hi")' in page
    assert "Navigation" not in page and "Search" not in page and "var x" not in page and "\u00b6" not in page
    code = sorted(k for k in docs if k.startswith("site-packages/"))
    assert code == ["site-packages/pkg/README.md", "site-packages/pkg/a.py"]


def test_the_code_part_is_fingerprinted_by_its_file_list(debs):
    _, code = debs
    before = corpus.code_fingerprint()
    (code / "pkg" / "b.py").write_text("y = 2\n")
    corpus.code_files.cache_clear()
    assert corpus.code_fingerprint() != before


def test_without_apt_get_or_a_carried_archive_the_error_says_what_to_carry(tmp_path, monkeypatch):
    from hf_fp4 import files

    monkeypatch.setattr(files.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"no apt-get here and no perl-doc_\*\.deb in .*carry"):
        files.apt_download("perl-doc", tmp_path)


def test_a_corrupt_archive_is_refused(tmp_path):
    (tmp_path / "x_1_all.deb").write_bytes(b"PK\3\4 not a deb")
    with pytest.raises(ValueError, match="not a Debian package"):
        corpus.deb_data(tmp_path / "x_1_all.deb")


def test_the_tokenizer_of_a_large_corpus_trains_on_a_deterministic_sample():
    docs = [(f"doc{i}", "x" * 1000) for i in range(1000)]
    sample = data.tokenizer_sample(docs, chars=100_000)
    assert 60 <= len(sample) <= 140 and sample == data.tokenizer_sample(docs, chars=100_000)
    assert len(data.tokenizer_sample(docs, chars=10 ** 9)) == 1000


def test_an_unknown_builtin_dataset_lists_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="dataset='builtin-huge': valid values are builtin, builtin-large"):
        TrainConfig.from_dict({"dataset": "builtin-huge", "output_dir": str(tmp_path)})


def test_the_html_pages_come_out_in_their_order_from_every_core():
    """ordered_map (the documentation pages parsed on every core): the texts of map(), in order -- the pages are
    largest first, so that a worker's later, smaller chunk finishes before an earlier one."""
    pages = [PAGE.replace("easy", f"easy {i} " + "word " * (4000 - 100 * i)).encode() for i in range(40)]
    got = list(corpus.ordered_map(corpus._page_text, iter(pages), chunksize=2))
    assert got == [corpus._page_text(p) for p in pages]
    assert [int(t.split("easy ")[1].split()[0]) for t in got] == list(range(40))


def test_the_code_part_takes_regular_files_and_enters_no_linked_folder(debs):
    _, code = debs
    (code / "pkg" / "link.py").symlink_to(code / "pkg" / "a.py")
    (code / "linked").symlink_to(code / "pkg", target_is_directory=True)
    (code / "pkg" / "sub").mkdir()
    (code / "pkg" / "sub" / ".hidden.py").write_text("z = 3\n")
    corpus.code_files.cache_clear()
    assert [doc_id for doc_id, _ in corpus.code_files()] == [
        "site-packages/pkg/README.md", "site-packages/pkg/a.py", "site-packages/pkg/copy_of_a.py",
        "site-packages/pkg/sub/.hidden.py"]
