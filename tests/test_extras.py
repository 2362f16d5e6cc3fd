"""Optional extras stay optional: each feature that needs one is skipped with a note or refused with the
install line, with the package made unimportable (sys.modules[name] = None)."""
import sys
from pathlib import Path

import pytest
import torch

from hf_fp4 import extras
from hf_fp4.train import trainer


def block(monkeypatch, *names):
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_require_names_the_extra_and_optional_prints_one_line(monkeypatch, capsys):
    block(monkeypatch, "matplotlib")
    with pytest.raises(ImportError, match=r"plotting needs matplotlib.*pip install 'hf-fp4\[plot\]'"):
        extras.require("matplotlib", "plot", "plotting")
    assert extras.optional("matplotlib", "plot", "the curve") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hf_fp4: the curve skipped: matplotlib is not installed (pip install 'hf-fp4[plot]')"]
    assert extras.optional("json", None, "x") is sys.modules["json"]


def test_plot_runs_refuses_without_matplotlib(monkeypatch, tmp_path):
    from hf_fp4.train.compare import plot_runs

    block(monkeypatch, "matplotlib")
    with pytest.raises(ImportError, match=r"hf-fp4\[plot\]"):
        plot_runs([], tmp_path / "x.png")


def test_missing_trackers_are_skipped_with_a_note(monkeypatch, capsys):
    block(monkeypatch, "tensorboard", "wandb")
    assert trainer.available_trackers(["tensorboard", "wandb"]) == []
    err = capsys.readouterr().err
    assert "hf-fp4[tensorboard]" in err and "pip install wandb" in err and "metrics.jsonl" in err


def test_lm_eval_and_gguf_are_refused_with_the_extra(monkeypatch, tmp_path):
    from hf_fp4.release.evaluation import load_model, run_lm_eval

    block(monkeypatch, "lm_eval", "gguf")
    with pytest.raises(ImportError, match=r"lm-eval.*hf-fp4\[eval\]|lm_eval.*hf-fp4\[eval\]"):
        run_lm_eval(None, None, ["sciq"])
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ImportError, match=r"GGUF.*hf-fp4\[eval\]"):
        load_model(str(tmp_path), gguf_file="m.gguf")


def test_compressed_tensors_export_is_refused_with_the_extra(monkeypatch, tmp_path):
    from hf_fp4.release.export import export_compressed_tensors

    block(monkeypatch, "compressed_tensors", "compressed_tensors.quantization")
    with pytest.raises(ImportError, match=r"compressed-tensors.*hf-fp4\[eval\]"):
        export_compressed_tensors(torch.nn.Linear(2, 2), None, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_the_source_digest_names_the_code_not_the_folder(tmp_path):
    """Two copies of the same sources digest alike; one changed byte, a renamed module or a new one changes it."""
    for name in ("a", "b"):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "x.py").write_text("x = 1\n")
        (tmp_path / name / "sub" / "y.py").write_text("y = 2\n")
        (tmp_path / name / "notes.txt").write_text(name)  # not a source
    a, b = (str(tmp_path / n) for n in ("a", "b"))
    assert extras.source_digest(a) == extras.source_digest(b) and len(extras.source_digest(a)) == 12
    (tmp_path / "b" / "sub" / "y.py").write_text("y = 3\n")
    assert extras.source_digest(a) != extras.source_digest(b)
    (tmp_path / "b" / "sub" / "y.py").write_text("y = 2\n")
    (tmp_path / "b" / "sub" / "y.py").rename(tmp_path / "b" / "sub" / "z.py")
    assert extras.source_digest(a) != extras.source_digest(b)
    assert extras.source_digest() == extras.source_digest(str(Path(extras.__file__).parent))
