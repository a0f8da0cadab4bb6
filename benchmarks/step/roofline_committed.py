"""The preparation roofline of a step-bench run recorded before the bench kept each layer's plan.

    python benchmarks/step/roofline_committed.py BENCH_JSON CASE [RUN ...] [--copy-tb-per-s 4.25]

The layers are rebuilt from the run's plan mix (``wq IHT/OE-left/BF16: 15``) and the preset's shapes: layers
that share an input (``roofline.SHARED_INPUTS``) are put in the same blocks when their kinds carry the same
strategy triples, which the call counts then check against the profile. Times are the profiled step's
preparation kernels (its ``top_kernels``). The floor is taken at the copy bandwidth measured on the H200
(4.25 TB/s, bytes read + written; ``docs/hopper-kernels.md``), since those runs did not measure it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from adahop.bench import roofline
from adahop.models import MODEL_PRESETS
from adahop.policy.strategies import Strategy

H200_COPY_TB_PER_S = 4.25


def layer_shapes(preset: str) -> dict[str, tuple[str, int, int]]:
    """(module, in, out) of every linear kind of a Llama block."""
    args = MODEL_PRESETS[preset]
    dim, kv, hidden = args.dim, args.n_kv_heads * args.head_dim, args.hidden_dim
    attention = {"wq": (dim, dim), "wk": (dim, kv), "wv": (dim, kv), "wo": (dim, dim)}
    ffn = {"w1": (dim, hidden), "w3": (dim, hidden), "w2": (hidden, dim)}
    return {k: ("attention", *v) for k, v in attention.items()} | {k: ("feed_forward", *v) for k, v in ffn.items()}


def layers_from_plan_mix(plan_mix: dict[str, int], preset: str) -> list[roofline.Layer]:
    """Every converted layer, block by block, from a plan mix; kinds that share an input must carry the
    same triples (they then share blocks), else the reconstruction would invent the merging."""
    triples: dict[str, list[tuple[str, ...]]] = defaultdict(list)
    for key, count in plan_mix.items():
        kind, plan = key.split(" ", 1)
        triples[kind] += [tuple(Strategy.parse(s).value for s in plan.split("/"))] * count
    groups: dict[str, list[str]] = defaultdict(list)
    for kind in triples:
        groups[roofline.SHARED_INPUTS.get(kind, kind)].append(kind)
    for kinds in groups.values():
        if len({tuple(sorted(triples[k])) for k in kinds}) > 1:
            raise ValueError(f"{kinds} share an input but not their plans: their blocks cannot be rebuilt")
    shapes = layer_shapes(preset)
    layers = []
    for kind, plans in triples.items():
        module, n_in, n_out = shapes[kind]
        for block, plan in enumerate(sorted(plans)):
            layers.append(roofline.Layer(f"layers.{block}.{module}.{kind}", n_in, n_out, *plan))
    return layers


def preparation_profile(profile: dict) -> dict[str, dict]:
    """ms and calls per preparation family, from a profile's largest kernels."""
    out: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
    for kernel in profile["top_kernels"]:
        if (family := roofline.kernel_family(kernel["name"])) is not None:
            out[family]["ms"] += kernel["ms"]
            out[family]["calls"] += kernel["calls"]
    return dict(out)


def committed_roofline(case: dict, run: dict, copy_tb_per_s: float = H200_COPY_TB_PER_S) -> dict | None:
    result = {
        "layers": [vars(layer) for layer in layers_from_plan_mix(run["plan_mix"], case["preset"])],
        "tokens_per_micro_step": case["batch"] * case["seq_len"],
        "accum": case.get("accum", 1),
        "merged": "compile" in run["mode"],
        "profile": {"cuda_ms": run["profile"]["cuda_ms"], "preparation": preparation_profile(run["profile"])},
    }
    return roofline.roofline(result, copy_tb_per_s * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("case", help="a step case key, e.g. llama3_1b_8x2048")
    parser.add_argument("runs", nargs="*", help="recipe/mode names (default: every run with a plan mix)")
    parser.add_argument("--copy-tb-per-s", type=float, default=H200_COPY_TB_PER_S)
    args = parser.parse_args(argv)
    report = json.loads(args.bench_json.read_text())
    case = report.get("step", report)["cases"][args.case]
    names = args.runs or [n for n, r in case["runs"].items() if r.get("plan_mix")]
    lines = []
    for name in names:
        table = committed_roofline(case, case["runs"][name], args.copy_tb_per_s)
        if table is not None:  # None: every GEMM in BF16
            lines += roofline.markdown(f"{args.case} {name}", table)
    print("\n".join(lines).lstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
