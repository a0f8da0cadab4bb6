"""Each weight's gradient under several recipes against the float64 unquantized gradient, same
model state, batches and rounding keys (issue 12: which GEMM, knob and layers carry the error?).

    python benchmarks/quality_cpu/gradient_error.py RUN_DIR [--batches N] [--device cuda]
        [--variants "TAG:--recipe.FIELD=VALUE ...;TAG2:..."] [--out FILE.json]

RUN_DIR is a run with a frozen adaptive plan (its latest checkpoint): its weights are the state,
its layers' frozen patterns give every adaptive variant's plan through that variant's table. A
variant is a recipe (``--recipe=NAME``) and recipe fields on top of the run's, in the VARIANTS
syntax of ``benchmarks/quality_h200.sh``; the default set is BF16 autocast, the run's lv1 and lv2
plans and uniform IHT. Quantized variants run under BF16 autocast (the GPU's operands; on CUDA the
Triton kernels and the fold_fp8 GEMM route); the reference is every linear in BF16 strategy, in
float64, without autocast. Prints each parameter's relative error (mean over batches), the error by
parameter kind (wq ... w3, the norms) and of the whole model; ``--out`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
from pathlib import Path

import torch

from adahop.nn import adahop_layers
from adahop.policy.strategies import LayerPlan, plan_for_patterns
from adahop.train.builders import build_data, build_model_from_config, load_run
from adahop.train.config import TrainConfig, apply_overrides

DEFAULT_VARIANTS = "bf16:--recipe=bf16;lv1:--recipe=adahop_lv1;lv2:--recipe=adahop_lv2;iht:--recipe=mxfp4_hadamard"


def parse_variants(spec: str) -> dict[str, list[tuple[str, str]]]:
    """``"TAG:--key=value ...;..."`` -> {tag: [(key, value), ...]} (keys without the dashes)."""
    variants = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        tag, _, args = entry.partition(":")
        pairs = []
        for arg in args.split():
            match = re.fullmatch(r"--([\w.]+)=(.*)", arg)
            if not match:
                raise SystemExit(f"variant {tag!r}: {arg!r} is not --key=value")
            pairs.append((match[1], match[2]))
        variants[tag] = pairs
    return variants


def variant_model(run_model: torch.nn.Module, cfg: TrainConfig, overrides: list, device: str) -> torch.nn.Module:
    """The run's weights under the recipe ``overrides`` make; adaptive plans from the run's frozen patterns."""
    vcfg = apply_overrides(copy.deepcopy(cfg), overrides)
    model = build_model_from_config(vcfg, device)
    model.load_state_dict(run_model.state_dict())
    frozen = adahop_layers(run_model)
    for name, layer in adahop_layers(model).items():
        recipe = layer.recipe
        if recipe.adaptive:
            p = frozen[name].plan.patterns
            layer.set_plan(plan_for_patterns(p["x"], p["w"], p["g"], recipe.table))
        else:
            layer.set_plan(LayerPlan.uniform(recipe.strategy))
    return model.train()


def gradients(model: torch.nn.Module, batches: list, *, autocast: bool, device: str) -> list[dict[str, torch.Tensor]]:
    """float64 copies of every parameter's gradient, one dict per batch; rounding keys seeded per batch."""
    out = []
    for i, (inputs, targets) in enumerate(batches):
        model.zero_grad()
        torch.manual_seed(1000 + i)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(inputs.to(device), targets.to(device))
        loss.backward()
        out.append({n: p.grad.double() for n, p in model.named_parameters()})
    return out


def relative(a: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], names: list[str]) -> float:
    return float(
        sum((a[n] - ref[n]).square().sum() for n in names).sqrt() / sum(ref[n].square().sum() for n in names).sqrt()
    )


def mean_error(grads: list, ref: list, names: list[str]) -> float:
    return sum(relative(g, r, names) for g, r in zip(grads, ref, strict=True)) / len(ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory with a frozen adaptive plan")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"default: {DEFAULT_VARIANTS}")
    parser.add_argument("--out", type=Path, help="also write the errors as JSON")
    args = parser.parse_args()
    variants = parse_variants(args.variants)
    run_model, cfg, state = load_run(args.run, args.device)
    if not all(layer.plan is not None for layer in adahop_layers(run_model).values()):
        raise SystemExit(f"{args.run}: its layers have no frozen plan yet (still calibrating)")
    loader = iter(build_data(cfg, progress=False).train)
    batches = [next(loader) for _ in range(args.batches)]

    reference = variant_model(run_model, cfg, [("recipe", "bf16")], args.device).double()
    ref = gradients(reference, batches, autocast=False, device=args.device)
    del reference
    runs = {}
    for tag, overrides in variants.items():
        model = variant_model(run_model, cfg, overrides, args.device)
        runs[tag] = gradients(model, batches, autocast=True, device=args.device)
        del model

    names = list(ref[0])
    per_parameter = {tag: {n: mean_error(gs, ref, [n]) for n in names} for tag, gs in runs.items()}
    kinds = sorted({n.split(".")[-2] for n in names if n.endswith(".weight") and ".layers." in f".{n}"})
    by_kind = {
        tag: {k: mean_error(gs, ref, [n for n in names if n.endswith(f".{k}.weight")]) for k in kinds}
        for tag, gs in runs.items()
    }
    whole = {tag: mean_error(gs, ref, names) for tag, gs in runs.items()}

    print(f"{args.run} (step {state.get('step')}), {args.batches} batches on {args.device}; variants: {variants}")
    print(f"{'parameter':34s}" + "".join(f"{tag:>12s}" for tag in runs))
    for n in names:
        print(f"{n:34s}" + "".join(f"{per_parameter[tag][n]:12.4f}" for tag in runs))
    print(f"\n{'parameter kind':34s}" + "".join(f"{tag:>12s}" for tag in runs))
    for k in kinds:
        print(f"{k:34s}" + "".join(f"{by_kind[tag][k]:12.4f}" for tag in runs))
    print(f"{'whole model':34s}" + "".join(f"{whole[tag]:12.4f}" for tag in runs))
    if args.out:
        report = {
            "run": str(args.run),
            "step": state.get("step"),
            "batches": args.batches,
            "device": args.device,
            "variants": {tag: [f"--{k}={v}" for k, v in o] for tag, o in variants.items()},
            "whole_model": whole,
            "by_kind": by_kind,
            "per_parameter": per_parameter,
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
