"""Strategy tables, the transpose rule and plan derivation, checked against the method text."""

import itertools
import tomllib

import pytest

from adahop.policy.strategies import (
    GEMMS,
    LEVEL1,
    LEVEL2,
    TABLES,
    LayerPlan,
    Strategy,
    gemm_pattern_pairs,
    get_table,
    opposite,
    plan_for_patterns,
)

PATTERNS = ("row", "col", "none")

# adahop-method.md section 5, transcribed: rows = pattern of A, columns = pattern of B.
METHOD_LV2 = {
    "row": {"row": "iht", "none": "oe_left", "col": "oe_right"},
    "col": {"row": "iht", "none": "iht", "col": "bf16"},
    "none": {"row": "iht", "none": "iht", "col": "oe_right"},
}
METHOD_LV1 = {**METHOD_LV2, "col": {**METHOD_LV2["col"], "col": "oe_right"}}  # lv1: col-col -> OE-right


def method_plan(px, pw, pg, level):
    """Independent re-derivation: transpose each operand into GEMM orientation, look up, fall back."""
    flip = {"row": "col", "col": "row", "none": "none"}
    table = METHOD_LV1 if level == "lv1" else METHOD_LV2
    forward = table[px][flip[pw]]  # Y = X W^T: A = X, B = W^T
    dgrad = table[pg][pw]  # dX = dY W: A = dY, B = W
    wgrad = table[flip[pg]][px]  # dW = dY^T X: A = dY^T, B = X
    if wgrad == "oe_left":  # X is saved only in MXFP4
        wgrad = "iht"
    return forward, dgrad, wgrad


@pytest.mark.parametrize("level", ["lv1", "lv2"])
def test_all_27_plans_match_the_method(level):
    for px, pw, pg in itertools.product(PATTERNS, repeat=3):
        plan = plan_for_patterns(px, pw, pg, level)
        assert (plan.forward.value, plan.dgrad.value, plan.wgrad.value) == method_plan(px, pw, pg, level)
        assert plan.patterns == {"x": px, "w": pw, "g": pg}


def test_tables_are_the_method_tables():
    for table, method in ((LEVEL1, METHOD_LV1), (LEVEL2, METHOD_LV2)):
        for a, b in itertools.product(PATTERNS, repeat=2):
            assert table[a, b] is Strategy(method[a][b])
    assert TABLES == {"lv1": LEVEL1, "lv2": LEVEL2}
    assert get_table("lv2") is LEVEL2 and get_table(LEVEL1) is LEVEL1
    assert [p for p in itertools.product(PATTERNS, repeat=2) if LEVEL1[p] != LEVEL2[p]] == [("col", "col")]


def test_transpose_rule():
    assert [opposite(p) for p in PATTERNS] == ["col", "row", "none"]
    assert gemm_pattern_pairs("col", "row", "none") == {
        "forward": ("col", "col"),
        "dgrad": ("none", "row"),
        "wgrad": ("none", "col"),
    }
    with pytest.raises(ValueError, match="valid"):
        opposite("diag")


def test_user_table_from_toml_round_trips():
    text = "\n".join(f'"{a},{b}" = "{"OE-left" if a == "row" else "iht"}"' for a in PATTERNS for b in PATTERNS)
    table = get_table(tomllib.loads(text))
    assert all(table[a, b] is (Strategy.OE_LEFT if a == "row" else Strategy.IHT) for a in PATTERNS for b in PATTERNS)
    assert get_table(table.to_dict()).entries == table.entries
    assert get_table(LEVEL2.to_dict()).entries == LEVEL2.entries
    assert get_table({(a, b): "bf16" for a in PATTERNS for b in PATTERNS})["row", "col"] is Strategy.BF16
    # wgrad OE-left still falls back with a user table
    assert plan_for_patterns("none", "none", "none", table).wgrad is Strategy.IHT


def test_bad_tables_get_clear_errors():
    full = LEVEL2.to_dict()
    with pytest.raises(ValueError, match="missing pattern pairs.*'none,none'"):
        get_table({k: v for k, v in full.items() if k != "none,none"})
    with pytest.raises(ValueError, match="unknown strategy 'fp8'.*valid"):
        get_table({**full, "row,row": "fp8"})
    with pytest.raises(ValueError, match="unknown pattern 'diag'"):
        get_table({**full, "diag,row": "iht"})
    with pytest.raises(ValueError, match="expected 'A,B'"):
        get_table({**full, "row": "iht"})
    with pytest.raises(ValueError, match=r"unknown strategy table 'lv3'.*lv1"):
        get_table("lv3")
    with pytest.raises(TypeError):
        get_table(3)


def test_tables_are_immutable():
    with pytest.raises(TypeError):
        LEVEL2.entries["row", "row"] = Strategy.BF16
    with pytest.raises(AttributeError):
        LEVEL2.name = "x"


def test_markdown_shows_every_entry():
    lines = LEVEL2.markdown().splitlines()
    assert lines[0] == "| A \\ B | row | none | col |"
    assert lines[2:] == [
        "| row | iht | oe_left | oe_right |",
        "| col | iht | iht | bf16 |",
        "| none | iht | iht | oe_right |",
    ]


def test_strategy_parse():
    assert Strategy.parse("OE-right") is Strategy.OE_RIGHT
    assert Strategy.parse(" BF16 ") is Strategy.BF16
    assert Strategy.parse(Strategy.IHT) is Strategy.IHT
    with pytest.raises(ValueError, match="valid.*mxfp4"):
        Strategy.parse("hadamard")


def test_layer_plan_dict_round_trip_and_validation():
    plan = plan_for_patterns("col", "none", "row", "lv2")
    assert LayerPlan.from_dict(plan.to_dict()) == plan
    fixed = LayerPlan.uniform("mxfp4")
    assert fixed.to_dict() == dict.fromkeys(GEMMS, "mxfp4") and fixed.patterns is None
    assert LayerPlan.from_dict(fixed.to_dict()) == fixed
    with pytest.raises(ValueError, match="wgrad cannot use oe_left"):
        LayerPlan.uniform(Strategy.OE_LEFT)
    with pytest.raises(ValueError, match="missing \\['wgrad'\\]"):
        LayerPlan.from_dict({"forward": "iht", "dgrad": "iht"})
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        LayerPlan.from_dict({**fixed.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="roles"):
        LayerPlan("iht", "iht", "iht", patterns={"x": "row"})
    with pytest.raises(ValueError, match="unknown pattern"):
        LayerPlan("iht", "iht", "iht", patterns={"x": "row", "w": "up", "g": "none"})


def test_every_table_default_is_the_recipes():
    """Leaving the table out gives the level-2 table everywhere, as a default Recipe does."""
    import inspect

    from adahop.policy.calibration import ModelPlan, PatternVotes
    from adahop.recipes import Recipe

    defaults = {
        inspect.signature(f).parameters["table"].default
        for f in (plan_for_patterns, PatternVotes.plan, ModelPlan.from_votes)
    }
    assert defaults == {Recipe().table} == {"lv2"}


# Tables whose answer depends on one operand's pattern only, so every transpose shows: A's
# pattern picks the strategy in BY_A, B's in BY_B (OE-left is left out: wgrad replaces it).
BY_A = {(a, b): {"row": "mxfp4", "col": "bf16", "none": "iht"}[a] for a in PATTERNS for b in PATTERNS}
BY_B = {(a, b): {"row": "mxfp4", "col": "bf16", "none": "oe_right"}[b] for a in PATTERNS for b in PATTERNS}


@pytest.mark.parametrize("name, entries", [("by_a", BY_A), ("by_b", BY_B)])
def test_each_operand_transpose_shows_in_the_plan(name, entries):
    """All 27 (px, pw, pg): A of wgrad is dY^T (pattern of g flipped), B of forward is W^T."""
    flip = {"row": "col", "col": "row", "none": "none"}
    for px, pw, pg in itertools.product(PATTERNS, repeat=3):
        plan = plan_for_patterns(px, pw, pg, get_table(entries))
        a_of = {"forward": px, "dgrad": pg, "wgrad": flip[pg]}
        b_of = {"forward": flip[pw], "dgrad": pw, "wgrad": px}
        for gemm in GEMMS:
            key = (a_of[gemm], b_of[gemm])
            assert getattr(plan, gemm) is Strategy(entries[key]), (name, px, pw, pg, gemm)
    # The documented example with a patterned dY: wgrad's A = dY^T is col when dY is row.
    assert gemm_pattern_pairs("col", "row", "row")["wgrad"] == ("col", "col")
    assert gemm_pattern_pairs("none", "none", "col")["wgrad"] == ("row", "none")
