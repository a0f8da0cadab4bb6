"""Bytes FSDP2 all-gathers per training step, with the high-precision gather and with the
low-precision one (``adahop.nn.fsdp``), for a model preset and a few recipes.

Counts every all-gather FSDP2 issues (forward, and backward's re-gathers) through its own
extension point (``FSDPModule.set_custom_all_gather``), over the last of ``--steps`` steps (after
calibration froze the plans), and checks that both gathers gave the same losses. Parameters
are gathered in ``--param-dtype`` (bf16: FSDP2's MixedPrecisionPolicy as adahop train uses on
CUDA).

CPU, 2 gloo ranks (default)::

    PYTHONPATH=src python benchmarks/distributed/gather_bytes.py --preset tiny --out benchmarks/distributed/RESULT

Under torchrun (NCCL on GPUs; prepared, see gather_bytes_h200.sh)::

    torchrun --standalone --nproc-per-node=2 benchmarks/distributed/gather_bytes.py --preset 125m --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from adahop import convert_model
from adahop.models.llama import build_model
from adahop.nn import adahop_layers
from adahop.nn.fsdp import gathered_format, low_precision_all_gather

RECIPES = {
    "mxfp4_hadamard": {"name": "mxfp4_hadamard"},
    "mxfp4 2-D weight tiles": {"name": "mxfp4", "weight_blocks": "2d"},
    "adahop_lv2": {"name": "adahop_lv2", "calibration_steps": 2},
    "adahop_lv1_fp8_forward": {"name": "adahop_lv1_fp8_forward", "calibration_steps": 2},
}


class CountingAllGather(DefaultAllGather):
    """FSDP2's own all-gather, counting the bytes each rank receives."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.bytes += output_tensor.numel() * output_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, async_op)


def run(args, recipe: dict, low_precision: bool, device: torch.device) -> dict:
    torch.manual_seed(0)
    with device:
        model = convert_model(build_model(args.preset), recipe)
    if low_precision:
        low_precision_all_gather(model)
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, args.param_dtype), reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    counter = CountingAllGather()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(counter)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab, rank = model.args.vocab_size, dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator).to(device)
        counter.bytes = 0
        start = time.perf_counter()
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        seconds = time.perf_counter() - start
    layers = adahop_layers(model)
    formats = [gathered_format(layer) for layer in layers.values()]
    # Their bytes in the high-precision gather: every block gathers in forward and again in backward.
    itemsize = getattr(torch, args.param_dtype).itemsize
    linear_bytes = 2 * sum(layer.weight.numel() * itemsize for layer in layers.values())
    return {
        "bytes": counter.bytes,
        "linear_weight_bytes_high_precision": linear_bytes,
        "losses": losses,
        "seconds_last_step": seconds,
        "layers_quantized": formats.count("quantized"),
        "layers": len(formats),
    }


def rank_main(rank: int, world: int, init: str | None, args, out: str) -> None:
    if init is not None:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    else:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    results = {}
    for label, recipe in RECIPES.items():
        high, low = run(args, recipe, False, device), run(args, recipe, True, device)
        results[label] = {"high": high, "low": low, "identical_losses": high["losses"] == low["losses"]}
    if dist.get_rank() == 0:
        report(args, results, dist.get_world_size(), device, Path(out))
    dist.barrier()
    dist.destroy_process_group()


def report(args, results: dict, world: int, device: torch.device, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"`{args.preset}`, {world} ranks on {device.type}, parameters gathered in {args.param_dtype}, "
        f"batch {args.batch} x {args.seq} per rank, bytes all-gathered per rank in step {args.steps} "
        f"(forward and backward), torch {torch.__version__}.",
        "",
        "All parameters: everything FSDP2 gathered (embedding, norms and LM head included, gathered alike).",
        "AdaHOPLinear weights: the same less the other parameters' bytes (the high-precision total less",
        "2 x the weights' bytes, forward and backward gathers).",
        "",
        "| recipe | all parameters, high / low precision (MiB) | ratio | AdaHOPLinear weights, high / low (MiB) | ratio | weights gathered quantized | losses identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        high, low = r["high"]["bytes"], r["low"]["bytes"]
        linear_high = r["high"]["linear_weight_bytes_high_precision"]
        linear_low = low - (high - linear_high)
        lines.append(
            f"| {label} | {high / 2**20:.2f} / {low / 2**20:.2f} | {high / low:.2f}x | "
            f"{linear_high / 2**20:.2f} / {linear_low / 2**20:.2f} | {linear_high / linear_low:.2f}x | "
            f"{r['low']['layers_quantized']} of {r['low']['layers']} | {'yes' if r['identical_losses'] else 'NO'} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "world": world, "results": results}, indent=1))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--steps",
        type=int,
        default=4,
        help="the last one is measured; at least calibration_steps + 2 (2 + 2 here), so the plans froze a step before",
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            rank_main, args=(2, f"file://{tmp}/rendezvous", args, args.out), nprocs=2, start_method="spawn"
        )


if __name__ == "__main__":
    main()
