"""What a `llama3_1b` block keeps for backward under each recipe, counted on the CPU (issue 30's memory target).

Two views, both at the real shapes (dim 2048, hidden 8192, 32 query and 8 KV heads) and on fake tensors
(``FakeTensorMode``: no arithmetic, so any token count costs nothing):

- **eager**: every storage autograd keeps between the block's forward and its backward
  (``torch.autograd.graph.saved_tensors_hooks``), each counted once, parameters left out, charged to the
  linear layer whose forward saved it ("other": norms, attention, SwiGLU, residual);
- **compiled**: what the trainer's ``torch.compile``'d block keeps: the values AOTAutograd's partitioner
  (Inductor's min-cut, after its joint-graph passes) hands from the forward graph to the backward graph,
  recorded at partition time; nothing is compiled further or run. Each adahop recipe also with
  ``training.recompute_wgrad_operands`` (row ``RECIPE+recompute``: ``adahop.nn.compiling``'s pass).

Bytes are measured at two token counts: ``per token`` is the slope (activations), ``per step`` the rest
(W's quantized operands and BF16 copies, made once per micro-batch whatever the token count). Adaptive
recipes run the plans the H200 froze for `llama3_1b` 8 x 2048 (``benchmarks/step/2026-12-04-h200-step/
recheck-c340476``: lv2's and lv1's plan mixes, rebuilt from the patterns below); a block runs each layer's
most common plan. torchao float8 tensorwise is converted by ``torchao.float8.convert_to_float8_training``.

    PYTHONPATH=src python benchmarks/linear/saved_bytes.py --out benchmarks/linear/<date>-cpu-saved-bytes
"""

from __future__ import annotations

import argparse
import json
import platform
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from adahop import convert_model
from adahop.bench.kept import kept_for_backward
from adahop.models.llama import TransformerBlock, get_model_args, rope_tables
from adahop.nn import adahop_layers
from adahop.nn.compiling import compile_options
from adahop.policy.strategies import plan_for_patterns
from adahop.recipes import get_recipe

PRESET = "llama3_1b"
TOKENS = (2048, 4096)  # two counts of batch 1 x seq: the slope is bytes per token
STEP_TOKENS = 8 * 2048  # the step bench's case, for the model totals
RECOMPUTE = "+recompute"  # a compiled row with training.recompute_wgrad_operands
RECIPES = (
    "bf16",
    "torchao_float8_tensorwise",
    "adahop_lv1_bf16_forward",
    "adahop_lv1_fp8_forward",
    "adahop_lv2",
    "mxfp4_hadamard",
)
LINEARS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
# The compiled table's ratio columns, each where its recipe is among ``--recipes``.
REFERENCES = {"bf16": "BF16 (per token)", "torchao_float8_tensorwise": "float8 tensorwise"}
# The (x, w, dY) patterns behind the plans the H200 froze at c340476 (lv2's and lv1's mixes over 16 blocks
# both follow from them: ``check_patterns``), most common first.
PATTERNS: dict[str, list[tuple[tuple[str, str, str], int]]] = {
    "wq": [(("col", "none", "row"), 15), (("none", "none", "row"), 1)],
    "wk": [(("col", "none", "row"), 15), (("none", "none", "row"), 1)],
    "wv": [(("col", "none", "row"), 15), (("none", "none", "row"), 1)],
    "wo": [(("col", "none", "none"), 8), (("col", "none", "row"), 7), (("row", "none", "row"), 1)],
    "w1": [(("col", "none", "none"), 12), (("col", "none", "row"), 4)],
    "w3": [(("col", "none", "none"), 12), (("col", "none", "row"), 4)],
    "w2": [(("col", "none", "row"), 9), (("col", "none", "none"), 7)],
}
# The mixes as the H200 bench logged them (``plan_mix`` in recheck-c340476/bench.json).
H200_MIX = {
    "adahop_lv2": {
        "wq IHT/OE-left/BF16": 15, "wk IHT/OE-left/BF16": 15, "wv IHT/OE-left/BF16": 15,
        "w1 IHT/IHT/OE-right": 12, "w3 IHT/IHT/OE-right": 12, "w2 IHT/OE-left/BF16": 9,
        "wo IHT/IHT/OE-right": 8, "wo IHT/OE-left/BF16": 7, "w2 IHT/IHT/OE-right": 7,
        "w1 IHT/OE-left/BF16": 4, "w3 IHT/OE-left/BF16": 4, "wq IHT/OE-left/IHT": 1,
        "wk IHT/OE-left/IHT": 1, "wv IHT/OE-left/IHT": 1, "wo OE-left/OE-left/IHT": 1,
    },
    "adahop_lv1": {
        "wq IHT/OE-left/OE-right": 15, "wk IHT/OE-left/OE-right": 15, "wv IHT/OE-left/OE-right": 15,
        "w1 IHT/IHT/OE-right": 12, "w3 IHT/IHT/OE-right": 12, "w2 IHT/OE-left/OE-right": 9,
        "wo IHT/IHT/OE-right": 8, "wo IHT/OE-left/OE-right": 7, "w2 IHT/IHT/OE-right": 7,
        "w1 IHT/OE-left/OE-right": 4, "w3 IHT/OE-left/OE-right": 4, "wq IHT/OE-left/IHT": 1,
        "wk IHT/OE-left/IHT": 1, "wv IHT/OE-left/IHT": 1, "wo OE-left/OE-left/IHT": 1,
    },
}  # fmt: skip
_SHOWN = {"bf16": "BF16", "mxfp4": "MXFP4", "iht": "IHT", "oe_left": "OE-left", "oe_right": "OE-right"}


def _shown(plan) -> str:
    return "/".join(_SHOWN[s.value] for s in plan.strategies().values())


def check_patterns() -> None:
    """``PATTERNS`` gives back the H200's plan mixes under both tables."""
    for recipe, mix in H200_MIX.items():
        table = get_recipe(recipe).table
        rebuilt = Counter()
        for name, entries in PATTERNS.items():
            for patterns, count in entries:
                rebuilt[f"{name} {_shown(plan_for_patterns(*patterns, table))}"] += count
        if dict(rebuilt) != mix:
            raise AssertionError(f"PATTERNS do not give {recipe}'s H200 mix: {dict(rebuilt)}")


def build_block(recipe: str, pattern_index: dict[str, int] | None = None) -> nn.Module:
    """A `llama3_1b` block under ``recipe``, each adaptive layer frozen on its ``pattern_index`` entry."""
    torch.manual_seed(0)
    block = TransformerBlock(get_model_args(PRESET))
    if recipe == "bf16":
        return block
    r = get_recipe(recipe)
    if r.torchao_float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        return convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(r.torchao_float8))
    convert_model(block, r)
    for name, layer in adahop_layers(block).items():
        if layer.plan is None:
            leaf = name.rsplit(".", 1)[-1]
            patterns = PATTERNS[leaf][(pattern_index or {}).get(leaf, 0)][0]
            layer.set_plan(layer._with_forward_strategy(plan_for_patterns(*patterns, r.table)))
    return block


def _layer_names(block: nn.Module) -> dict[nn.Module, str]:
    return {m: n.rsplit(".", 1)[-1] for n, m in block.named_modules() if isinstance(m, nn.Linear)}


def eager_saved(block: nn.Module, tokens: int) -> dict[str, int]:
    """Bytes of the storages the block's eager forward saves for backward, by the layer that saved them."""
    names = _layer_names(block)
    current = ["other"]
    hooks = [m.register_forward_pre_hook(lambda m, _: current.__setitem__(0, names[m])) for m in names]
    hooks += [m.register_forward_hook(lambda m, *_: current.__setitem__(0, "other")) for m in names]
    args = get_model_args(PRESET)
    seen: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen.setdefault(storage._cdata, (storage.nbytes(), current[0]))
        return t

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_params = [mode.from_tensor(p) for p in block.parameters()]  # kept: their addresses stay theirs
            params = {p.untyped_storage()._cdata for p in (*fake_params, *block.parameters())}
            x = torch.empty(1, tokens, args.dim, requires_grad=True)
            cos, sin = rope_tables(args.head_dim, tokens, args.rope_theta)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    block(x, cos, sin)
    finally:
        for h in hooks:
            h.remove()
    by_layer: dict[str, int] = defaultdict(int)
    for key, (nbytes, layer) in seen.items():
        if key not in params:
            by_layer[layer] += nbytes
    return dict(by_layer)


def compiled_saved(block: nn.Module, tokens: int, recompute: bool = False) -> tuple[int, list[str]]:
    """Bytes the compiled block's forward hands its backward (parameters left out) and what they are;
    ``recompute``: compiled as ``training.recompute_wgrad_operands`` compiles it."""
    args = get_model_args(PRESET)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", dynamic=False, options=compile_options(recompute) or None)
    x = torch.zeros(1, tokens, args.dim, requires_grad=True)
    cos, sin = rope_tables(args.head_dim, tokens, args.rope_theta)
    param_shapes = {tuple(p.shape) for p in block.parameters()}

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            compiled(x, cos, sin)

    chosen = kept_for_backward(run)
    total, what = 0, []
    for node in chosen:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # a symbolic size
        is_param = node.op == "placeholder" and tuple(val.shape) in param_shapes
        if not is_param:
            total += val.untyped_storage().nbytes()
            what.append(f"{node.name} {str(val.dtype).removeprefix('torch.')}{list(val.shape)}")
    return total, what


def _fit(at: dict[int, float]) -> tuple[float, float]:
    """(bytes per token, bytes per step) from bytes at the two ``TOKENS``."""
    (t0, b0), (t1, b1) = sorted(at.items())
    slope = (b1 - b0) / (t1 - t0)
    return slope, b0 - slope * t0


def measure(recipes=RECIPES, compiled: bool = True) -> dict:
    check_patterns()
    results: dict = {"tokens": list(TOKENS), "eager": {}, "compiled": {}, "eager_mix": {}}
    for recipe in recipes:
        at = {t: eager_saved(build_block(recipe), t) for t in TOKENS}
        layers = sorted({k for v in at.values() for k in v}, key=lambda n: (n == "other", n))
        results["eager"][recipe] = {
            name: dict(zip(("per_token", "per_step"), _fit({t: at[t].get(name, 0) for t in TOKENS}))) for name in layers
        }
        if get_recipe(recipe).adaptive:  # each layer's other H200 plans, weighted by their counts
            mix = {}
            for leaf, entries in PATTERNS.items():
                for index, (_, count) in enumerate(entries):
                    block = build_block(recipe, {leaf: index})
                    one = {t: eager_saved(block, t).get(leaf, 0) for t in TOKENS}
                    plan = adahop_layers(block)[_path(leaf)].plan
                    per_token, per_step = _fit(one)
                    mix[f"{leaf} {_shown(plan)}"] = {"count": count, "per_token": per_token, "per_step": per_step}
            results["eager_mix"][recipe] = mix
        variants = (False, True) if adahop_layers(build_block(recipe)) else (False,)
        for recompute in variants if compiled else ():
            totals, what = {}, {}
            for t in TOKENS:
                totals[t], what[t] = compiled_saved(build_block(recipe), t, recompute)
            per_token, per_step = _fit(totals)
            row = {"per_token": per_token, "per_step": per_step, "saved": what[TOKENS[0]]}
            results["compiled"][recipe + (RECOMPUTE if recompute else "")] = row
    return results


def _path(leaf: str) -> str:
    return f"{'attention' if leaf in ('wq', 'wk', 'wv', 'wo') else 'feed_forward'}.{leaf}"


def markdown(results: dict) -> str:
    n_layers = get_model_args(PRESET).n_layers
    eager, compiled = results["eager"], results["compiled"]
    recipes = list(eager)
    lines = [
        f"Saved for backward by one `{PRESET}` block (bytes per token; per-step bytes in MB), eager, by layer:",
        "",
        "| layer | " + " | ".join(recipes) + " |",
        "|---" * (len(recipes) + 1) + "|",
    ]
    for name in (*LINEARS, "other"):
        cells = []
        for recipe in recipes:
            entry = eager[recipe].get(name)
            cells.append("-" if entry is None else f"{entry['per_token']:,.0f} + {entry['per_step'] / 1e6:.1f} MB")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    totals = {
        r: (sum(e["per_token"] for e in eager[r].values()), sum(e["per_step"] for e in eager[r].values()))
        for r in recipes
    }
    lines.append("| **block** | " + " | ".join(f"**{t:,.0f}** + {s / 1e6:.1f} MB" for t, s in totals.values()) + " |")
    if "bf16" in eager:  # a ratio to BF16's in every cell: no row without it
        bf16_linear = sum(eager["bf16"][n]["per_token"] for n in LINEARS)
        lines.append(
            "| linears vs BF16 | "
            + " | ".join(
                f"{sum(eager[r].get(n, {}).get('per_token', 0) for n in LINEARS) / bf16_linear:.2f}" for r in recipes
            )
            + " |"
        )
    if compiled:
        # A ratio column for each reference recipe measured in this run.
        references = {f"vs {label}": compiled[name] for name, label in REFERENCES.items() if name in compiled}
        lines += [
            "",
            f"Compiled block (what Inductor's partitioner keeps), and `{PRESET}` {STEP_TOKENS // 2048} x 2048 over "
            f"{n_layers} blocks (activations + per-step operands, GiB):",
            "",
            "| recipe | bytes per token | per-step MB | " + "".join(f"{h} | " for h in references) + "model GiB |",
            "|---|---:|---:|" + "---:|" * (len(references) + 1),
        ]
        for recipe, c in compiled.items():
            model = n_layers * (c["per_token"] * STEP_TOKENS + c["per_step"]) / 2**30
            ratios = "".join(f"{c['per_token'] / ref['per_token']:.3f} | " for ref in references.values())
            lines.append(f"| {recipe} | {c['per_token']:,.0f} | {c['per_step'] / 1e6:.1f} | {ratios}{model:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for saved_bytes.json and saved_bytes.md")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--eager-only", action="store_true", help="skip the compiled blocks")
    a = parser.parse_args()
    results = measure(a.recipes, compiled=not a.eager_only)
    results["torch"], results["python"] = torch.__version__, platform.python_version()
    text = markdown(results)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "saved_bytes.json").write_text(json.dumps(results, indent=1) + "\n")
        (a.out / "saved_bytes.md").write_text(text)


if __name__ == "__main__":
    main()
