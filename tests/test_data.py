"""Data: document-level held-out split, token shards, deterministic and resumable order."""
import json

import numpy as np
import pytest

from hf_fp4.train import data


def test_validation_split_is_by_document_and_deterministic():
    docs = [(f"doc{i}", f"text {i}") for i in range(500)]
    train, val = data.split_documents(docs, 0.1)
    assert {d for d, _ in train}.isdisjoint({d for d, _ in val})
    assert len(train) + len(val) == 500 and 25 < len(val) < 80
    assert data.split_documents(list(reversed(docs)), 0.1)[1] == sorted(val, key=lambda d: docs.index(d))[::-1]
    assert data.split_documents(docs[:2], 0.01)[1]  # tiny corpora still hold one document out


def test_prepare_data_tokenises_once_into_shards(corpus_files, tmp_path):
    source = {"files": corpus_files}
    prepared = data.prepare_data(source, "builtin", vocab_size=400, val_fraction=0.1)
    meta = json.loads((prepared.root / "meta.json").read_text())
    assert meta["train_tokens"] == prepared.train_tokens > 1000 and meta["val_documents"] >= 1
    train = prepared.shard("train")
    assert train.dtype == np.uint16 and len(train) == prepared.train_tokens
    assert (train == prepared.tokenizer.eos_token_id).sum() == meta["train_documents"]
    # the shard is every training document's ids, as the tokenizer's own call encodes it, each followed by EOS
    # (prepare_data encodes through the backend's offsets-free batch encoder)
    train_docs, _ = data.split_documents(data.iter_documents(source), 0.1)
    tok = prepared.tokenizer
    expected = [i for _, t in train_docs for i in tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert np.array_equal(train, np.asarray(expected, dtype=np.uint16))
    text = prepared.tokenizer.decode(train[:50].tolist())
    assert "the" in text.lower() or "of" in text.lower()
    mtime = (prepared.root / "train.bin").stat().st_mtime_ns
    again = data.prepare_data(source, "builtin", vocab_size=400, val_fraction=0.1)
    assert again.root == prepared.root and (prepared.root / "train.bin").stat().st_mtime_ns == mtime
    expected_val = {f"files/{i}" for i in range(len(corpus_files)) if data.is_validation(f"files/{i}", 0.1)}
    assert set(meta["val_ids"]) == (expected_val or {max(f"files/{i}" for i in range(len(corpus_files)))})


def test_batch_order_is_deterministic_and_resumable():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = data.TokenWindows(tokens, 32, seed=1)
    b = data.TokenWindows(tokens, 32, seed=1)
    full = a.batch(0, 400)  # crosses an epoch boundary (312 windows)
    assert np.array_equal(full[100:].numpy(), b.batch(100, 300).numpy())  # resume at any position
    assert not np.array_equal(full[:10].numpy(), data.TokenWindows(tokens, 32, seed=2).batch(0, 10).numpy())
    epoch0 = {int(w[0]) for w in full[:a.num_windows]}
    assert len(epoch0) == a.num_windows  # each window once per epoch
    assert (full[:, 1:] - full[:, :-1] == 1).all()  # contiguous windows of seq_len + 1


def test_missing_files_and_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        list(data.iter_documents({"files": [str(tmp_path / "nope.txt")]}))
    with pytest.raises(ValueError, match="'files' or 'hub'"):
        list(data.iter_documents({"path": "x"}))
    with pytest.raises(ValueError, match="could not load tokenizer"):
        data.load_tokenizer(str(tmp_path / "no_tokenizer"))
