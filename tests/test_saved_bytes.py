"""``benchmarks/linear/saved_bytes.py``'s tables: the committed run's JSON gives back its committed markdown,
and a run without BF16 or float8 among ``--recipes`` drops the ratio columns and rows that need them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

LINEAR = Path(__file__).parents[1] / "benchmarks" / "linear"
RUN = LINEAR / "2026-12-05-cpu-saved-bytes-recompute"


@pytest.fixture(scope="module")
def saved_bytes():
    spec = importlib.util.spec_from_file_location("saved_bytes", LINEAR / "saved_bytes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _without(results: dict, *recipes: str) -> dict:
    return results | {
        view: {r: v for r, v in results[view].items() if r not in recipes} for view in ("eager", "compiled")
    }


def _compiled_rows(text: str) -> dict[str, list[str]]:
    """The compiled table: the header's cells, and each recipe's."""
    table = text[text.index("| recipe |") :].splitlines()
    return {row.split(" | ")[0].removeprefix("| "): row.strip("| ").split(" | ") for row in table if "---" not in row}


def test_the_committed_run_gives_back_its_markdown(saved_bytes):
    assert (
        saved_bytes.markdown(json.loads((RUN / "saved_bytes.json").read_text())) == (RUN / "saved_bytes.md").read_text()
    )


def test_without_bf16_its_ratios_are_dropped_and_the_rest_kept(saved_bytes):
    results = json.loads((RUN / "saved_bytes.json").read_text())
    full, text = _compiled_rows(saved_bytes.markdown(results)), saved_bytes.markdown(_without(results, "bf16"))
    assert "linears vs BF16" not in text and "| bf16 |" not in text
    rows = _compiled_rows(text)
    assert rows["recipe"] == ["recipe", "bytes per token", "per-step MB", "vs float8 tensorwise", "model GiB"]
    for recipe, cells in rows.items():
        assert cells == full[recipe][:3] + full[recipe][4:]  # the float8 ratios as they were
    bare = _compiled_rows(saved_bytes.markdown(_without(results, "bf16", "torchao_float8_tensorwise")))
    assert bare["recipe"] == ["recipe", "bytes per token", "per-step MB", "model GiB"]
    assert bare["adahop_lv2+recompute"] == full["adahop_lv2+recompute"][:3] + full["adahop_lv2+recompute"][5:]
