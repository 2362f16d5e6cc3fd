#!/usr/bin/env python
"""Plant plausible bugs one at a time and see whether the test suite notices (a small mutation run).

    python scripts/mutation_check.py [--only N,M] [--out FILE]

Each mutant replaces one exact snippet (which must occur once) in the numerics, the autograd function or
the trainer's step logic, runs the tests that cover that part (stopping at the first failure), restores the
file, and reports KILLED or SURVIVED.  Survivors need a test, or an argument that they are equivalent.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMERICS_TESTS = ["tests/test_formats.py", "tests/test_quantize.py", "tests/test_scale_boundaries.py",
                  "tests/test_hadamard.py", "tests/test_fuzz.py", "tests/test_kernels.py", "tests/test_linear.py"]
LAYER_TESTS = ["tests/test_linear.py", "tests/test_kernels.py"]
TRAINER_TESTS = ["tests/test_pretrain.py"]

# (file, snippet, replacement, what the bug is, tests)
MUTANTS = [
    ("hf_fp4/numerics/formats.py", "(hi % 2 == 0)", "(hi % 2 == 1)", "RNE ties to the odd code", NUMERICS_TESTS),
    ("hf_fp4/numerics/formats.py", "noise < d_lo / (t_hi - t_lo)", "noise <= d_lo / (t_hi - t_lo)",
     "SR takes the upper neighbour on an exact noise tie", NUMERICS_TESTS),
    ("hf_fp4/numerics/scales.py", "torch.ones_like(amax))) - grid_emax(grid)", "torch.ones_like(amax))) - grid_emax(grid) + 1",
     "OCP floor scale one binade too large", NUMERICS_TESTS),
    ("hf_fp4/numerics/scales.py", "E4M3_MAX * grid_max(grid)) / amax", "E4M3_MAX) / amax",
     "two-level tensor scale forgets the grid max", NUMERICS_TESTS),
    ("hf_fp4/numerics/scales.py", "torch.reciprocal(decode_factor)", "torch.reciprocal(s_b) * s_enc",
     "two-level encode factor computed in another order (TE's order is the spec)", NUMERICS_TESTS),
    ("hf_fp4/numerics/hadamard.py", "blocks = blocks * torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32)",
     "blocks = blocks * torch.tensor(1.0 / n, dtype=torch.float32)", "Hadamard normalised by 1/n", NUMERICS_TESTS),
    ("hf_fp4/numerics/philox.py", "counters = torch.arange(rows * cols // 4,", "counters = 1 + torch.arange(rows * cols // 4,",
     "Philox counters off by one", NUMERICS_TESTS),
    ("hf_fp4/nn/autograd.py", "seeds[4:6], signs, None, need_dw", "seeds[2:4], signs, None, need_dw",
     "dy drawn with the weight's SR seeds", LAYER_TESTS),
    ("hf_fp4/nn/autograd.py", "dw = dw + dy2.float().sum(0)[:, None] * mu[None, :]",
     "dw = dw", "mean-bias removal drops its wgrad term", LAYER_TESTS),
    ("hf_fp4/nn/autograd.py", "db = dy2.sum(0).to(w_dtype)", "db = dy2.mean(0).to(w_dtype)", "bias gradient averaged",
     LAYER_TESTS),
    ("hf_fp4/nn/autograd.py", 'x_seeds = seeds[0:2] if plan.seeded("x") else', "x_seeds = seeds[0:2] if False else",
     "layers sharing an input share its SR noise too", LAYER_TESTS),
    ("hf_fp4/nn/autograd.py", "t, k, act_dtype).to(x_dtype)", "t, k, x_dtype).to(x_dtype)",
     "dgrad under autocast leaves its GEMM in FP32 (not nn.Linear's BF16)", LAYER_TESTS),
    ("kernels/src/operand.py", "tl.atomic_max(b_stat + cols, tl.max(a, axis=0), mask=cols < C)",
     "tl.atomic_max(b_stat + cols, tl.max(a, axis=0), mask=cols < R)",
     "per-column statistics masked by the row count", LAYER_TESTS),
    ("kernels/src/operand.py", "            tl.store(flag_ptr + n_rows, tl.full([], 1, tl.int8))", "",
     "a lost block flags its row but not the operand's 'any row' element", LAYER_TESTS),
    ("kernels/src/gemm.py", "if tl.load(a_flags + MA).to(tl.int32) + tl.load(b_flags + NB).to(tl.int32) > 0:",
     "if tl.load(a_flags + MA).to(tl.int32) > 0:", "the correction looks at lhs flags only", LAYER_TESTS),
    ("hf_fp4/train/trainer.py", '        rewrite_metrics(run_dir / "metrics.jsonl", 0)\n', "",
     "resume before the first checkpoint keeps the killed run's metrics", TRAINER_TESTS),
    ("hf_fp4/train/trainer.py", "            state.bad_in_row = 0\n", "", "a good step does not reset the bad streak",
     TRAINER_TESTS),
    ("hf_fp4/train/trainer.py", "if state.bad_in_row >= cfg.max_bad_steps:", "if state.bad_in_row > cfg.max_bad_steps:",
     "the abort comes one bad step late", TRAINER_TESTS),
    ("hf_fp4/train/trainer.py", "return (step + 1) / cfg.warmup_steps", "return step / cfg.warmup_steps",
     "warmup starts at lr 0", TRAINER_TESTS),
    ("hf_fp4/train/trainer.py", "clip_grad_norm_(params, cfg.grad_clip)", "clip_grad_norm_(params, 10 * cfg.grad_clip)",
     "gradient clipping threshold ignored", TRAINER_TESTS),
]


def run(mutant, timeout: int) -> tuple[str, float]:
    path, old, new, _, tests = mutant
    file = ROOT / path
    text = file.read_text()
    if text.count(old) != 1:
        return f"SNIPPET FOUND {text.count(old)}x", 0.0
    file.write_text(text.replace(old, new))
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        verdict = "KILLED" if proc.returncode != 0 else "SURVIVED"
    except subprocess.TimeoutExpired:
        verdict = "TIMEOUT"
    finally:
        file.write_text(text)
    return verdict, time.time() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="comma list of mutant numbers (1-based)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args()
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(1, len(MUTANTS) + 1)
    lines = ["| # | file | bug | verdict | seconds |", "|---|---|---|---|---|"]
    for i in chosen:
        verdict, secs = run(MUTANTS[i - 1], args.timeout)
        lines.append(f"| {i} | {MUTANTS[i - 1][0]} | {MUTANTS[i - 1][3]} | {verdict} | {secs:.0f} |")
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
