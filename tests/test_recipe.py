"""Recipes as data: the README's recipe table is generated from the presets and must not drift."""
from pathlib import Path

from hf_fp4.recipe import preset_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_recipe_table_is_the_generated_one():
    assert preset_table() in (ROOT / "README.md").read_text(), (
        "README.md's recipe table differs from hf_fp4.recipe.preset_table(): paste the generated table")
