"""Every bad input in the README's "Bad input" table fails at once with a clear error, before any download,
tokenization or training.  The table is rendered from CASES: a row without a case here fails the test."""
import json
from pathlib import Path

import pytest
import torch

import hf_fp4
from hf_fp4.train import trainer
from hf_fp4.train.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4}, "dataset": "builtin"}


def cfg(**changes):
    return TrainConfig.from_dict({**TINY, **changes})


def a_run_dir(tmp_path, fingerprint=None):
    """A folder holding a run: metrics, and a complete checkpoint with the given config fingerprint."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / "checkpoints" / "step_2" / trainer.COMPLETE).write_text(json.dumps({"step": 2, "fingerprint":
                                                                               fingerprint or "another run"}))
    return run


# (what the user did, the exception, what the message says) -> a callable doing it
CASES = [
    ("unknown recipe preset", ValueError, "valid presets: bf16, nvfp4",
     lambda tmp: hf_fp4.FP4TrainConfig("nvfp5")),
    ("misspelt config key", ValueError, "unknown config key 'lrr' \\(did you mean 'lr'\\?\\); valid keys",
     lambda tmp: cfg(lrr=1e-3)),
    ("wrong type in the YAML", ValueError, "config key 'max_steps' must be int, got str 'ten'",
     lambda tmp: cfg(max_steps="ten")),
    ("a switch that is not a bool", ValueError, "config key 'fp4_all_gather' must be bool, got str 'no'",
     lambda tmp: cfg(fp4_all_gather="no")),
    ("a three-way switch given another value", ValueError, "fp8_gemms='no': valid values are auto, true, false",
     lambda tmp: cfg(fp8_gemms="no")),
    ("value outside its choices", ValueError, "compile_mode='fast': valid values are auto, default, reduce-overhead",
     lambda tmp: cfg(compile_mode="fast")),
    ("override that is not key=value", ValueError, "override 'lr' must look like key=value",
     lambda tmp: load_config(ROOT / "configs" / "tiny-cpu.yaml", ["lr"])),
    ("missing config file", FileNotFoundError, "config file .*nope.yaml not found",
     lambda tmp: load_config(tmp / "nope.yaml")),
    ("unknown recipe option", ValueError, "unknown recipe option\\(s\\) \\['lora_rank'\\]; valid: seed, rules, attention, gemms",
     lambda tmp: cfg(recipe="nvfp4", recipe_options={"lora_rank": 8})),
    ("ill-typed recipe option", ValueError, "recipe option lora_svd_rank must be int, got str",
     lambda tmp: cfg(recipe="nvfp4", recipe_options={"lora_svd_rank": "8"})),
    ("a LoRA-SVD lr scale of zero", ValueError, "lora_svd_lr_scale must be a number > 0, got 0",
     lambda tmp: cfg(recipe="nvfp4", recipe_options={"lora_svd_rank": 8}, lora_svd_lr_scale=0)),
    ("unknown attention format", ValueError, "attention.ds: unknown format 'nvfp5'; valid: none, nvfp4",
     lambda tmp: cfg(recipe="nvfp4", recipe_options={"attention": {"ds": "nvfp5"}})),
    ("unknown quantization format value", ValueError, "unknown element grid 'e2m2'; valid grids: e2m1",
     lambda tmp: hf_fp4.QuantSpec(grid="e2m2")),
    ("unknown model type", ValueError, "model_type='lama' is not a transformers model type \\(did you mean 'llama'",
     lambda tmp: cfg(model={"model_type": "lama"})),
    ("attention heads that do not divide", ValueError, "hidden_size=64 is not a multiple of model.num_attention_heads=5",
     lambda tmp: cfg(model={**TINY["model"], "num_attention_heads": 5})),
    ("precision schedule naming an unknown GEMM", ValueError,
     "precision_schedule\\[0\\].bf16 must be a non-empty list of GEMMs from fprop, dgrad, wgrad",
     lambda tmp: cfg(precision_schedule=[{"at": 0.85, "bf16": ["fprob"]}])),
    ("missing dataset files", FileNotFoundError, "dataset.files: not found: .*missing.txt",
     lambda tmp: cfg(dataset={"files": [str(tmp / "missing.txt")]})),
    ("output directory holding another run", FileExistsError, "already holds a run; pass --resume .* or --overwrite",
     lambda tmp: trainer.check_output_dir(a_run_dir(tmp), cfg(), resume=False, overwrite=False)),
    ("--resume with a config that differs from the checkpoint's", ValueError, "belongs to another run",
     lambda tmp: trainer.check_output_dir(a_run_dir(tmp), cfg(), resume=True, overwrite=False)),
    ("unknown FP4Linear backend", ValueError, "FP4Linear.backend='cuda'; valid: auto, reference, triton",
     lambda tmp: _layer_with_backend("cuda")(torch.randn(2, 32))),
    ("a generator for the Triton quantizer", ValueError, "draws stochastic-rounding noise with Philox: pass seed=",
     lambda tmp: hf_fp4.quantize(torch.randn(4, 32), "mxfp4", backend="triton", generator=torch.Generator())),
    ("model directory without weights", FileNotFoundError, "has a config.json but no weights",
     lambda tmp: _config_only(tmp)),
    ("a GGUF architecture transformers cannot load", ValueError,
     "transformers cannot load m.gguf: GGUF model with architecture rwkv7 is not supported",
     lambda tmp: _gguf_of(tmp, "rwkv7")),
]


def _layer_with_backend(backend):
    layer = hf_fp4.FP4Linear.from_linear(torch.nn.Linear(32, 16), hf_fp4.preset("mxfp4").linear)
    layer.backend = backend
    return layer


def _config_only(tmp):
    from hf_fp4.release.evaluation import load_model

    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text("{}")
    return load_model(str(tmp / "m"))


def _gguf_of(tmp, arch):
    """A GGUF file of the given architecture (one tensor), loaded the way scripts/evaluate.py --gguf does."""
    import gguf  # the eval extra, installed by scripts/setup.sh
    import numpy as np

    from hf_fp4.release.evaluation import load_model

    writer = gguf.GGUFWriter(str(tmp / "m.gguf"), arch=arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return load_model(str(tmp), gguf_file="m.gguf")


def bad_input_table() -> str:
    rows = ["| bad input | error |", "|---|---|"]
    for what, exc, message, _ in CASES:
        shown = message.replace("\\", "").replace(".*", "...")
        rows.append(f"| {what} | `{exc.__name__}`: {shown} |")
    return "\n".join(rows)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_with_a_clear_error(case, tmp_path):
    _, exc, message, do = case
    if "Triton" in case[0]:
        pytest.importorskip("hf_fp4.kernels.quant")
    with pytest.raises(exc, match=message):
        do(tmp_path)


def test_readme_bad_input_table_is_the_tested_one():
    assert bad_input_table() in (ROOT / "README.md").read_text(), "README's bad-input table drifted:\n" + \
        bad_input_table()
