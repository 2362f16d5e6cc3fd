"""The typed pretraining config: YAML file + `key=value` overrides, validated before the first step."""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from ..nn.recipe import GEMMS, preset
from ..nn.compile import BACKENDS as COMPILE_BACKENDS, MODES
from .data import BUILTIN_DATASETS

#: optimizer name -> the optimizer_options it takes (lr, betas, eps, weight decay come from the config)
OPTIMIZERS = {"adamw": (), "fp4_adamw": ("state_spec", "v_transform", "min_numel"),
              "muon": ("muon_lr", "momentum", "ns_steps", "ns_spec", "ns_iteration", "ns_cuda_graphs")}


@dataclass
class TrainConfig:
    # model: an architecture name ("llama", "qwen2", ... any AutoConfig model_type) plus its config keys
    model: dict[str, Any] = field(default_factory=lambda: {"model_type": "llama"})
    init_from: str = ""                           # continue from a checkpoint (scripts/convert.py --mode train)
    recipe: str = "bf16"                          # an hf_fp4 preset (hf_fp4.PRESET_NAMES)
    recipe_options: dict[str, Any] = field(default_factory=dict)  # FP4TrainConfig options (gemms, hadamard, ...)
    # late high precision: [{at: 0.85, bf16: [fprop]}] runs the named GEMMs in BF16 from that fraction of max_steps on
    precision_schedule: list[dict[str, Any]] = field(default_factory=list)
    # data
    dataset: Any = "builtin"                      # "builtin" | "builtin-large" | {"files": [...]} | {"hub": name}
    tokenizer: str = "builtin"                    # "builtin" (BPE trained on the corpus) or an HF tokenizer
    vocab_size: int = 8192                        # of the built-in tokenizer
    val_fraction: float = 0.02                    # documents held out for validation
    seq_len: int = 256
    # optimisation
    batch_size: int = 16                          # sequences per micro-batch per process
    grad_accum: int = 1
    max_steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"                      # cosine | wsd | constant
    wsd_decay_fraction: float = 0.2               # WSD: the last fraction of steps decays linearly
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    optimizer: str = "auto"   # auto (the recipe's: fullstack fp4_adamw, else adamw) | adamw | fp4_adamw | muon
    optimizer_options: dict[str, Any] = field(default_factory=dict)  # see OPTIMIZERS
    lora_svd_lr_scale: float = 1.0                # LoRA-SVD factors train at lr * this (recipe lora_svd_rank > 0)
    lora_svd_weight_decay: float = 0.0            # and with this decoupled weight decay
    seed: int = 0
    mixed_precision: str = "auto"                 # auto (bf16 on GPU, no on CPU) | bf16 | no
    compile: Any = "auto"                         # torch.compile each decoder block: auto (on GPU) | true | false
    compile_mode: str = "auto"                    # auto (CUDA graphs on GPU) | default | reduce-overhead | max-autotune...
    compile_backend: str = "inductor"             # inductor | aot_eager (debugging: same numerics as eager)
    fp8_gemms: Any = "auto"                       # MX-family GEMMs: auto (FP8 linears, BF16 MoE experts) | true
    #                                               (all on the FP8 tensor cores) | false (all BF16, FP32 accum.)
    fp4_all_gather: bool = False                  # FSDP2: all-gather FP4 layers' weights as FP4 codes + scales
    # bookkeeping
    output_dir: str = "runs/default"
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 1
    log_top_grads: int = 0                        # > 0: each logged step names its n largest gradient norms
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    max_bad_steps: int = 5                        # non-finite steps in a row before aborting
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        choices = {"schedule": ("cosine", "wsd", "constant"), "mixed_precision": ("auto", "bf16", "no"),
                   "compile": ("auto", True, False), "fp8_gemms": ("auto", True, False),
                   "fp4_all_gather": (True, False),
                   "compile_mode": MODES, "compile_backend": COMPILE_BACKENDS}
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ValueError(f"{key}={getattr(self, key)!r}: valid values are "
                                 f"{', '.join(str(v).lower() for v in valid)}")
        for key in ("lora_svd_lr_scale", "lora_svd_weight_decay"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    key == "lora_svd_lr_scale" and value == 0):
                raise ValueError(f"{key} must be a number {'> 0' if key == 'lora_svd_lr_scale' else '>= 0'}, "
                                 f"got {value!r}")
        if not isinstance(self.log_top_grads, int) or self.log_top_grads < 0:
            raise ValueError(f"log_top_grads must be an integer >= 0, got {self.log_top_grads!r}")
        positive = ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches",
                    "log_every", "checkpoint_every", "keep_checkpoints", "max_bad_steps", "vocab_size")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if "model_type" not in self.model:
            raise ValueError("model needs a model_type (e.g. llama, qwen2)")
        self._validate_model()
        preset(self.recipe, seed=self.seed, **self.recipe_options)  # unknown or ill-typed options fail here
        self._validate_precision_schedule()
        self._validate_optimizer()
        if not isinstance(self.dataset, dict) and self.dataset not in BUILTIN_DATASETS:
            raise ValueError(f"dataset={self.dataset!r}: valid values are {', '.join(BUILTIN_DATASETS)} or a "
                             "mapping ({files: [...]} or {hub: name})")
        if isinstance(self.dataset, dict) and "files" in self.dataset:
            missing = [str(f) for f in self.dataset["files"] if not Path(f).exists()]
            if missing:
                raise FileNotFoundError(f"dataset.files: not found: {missing}")

    def optimizer_name(self) -> str:
        """The optimizer this run builds: `optimizer`, or for auto the recipe's own (else adamw)."""
        if self.optimizer != "auto":
            return self.optimizer
        return preset(self.recipe, seed=self.seed, **self.recipe_options).optimizer or "adamw"

    def _validate_optimizer(self) -> None:
        if self.optimizer not in ("auto", *OPTIMIZERS):
            raise ValueError(f"optimizer={self.optimizer!r}: valid values are auto, {', '.join(OPTIMIZERS)}")
        name = self.optimizer_name()
        valid = OPTIMIZERS[name]
        unknown = sorted(set(self.optimizer_options) - set(valid))
        if unknown:
            raise ValueError(f"optimizer_options {unknown} for optimizer={name}; valid: "
                             f"{', '.join(valid) or 'none'}")
        if name == "adamw":
            return
        from ..optim import build_optimizer  # bad values (an unknown spec, a transform) fail here, not at step 1

        build_optimizer(name, [{"params": [torch.zeros(1, 1, requires_grad=True)], "muon": True}],
                        self.lr, (self.beta1, self.beta2), self.optimizer_options)

    def _validate_precision_schedule(self) -> None:
        last = 0.0
        for i, entry in enumerate(self.precision_schedule):
            where = f"precision_schedule[{i}]"
            if not isinstance(entry, dict) or set(entry) != {"at", "bf16"}:
                raise ValueError(f"{where} must be a mapping with keys at, bf16 (e.g. {{at: 0.85, bf16: [fprop]}}), "
                                 f"got {entry!r}")
            at, gemms = entry["at"], entry["bf16"]
            if isinstance(at, bool) or not isinstance(at, (int, float)) or not last < at <= 1:
                raise ValueError(f"{where}.at must be a fraction of max_steps in ({last}, 1], increasing; got {at!r}")
            if not isinstance(gemms, list) or not gemms or set(gemms) - set(GEMMS):
                raise ValueError(f"{where}.bf16 must be a non-empty list of GEMMs from {', '.join(GEMMS)}; "
                                 f"got {gemms!r}")
            last = float(at)
            if self.fp4_all_gather and {"fprop", "dgrad"} & set(gemms):
                raise ValueError(f"{where}: fprop and dgrad in BF16 need the weight itself, which fp4_all_gather "
                                 "does not gather (switch wgrad only, or gather in high precision)")

    def bf16_gemms_at(self, step: int) -> tuple[str, ...]:
        """The GEMMs the precision schedule runs in BF16 for the step after `step` completed ones."""
        switched = {g for e in self.precision_schedule if step >= math.ceil(e["at"] * self.max_steps)
                    for g in e["bf16"]}
        return tuple(g for g in GEMMS if g in switched)

    def _validate_model(self) -> None:
        """The model's type is one transformers knows, and its attention shapes divide."""
        from transformers import CONFIG_MAPPING

        kind = self.model["model_type"]
        if kind not in CONFIG_MAPPING:
            close = difflib.get_close_matches(str(kind), list(CONFIG_MAPPING.keys()), n=3)
            raise ValueError(f"model.model_type={kind!r} is not a transformers model type"
                             + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
        m = self.model
        heads, kv = m.get("num_attention_heads"), m.get("num_key_value_heads")
        if heads and "hidden_size" in m and "head_dim" not in m and m["hidden_size"] % heads:
            raise ValueError(f"model.hidden_size={m['hidden_size']} is not a multiple of "
                             f"model.num_attention_heads={heads}")
        if heads and kv and heads % kv:
            raise ValueError(f"model.num_attention_heads={heads} is not a multiple of model.num_key_value_heads={kv}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        hints = typing.get_type_hints(cls)
        for key, value in data.items():
            if key not in hints:
                close = difflib.get_close_matches(key, hints, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(hints)}")
            _check_type(key, value, hints[key])
        return cls(**data)


def _check_type(key: str, value: Any, hint: Any) -> None:
    origin = typing.get_origin(hint) or hint
    if hint is Any:
        return
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if origin in (int, float, str, bool) and (not isinstance(value, origin) or
                                               (origin is int and isinstance(value, bool))):
        raise ValueError(f"config key {key!r} must be {origin.__name__}, got {type(value).__name__} {value!r}")
    if origin in (dict, list) and not isinstance(value, origin):
        raise ValueError(f"config key {key!r} must be a {origin.__name__}, got {type(value).__name__}")


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key=value (e.g. recipe=nvfp4, model.hidden_size=256)")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """A TrainConfig from a YAML file plus dotted `key=value` overrides (values parsed as YAML)."""
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).exists():
            raise FileNotFoundError(f"config file {path} not found")
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the config must be a mapping")
    return TrainConfig.from_dict(apply_overrides(data, overrides))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """data with each dotted `key=value` override set in place (values parsed as YAML); returns data."""
    for text in overrides:
        keys, value = parse_override(text)
        target = data
        for k in keys[:-1]:
            target = target.setdefault(k, {})
            if not isinstance(target, dict):
                raise ValueError(f"override {text!r}: {k} is not a mapping")
        target[keys[-1]] = value
    return data
