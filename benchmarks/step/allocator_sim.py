"""Where AdamW's moments land in the CUDA caching allocator after eager calibrating steps, simulated on the CPU (issue 30).

The adaptive recipes calibrate eagerly on the default stream before the captured graphs take over; BF16 and
float8 start in their graph's warm-up. If the moments are made by the first calibrating step, they are
allocated inside the blocks that step's forward and backward just freed, and a segment that holds one can never
be returned: its free part stays reserved beside the graphs' private pool. This replays a `llama3_1b` run's
allocations up to the end of calibration (the model on fake tensors, so the real shapes cost nothing) through a
model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp`` with its default settings:
sizes rounded to 512 bytes; requests up to 1 MiB served from 2 MiB segments, up to 10 MiB from 20 MiB ones,
larger ones from segments rounded to 2 MiB; best fit among the stream's free blocks, split where more than
1 MiB (512 bytes in the small pool) is left, freed neighbours merged; ``empty_cache`` returns whole free
segments), with the moments made when the trainer is built (``train.optim.allocate_state``) or by the first
step (as before it), and reports the default pool after ``empty_cache``: reserved, allocated, and the free
bytes in segments that still hold a live block.

    PYTHONPATH=src python benchmarks/step/allocator_sim.py --batch 8            # 8 x 2048, 4 calibrating steps
    PYTHONPATH=src python benchmarks/step/allocator_sim.py --batch 2 --accum 4
    PYTHONPATH=src python benchmarks/step/allocator_sim.py --batch 8 --frozen-step   # a graph pool per recipe

``--frozen-step`` asks another question: whether a recipe's quantize outputs fragment a CUDA graph's pool more
than BF16's do (one eager frozen micro-step through a fresh pool, on the H200's route and plans).

A model, not the allocator: it sees every tensor an op returns (``TorchDispatchMode``) and every storage's end
(a finalizer), not the kernels' own workspaces; CPU autocast and the CPU's attention kernel stand in for CUDA's
(flash attention's outputs: the output and its log-sum-exp).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from adahop import convert_model, ops
from adahop.formats import MXTensor
from adahop.models import build_model
from adahop.nn import adahop_layers
from adahop.policy.routes import GemmRoute
from adahop.policy.strategies import LayerPlan
from adahop.recipes import get_recipe

MIB, GIB = 2**20, 2**30
SMALL, SMALL_SEGMENT, LARGE_SEGMENT, MIN_LARGE, ROUND_LARGE = MIB, 2 * MIB, 20 * MIB, 10 * MIB, 2 * MIB


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(eq=False)
class Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: Block | None = None
    next: Block | None = None


@dataclass
class CachingAllocator:
    """One stream's pools of the CUDA caching allocator (the default stream: calibration runs there)."""

    segments: dict[int, int] = field(default_factory=dict)  # id -> bytes
    segment_ids: itertools.count = field(default_factory=itertools.count)
    free_blocks: list[Block] = field(default_factory=list)
    used: dict[int, Block] = field(default_factory=dict)  # storage key -> its block
    allocated: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0

    def malloc(self, key: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        size = _round(nbytes, 512)
        small = size <= SMALL
        fits = [b for b in self.free_blocks if b.small == small and b.size >= size]
        if fits:
            block = min(fits, key=lambda b: (b.size, b.segment, b.offset))
            self.free_blocks.remove(block)
        else:
            total = SMALL_SEGMENT if small else LARGE_SEGMENT if size < MIN_LARGE else _round(size, ROUND_LARGE)
            segment = next(self.segment_ids)
            self.segments[segment] = total
            self.peak_reserved = max(self.peak_reserved, sum(self.segments.values()))
            block = Block(segment, 0, total, small)
        rest = block.size - size
        if rest >= 512 if small else rest > SMALL:
            tail = Block(block.segment, block.offset + size, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self.free_blocks.append(tail)
        block.free = False
        self.used[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def release(self, key: int) -> None:
        block = self.used.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self.free_blocks.remove(neighbour)
                first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                block = first
        self.free_blocks.append(block)

    def empty_cache(self) -> None:
        for block in [b for b in self.free_blocks if b.prev is None and b.next is None]:
            self.free_blocks.remove(block)
            del self.segments[block.segment]

    def state(self) -> dict[str, float]:
        held = {b.segment for b in self.used.values()}
        pinned_free = sum(b.size for b in self.free_blocks if b.segment in held)
        return {
            "reserved_gib": sum(self.segments.values()) / GIB,
            "allocated_gib": sum(b.size for b in self.used.values()) / GIB,
            "pinned_free_gib": pinned_free / GIB,
            "peak_allocated_gib": self.peak_allocated / GIB,
            "peak_reserved_gib": self.peak_reserved / GIB,
            "segments": len(self.segments),
        }


class Recorder(TorchDispatchMode):
    """Feeds every new storage an op returns, and every storage's end, to ``allocator``."""

    def __init__(self, allocator: CachingAllocator) -> None:
        super().__init__()
        self.allocator, self.live = allocator, set()

    def track(self, tensors) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live:
                continue
            self.live.add(key)
            self.allocator.malloc(key, storage.nbytes())
            weakref.finalize(storage, self._end, key)

    def _end(self, key: int) -> None:
        self.live.discard(key)
        self.allocator.release(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_flatten(out)[0])
        return out


def simulate(recipe: str, batch: int, accum: int, steps: int, moments: str, seq_len: int = 2048) -> dict:
    """The default pool after ``steps`` calibrating steps of ``accum`` micro-batches and ``empty_cache``;
    ``moments``: "built" (made with the trainer) or "first step" (made by the first optimizer step)."""
    allocator = CachingAllocator()
    with FakeTensorMode(allow_non_fake_inputs=True), Recorder(allocator):
        torch.manual_seed(0)
        model = convert_model(build_model("llama3_1b"), get_recipe(recipe))
        params = list(model.parameters())
        matrices, vectors = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]

        def make_moments() -> list[torch.Tensor]:  # AdamW's groups, in their order (train.optim)
            return [torch.zeros_like(p) for p in (*matrices, *vectors) for _ in range(2)]

        made = make_moments() if moments == "built" else []
        model.recompute = True  # the trainer's calibrating steps (training.recompute_pattern_steps)
        vocab = model.args.vocab_size
        for step in range(steps):
            for _ in range(accum):
                tokens = torch.randint(0, vocab, (batch, seq_len))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(tokens, tokens)[1]  # the logits die here, as in the trainer's micro-step
                loss.backward()
                del loss
                gc.collect()
            if step == 0 and not made:
                made = make_moments()
            for p in params:
                p.grad = None
            gc.collect()
        allocator.empty_cache()  # the graphs' warm-up starts with one
        state = allocator.state()
        moment_bytes = sum(t.untyped_storage().nbytes() for t in made)
    return {
        "recipe": recipe,
        "batch": batch,
        "accum": accum,
        "moments": moments,
        "moments_gib": moment_bytes / GIB,
    } | state


def frozen_step(recipe: str, batch: int, plans: dict[str, LayerPlan], seq_len: int = 2048) -> dict:
    """A fresh pool (a CUDA graph's) through one eager frozen micro-step whose gradients are made in it,
    the layers on ``plans`` and on the H200's route: operands quantized into folded E4M3, every MX GEMM
    folding its operands first; the GEMMs' outputs are made, not computed. Eager, not the compiled blocks
    the graphs capture: Inductor keeps less and plans its buffers, so this compares recipes' fragmentation
    (peak reserved against peak allocated), not the pools' sizes."""

    def folded_matmul(a, b, out_dtype, *, fast_accum=True):
        a, b = (ops.fold_fp8(t) if isinstance(t, MXTensor) else t for t in (a, b))
        return torch.empty((a.data.shape[0], b.data.shape[0]), dtype=out_dtype)

    allocator = CachingAllocator()
    with contextlib.ExitStack() as stack:
        for name, value in (
            ("folds_into_fp8", lambda device, n: True),
            ("route_of", lambda *args, **kwargs: GemmRoute.FOLD_FP8),
            ("folded_matmul", folded_matmul),
        ):
            stack.enter_context(mock.patch.object(ops, name, value))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        torch.manual_seed(0)
        model = convert_model(build_model("llama3_1b"), get_recipe(recipe))
        for name, layer in adahop_layers(model).items():
            if layer.plan is None:
                layer.set_plan(plans[name])
        tokens = torch.randint(0, model.args.vocab_size, (batch, seq_len))
        recorder = stack.enter_context(Recorder(allocator))
        recorder.live.update(t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, tokens)[1]
        loss.backward()
        del loss
        gc.collect()
    state = allocator.state()
    return {"recipe": recipe, "batch": batch, "frozen_step": True} | {
        k: state[k] for k in ("peak_allocated_gib", "peak_reserved_gib", "allocated_gib")
    }


def h200_plans(bench_json: Path, recipe: str) -> dict[str, LayerPlan]:
    """Each layer's plan as the H200 froze it (a step bench run's ``layers``)."""
    result = json.loads(bench_json.read_text())
    runs = next(iter(result.get("step", result)["cases"].values()))["runs"]
    layers = next(r["layers"] for name, r in runs.items() if name.startswith(recipe + "/") and "layers" in r)
    return {entry["name"]: LayerPlan(entry["forward"], entry["dgrad"], entry["wgrad"]) for entry in layers}


H200_BENCH = Path(__file__).parent / "2026-12-05-h200-issue30/s2-llama3_1b_8x2048/bench.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="adahop_lv2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="calibrating steps (the step bench's)")
    parser.add_argument(
        "--frozen-step",
        nargs="*",
        metavar="RECIPE",
        help="instead: a graph pool through one frozen micro-step of each recipe (plans of the H200's 2026-12-05 run)",
    )
    a = parser.parse_args()
    if a.frozen_step is not None:
        for recipe in a.frozen_step or ("bf16", "adahop_lv2", "adahop_lv1_bf16_forward", "adahop_lv1_fp8_forward"):
            plans = {} if not get_recipe(recipe).adaptive else h200_plans(H200_BENCH, recipe)
            print(json.dumps(frozen_step(recipe, a.batch, plans)), flush=True)
        return
    for moments in ("first step", "built"):
        print(json.dumps(simulate(a.recipe, a.batch, a.accum, a.steps, moments)), flush=True)


if __name__ == "__main__":
    main()
