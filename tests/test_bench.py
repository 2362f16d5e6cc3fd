"""scripts/bench.py runs end to end at --quick sizes on the CPU (a crash there would cost GPU time): every part
asked for writes a row per implementation into the results JSON, with the command.  No timing is checked."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_quick_parts_write_every_row(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--parts",
           "linear,attention,attention50m,moe,sharq,optim",
           "--impls", "bf16,hf_fp4:nvfp4,hf_fp4:mxfp4+bf16gemm,emulation_compiled", "--out", str(tmp_path)]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True, timeout=600)
    results = json.loads(next(tmp_path.glob("results-*.json")).read_text())
    assert results["command"].startswith("python ") and "--quick" in results["command"]
    linear = {"bf16", "hf_fp4:nvfp4", "hf_fp4:mxfp4+bf16gemm", "emulation_compiled"}
    assert {r["impl"] for r in results["linear"]} == linear
    attention = {"sdpa", "sdpa:flash", "hf_fp4:nvfp4:reference"} | (
        {"hf_fp4:nvfp4:triton"} if torch.cuda.is_available() else set())
    # (no Triton on a CPU without its interpreter); each impl at the shape and at bench-50m's heads
    shapes = {r["shape"] for r in results["attention"]}
    assert shapes == {"B1 H4/2 T64 D32", "B1 H10/5 T64 D64"}
    for shape in shapes:
        assert {r["impl"] for r in results["attention"] if r["shape"] == shape} == attention
    # the default dispatch's backend is recorded (PyTorch may prefer cuDNN's kernels to the flash backend)
    assert {r.get("backend") for r in results["attention"] if r["impl"] == "sdpa"} <= {
        "flash_attention", "cudnn_attention", "efficient_attention", "math", "overrideable"}
    # the listed presets and GEMM forms, the first preset's loop beside them
    moe = {"bf16:grouped_mm", "bf16:eager", "emulation_compiled", "hf_fp4:nvfp4", "hf_fp4:mxfp4+bf16gemm",
           "hf_fp4:nvfp4:loop"}
    assert {r["impl"] for r in results["moe"]} == moe
    assert {r["impl"] for r in results["sharq"]} == {"bf16", "hf_fp4:nvfp4", "hf_fp4:nvfp4+sharq"}
    assert all(r["ms"] > 0 for part in ("linear", "attention", "moe", "sharq") for r in results[part])
    assert all(r["ms_stream"] > 0 for r in results["linear"])  # the back-to-back timing beside it
    optim = {r["impl"]: r for r in results["optim"]}
    assert set(optim) == {"adamw", "fp4_adamw", "fp4_adamw:reference", "muon", "muon+nvfp4_ns", "muon+nvfp4_ns:eager"}
    assert all(r["step_ms"] > 0 and r["optimizer_step_ms"] > 0 for r in optim.values())
    assert optim["fp4_adamw"]["state_bytes_per_param"] < optim["adamw"]["state_bytes_per_param"]
    assert next(tmp_path.glob("results-*.md")).read_text().count("|---") >= 5


def test_bench_rejects_unknown_parts_and_impls_before_running(tmp_path, monkeypatch, capsys):
    """A misspelt impl or part ends the run with the valid names before any device time is spent (session 14's
    linear table silently lost torchao to an e2e-only name); a name valid for another part is noted, not dropped
    without a word."""
    import importlib.util

    # the refusals in this process (an interpreter start each cost ~5 s of the suite's 2 cores): main() as run
    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for args, message in ((["--parts", "lin"], "unknown part(s) lin; valid: quant, linear"),
                          (["--parts", "linear", "--impls", "bf16,hf_fp4:nvfp5"],
                           "unknown impl(s) hf_fp4:nvfp5; valid:")):
        monkeypatch.setattr(sys, "argv", ["bench.py", "--quick", "--out", str(tmp_path), *args])
        with pytest.raises(SystemExit) as exit_:
            bench.main()
        assert exit_.value.code == 2 and message in capsys.readouterr().err
        assert not list(tmp_path.glob("results-*"))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--out", str(tmp_path),
                          "--parts", "linear", "--impls", "bf16,torchao_fp8_rowwise:compiled"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "not a linear impl, skipped there: torchao_fp8_rowwise:compiled" in run.stderr


def test_fsdp_bench_quick_on_two_cpu_ranks_writes_every_row(tmp_path):
    """scripts/bench_fsdp.py (issues 17 / 18) under torchrun with two gloo ranks: a row per impl with the counted
    all-gather bytes (FP4 all-gather below BF16's), the md table; an unknown impl is refused before running."""
    script = str(ROOT / "scripts" / "bench_fsdp.py")
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    impls = "bf16,hf_fp4:nvfp4,hf_fp4:nvfp4+fp4ag"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", script, "--quick", "--steps", "2", "--impls", impls,
                    "--out", str(tmp_path)], check=True, cwd=tmp_path, env=env, capture_output=True, timeout=600)
    results = json.loads(next(tmp_path.glob("multi-gpu-*.json")).read_text())
    runs = {r["impl"]: r for r in results["runs"]}
    assert set(runs) == set(impls.split(",")) and all(r["gpus"] == 2 for r in runs.values())
    assert runs["hf_fp4:nvfp4+fp4ag"]["all_gather_bytes_per_step"] < runs["hf_fp4:nvfp4"]["all_gather_bytes_per_step"]
    assert runs["hf_fp4:nvfp4"]["all_gather_bytes_per_step"] == runs["bf16"]["all_gather_bytes_per_step"]
    assert "torchrun --nproc_per_node 2" in results["commands"][0]
    table = next(tmp_path.glob("multi-gpu-*.md")).read_text().splitlines()
    assert sum(line.startswith("|---") for line in table) == 1 and sum(line.startswith("| hf_fp4") for line in table) == 2
    bad = subprocess.run([sys.executable, script, "--impls", "hf_fp4:nvfp5"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "unknown impl(s) hf_fp4:nvfp5; valid: bf16" in bad.stderr


def test_merged_results_render_each_timing_and_skip_missing_ones(tmp_path):
    """--merge: the linear rows of several runs in one table per timing -- the captured one too, where an impl has it
    (None for the reduce-overhead impls: a '-', not a crash)."""
    def run(name, impls):
        rows = [{"shape": "64x64", "tokens": 32, "impl": i, "ms": ms, "ms_stream": ms / 2, "ms_captured": cap,
                 "inputs": "normal"} for i, ms, cap in impls]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"device": "d", "versions": {}, "command": f"python {name}", "date": "2026-01-01",
                                    "linear": rows, "e2e": [], "quant": []}))
        return str(path)

    paths = [run("a", [("bf16", 2.0, 1.0), ("hf_fp4:mxfp4:graphs", 1.0, None)]), run("b", [("hf_fp4:mxfp4", 4.0, 0.5)])]
    moe = {"device": "d", "versions": {}, "command": "python c", "date": "2026-01-01", "linear": [], "e2e": [],
           "quant": [], "moe": [{"shape": "E4", "impl": "bf16:grouped_mm", "ms": 3.0, "ms_captured": 2.0},
                                {"shape": "E4", "impl": "hf_fp4:nvfp4", "ms": 6.0, "ms_captured": 4.0}]}
    (tmp_path / "c.json").write_text(json.dumps(moe))
    paths.append(str(tmp_path / "c.json"))  # a part beyond linear / e2e / quant is kept and rendered too
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--merge", *paths, "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    text = next(out.glob("results-*.md")).read_text()
    captured = text.split("captured in a CUDA graph")[1].split("###")[0]
    assert "| 64x64 | 1.00 (1.00x) | - | 0.50 (2.00x) |" in captured
    assert "| 64x64 | 2.00 (1.00x) | 1.00 (2.00x) | 4.00 (0.50x) |" in text  # the waited timing
    assert "- command: `python a`" in text and "- command: `python b`" in text
    assert "| hf_fp4:nvfp4 | 6.00 | 0.50x | 4.00 | 0.50x |" in text
    merged = json.loads(next(out.glob("results-*.json")).read_text())
    assert [r["impl"] for r in merged["moe"]] == ["bf16:grouped_mm", "hf_fp4:nvfp4"]


def test_the_moe_emulation_peer_computes_each_experts_three_gemms():
    """bench.py's EmulatedGroupedNVFP4 (the MoE part's compiled-emulation peer): each segment's output, input
    gradient and its expert's weight gradient equal the products of the fake-quantized tensors (each quantized
    whole: the stacked weights one tensor; blocks along K for fprop, N for dgrad, the tokens for wgrad) sliced per
    expert, segments of any length (an empty one too)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench import EmulatedGroupedNVFP4, fake_nvfp4

    g = torch.Generator().manual_seed(0)
    e, n, k, counts = 3, 32, 48, [5, 0, 11]
    rows = sum(counts)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(e, n, k, generator=g).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    dy = torch.randn(rows, n, generator=g).to(torch.bfloat16)
    y = EmulatedGroupedNVFP4.apply(x, w, offs)
    y.backward(dy)
    xq, dyq = fake_nvfp4(x.detach()).float(), fake_nvfp4(dy).float()
    xtq, dytq = fake_nvfp4(x.detach().t().contiguous()).float(), fake_nvfp4(dy.t().contiguous()).float()
    start = 0
    for i, c in enumerate(counts):
        seg = slice(start, start + c)
        wq = fake_nvfp4(w.detach().reshape(e * n, k)).view(e, n, k)[i].float()  # all experts as one tensor
        wtq = fake_nvfp4(w.detach().transpose(1, 2).reshape(e * k, n)).view(e, k, n)[i].float()
        torch.testing.assert_close(y[seg].float(), (xq[seg] @ wq.t()).bfloat16().float(), rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(x.grad[seg].float(), (dyq[seg] @ wtq.t()).bfloat16().float(), rtol=2 ** -7,
                                   atol=1e-3)
        torch.testing.assert_close(w.grad[i].float(), (dytq[:, seg] @ xtq[:, seg].t()).bfloat16().float(),
                                   rtol=2 ** -7, atol=1e-3)
        start += c


def test_the_moe_part_saves_each_row_before_the_next_impl_runs(monkeypatch):
    """A device-side assert ends bench.py's process without an exception it could catch: the MoE part hands its
    results to save() after every impl, so the rows measured before a crash are on disk (session 23 lost a whole
    part).  Here the second impl's step ends the process (SystemExit, which `except Exception` lets through)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    def steps(dev, quick, names):
        yield "bf16:grouped_mm", lambda: None, "E4"
        yield "hf_fp4:nvfp4", lambda: sys.exit(134), "E4"

    monkeypatch.setattr(bench, "moe_steps", steps)
    monkeypatch.setattr(bench, "timed", lambda step, inputs, **kw: (step(), 2.0)[1])
    monkeypatch.setattr(bench, "captured_ms", lambda step, args: 1.0)
    saved = []
    results = {}
    with pytest.raises(SystemExit):
        bench.bench_moe("cpu", True, results, ["hf_fp4:nvfp4"], lambda: saved.append(json.dumps(results)))
    assert [[r["impl"] for r in json.loads(s)["moe"]] for s in saved] == [["bf16:grouped_mm"]]


def test_the_attention_part_names_the_backend_sdpa_dispatched_to(monkeypatch):
    """bench.py's sdpa_backend (the default SDPA row's recorded backend): SDPA restricted to the backend it names
    runs and gives the default dispatch's output bit for bit (a wrong name would fail, or compute otherwise: e.g.
    math in place of flash), and sdpa_flash is SDPA's flash backend alone (it equals the restricted call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench import sdpa_backend, sdpa_flash

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 64, 32, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 64, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    options = dict(is_causal=True, enable_gqa=True)
    name = sdpa_backend(q, k, v, **options)
    assert name in {n.lower() for n in SDPBackend.__members__} - {"error"}
    default = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
    with sdpa_kernel(SDPBackend.__members__[name.upper()]):
        assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, v, **options), default)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
    # on the CPU the default dispatch is flash too, so the outputs alone cannot tell: the call must also run with
    # every other backend switched off
    sdpa, enabled = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        backends = ("flash", "math", "mem_efficient", "cudnn")
        enabled.append({b: getattr(torch.backends.cuda, f"{b}_sdp_enabled")() for b in backends})
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    assert torch.equal(sdpa_flash(q, k, v, **options), flash)
    assert enabled == [{"flash": True, "math": False, "mem_efficient": False, "cudnn": False}]
