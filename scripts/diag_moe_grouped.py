"""Locate a difference between the grouped expert path and the per-expert loop on the GPU (issue 16's diverged
NVFP4 / UFP4 study runs): one experts layer of the small MoE study model, the same input, routing and incoming
gradient through both paths, under variants that switch one suspect off at a time, and for each the largest
difference of y, dx, dW_up, dW_down relative to the loop's largest value.  Then the dy / x operands the two paths
made, segment by segment.  Prints a table; a diagnostic, not a test (the tests assert what it finds)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_experts import experts_modules, study_moe_config, study_recipe  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def layer_case(recipe, tokens, skew, fp32):
    torch.manual_seed(0)
    cfg = study_moe_config()
    model = AutoModelForCausalLM.from_config(cfg, quantization_config=study_recipe(recipe)).to(DEV)
    if not fp32:
        model = model.to(torch.bfloat16)
    module = next(iter(experts_modules(model).values()))
    g = torch.Generator(DEV).manual_seed(0)
    x = torch.randn(tokens, cfg.hidden_size, device=DEV, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, cfg.num_experts, device=DEV, generator=g)
    logits = logits + torch.linspace(0, 3 * skew, cfg.num_experts, device=DEV)
    weights, index = torch.softmax(logits, -1).topk(cfg.num_experts_per_tok, dim=-1)
    grad_out = torch.randn(tokens, cfg.hidden_size, device=DEV, generator=g)
    return module, x, index, weights.to(torch.bfloat16), grad_out


def run(case, grouped):
    module, x, index, weights, grad_out = case
    module.zero_grad(set_to_none=True)
    module.hf_fp4.backend, module.hf_fp4.grouped = "triton", grouped
    xx = x.clone().requires_grad_()
    y = module(xx, index, weights)
    (y.float() * grad_out).sum().backward()
    return y.float(), xx.grad.float(), module.gate_up_proj.grad.float(), module.down_proj.grad.float()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default="nvfp4,ufp4,nvfp4:stochastic_rounding=false,nvfp4:hadamard=none,mxfp4")
    ap.add_argument("--scale", type=int, default=1, help="divide the token counts by this (a CPU check)")
    args = ap.parse_args()
    from hf_fp4.kernels import grouped_gemm

    kernel_device = grouped_gemm._kernel_device
    rows = []
    for recipe in args.recipes.split(","):
        for tokens, skew, fp32, gemm in [(8192, 1, True, "kernel"), (8192, 1, True, "torch"), (8192, 0, True, "kernel"),
                                         (8192, 1, False, "kernel"), (2048, 1, True, "kernel"),
                                         (512, 1, True, "kernel")]:
            grouped_gemm._kernel_device = kernel_device if gemm == "kernel" else (lambda t: False)
            case = layer_case(recipe, tokens // args.scale, skew, fp32)
            got, want = run(case, True), run(case, False)
            rows.append((recipe, tokens, skew, "fp32" if fp32 else "bf16", gemm, *(rel(a, b) for a, b in zip(got, want))))
            print("| " + " | ".join(str(c) if not isinstance(c, float) else f"{c:.2e}" for c in rows[-1]) + " |",
                  flush=True)
    grouped_gemm._kernel_device = kernel_device
    operand_diff(args.recipes.split(",")[0], 8192 // args.scale)


def operand_diff(recipe, tokens):
    """The dy operands (dgrad orientation) of each projection, grouped path segment by segment against the loop's
    per-expert call on the same rows."""
    from hf_fp4.nn import autograd, grouped

    calls = {True: [], False: []}
    orig_pair, orig_ops = grouped._pair, autograd.tensor_operands

    def pair(t, plan, tensor, seeds, signs, both, groups):
        ops = orig_pair(t, plan, tensor, seeds, signs, both, groups)
        calls[True].append((tensor, t.detach().clone(), ops, groups))
        return ops

    def tops(t, plan, seeds, signs, mu, need, tensor, observer, groups=None):
        ops = orig_ops(t, plan, seeds, signs, mu, need, tensor, observer, groups)
        if groups is None:
            calls[False].append((tensor, t.detach().clone(), ops, None))
        return ops

    grouped._pair, autograd.tensor_operands = pair, tops
    case = layer_case(recipe, tokens, 1, True)
    run(case, True)
    run(case, False)
    grouped._pair, autograd.tensor_operands = orig_pair, orig_ops
    print(f"\n{recipe}: grouped calls {[(c[0], tuple(c[1].shape)) for c in calls[True]]}")
    print(f"loop calls: {len(calls[False])}")
    for tensor, t, ops, groups in calls[True]:
        starts = groups.starts.tolist() if groups is not None else None
        for ltensor, lt, lops, _ in calls[False]:
            if ltensor != tensor or lt.shape[-1] != t.shape[-1] or starts is None:
                continue
            lt2 = lt.reshape(-1, lt.shape[-1])
            c = lt2.shape[0]
            for e, s in enumerate(starts):
                if s + c <= t.shape[0] and torch.equal(t[s:s + c], lt2):
                    for i, name in ((0, "A"), (1, "B")):
                        if ops[i] is None or lops[i] is None:
                            continue
                        ge = ops[i].scale[e] if ops[i].scale.numel() > 1 else ops[i].scale
                        gd = ops[i].data[s:s + c] if i == 0 else ops[i].data[:, s:s + lops[i].data.shape[1]]
                        ld = lops[i].data
                        gd = gd[:ld.shape[0], :ld.shape[1]].float() * ge
                        lv = ld.float() * lops[i].scale
                        bad = (gd != lv).sum().item()
                        print(f"{tensor} {name} seg {e} rows {c}: scales {float(ge):.6g} vs "
                              f"{float(lops[i].scale.reshape(-1)[0]):.6g}, differing values {bad} of {lv.numel()}, "
                              f"max |diff| {float((gd - lv).abs().max()):.3g} (max {float(lv.abs().max()):.3g})")
                    break


if __name__ == "__main__":
    main()
