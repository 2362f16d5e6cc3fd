"""FP4 weight all-gather (hf_fp4.nn.fp4_gather): the shards' FP4 payloads, gathered, give the layer the weight
operands it makes from the gathered high-precision weight, bit for bit, in every operand form; and FSDP2 on two
CPU ranks trains bit-identically with it in a quarter of the layers' all-gather bytes."""
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_fp4  # noqa: E402
from hf_fp4.nn.fp4_gather import (FP4MasterWeight, GatheredFP4Weight, _rotated, gathered_operands,  # noqa: E402
                                  payload_bytes, shard_payload, weight_gather)
from hf_fp4.nn.linear import hadamard_signs  # noqa: E402
from hf_fp4.nn.operands import LinearPlan, operands, stored_operand  # noqa: E402
from hf_fp4.nn.recipe import preset  # noqa: E402
from hf_fp4.numerics.quantize import tensor_amax  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda" if CUDA else "cpu"
GATHERED = ["nvfp4", "mxfp4", "mxfp4_dh", "ufp4", "tib"]


SIZE = (2048, 4096) if CUDA else (128, 128)  # full size on the GPU (scripts/gpu_check.sh), interpreted here


def two_ranks(tmp_path, worker: str, *args: str) -> dict:
    """tests/<worker> on two gloo ranks (torchrun --standalone: a free port from the OS) with args after its output
    path; returns what it wrote."""
    out = tmp_path / f"{worker}-{'-'.join(args)}.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           str(ROOT / "tests" / worker),
                           str(out), *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def weight(rows=SIZE[0], cols=SIZE[1], seed=0):
    """32-row and 32-column bands 0, 14, 20 and 15 binades down: an FP8 operand loses blocks in both orientations
    (E2M1 folds blocks down to 14 binades below a row's largest exactly), and some block sits on that bound."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.tensor([0.0, -14.0, -20.0, -15.0])
    band = lambda n: torch.exp2(levels[(torch.arange(n) // 32) % 4])  # noqa: E731
    return (torch.randn(rows, cols, generator=g) * band(rows)[:, None] * band(cols)[None, :]).to(DEV)


def gather(w, recipe, world, per_shard_amax=False, backend="reference"):
    """What FSDP2 hands the layer: each shard's payload -- its two-level tensor scales from the amax of the whole
    (rotated) tensor, as the all-reduce gives it, or, per_shard_amax, the bug of forgetting the all-reduce --
    concatenated along rows."""
    g = weight_gather(recipe)
    signs = {o.gemm: hadamard_signs(recipe, o.gemm, 0, 0) for o in g.orientations}
    signs = {k: v.to(DEV) if v is not None else None for k, v in signs.items()}
    shards = w.chunk(world)
    whole = [max(tensor_amax(_r(s, o, signs)) for s in shards) for o in g.orientations
             if o.spec.scale.value == "ue4m3_fp32"]
    amaxes = itertools.cycle(whole)
    parts = [shard_payload(s, g, signs, None if per_shard_amax else lambda a: next(amaxes), backend=backend)
             for s in shards]
    payload = [torch.cat([p[0][i] for p in parts]) for i in range(len(parts[0][0]))]
    q = gathered_operands(payload, parts[0][1], g)
    return (q["fprop"], q["dgrad"]), signs


def _r(t, o, signs):
    """An orientation of a weight (or shard) as its operand sees it: transposed for dgrad, rotated."""
    return _rotated(t.t() if o.transposed else t, o, signs.get(o.gemm))


def bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """A one-byte tensor (codes, E8M0 / E4M3 scales) as its bytes, compared bit for bit; other tensors as they are."""
    return t.view(torch.uint8) if t is not None and t.element_size() == 1 else t


def assert_same_operand(got, ref, plan):
    for field, a, b in zip(got._fields, got, ref):
        if field == "side" and ref.eb.numel():  # defined where a block is lost (elsewhere never read)
            lost = (ref.eb != -128).repeat_interleave(plan.spec.block[1], 1)
            a, b = a.view(torch.uint8)[lost], b.view(torch.uint8)[lost]
        a, b = bits(a), bits(b)
        assert a.shape == b.shape, (field, plan.form, a.shape, b.shape)
        assert torch.equal(a, b), (field, plan.form, mismatches(a, b, ref, plan))


def mismatches(got, want, ref, plan, show=8) -> str:
    """Where two operand fields differ (a GPU-only mismatch is diagnosed from the suite's log): how many entries, and
    the first few with their indices, both values and, for FP8 data, the E4M3 values, the row's reference scale and
    the block's lost-exponent entry."""
    bad = (got != want) if got.dtype != torch.float32 else ~((got == want) | (got.isnan() & want.isnan()))
    where = bad.nonzero()[:show].tolist()
    lines = [f"{int(bad.sum())} of {bad.numel()} differ"]
    for idx in where:
        g, w = got[tuple(idx)].item(), want[tuple(idx)].item()
        line = f"{idx}: got {g} want {w}"
        if plan is not None and got.dtype == torch.uint8 and got.dim() == 2 and plan.form == "fp8":
            f8 = lambda v: torch.tensor([v], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()  # noqa: E731
            line += f" (e4m3 {f8(g)} vs {f8(w)}; row scale {ref.scale[idx[0]].item()}"
            if ref.eb.numel():
                line += f", block eb {ref.eb[idx[0], idx[1] // plan.spec.block[1]].item()}"
            line += ")"
        lines.append(line)
    return "; ".join(lines)


@pytest.mark.parametrize("name", GATHERED)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gathered_shards_give_the_operands_of_the_gathered_weight(name, backend):
    recipe = preset(name).linear
    w = weight()
    (q_fprop, q_dgrad), signs = gather(w, recipe, world=2, backend=backend)  # shards by the kernel or reference
    if backend == "triton":  # the kernel-made payload is the reference-made one, byte for byte
        for got, want in zip((q_fprop, q_dgrad), gather(w, recipe, world=2)[0]):
            for field in ("codes", "scales", "tensor_scale"):
                a, b = (bits(getattr(q, field)) for q in (got, want))
                assert (a is None) == (b is None), field
                assert a is None or (a.shape == b.shape and torch.equal(a, b)), (field, mismatches(a, b, None, None))
    plan = LinearPlan.build(recipe, backend)
    sign_pair = (signs.get("fprop"), signs.get("dgrad"))
    seeds = torch.zeros(2, dtype=torch.int64, device=DEV)
    ref = operands(w, plan.w, seeds, sign_pair, triton_ops=False)
    lost = 0
    for q, p, r in zip((q_fprop, q_dgrad), plan.w, ref):
        assert_same_operand(stored_operand(q, p), r, p)
        lost += int(r.flags[-1]) if p.form == "fp8" else 0
    if plan.w[0].form == "fp8":
        assert lost == 2  # both orientations exercised the lost-block path


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forgetting_the_amax_all_reduce_changes_two_level_operands(backend):
    """Planted bug: each shard scaled by its own amax (no all-reduce) -- the NVFP4 operands differ."""
    recipe = preset("nvfp4").linear
    w = weight()
    w[:32] *= 8  # the shards' amaxes differ
    good, _ = gather(w, recipe, world=2, backend=backend)
    bad, _ = gather(w, recipe, world=2, per_shard_amax=True, backend=backend)
    assert not torch.equal(good[0].dequantize(), bad[0].dequantize())


@pytest.mark.parametrize("name", ["nvfp4", "ufp4"])
def test_a_layer_on_a_gathered_fp4_weight_computes_what_it_does_on_the_weight(name):
    """y, dx and dW of an FP4Linear whose weight is the gathered FP4 payload equal the plain layer's, bit for bit:
    with both operands in one gather, and split -- the forward's gather brings fprop's operand, the backward's
    dgrad's (FSDP2 updates the gathered parameter in place between them)."""
    torch.manual_seed(0)
    layer = hf_fp4.FP4Linear(96, 64, bias=True, recipe=preset(name).linear, name="l").to(DEV)
    x = torch.randn(48, 96, device=DEV, requires_grad=True)
    y = layer(x)
    y.backward(torch.cos(y.detach()))
    want = (y.detach(), x.grad.clone(), layer.weight.grad.clone())
    w = layer.weight.detach()
    g = weight_gather(layer.recipe)
    signs = {o.gemm: layer.hadamard_signs(o.gemm) for o in g.orientations}

    def payload(gemms=None):
        amaxes = iter([tensor_amax(_r(w, o, signs)) for o in g.orientations if gemms is None or o.gemm in gemms])
        return shard_payload(w, g, signs, lambda a: next(amaxes), gemms)

    for split in (False, True):
        x.grad = None
        layer.sr_calls = 0
        gathered = torch.nn.Parameter(GatheredFP4Weight(w.shape, w.dtype, w.device, *payload(
            ("fprop",) if split else None), g))
        layer.weight = gathered
        y2 = layer(x)
        if split:  # what fsdp_post_all_gather(out=...) does with the backward's gather
            gathered._payload, gathered._meta = payload(("dgrad",))
        y2.backward(torch.cos(y2.detach()))
        for a, b in zip(want, (y2.detach(), x.grad, gathered.grad)):
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="FP4 codes and scales"):
        gathered + 1  # no high-precision values to compute with
    gathered._payload, gathered._meta = payload(("dgrad",))
    with pytest.raises(RuntimeError, match="gathered for the backward"):
        layer(x)


def test_enable_converts_eligible_layers_and_says_why_not_for_the_others():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=1, max_position_embeddings=32)
    model = AutoModelForCausalLM.from_config(cfg, quantization_config=hf_fp4.FP4TrainConfig("mxfp4"))
    left = hf_fp4.enable_fp4_all_gather(model, world_size=2)
    # k/v: 16 rows -> 8 per shard, not a multiple of dgrad's 32-wide blocks along N
    assert set(left) == {"model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"}
    assert "multiple of 32" in left["model.layers.0.self_attn.k_proj"]
    up = model.model.layers[0].mlp.up_proj
    assert isinstance(up.weight, torch.nn.Parameter) and isinstance(up.weight, FP4MasterWeight)
    # transparent to everything but FSDP2: the optimizer's update and the state dict are the plain tensor's
    before = up.weight.detach().clone()
    plain = before.clone()
    up.weight.grad = torch.ones_like(plain)
    torch.optim.AdamW([up.weight], lr=0.1).step()
    p = torch.nn.Parameter(plain)
    p.grad = torch.ones_like(plain)
    torch.optim.AdamW([p], lr=0.1).step()
    assert torch.equal(up.weight._tensor, p.detach()) and not torch.equal(before._tensor, p.detach())
    # accelerate's FSDP2 prepare maps optimizer parameters to the sharded ones by data pointer (a wrapper's is 0)
    from accelerate.utils.modeling import _get_parameter_id

    ids = [_get_parameter_id(p) for p in model.parameters()]
    assert len(set(ids)) == len(ids) and _get_parameter_id(up.weight) == up.weight._tensor.data_ptr() != 0

    mean_bias = AutoModelForCausalLM.from_config(
        cfg, quantization_config=hf_fp4.FP4TrainConfig("mxfp4", mean_bias_removal=True))
    assert all("mean-bias" in r for r in hf_fp4.enable_fp4_all_gather(mean_bias, world_size=1).values())
    r = preset("nvfp4").linear
    sr_weight = dataclasses.replace(r, fprop=dataclasses.replace(
        r.fprop, rhs=dataclasses.replace(r.fprop.rhs, rounding="stochastic")))
    assert "fprop's weight rounds stochastically" in weight_gather(sr_weight)


def test_a_recipe_change_that_needs_the_weight_itself_is_refused():
    layer = hf_fp4.FP4Linear(64, 64, recipe=preset("ufp4").linear, name="l")
    layer.fp4_gather = dataclasses.replace(weight_gather(layer.recipe), split=True)  # as enable_fp4_all_gather sets it
    layer.recipe = preset("ufp4").linear.with_options(gemms=("fprop", "dgrad"))  # wgrad in BF16: still fine
    assert layer.fp4_gather == dataclasses.replace(weight_gather(preset("ufp4").linear), split=True)  # split kept
    with pytest.raises(ValueError, match="fprop does not quantize the weight"):
        layer.recipe = preset("ufp4").linear.with_options(gemms=("dgrad", "wgrad"))
    with pytest.raises(ValueError, match="quantizes the weight's fprop / dgrad operands differently"):
        layer.recipe = preset("mxfp4").linear


def test_payload_bytes_per_all_gather_are_about_a_quarter_of_bf16():
    """2D tiles: one payload for both GEMMs; 1D: each pass gathers its own operand (split), else both."""
    for name, most in (("nvfp4", 0.26), ("tib", 0.26), ("mxfp4", 0.27), ("ufp4", 0.29)):
        g = weight_gather(preset(name).linear)
        g = dataclasses.replace(g, split=len(g.orientations) == 2)
        assert payload_bytes(g, 2048, 4096) <= most * 2 * 2048 * 4096, name
    both = dataclasses.replace(weight_gather(preset("ufp4").linear), split=False)
    assert payload_bytes(both, 2048, 4096) > 0.55 * 2 * 2048 * 4096


@pytest.mark.parametrize("recipe,checkpointing,ratio,compiled,precompute", [
    ("nvfp4", "0", 3.9, "", "once"), ("ufp4", "0", 3.5, "", "1"), ("ufp4", "1", 1.7, "", "0"),
    ("nvfp4", "0", 3.9, "aot_eager", "0")])
@pytest.mark.slow
def test_fsdp2_with_fp4_all_gather_trains_exactly_as_with_bf16_all_gather(tmp_path, recipe, checkpointing, ratio,
                                                                          compiled, precompute):
    """Two CPU ranks (gloo), FSDP2 with BF16 mixed precision: the losses and the gathered weights are bit-identical
    with and without FP4 all-gather, a run resumed from a sharded checkpoint continues bit for bit, and the decoder
    layers' all-gathers (measured: the bytes each all-gather call receives) shrink: nvfp4 3.9x (one 2D payload for
    both GEMMs); ufp4 3.5x (1D: the forward gathers fprop's operand, the backward dgrad's), or 1.7x under
    activation checkpointing (the recomputed forward runs after the backward's gather: both operands each time).
    With each decoder block compiled (aot_eager) the FP4-gathered layers run outside the graph (traced, their
    weights' gradients were silently lost): still the same bits as BF16 all-gather.  With precompute_fp4_amax after
    each optimizer step the two-level tensor amaxes take one all-reduce per step instead of one per operand per
    gather (ufp4: 36 all-reduces in 4 steps instead of 116, the losses' own 4 included); after one precompute only,
    the later gathers all-reduce again (nvfp4 "once": a stale amax would change the bits)."""
    plain, fp4 = (two_ranks(tmp_path, "fsdp2_worker.py", recipe, fp4, "bf16", "4", checkpointing, "llama", compiled,
                            precompute) for fp4 in ("0", "1"))
    fp4_layers, steps = 14, 4
    if precompute == "1":  # the first step's gathers reduce their own, then one all-reduce after each step
        assert fp4["all_reduces"] == steps + 2 * fp4_layers + steps
    elif precompute == "once":  # step 2's gathers take it; steps 3, 4 reduce their own again
        assert fp4["all_reduces"] == steps + 1 + 3 * 2 * fp4_layers
    elif recipe == "ufp4":  # per operand sent (split: 1, both: 2), layer and gather (forward, backward) + the losses'
        assert fp4["all_reduces"] == steps * ((1 if checkpointing == "0" else 2) * 2 * fp4_layers + 1)
    assert fp4["left_in_high_precision"] == {}
    assert fp4["state_types"] == ["Tensor"]  # the gathered full state dict (the export) holds plain tensors
    assert fp4["losses"] == plain["losses"] and fp4["w_bits"] == plain["w_bits"]
    # a fresh model resumed from the half-way sharded checkpoint (torch.distributed.checkpoint: model + optimizer)
    # repeats the second half bit for bit
    assert fp4["resumed"] == fp4["losses"][2:] and plain["resumed"] == plain["losses"][2:]
    calls = list(zip(plain["all_gather_bytes"], fp4["all_gather_bytes"]))
    assert len(calls) == 20  # 4 steps x (the root's embeddings / norm / head + 2 layers x forward and backward)
    layer_ratios = [a / b for a, b in calls if a != b]
    assert len(layer_ratios) == 16 and len({round(r, 6) for r in layer_ratios}) == 1
    assert ratio < layer_ratios[0] < ratio + 0.2


def test_training_config_refuses_what_fp4_all_gather_cannot_do():
    from accelerate import Accelerator

    from hf_fp4.train.config import TrainConfig
    from hf_fp4.train.trainer import enable_fp4_gather

    with pytest.raises(ValueError, match="fprop and dgrad in BF16 need the weight itself"):
        TrainConfig(recipe="nvfp4", fp4_all_gather=True, precision_schedule=[{"at": 0.9, "bf16": ["fprop"]}])
    TrainConfig(recipe="nvfp4", fp4_all_gather=True, precision_schedule=[{"at": 0.9, "bf16": ["wgrad"]}])
    with pytest.raises(ValueError, match="fp4_all_gather needs FSDP2"):
        enable_fp4_gather(Accelerator(cpu=True), torch.nn.Linear(2, 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="FSDP2 forced onto CPU gloo ranks is the CPU emulation (it "
                    "died with SIGSEGV on the H200 machine, session 17); there scripts/multi_gpu_check.sh runs the real one")
def test_accelerates_fsdp2_preparation_trains_the_same_with_fp4_all_gather(tmp_path):
    """accelerate's FSDP2 prepare (the trainer's path) re-maps the optimizer to the shards by data pointer: with a
    wrapper subclass's own (0) every FP4 weight mapped to one parameter and the losses drifted silently (3rd step
    11.1437 vs 11.1559 summed over ranks); FP4MasterWeight.data_ptr is its tensor's.  Two gloo ranks, nvfp4:
    the same losses bit for bit with and without FP4 all-gather, a plain gathered state dict."""
    runs = {fp4: two_ranks(tmp_path, "accelerate_fsdp2_worker.py", "nvfp4", fp4) for fp4 in ("0", "1")}
    assert runs["1"]["fsdp"].startswith("FSDP") and runs["1"]["left"] == {}
    assert runs["1"]["losses"] == runs["0"]["losses"]
    assert runs["1"]["state_types"] == ["Tensor"]


def test_under_fsdp_the_trainer_compiles_without_cuda_graphs():
    from hf_fp4.train.trainer import compile_mode

    assert compile_mode("auto", "FSDP") == "default" and compile_mode("max-autotune-no-cudagraphs", "FSDP") == \
        "max-autotune-no-cudagraphs"
    assert compile_mode("auto", "MULTI_GPU") == "auto" and compile_mode("reduce-overhead", "NO") == "reduce-overhead"
    with pytest.raises(ValueError, match="CUDA graphs, which FSDP does not support"):
        compile_mode("reduce-overhead", "FSDP")


def test_a_precomputed_amax_serves_only_the_values_it_was_taken_from():
    """FP4MasterWeight.cached_amax hands precompute_fp4_amax's amax to the gather while the shard is unchanged, and
    nothing once an in-place update (the optimizer's) moved the shard's version counter."""
    from transformers import AutoModelForCausalLM

    from tiny import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), quantization_config=hf_fp4.FP4TrainConfig("ufp4"))
    hf_fp4.enable_fp4_all_gather(model, world_size=1)
    layer = model.model.layers[0].mlp.up_proj
    shard = layer.weight  # (FSDP2's local shard of it, on one rank)
    layer.fp4_amax = (shard._version, {"fprop": torch.tensor(2.0), "dgrad": torch.tensor(3.0)})
    assert [float(a) for a in shard.cached_amax(layer, None)] == [2.0, 3.0]
    assert [float(a) for a in shard.cached_amax(layer, ("dgrad",))] == [3.0]
    with torch.no_grad():
        layer.weight.mul_(1.5)  # what an optimizer step does to the shard
    assert shard.cached_amax(layer, None) == [None, None]
