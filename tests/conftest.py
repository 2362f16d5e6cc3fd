import os
import random
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker, and every process a test starts, computes on one thread: two workers on two
# cores with torch's default of one thread per core each (and a third process a test launches) oversubscribed the
# cores, and OpenMP's spinning threads ran the SIGKILL-resume test at 320 s in the suite against 58 s alone.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Small, local, real-looking English: a fixed word list arranged by a seeded generator.
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
         "have an they you were her she there been one all we their has would when if so no what more up "
         "out them some time could into only other then its these two may first any new like our over such "
         "after most also made many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see men work "
         "long here get both between life being under never day same another know while last might us great "
         "old year off come since against go came right used take three").split()


def pytest_collection_modifyitems(config, items):
    """The tests marked slow first (in their collection order): under -n 2 each then runs beside the many short
    ones instead of ending the suite alone (session 23: the SIGKILL-resume test ran 232 s, the suite 15.2 min)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def need(module: str, extra: str):
    """Import a package the test environment must have (an extra scripts/setup.sh installs): missing, the
    test fails and says how to install it -- it never turns into a skip."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        pytest.fail(f"{module} is not installed ({err}); scripts/setup.sh installs it (pip install -e '.[{extra}]')")


def write_corpus(root: Path, n_docs: int = 24, words_per_doc: int = 600, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n_docs):
        sentences = []
        for _ in range(words_per_doc // 12):
            words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
            sentences.append(" ".join(words).capitalize() + ".")
        path = root / f"doc_{i:03d}.txt"
        path.write_text(" ".join(sentences) + "\n")
        files.append(str(path))
    return files


@pytest.fixture
def corpus_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_FP4_CACHE", str(tmp_path / "cache"))
    return write_corpus(tmp_path / "corpus")
