"""Recipes: registry, files, validation."""

import dataclasses
import json

import pytest

from adahop import RECIPES, Recipe, get_recipe
from adahop.policy.strategies import LEVEL1, LEVEL2, get_table


def test_registered_recipes():
    assert set(RECIPES) == {
        "bf16",
        "mxfp4",
        "mxfp4_hadamard",
        "adahop_lv1",
        "adahop_lv2",
        "adahop_lv1_bf16_forward",
        "adahop_lv1_fp8_forward",
        "torchao_float8_tensorwise",
        "torchao_float8_rowwise",
    }
    assert get_recipe("adahop_lv1_bf16_forward").bf16_gemms == ("forward",)
    assert get_recipe("mxfp4_hadamard").strategy == "iht"
    assert get_table(get_recipe("adahop_lv1").table) == LEVEL1
    assert get_table(get_recipe("adahop_lv2").table) == LEVEL2
    assert get_recipe("adahop_lv2").adaptive and not get_recipe("bf16").adaptive


def test_recipes_are_frozen_and_variants_leave_the_registry_alone():
    r = get_recipe("adahop_lv2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.oe_k = 1
    assert dataclasses.replace(r, oe_k=1).oe_k == 1
    assert RECIPES["adahop_lv2"].oe_k == 64


def test_toml_and_json_files(tmp_path):
    (tmp_path / "r.toml").write_text(
        '[recipe]\nname = "adahop_lv1"\nscale_rule = "rceil"\noe_k = 32\nhadamard_signs = true\n'
        '[recipe.table]\n"row,row" = "iht"\n"row,none" = "oe_left"\n"row,col" = "oe_right"\n'
        '"col,row" = "iht"\n"col,none" = "iht"\n"col,col" = "bf16"\n'
        '"none,row" = "iht"\n"none,none" = "mxfp4"\n"none,col" = "oe_right"\n'
    )
    r = get_recipe(tmp_path / "r.toml")
    assert (r.name, r.scale_rule, r.oe_k, r.hadamard_signs) == ("adahop_lv1", "rceil", 32, True)
    assert get_table(r.table)[("none", "none")].value == "mxfp4"
    (tmp_path / "r.json").write_text(json.dumps(r.to_dict()))
    assert get_recipe(str(tmp_path / "r.json")) == r


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"scale_rule": "nearest"}, "scale_rule"),
        ({"fmt": "fp4"}, "fmt"),
        ({"strategy": "oe_left"}, "strategy"),
        ({"hadamard_block_size": 48}, "hadamard_block_size"),
        ({"oe_k": 0}, "oe_k"),
        ({"table": "lv3"}, "lv1"),
        ({"bogus": 1}, "unknown recipe fields"),
    ],
)
def test_bad_values_list_the_choices(fields, match):
    with pytest.raises(ValueError, match=match):
        Recipe.from_dict({"name": "adahop_lv2", **fields})


def test_unknown_name_lists_valid_recipes():
    with pytest.raises(ValueError, match="adahop_lv2"):
        get_recipe("adahop_lv3")


def test_the_default_recipe_is_the_one_at_bf16s_loss_everywhere_a_recipe_can_be_left_out():
    """docs/quality.md (phases 4-5): lv1 with its forward GEMMs in BF16, dgrad and wgrad MXFP4."""
    from torch import nn

    from adahop import DEFAULT_RECIPE, AdaHOPLinear, convert_model
    from adahop.train.config import TrainConfig

    default = get_recipe(DEFAULT_RECIPE)
    assert (DEFAULT_RECIPE, default.bf16_gemms, get_table(default.table)) == (
        "adahop_lv1_bf16_forward",
        ("forward",),
        LEVEL1,
    )
    assert AdaHOPLinear(64, 32).recipe is default
    assert AdaHOPLinear.from_linear(nn.Linear(64, 32)).recipe is default
    model = convert_model(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    assert [m.recipe for m in model] == [default, default]
    assert [m.bf16_gemms for m in model] == [("forward",), ("forward",)]
    assert TrainConfig().recipe is default
    # A recipe table or file that names no base starts from the default, as the trainer's overrides do.
    assert Recipe.from_dict({"oe_k": 32}) == dataclasses.replace(default, oe_k=32)
