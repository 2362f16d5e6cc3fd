"""Replay one training step of a study run eagerly and compiled, on the same weights and batch, and say where the
gradients part (issue 16: NVFP4 / UFP4 MoE runs whose gradient norm explodes under torch.compile at step 5 of
configs/study/moe-probe.yaml while eager trains as bf16 does).

    python scripts/probe_moe_compile.py configs/study/moe-probe.yaml nvfp4 --step 5 [--set key=value ...]

Trains the run eagerly up to the step (the trainer itself, compile off), keeps the weights, RNG counters and batch
the step starts from, then computes that step's gradients again eagerly and compiled (inductor; aot_eager; CUDA
graphs) and prints, per parameter, the compiled gradient's distance from eager's.  For the experts layer that
parts most it replays the layer alone on its captured inputs (hidden states, routing, output gradient): y, dx,
dW eager against compiled, the routing layout compiled against eager, and the experts' token counts.  A
diagnostic (the GPU tests in tests/test_experts.py assert what it finds); prints only.
"""
from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch

from hf_fp4.nn.compile import compile_model
from hf_fp4.nn.experts import experts_modules
from hf_fp4.nn.grouping import group_layout
from hf_fp4.nn.swap import load_rng_state_dict, place_rng_states, rng_state_dict
from hf_fp4.train import trainer
from hf_fp4.train.config import TrainConfig, apply_overrides
from hf_fp4.train.study import load_study

MODES = [("inductor", "default"), ("aot_eager", "default"), ("inductor", "reduce-overhead")]


def capture_step(cfg: TrainConfig, step: int) -> dict:
    """Train eagerly up to `step`; the weights, RNG counters and batch that step starts from."""
    captured: dict = {}
    real = trainer.compute_loss
    calls = [0]

    def spy(model, tokens):
        calls[0] += 1
        if calls[0] == step:
            inner = getattr(model, "module", model)
            captured.update(tokens=tokens.clone(), rng=rng_state_dict(inner),
                            state={k: v.detach().clone() for k, v in inner.state_dict().items()})
        return real(model, tokens)

    trainer.compute_loss = spy
    try:
        trainer.train(cfg)
    finally:
        trainer.compute_loss = real
    return captured


def fresh_model(cfg: TrainConfig, captured: dict, device):
    model = trainer.build_model(cfg, cfg.vocab_size)
    model.load_state_dict(captured["state"])
    model.to(device).train()
    place_rng_states(model)  # as the trainer does
    load_rng_state_dict(model, captured["rng"])
    return model


def step_grads(model, tokens, device, repeats: int = 1, rng=None):
    """The step's loss and gradients (repeats > 1: CUDA graphs record on a later call; the counters reset)."""
    for _ in range(repeats):
        if rng is not None:
            load_rng_state_dict(model, rng)
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = trainer.compute_loss(model, tokens)
        loss.backward()
    return float(loss), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(eager: dict, other: dict, top: int = 8) -> list[tuple[str, float, float, float]]:
    rows = []
    for n, g in eager.items():
        e = float(g.norm())
        rows.append((n, e, float(other[n].norm()), float((other[n] - g).norm()) / max(e, 1e-30)))
    return sorted(rows, key=lambda r: -r[3])[:top]


def experts_inputs(model, name: str, tokens, device, rng) -> tuple:
    """The experts layer `name`'s inputs and output gradient in an eager step."""
    module = dict(model.named_modules())[name]
    seen: dict = {}

    def pre(mod, args, kwargs):
        h, idx, w = (list(args) + [kwargs.get(k) for k in ("hidden_states", "top_k_index", "top_k_weights")])[:3]
        seen.update(x=h.detach().clone(), index=idx.detach().clone(), weights=w.detach().clone(),
                    step=int(mod.hf_fp4.step))

    def post(mod, args, kwargs, out):
        out.register_hook(lambda g: seen.update(grad=g.detach().clone()))

    handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
               module.register_forward_hook(post, with_kwargs=True)]
    step_grads(model, tokens, device, rng=rng)
    for h in handles:
        h.remove()
    return module, seen


def replay_layer(module, seen: dict, backend: str, mode: str):
    def run(fn):
        module.zero_grad(set_to_none=True)
        module.hf_fp4.step.fill_(seen["step"])
        torch.compiler.cudagraph_mark_step_begin()
        x = seen["x"].clone().requires_grad_()
        y = fn(x, seen["index"], seen["weights"])
        y.backward(seen["grad"])
        up = "gate_up_proj" if module.has_gate else "up_proj"
        return y.float(), x.grad.float(), getattr(module, up).grad.float(), module.down_proj.grad.float()

    eager = run(module)
    options = {"mode": mode} if backend == "inductor" else {}
    compiled = torch.compile(module, backend=backend, dynamic=False, **options)
    run(compiled)
    got = run(compiled)
    return {n: (float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)), float(a.abs().max()), float(b.abs().max()))
            for n, a, b in zip(("y", "dx", "dW_up", "dW_down"), got, eager)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study")
    ap.add_argument("label")
    ap.add_argument("--step", type=int, default=5)
    ap.add_argument("--set", nargs="*", default=[], help="config overrides key=value (e.g. batch_size=2)")
    ap.add_argument("--modes", default=",".join(f"{b}:{m}" for b, m in MODES))
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="probe_"))
    run = next(r for r in load_study(args.study, out).runs if r.label == args.label)
    config = copy.deepcopy(run.config)
    config.update(compile=False, max_steps=args.step, output_dir=str(out / "run"), trackers=[], log_top_grads=0,
                  checkpoint_every=10 ** 6, eval_every=10 ** 6)
    cfg = TrainConfig.from_dict(apply_overrides(config, args.set))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    captured = capture_step(cfg, args.step)
    tokens = captured["tokens"].to(device)
    eager_model = fresh_model(cfg, captured, device)
    loss_e, eager = step_grads(eager_model, tokens, device)
    print(f"step {args.step}, eager loss {loss_e:.5f}, gradient norm "
          f"{sum(float(g.norm()) ** 2 for g in eager.values()) ** 0.5:.4g}")
    worst_layer = None
    for spec in args.modes.split(","):
        backend, mode = spec.split(":")
        torch._dynamo.reset()
        model = fresh_model(cfg, captured, device)
        compile_model(model, mode=mode, backend=backend)
        loss_c, grads = step_grads(model, tokens, device, repeats=2 if "overhead" in mode else 1, rng=captured["rng"])
        total = sum(float(g.norm()) ** 2 for g in grads.values()) ** 0.5
        print(f"\n{backend}:{mode}: loss {loss_c:.5f}, gradient norm {total:.4g}")
        print("| parameter | eager norm | compiled norm | |compiled - eager| / |eager| |\n|---|---|---|---|")
        rows = compare(eager, grads)
        for n, e, c, r in rows:
            print(f"| {n} | {e:.4g} | {c:.4g} | {r:.3g} |")
        experts = [n for n, *_ in rows if ".experts." in n]
        if worst_layer is None and experts:
            worst_layer = experts[0].rsplit(".", 1)[0]
    names = list(experts_modules(eager_model))
    name = worst_layer if worst_layer in names else names[0]
    torch._dynamo.reset()
    module, seen = experts_inputs(fresh_model(cfg, captured, device), name, tokens, device, captured["rng"])
    e = module.down_proj.shape[0]
    counts = torch.bincount(seen["index"].reshape(-1), minlength=e).tolist()
    print(f"\n{name}: tokens per expert {counts}; x max {float(seen['x'].abs().max()):.4g}, "
          f"output gradient max {float(seen['grad'].abs().max()):.4g}")
    layout = group_layout(seen["index"], e, 16)
    fields = ("rows", "pos", "counts", "tile_expert", "row_expert", "starts", "ends")
    compiled_layout = torch.compile(lambda i: tuple(getattr(group_layout(i, e, 16), f) for f in fields),
                                    dynamic=False)(seen["index"])
    print("layout compiled == eager:",
          {f: bool(torch.equal(getattr(layout, f), c)) for f, c in zip(fields, compiled_layout)})
    for spec in args.modes.split(","):
        backend, mode = spec.split(":")
        torch._dynamo.reset()
        print(f"layer alone, {backend}:{mode}: (max |diff| / max |eager|, max |compiled|, max |eager|)",
              replay_layer(module, seen, backend, mode))


if __name__ == "__main__":
    main()
