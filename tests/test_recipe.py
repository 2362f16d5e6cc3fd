"""Recipes as data: the README's recipe table is generated from the presets and must not drift."""
from pathlib import Path

import pytest

from hf_fp4.nn.recipe import OPTION_DOCS, RECIPE_OPTIONS, option_table, preset, preset_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_recipe_table_is_the_generated_one():
    assert preset_table() in (ROOT / "README.md").read_text(), (
        "README.md's recipe table differs from hf_fp4.nn.recipe.preset_table(): paste the generated table")


def test_readme_option_table_is_the_generated_one_and_lists_every_option():
    assert set(OPTION_DOCS) == set(RECIPE_OPTIONS) | {"seed", "rules", "attention"}, (
        "an option of preset() has no row in OPTION_DOCS (or a row names no option)")
    assert option_table() in (ROOT / "README.md").read_text(), (
        "README.md's option table differs from hf_fp4.nn.recipe.option_table(): paste the generated table")


def test_every_documented_option_is_accepted_and_an_unknown_one_names_them():
    for value in ({"gemms": ("fprop",)}, {"hadamard": "deterministic"}, {"hadamard_size": 32}, {"grid": "e1m2"},
                  {"mean_bias_removal": True}, {"lora_svd_rank": 4}, {"lora_svd_refresh_every": 10},
                  {"stochastic_rounding": False}, {"weight_blocks": "1d"}, {"activation_scheme": "plain"},
                  {"seed": 3}, {"rules": {"keep_last_blocks": 1}}, {"attention": "nvfp4"}):
        preset("nvfp4", **value)
    with pytest.raises(ValueError, match="unknown recipe option.*valid: seed, rules, attention, gemms"):
        preset("nvfp4", lora_rank=4)


def test_sr_and_weight_block_ablation_options():
    """stochastic_rounding=False: every operand rounds to nearest; weight_blocks: the fprop / dgrad weight
    operands get 1 x B or B x B blocks, the activations and gradients keep theirs."""
    from hf_fp4.numerics.spec import Rounding

    base = preset("nvfp4").linear
    assert any(s.rounding is Rounding.STOCHASTIC for s in base.operand_specs())
    rtn = preset("nvfp4", stochastic_rounding=False).linear
    assert all(s.rounding is Rounding.NEAREST for s in rtn.operand_specs())
    assert preset("nvfp4", stochastic_rounding=True).linear == base
    one_d = preset("nvfp4", weight_blocks="1d").linear
    assert one_d.fprop.rhs.block == one_d.dgrad.rhs.block == (1, 16) and one_d.wgrad == base.wgrad
    assert one_d.fprop.lhs == base.fprop.lhs and one_d.dgrad.lhs == base.dgrad.lhs
    two_d = preset("mxfp4", weight_blocks="2d").linear
    assert two_d.fprop.rhs.block == two_d.dgrad.rhs.block == (32, 32) and two_d.wgrad.rhs.block == (1, 32)
    with pytest.raises(ValueError, match="weight_blocks='3d': valid values are 1d, 2d"):
        preset("nvfp4", weight_blocks="3d")
