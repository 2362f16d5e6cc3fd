"""The pretraining loop: one flat loop over micro-steps with accelerate (nanoGPT spirit).

    for step in range(start, max_steps):
        micro-steps (grad accumulation) -> clip -> skip if non-finite -> optimizer / scheduler step
        every log_every:        one log line + metrics.jsonl record (+ trackers)
        every eval_every:       validation loss / perplexity on fixed held-out windows
        every checkpoint_every: accelerate save_state into checkpoints/step_<N>/, atomically

Checkpoints hold model, optimizer, scheduler, RNG states (accelerate) and the run state (step, data
position, SR call counters, non-finite streak) and, in their COMPLETE.json marker, the SHA-256 of every
file; `resume=True` continues from the newest complete one whose files match (a damaged one is named and
passed over), so the remaining losses equal an uninterrupted run's.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from ..nn.compile import CUDA_GRAPH_MODES, compile_model, uses_cuda_graphs
from ..nn import lora_svd
from ..nn.fp4_gather import precompute_fp4_amax
from ..nn.swap import (enable_fp4_all_gather, fp4_modules, load_rng_state_dict, place_rng_states, rng_state_dict,
                       run_gemms_in_bf16, set_fp8_gemms)
from ..files import atomic_write_text, replace_dir
from .data import TokenWindows, fingerprint, prepare_data
from ..nn.diagnostics import locate_non_finite
from ..nn.experts import experts_states
from ..extras import optional, source_digest, versions
from ..hf.quantizer import FP4TrainConfig
from ..optim import build_optimizer, param_groups
from ..numerics.quantize import NonFiniteError
from .config import TrainConfig

COMPLETE = "COMPLETE.json"


class RunState:
    """What accelerate does not know: step, data position, SR counters, non-finite streak."""

    def __init__(self, model):
        self.model = model
        self.step = 0
        self.position = 0
        self.bad_in_row = 0
        self.skipped = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "position": self.position, "bad_in_row": self.bad_in_row,
                "skipped": self.skipped, "sr_calls": rng_state_dict(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.position = state["step"], state["position"]
        self.bad_in_row, self.skipped = state["bad_in_row"], state["skipped"]
        load_rng_state_dict(self.model, state["sr_calls"])


def run_fingerprint(cfg: TrainConfig) -> str:
    """What must match for a checkpoint to belong to this run (not output_dir / max_steps / logging)."""
    skip = {"output_dir", "max_steps", "eval_every", "log_every", "checkpoint_every", "keep_checkpoints",
            "trackers", "eval_batches"}
    return fingerprint({k: v for k, v in cfg.to_dict().items() if k not in skip})


def build_model(cfg: TrainConfig, vocab_size: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.init_from:  # continued pretraining: an hf_fp4 checkpoint keeps its recipe, a plain one gets cfg's
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from)
        if getattr(model.config, "quantization_config", None) is None:
            from ..hf.quantizer import apply_fp4_config
            apply_fp4_config(model, FP4TrainConfig(cfg.recipe, seed=cfg.seed, **cfg.recipe_options))
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"{cfg.init_from}: vocab_size {model.config.vocab_size} < tokenizer's {vocab_size}; "
                             f"use its own tokenizer (tokenizer={cfg.init_from})")
        return model

    kwargs = dict(cfg.model)
    model_type = kwargs.pop("model_type")
    kwargs.setdefault("vocab_size", vocab_size)
    if kwargs["vocab_size"] < vocab_size:
        raise ValueError(f"model.vocab_size={kwargs['vocab_size']} is smaller than the tokenizer's "
                         f"{vocab_size} tokens; drop model.vocab_size (it defaults to the tokenizer's)")
    try:
        hf_config = AutoConfig.for_model(model_type, **kwargs)
    except ValueError as err:
        raise ValueError(f"model.model_type={model_type!r}: {err}") from None
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos is not None and cfg.seq_len > max_pos:
        raise ValueError(f"seq_len={cfg.seq_len} exceeds the model's max_position_embeddings={max_pos}; "
                         "lower seq_len or raise model.max_position_embeddings")
    qc = FP4TrainConfig(cfg.recipe, seed=cfg.seed, **cfg.recipe_options)
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(hf_config, quantization_config=qc)


def check_accelerate_dynamo(accelerator) -> None:
    """The trainer compiles its model itself; Accelerate must not compile it again in `prepare`.  Its dynamo setting
    from the environment is overridden (and said); a process whose Accelerate state was set up earlier with a
    dynamo backend (Accelerate keeps one state per process: an HF Trainer run with torch_compile before this one)
    cannot be, and is refused before training."""
    from accelerate.utils import DynamoBackend

    env = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
    if env.lower() != "no" and accelerator.is_main_process:
        print(f"hf_fp4: ACCELERATE_DYNAMO_BACKEND={env} is not used: the training config's compile, compile_mode "
              "and compile_backend decide how the model is compiled")
    backend = accelerator.state.dynamo_plugin.backend
    if backend != DynamoBackend.NO:
        raise RuntimeError(f"this process's Accelerate state was set up earlier with dynamo backend "
                           f"{backend.value.lower()} (an Accelerator or an HF Trainer with torch_compile before this "
                           "run), so Accelerate would compile the model again over hf_fp4's own compilation: run "
                           "the trainer in a fresh process (its config's compile / compile_backend decide)")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Warmup, then cosine / WSD / constant down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        decay_start = int(cfg.max_steps * (1 - cfg.wsd_decay_fraction))
        if step < decay_start:
            return 1.0
        frac = (step - decay_start) / max(1, cfg.max_steps - decay_start)
        return 1.0 - (1.0 - cfg.min_lr_ratio) * frac
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def compute_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of [B, L + 1] token windows.  No KV cache: building one would also make
    each compiled decoder block specialise on its layer index (a recompilation per layer).  Each call is a new
    step for CUDA graphs (compile_mode reduce-overhead): the previous forward's graph outputs are dead by then."""
    torch.compiler.cudagraph_mark_step_begin()
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1))


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU batch on `device`: to a GPU from pinned memory without blocking -- a copy from pageable memory first
    waits for the stream, so the host could not queue the next forward while the optimizer step still ran."""
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


def _forward_backward(accelerator, model, tokens) -> None:
    with accelerator.autocast():
        loss = compute_loss(model, tokens)
    loss.backward()


@torch.no_grad()
def evaluate(model, windows: TokenWindows, cfg: TrainConfig, device) -> float:
    model.eval()
    n = min(cfg.eval_batches * cfg.batch_size, windows.num_windows)
    losses = []
    for start in range(0, n, cfg.batch_size):
        tokens = windows.batch(start, min(cfg.batch_size, n - start)).to(device)
        losses.append(compute_loss(model, tokens).item())
    model.train()
    return sum(losses) / len(losses)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    ckpts = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / COMPLETE).exists()]
    return sorted(ckpts, key=lambda p: int(p.name.split("_")[1]))


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under folder (the marker itself excluded), by relative path."""
    digests = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != COMPLETE:
            h = hashlib.sha256()
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            digests[str(path.relative_to(folder))] = h.hexdigest()
    return digests


def checkpoint_damage(ckpt: Path) -> str | None:
    """None when every file the marker lists is there with its checksum; else what is wrong."""
    recorded = json.loads((ckpt / COMPLETE).read_text()).get("files")
    if recorded is None:
        return None  # a checkpoint written before checksums were recorded
    found = file_digests(ckpt)
    for name, digest in recorded.items():
        if name not in found:
            return f"{name} is missing"
        if found[name] != digest:
            return f"{name} does not match its recorded SHA-256 (truncated or corrupted)"
    return None


def check_output_dir(run_dir: Path, cfg: TrainConfig, resume: bool, overwrite: bool) -> Path | None:
    """Refuse to clobber another run; return the checkpoint to resume from (if any): the newest one whose
    files match their recorded checksums, saying which damaged ones were passed over."""
    has_run = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()
    if overwrite and run_dir.exists():
        shutil.rmtree(run_dir)
        return None
    if not has_run:
        return None
    if not resume:
        raise FileExistsError(f"{run_dir} already holds a run; pass --resume to continue it or --overwrite "
                              "to start over (its files would be deleted)")
    ckpts = complete_checkpoints(run_dir)
    if not ckpts:  # killed before its first checkpoint completed: start over, if it is this run
        saved = run_dir / "train_config.yaml"
        if saved.exists() and run_fingerprint(TrainConfig.from_dict(yaml.safe_load(saved.read_text()))) \
                != run_fingerprint(cfg):
            raise ValueError(f"{run_dir} belongs to another run (different config); use another --output_dir "
                             "or --overwrite")
        rewrite_metrics(run_dir / "metrics.jsonl", 0)
        print(f"hf_fp4: {run_dir} holds no complete checkpoint; --resume starts the run over from step 0")
        return None
    marker = json.loads((ckpts[-1] / COMPLETE).read_text())
    if marker["fingerprint"] != run_fingerprint(cfg):
        raise ValueError(f"{ckpts[-1]} belongs to another run (different config); use another --output_dir "
                         "or --overwrite")
    damaged = []
    for ckpt in reversed(ckpts):
        problem = checkpoint_damage(ckpt)
        if problem is None:
            if damaged:
                print(f"hf_fp4: skipping damaged checkpoint(s) {'; '.join(damaged)}; resuming from {ckpt}")
            return ckpt
        damaged.append(f"{ckpt}: {problem}")
    raise RuntimeError("every checkpoint is damaged, nothing to resume from: " + "; ".join(damaged)
                       + " (--overwrite starts over)")


def save_checkpoint(accelerator, run_dir: Path, step: int, cfg: TrainConfig) -> None:
    """accelerate save_state into a temporary folder, then one rename: never half-written."""
    final = run_dir / "checkpoints" / f"step_{step}"
    tmp = run_dir / "checkpoints" / f".tmp_step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            atomic_write_text(tmp / COMPLETE, json.dumps({"step": step, "fingerprint": run_fingerprint(cfg),
                                                          "files": file_digests(tmp)}))
    except OSError as e:  # e.g. a full disk: the half-written folder goes, the previous checkpoints stay
        shutil.rmtree(tmp, ignore_errors=True)
        kept = complete_checkpoints(run_dir)
        raise RuntimeError(f"writing the step-{step} checkpoint failed ({e}); "
                           + (f"{kept[-1]} is intact (--resume continues from it)" if kept else
                              "no earlier checkpoint exists")) from e
    if accelerator.is_main_process:
        replace_dir(tmp, final)
        for old in complete_checkpoints(run_dir)[:-cfg.keep_checkpoints]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def export_final(accelerator, model, tokenizer, run_dir: Path, cfg: TrainConfig) -> Path:
    """save_pretrained of the full model into final/ (gathered first when sharded: a collective)."""
    final = run_dir / "final"
    state = accelerator.get_state_dict(model)  # every rank takes part (FSDP gathers the shards)
    if accelerator.is_main_process:
        tmp = run_dir / ".tmp_final"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        # save_pretrained ignores state_dict= while a quantizer is attached: detach it for the call
        quantizer = getattr(unwrapped, "hf_quantizer", None)
        unwrapped.hf_quantizer = None
        try:
            unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        finally:
            unwrapped.hf_quantizer = quantizer
        tokenizer.save_pretrained(tmp)
        (tmp / "train_config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        replace_dir(tmp, final)
    accelerator.wait_for_everyone()
    return final


def rewrite_metrics(path: Path, up_to_step: int) -> None:
    """On resume, drop the records an interrupted run wrote after its last checkpoint."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= up_to_step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))


def available_trackers(names: list[str]) -> list[str]:
    """The trackers that can run; each missing one is skipped with a note (metrics.jsonl is always written)."""
    extras = {"tensorboard": "tensorboard"}  # others (wandb, ...) are plain packages
    return [name for name in names
            if optional(name, extras.get(name), f"logging to {name} (metrics still go to metrics.jsonl)")]


def compile_mode(mode: str, distributed_type: str) -> str:
    """The compile mode of a run: under FSDP (accelerate's FSDP / FSDP2) without CUDA graphs -- FSDP frees each
    block's gathered weights after use and allocates them again at the next gather, which a replayed graph's
    fixed addresses cannot follow: "auto" compiles without them, a CUDA-graph mode is refused."""
    if distributed_type != "FSDP":
        return mode
    if mode == "auto":
        return "default"
    if mode in CUDA_GRAPH_MODES:
        raise ValueError(f"compile_mode={mode} runs CUDA graphs, which FSDP does not support (it frees and "
                         "re-allocates the gathered weights every step): use compile_mode: default (auto does under "
                         "FSDP)")
    return mode


def enable_fp4_gather(accelerator, model) -> None:
    """FP4 weight all-gather (hf_fp4.nn.fp4_gather) under accelerate's FSDP2, before prepare shards the model."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type is not DistributedType.FSDP or not getattr(accelerator, "is_fsdp2", False):
        raise ValueError("fp4_all_gather needs FSDP2: accelerate launch --config_file configs/accelerate/fsdp2.yaml "
                         f"(this run is {accelerator.distributed_type.value})")
    left = enable_fp4_all_gather(model, world_size=accelerator.num_processes)
    if accelerator.is_main_process:
        print(f"hf_fp4: FP4 all-gather for {len(fp4_modules(model)) - len(left)} FP4 linears"
              + "".join(f"\n  {name}: high precision ({why})" for name, why in left.items()))


def largest_grad_norms(model: torch.nn.Module, n: int) -> dict[str, float]:
    """The n parameters with the largest gradient norms (before clipping), largest first: which layer a growing
    total norm comes from.  Under FSDP each process's shard of a gradient (its local norm)."""
    norms = [(name, p.grad.detach().float().norm()) for name, p in model.named_parameters() if p.grad is not None]
    if not norms:
        return {}
    values = torch.stack([v for _, v in norms]).cpu().tolist()  # one device-to-host copy
    order = sorted(range(len(values)), key=lambda i: -values[i] if values[i] == values[i] else -math.inf)
    return {norms[i][0]: values[i] for i in order[:n]}


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run one pretraining job; returns the final metrics record."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    run_dir = Path(cfg.output_dir)
    resume_from = check_output_dir(run_dir, cfg, resume, overwrite)
    mixed = cfg.mixed_precision if cfg.mixed_precision != "auto" else ("bf16" if torch.cuda.is_available() else "no")
    trackers = available_trackers(cfg.trackers)
    # one scheduler step per optimizer step, whatever the number of processes; no dynamo: the trainer compiles the
    # model itself (check_accelerate_dynamo)
    accelerator = Accelerator(mixed_precision=mixed, log_with=trackers or None, project_dir=str(run_dir),
                              step_scheduler_with_optimizer=False, dynamo_backend="no")
    check_accelerate_dynamo(accelerator)
    # each machine's first process tokenises into the cache, the others then read it: ranks that prepared the same
    # shards side by side replaced each other's tokenizer folder while reading it (a CI run of session 20)
    with accelerator.local_main_process_first():
        data = prepare_data(cfg.dataset, cfg.tokenizer, cfg.vocab_size, cfg.val_fraction)
    set_seed(cfg.seed)
    model = build_model(cfg, data.vocab_size)
    if cfg.fp8_gemms != "auto":  # auto keeps each module's default (FP8 for FP4 linears, BF16 for MoE experts)
        set_fp8_gemms(model, cfg.fp8_gemms)
    if cfg.fp4_all_gather:
        enable_fp4_gather(accelerator, model)
    compiled = cfg.compile is True or (cfg.compile == "auto" and torch.cuda.is_available())
    mode = compile_mode(cfg.compile_mode, accelerator.distributed_type.value)
    if compiled:
        compile_model(model, mode, cfg.compile_backend)
    # A gradient is a CUDA-graph output that the next micro-step's replay overwrites: a parameter whose .grad is
    # None would take that buffer as its .grad; an allocated .grad accumulates into itself instead.
    keep_grads = compiled and uses_cuda_graphs(mode, cfg.compile_backend, model) and cfg.grad_accum > 1
    train_windows = TokenWindows(data.shard("train"), cfg.seq_len, seed=cfg.seed)
    val_windows = TokenWindows(data.shard("val"), cfg.seq_len, shuffle=False)

    optimizer_name = cfg.optimizer_name()  # muon: hidden matrices by Muon, the rest by its AdamW part
    groups = param_groups(model, optimizer_name, cfg.weight_decay, cfg.lora_svd_lr_scale, cfg.lora_svd_weight_decay)
    optimizer = build_optimizer(optimizer_name, groups, cfg.lr, (cfg.beta1, cfg.beta2), cfg.optimizer_options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    place_rng_states(accelerator.unwrap_model(model))
    state = RunState(accelerator.unwrap_model(model))
    accelerator.register_for_checkpointing(state)

    metrics_path = run_dir / "metrics.jsonl"
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        if accelerator.is_main_process:
            rewrite_metrics(metrics_path, state.step)
            print(f"hf_fp4: resumed from {resume_from} (step {state.step})")
    if trackers:
        accelerator.init_trackers("hf_fp4", config={k: str(v) for k, v in cfg.to_dict().items()})

    n_params = sum(p.numel() for p in model.parameters())
    world, rank = accelerator.num_processes, accelerator.process_index
    tokens_per_step = cfg.batch_size * cfg.grad_accum * world * cfg.seq_len
    if accelerator.is_main_process:
        print(f"hf_fp4: {n_params / 1e6:.2f}M parameters, recipe {cfg.recipe}, {world} process(es) "
              f"({accelerator.distributed_type.value}), "
              f"{len(fp4_modules(accelerator.unwrap_model(model)))} FP4 linears, "
              f"{sum(s.recipe.quantized for s in experts_states(accelerator.unwrap_model(model)).values())} FP4 "
              f"experts layers, {tokens_per_step} tokens/step, "
              f"{data.train_tokens} train / {data.val_tokens} val tokens")
        # what ran: runs of one study made by different code can part ways long before their recipes differ
        atomic_write_text(run_dir / "run_info.json", json.dumps(
            {"train_tokens_available": data.train_tokens, "val_tokens": data.val_tokens,
             "tokens_per_step": tokens_per_step, "processes": world, "parameters": n_params,
             "device": torch.cuda.get_device_name(accelerator.device) if accelerator.device.type == "cuda"
             else accelerator.device.type,
             "versions": versions("torch", "triton", "transformers", "accelerate", "hf_fp4"),
             "hf_fp4_source": source_digest()}))
    # a log file (a study's runs, a batch job) gets a progress line every 30 s, not one per step
    bar = tqdm(total=cfg.max_steps, initial=state.step, disable=not accelerator.is_main_process, desc="train",
               mininterval=0.1 if sys.stderr.isatty() else 30.0)
    record: dict[str, Any] = {}
    params = [p for p in model.parameters() if p.requires_grad]
    if keep_grads:
        for p in params:
            p.grad = torch.zeros_like(p)
    base_recipes = {name: m.recipe for name, m in fp4_modules(accelerator.unwrap_model(model)).items()}
    bf16_gemms: tuple[str, ...] = ()
    while state.step < cfg.max_steps:
        if (wanted := cfg.bf16_gemms_at(state.step)) != bf16_gemms:  # the precision schedule: the step's alone
            bf16_gemms = wanted
            run_gemms_in_bf16(accelerator.unwrap_model(model), bf16_gemms, base_recipes)
            accelerator.print(f"hf_fp4: from step {state.step + 1} on, {', '.join(bf16_gemms)} in BF16 "
                              "(precision_schedule)")
        t0 = time.perf_counter()
        loss_sum, finite, reason = 0.0, True, ""
        losses, batches = [], []
        for micro in range(cfg.grad_accum):
            tokens = to_device(train_windows.batch(state.position + rank * cfg.batch_size, cfg.batch_size),
                               accelerator.device)
            state.position += cfg.batch_size * world
            batches.append(tokens)
            sync = accelerator.no_sync(model) if micro < cfg.grad_accum - 1 else _nullcontext()
            with sync:
                loss = None
                try:
                    with accelerator.autocast():
                        loss = compute_loss(model, tokens)
                    accelerator.backward(loss / cfg.grad_accum)
                except NonFiniteError as err:  # a quantizer of the reference path met a NaN / Inf: in the
                    # backward of a non-finite loss, the loss is the cause to name
                    value = loss.item() if loss is not None else 0.0
                    finite, reason = False, f"loss is {value}" if not math.isfinite(value) else str(err)
                    break
            losses.append(loss.detach().clone())  # (a copy: the next micro-step's replay may reuse a graph output)
        if finite:  # the micro-steps' losses in one host read, once their backward passes are queued (session 35: a
            # read between forward and backward left the GPU idle while the host launched the backward); a
            # non-finite loss only costs its backward pass, whose gradients the skipped step never applies
            for micro, value in enumerate(torch.stack(losses).float().tolist()):
                if not math.isfinite(value):
                    finite, reason, tokens = False, f"loss is {value}", batches[micro]  # (the rerun's batch)
                    break
                loss_sum += value / cfg.grad_accum
        if world > 1:  # the logged loss is the mean over ranks: the same number a single process logs
            stats = torch.tensor([loss_sum if finite else float("nan"), float(finite)], device=accelerator.device)
            stats = accelerator.reduce(stats, reduction="mean")
            finite = finite and bool(stats[1] == 1.0)
            loss_sum = float(stats[0])
            if not finite and not reason:
                reason = "non-finite loss on another rank"
        grad_norm = float("nan")
        top_grads = None
        if finite and cfg.log_top_grads and (state.step + 1) % cfg.log_every == 0:
            top_grads = largest_grad_norms(accelerator.unwrap_model(model), cfg.log_top_grads)
        if finite:
            grad_norm = float(accelerator.clip_grad_norm_(params, cfg.grad_clip))
            if not math.isfinite(grad_norm):
                finite, reason = False, f"gradient norm is {grad_norm}"
        if not finite and world == 1:  # name the layer and GEMM that met the NaN/Inf (a rerun, eager)
            where = locate_non_finite(accelerator.unwrap_model(model), lambda: _forward_backward(
                accelerator, model, tokens))
            reason += f"; first in a quantized GEMM: {where}" if where else "; no FP4 GEMM input was non-finite"
        state.step += 1
        if finite:
            optimizer.step()
            scheduler.step()
            state.bad_in_row = 0
            lora_svd.maybe_refresh(accelerator.unwrap_model(model), state.step)
            if cfg.fp4_all_gather:  # the next gathers' tensor amaxes, in one all-reduce
                precompute_fp4_amax(accelerator.unwrap_model(model))
        else:
            state.bad_in_row += 1
            state.skipped += 1
        optimizer.zero_grad(set_to_none=not keep_grads)
        dt = time.perf_counter() - t0
        record = {"step": state.step, "tokens": state.step * tokens_per_step,
                  "loss": loss_sum if finite else None, "lr": scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm if finite else None, "tokens_per_s": tokens_per_step / dt,
                  "skipped": not finite}
        if bf16_gemms:
            record["bf16_gemms"] = list(bf16_gemms)
        if top_grads:
            record["top_grads"] = top_grads
        if not finite:
            record["reason"] = reason
            accelerator.print(f"hf_fp4: step {state.step} skipped ({reason}); "
                              f"{state.bad_in_row} non-finite step(s) in a row")
        if state.step % cfg.eval_every == 0 or state.step == cfg.max_steps:
            val = evaluate(model, val_windows, cfg, accelerator.device)
            record.update(val_loss=val, val_ppl=math.exp(min(val, 50)))
        if accelerator.is_main_process and (state.step % cfg.log_every == 0 or "val_loss" in record or not finite):
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if trackers:
            accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and v is not None},
                            step=state.step)
        bar.update(1)
        # (no forced refresh: tqdm's mininterval decides, so a log file gets a line every 30 s, not one per step)
        bar.set_postfix(loss=f"{loss_sum:.3f}" if finite else "skip", tok_s=f"{record['tokens_per_s']:.0f}",
                        refresh=False)
        if state.bad_in_row >= cfg.max_bad_steps:
            save_checkpoint(accelerator, run_dir, state.step, cfg)
            raise RuntimeError(f"{state.bad_in_row} non-finite steps in a row (last: {reason}); "
                               f"checkpoint saved at {run_dir}/checkpoints/step_{state.step}")
        if state.step % cfg.checkpoint_every == 0:
            save_checkpoint(accelerator, run_dir, state.step, cfg)
    bar.close()
    final = export_final(accelerator, model, data.tokenizer, run_dir, cfg)
    if trackers:
        accelerator.end_training()
    if accelerator.is_main_process:
        sample = None
        if world == 1:  # a sharded model would need a gather to generate
            sample = greedy_sample(accelerator.unwrap_model(model), data.tokenizer,
                                   val_windows.batch(0, 1)[0, :8], accelerator.device)
        print(run_summary(run_dir, final, record, sample))
    return record


def greedy_sample(model, tokenizer, prompt: torch.Tensor, device, new_tokens: int = 32) -> str:
    """A short greedy continuation of a validation prompt by the final model (eager: no recompilation)."""
    model.eval()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        ids = model.generate(prompt[None].to(device), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id or 0)
    model.train()
    return tokenizer.decode(ids[0], skip_special_tokens=True)


def run_summary(run_dir: Path, final: Path, record: dict, sample: str | None) -> str:
    """What a finished run leaves behind, for a person: where everything is, the curve, a sample of text."""
    lines = [f"hf_fp4: done, step {record.get('step')}"
             + (f", validation loss {record['val_loss']:.4f}" if record.get("val_loss") is not None else ""),
             f"  metrics      {run_dir / 'metrics.jsonl'}"]
    if optional("matplotlib", "plot", "the loss-curve PNG"):
        from .compare import load_run, plot_runs
        plot_runs([load_run(run_dir)], run_dir / "loss_curve.png")
        lines.append(f"  loss curve   {run_dir / 'loss_curve.png'}")
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if checkpoints:
        lines.append(f"  checkpoints  {run_dir / 'checkpoints'} (newest {checkpoints[-1].name}; --resume continues)")
    lines.append(f"  final model  {final} (scripts/export.py --model {final} ...)")
    if sample is not None:
        lines.append(f"  sample       {sample!r} (greedy, from a validation prompt)")
    return "\n".join(lines)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
