"""Each weight's gradient under several plans against the float64 unquantized gradient, same
model state, batches and rounding keys (issue 12: is lv2's BF16 wgrad exact, and does it change
anything else?).

    python benchmarks/quality_cpu/gradient_error.py RUN_DIR [--batches N]

RUN_DIR is a run with a frozen adaptive plan; its patterns give the lv1 and lv2 plans. The
quantized plans run under CPU BF16 autocast (the GPU's operands); the reference is every linear
in BF16 strategy, in float64, without autocast. Prints the relative error of each parameter's
gradient (mean over batches), which parameters lv1 and lv2 differ in, and the whole-model error.
"""

from __future__ import annotations

import argparse
import copy

import torch

from adahop.nn import AdaHOPLinear
from adahop.policy.strategies import LayerPlan, plan_for_patterns
from adahop.train.builders import build_data, load_run

PLANS = ("lv1", "lv2", "iht")


def with_plans(model: torch.nn.Module, plan: str) -> torch.nn.Module:
    """A copy whose layers run ``plan``: a table name (looked up on the frozen patterns) or one strategy."""
    model = copy.deepcopy(model)
    for layer in model.modules():
        if isinstance(layer, AdaHOPLinear):
            p = layer.plan.patterns
            layer.set_plan(
                plan_for_patterns(p["x"], p["w"], p["g"], plan) if plan in ("lv1", "lv2") else LayerPlan.uniform(plan)
            )
    return model


def gradients(model: torch.nn.Module, batches: list, *, autocast: bool) -> list[dict[str, torch.Tensor]]:
    """float64 copies of every parameter's gradient, one dict per batch; rounding keys seeded per batch."""
    out = []
    for i, (inputs, targets) in enumerate(batches):
        model.zero_grad()
        torch.manual_seed(1000 + i)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(inputs, targets)
        loss.backward()
        out.append({n: p.grad.double() for n, p in model.named_parameters()})
    return out


def relative(a: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], names: list[str]) -> float:
    return float(
        sum((a[n] - ref[n]).square().sum() for n in names).sqrt() / sum(ref[n].square().sum() for n in names).sqrt()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory with a frozen adaptive plan")
    parser.add_argument("--batches", type=int, default=2)
    args = parser.parse_args()
    model, cfg, _ = load_run(args.run)
    model.train()
    loader = iter(build_data(cfg, progress=False).train)
    batches = [next(loader) for _ in range(args.batches)]
    ref = gradients(with_plans(model, "bf16").double(), batches, autocast=False)
    runs = {"bf16 autocast": gradients(with_plans(model, "bf16"), batches, autocast=True)}
    runs |= {plan: gradients(with_plans(model, plan), batches, autocast=True) for plan in PLANS}
    wgrad = {n + ".weight": m.plan.wgrad.value for n, m in model.named_modules() if isinstance(m, AdaHOPLinear)}
    print(f"{'parameter':34s} {'lv2 wgrad':9s}" + "".join(f"{k:>14s}" for k in runs) + "  lv1 vs lv2")
    for name in ref[0]:
        errors = "".join(
            f"{sum(relative(g, r, [name]) for g, r in zip(gs, ref)) / len(ref):14.4f}" for gs in runs.values()
        )
        same = all(torch.equal(a[name], b[name]) for a, b in zip(runs["lv1"], runs["lv2"]))
        print(f"{name:34s} {wgrad.get(name, '-'):9s}{errors}  {'identical' if same else 'differ'}")
    names = list(ref[0])
    for key, gs in runs.items():
        error = sum(relative(g, r, names) for g, r in zip(gs, ref)) / len(ref)
        print(f"whole model, {key}: relative gradient error {error:.4f}")


if __name__ == "__main__":
    main()
