"""Each weight's gradient under several recipes against the float64 unquantized gradient, same
model state, batches and rounding keys (issue 12: which GEMM, knob and layers carry the error?).

    python benchmarks/quality/gradient_error.py RUN_DIR [--batches N] [--device cuda]
        [--variants "TAG:--recipe.FIELD=VALUE ...;TAG2:..."] [--out FILE.json]

RUN_DIR is a run with a frozen adaptive plan (its latest checkpoint): its weights are the state,
its layers' frozen patterns give every adaptive variant's plan through that variant's table. A
variant is the run's config with overrides in the VARIANTS syntax of ``benchmarks/quality/quality_h200.sh``:
``--recipe=NAME`` starts from that registered recipe (the run's own recipe fields are dropped),
``--recipe.FIELD=VALUE`` changes one field; the default set is BF16 autocast, lv1, lv2 and uniform IHT. Quantized variants run under BF16 autocast (the GPU's operands; on CUDA the
Triton kernels and the fold_fp8 GEMM route); the reference is every linear in BF16 strategy, in
float64, without autocast. Prints each parameter's relative error (mean over batches), the error by
parameter kind (wq ... w3, the norms) and of the whole model; ``--out`` writes the same as JSON,
rewritten after each variant. Only the reference gradients are kept (one float64 copy per batch).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from adahop.atomic import write_atomic
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
    # The run's weights without its plans (each layer's _extra_state): the variant's recipe sets its own.
    weights = {k: v for k, v in run_model.state_dict().items() if not k.endswith("_extra_state")}
    model.load_state_dict(weights)
    frozen = adahop_layers(run_model)
    for name, layer in adahop_layers(model).items():
        recipe = layer.recipe
        if recipe.adaptive:
            p = frozen[name].plan.patterns
            layer.set_plan(plan_for_patterns(p["x"], p["w"], p["g"], recipe.table))
        else:
            layer.set_plan(LayerPlan.uniform(recipe.strategy))
    return model.train()


def gradients(model: torch.nn.Module, batches: list, *, autocast: bool, device: str) -> Iterator[dict]:
    """float64 copies of every parameter's gradient, one dict per batch (made as it is consumed);
    rounding keys seeded per batch."""
    for i, (inputs, targets) in enumerate(batches):
        model.zero_grad()
        torch.manual_seed(1000 + i)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(inputs.to(device), targets.to(device))
        loss.backward()
        yield {n: p.grad.double() for n, p in model.named_parameters()}


def squared_errors(grads: Iterator[dict], ref: list[dict]) -> list[dict[str, float]]:
    """Per batch, each parameter's squared error norm against the reference."""
    return [{n: float((g[n] - r[n]).square().sum()) for n in r} for g, r in zip(grads, ref, strict=True)]


def mean_error(errors: list[dict[str, float]], ref_norms: list[dict[str, float]], names: list[str]) -> float:
    """Relative error of the parameters ``names`` taken together, averaged over batches."""
    per_batch = []
    for e, r in zip(errors, ref_norms, strict=True):
        norm = sum(r[n] for n in names)
        per_batch.append(math.sqrt(sum(e[n] for n in names) / norm) if norm else math.nan)  # nan: no gradient
    return sum(per_batch) / len(per_batch)


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
    ref = list(gradients(reference, batches, autocast=False, device=args.device))
    del reference
    ref_norms = [{n: float(g.square().sum()) for n, g in r.items()} for r in ref]
    names = list(ref[0])
    kinds = sorted({n.split(".")[-2] for n in names if n.endswith(".weight") and ".layers." in f".{n}"})
    per_parameter, by_kind, whole = {}, {}, {}
    for tag, overrides in variants.items():
        model = variant_model(run_model, cfg, overrides, args.device)
        errors = squared_errors(gradients(model, batches, autocast=True, device=args.device), ref)
        del model
        per_parameter[tag] = {n: mean_error(errors, ref_norms, [n]) for n in names}
        by_kind[tag] = {
            k: mean_error(errors, ref_norms, [n for n in names if n.endswith(f".{k}.weight")]) for k in kinds
        }
        whole[tag] = mean_error(errors, ref_norms, names)
        if args.out:  # after each variant: a probe cut short keeps what it measured
            report = {
                "run": str(args.run),
                "step": state.get("step"),
                "batches": args.batches,
                "device": args.device,
                "variants": {t: [f"--{k}={v}" for k, v in o] for t, o in variants.items() if t in whole},
                "whole_model": whole,
                "by_kind": by_kind,
                "per_parameter": per_parameter,
            }
            write_atomic(args.out, json.dumps(report, indent=1) + "\n")

    print(f"{args.run} (step {state.get('step')}), {args.batches} batches on {args.device}; variants: {variants}")
    print(f"{'parameter':34s}" + "".join(f"{tag:>12s}" for tag in whole))
    for n in names:
        print(f"{n:34s}" + "".join(f"{per_parameter[tag][n]:12.4f}" for tag in whole))
    print(f"\n{'parameter kind':34s}" + "".join(f"{tag:>12s}" for tag in whole))
    for k in kinds:
        print(f"{k:34s}" + "".join(f"{by_kind[tag][k]:12.4f}" for tag in whole))
    print(f"{'whole model':34s}" + "".join(f"{whole[tag]:12.4f}" for tag in whole))


if __name__ == "__main__":
    main()
