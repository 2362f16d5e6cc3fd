"""Recipes as data: the README's recipe table is generated from the presets and must not drift."""
from pathlib import Path

import pytest

from hf_fp4.recipe import preset, preset_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_recipe_table_is_the_generated_one():
    assert preset_table() in (ROOT / "README.md").read_text(), (
        "README.md's recipe table differs from hf_fp4.recipe.preset_table(): paste the generated table")


def test_sr_and_weight_block_ablation_options():
    """stochastic_rounding=False: every operand rounds to nearest; weight_blocks: the fprop / dgrad weight
    operands get 1 x B or B x B blocks, the activations and gradients keep theirs."""
    from hf_fp4.spec import Rounding

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
