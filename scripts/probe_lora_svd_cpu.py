"""CPU probe of LoRA-SVD's training dynamics (session 31: fs-lora16 diverged on the GPU, gradient norm 0.7 -> 48).

A small Llama whose decoder linears are W (variant "plain...") or the LoRA-SVD split W_res + B A (B = U_r S_r^1/2,
A = S_r^1/2 V_r^T, rank 16: hf_fp4.nn.lora_svd's), trained with AdamW as the trainer does (lr warmup + cosine over
`horizon` steps, weight decay 0.1 on matrices, none on the factors, clipping at 1) on the built-in corpus; a
"-q" variant fake-quantizes W / W_res to NVFP4 in the forward (straight-through), "-wd" gives the factors weight
decay 0.05, "-lr4" a quarter of the lr, "-refresh" re-splits every 100 steps, "-frozen" trains no factors (W_res
takes every update, as lora_svd_factors: frozen) and re-splits every 100 steps.  Prints the loss, the gradient norm
and the norms of W_res, B A and W every 25 steps.  Plain PyTorch (no hf_fp4 kernels): minutes, not hours, on a CPU.

    python scripts/probe_lora_svd_cpu.py VARIANT STEPS LR [HIDDEN] [HORIZON] [LAYERS]
    e.g. python scripts/probe_lora_svd_cpu.py lora-q 1500 2e-3 640 6104 2   (needs the built-in corpus at vocab 4096:
    the README's first command prepares it)
"""
import json
import math
import sys
import time

import numpy as np
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fp4 import fake_quantize
from hf_fp4.train.data import prepare_data

torch.set_num_threads(1)
variant, steps, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
hidden = int(sys.argv[4]) if len(sys.argv) > 4 else 128
horizon = int(sys.argv[5]) if len(sys.argv) > 5 else steps
layers = int(sys.argv[6]) if len(sys.argv) > 6 else 4
rank = 16
tok = np.memmap(prepare_data("builtin", "builtin", 4096).root / "train.bin", dtype=np.uint16, mode="r")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=int(2.7 * hidden), num_hidden_layers=layers,
                  num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=256, tie_word_embeddings=True)
model = LlamaForCausalLM(cfg)
QUANT = "-q" in variant


def fq(w):
    return w + (fake_quantize(w.detach(), "nvfp4") - w.detach()) if QUANT else w

class Plain(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.weight = nn.Parameter(lin.weight.detach().clone())
    def forward(self, x):
        return x @ fq(self.weight).t()

class Split(nn.Module):
    def __init__(self, lin):
        super().__init__()
        w = lin.weight.detach()
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        r = s[:rank].sqrt()
        self.B = nn.Parameter(u[:, :rank] * r)
        self.A = nn.Parameter(r[:, None] * vh[:rank])
        self.weight = nn.Parameter(w - self.B.detach() @ self.A.detach())
    def forward(self, x):
        return x @ fq(self.weight).t() + (x @ self.A.t()) @ self.B.t()
    def refresh(self):
        with torch.no_grad():
            full = self.weight + self.B @ self.A
            u, s, vh = torch.linalg.svd(full, full_matrices=False)
            r = s[:rank].sqrt()
            self.B.copy_(u[:, :rank] * r); self.A.copy_(r[:, None] * vh[:rank]); self.weight.copy_(full - self.B @ self.A)

swap = Plain if variant.startswith("plain") else Split
for layer in model.model.layers:
    for parent in (layer.self_attn, layer.mlp):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, swap(child))
named = list(model.named_parameters())
fac = [p for n, p in named if n.endswith((".A", ".B"))]
FROZEN = "-frozen" in variant
for p in fac:
    p.requires_grad_(not FROZEN)
dec = [p for n, p in named if p.dim() >= 2 and not n.endswith((".A", ".B"))]
nod = [p for n, p in named if p.dim() < 2]
fwd = 0.05 if "-wd" in variant else 0.0
flr = lr / 4 if "-lr4" in variant else lr
groups = [{"params": dec, "weight_decay": 0.1}, {"params": nod, "weight_decay": 0.0}]
if fac and not FROZEN:
    groups.append({"params": fac, "weight_decay": fwd, "lr": flr})
opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
base = [g["lr"] for g in opt.param_groups]
def factor(s):
    if s < 50: return (s + 1) / 50
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - 50) / (horizon - 50))))
rng = np.random.default_rng(0)
T, Bsz = 128, 8
t0 = time.time()
for s in range(steps):
    for g, b in zip(opt.param_groups, base): g["lr"] = b * factor(s)
    idx = rng.integers(0, len(tok) - T - 1, Bsz)
    x = torch.from_numpy(np.stack([tok[i:i + T + 1].astype(np.int64) for i in idx]))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    if ("-refresh" in variant or FROZEN) and s % 100 == 99:
        for m in model.modules():
            if isinstance(m, Split): m.refresh()
    if s % 25 == 0 or s == steps - 1:
        fn = sum(p.detach().norm() ** 2 for p in fac) ** 0.5 if fac else 0.0
        splits = [m for m in model.modules() if isinstance(m, Split)]
        wres = sum(m.weight.detach().norm() ** 2 for m in splits) ** 0.5 if splits else 0.0
        ba = sum((m.B @ m.A).detach().norm() ** 2 for m in splits) ** 0.5 if splits else 0.0
        full = sum((m.weight + m.B @ m.A).detach().norm() ** 2 for m in splits) ** 0.5 if splits else 0.0
        print(json.dumps({"step": s, "loss": round(loss.item(), 3), "gn": round(gn.item(), 3), "factor_norm": round(float(fn), 2), "wres": round(float(wres), 2), "ba": round(float(ba), 2), "w": round(float(full), 2),
                          "t": round(time.time() - t0)}), flush=True)
