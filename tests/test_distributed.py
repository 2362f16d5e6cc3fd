"""Several processes on CPU (gloo): DDP through accelerate gives the single-process losses."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def run(cfg, path, env, nproc):
    path.write_text(yaml.safe_dump(cfg))
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(path)]
    else:
        # --standalone: a free port from the OS (tests run side by side under pytest -n)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
               str(ROOT / "scripts" / "pretrain.py"), "--config", str(path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (Path(cfg["output_dir"]) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe", ["bf16", "mxfp4"])
def test_ddp_on_two_cpu_ranks_matches_one_process_with_the_same_global_batch(corpus_files, tmp_path, recipe):
    env = {**os.environ, "TQDM_DISABLE": "1", "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    base = {"model": MODEL, "recipe": recipe, "dataset": {"files": corpus_files}, "vocab_size": 300,
            "val_fraction": 0.1, "seq_len": 32, "max_steps": 6, "eval_every": 3, "eval_batches": 2,
            "checkpoint_every": 100, "trackers": [], "lr": 3e-3, "warmup_steps": 1}
    single = run({**base, "batch_size": 4, "output_dir": str(tmp_path / "one")}, tmp_path / "one.yaml", env, 1)
    ddp = run({**base, "batch_size": 2, "output_dir": str(tmp_path / "two")}, tmp_path / "two.yaml", env, 2)
    assert [r["step"] for r in ddp] == [r["step"] for r in single]
    for a, b in zip(single, ddp):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=1e-5), (a, b)  # reduction order only
    assert (tmp_path / "two" / "final" / "config.json").exists()


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4_dh"])
def test_fsdp2_fully_shard_on_two_cpu_ranks_matches_one_process(tmp_path, recipe):
    """FP4Linear under FSDP2: parameters are DTensor shards, gathered for each forward/backward.

    Recipes with round-to-nearest and block-local scales are bit-compatible with one process; stochastic
    rounding draws at local offsets and per-tensor (NVFP4) scales see the local batch, so those recipes
    are equivalent in distribution, not bit for bit, under a data-parallel split."""
    worker = str(ROOT / "tests" / "fsdp2_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, worker, str(tmp_path / "one.json"), recipe], env=env,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          worker, str(tmp_path / "two.json"), recipe], env=env,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert a["fp4_layers"] == b["fp4_layers"] == 14
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
    assert b["w_abs"] == pytest.approx(a["w_abs"], rel=1e-5)  # the gathered export equals the single-process one


def test_fsdp2_shards_fp4_experts_and_resumes_exactly(tmp_path):
    """A Qwen3-MoE model with FP4 experts (nvfp4, grouped path) under FSDP2 on two CPU ranks: the experts' 3D weights
    are sharded along the experts and gathered per step; a fresh model resumed from the half-way sharded checkpoint
    (torch.distributed.checkpoint: model, optimizer, hf_fp4 RNG counters) repeats the second half bit for bit.
    Against one process the losses agree to ~1% only (lr 1e-2): each rank's expert segments hold its own tokens, so the
    wgrad blocks along tokens (and NVFP4's per-rank tensor scales, SR offsets) differ."""
    worker = str(ROOT / "tests" / "fsdp2_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["nvfp4", "0", "fp32", "4", "0", "qwen3_moe"]
    one = subprocess.run([sys.executable, worker, str(tmp_path / "one.json"), *args], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", worker,
                          str(tmp_path / "two.json"), *args], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert a["fp4_layers"] == b["fp4_layers"] == 8  # attention projections; the experts are not FP4Linear
    assert b["resumed"] == b["losses"][2:]
    assert b["losses"] == pytest.approx(a["losses"], rel=2e-2)  # a sanity bound (see above), not equivalence
    assert b["state_types"] == ["Tensor"]
    assert list(b["local_shapes"].values()) == [[2, 64, 64]]  # each rank holds 2 of the 4 experts' down_proj


@pytest.mark.slow
def test_trainer_under_fsdp2_with_fp4_all_gather_trains_resumes_and_exports(corpus_files, tmp_path):
    """scripts/pretrain.py's trainer under accelerate's FSDP2 on two CPU ranks (tests/accelerate_fsdp2_worker.py: the
    distributed type set to FSDP after accelerate builds its state -- it enables FSDP on GPUs only), nvfp4: with
    fp4_all_gather the losses equal BF16 all-gather's bit for bit; a run resumed from its step-3 sharded checkpoint
    (accelerate save_state / load_state) repeats steps 4-6 bit for bit; the gathered final export holds the same
    weights; with the decoder blocks compiled (aot_eager) the losses still match BF16 all-gather's on the same graph
    cut (every FP4 layer outside the graphs: the worker's pretrain-fp4-eager)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    worker = str(ROOT / "tests" / "accelerate_fsdp2_worker.py")
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    base = {"model": MODEL, "recipe": "nvfp4", "dataset": {"files": corpus_files}, "vocab_size": 300,
            "val_fraction": 0.1, "seq_len": 32, "max_steps": 6, "eval_every": 3, "eval_batches": 2,
            "checkpoint_every": 3, "trackers": [], "lr": 3e-3, "warmup_steps": 1, "batch_size": 2, "compile": False}

    def launch(name, *extra, mode="pretrain", **overrides):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({**base, "output_dir": str(tmp_path / name), **overrides}))
        # --standalone: a free port from the OS (fixed ports above 32767 met gloo's ephemeral ones: EADDRINUSE)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                               worker, mode, "--config", str(cfg), *extra], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert ("resumed from" in done.stdout and "(step 3)" in done.stdout) == ("--resume" in extra), done.stdout
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    plain = launch("plain")
    fp4 = launch("fp4", fp4_all_gather=True)
    assert [r.get("loss") for r in fp4] == [r.get("loss") for r in plain] and len(fp4) >= 6
    shutil.copytree(tmp_path / "fp4", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_6")
    shutil.rmtree(tmp_path / "cut" / "final")
    (tmp_path / "cut.yaml").write_text((tmp_path / "fp4.yaml").read_text().replace(str(tmp_path / "fp4"),
                                                                                   str(tmp_path / "cut")))
    resumed = launch("cut", "--resume", fp4_all_gather=True)
    assert [r.get("loss") for r in resumed] == [r.get("loss") for r in fp4]
    a, b = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("plain", "fp4"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # compiled decoder blocks (the FP4-gathered layers run outside the graph): BF16 all-gather's losses on the same
    # cut (an uncut block sums q/k/v's and gate/up's input gradients in another order: other FP32 roundings)
    compiled = {"compile": True, "compile_backend": "aot_eager"}
    assert [r.get("loss") for r in launch("plain-compiled", mode="pretrain-fp4-eager", **compiled)] == \
        [r.get("loss") for r in launch("fp4-compiled", fp4_all_gather=True, **compiled)]
