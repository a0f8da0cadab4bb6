"""Low-precision FSDP2 all-gather (``adahop.nn.fsdp``) on two CPU ranks over gloo.

Each rank quantizes its rows of every weight into the GEMM operands and FSDP2 gathers those:
training must be bit-identical to FSDP2's own (high-precision) gather, through calibration, the
freeze and the frozen steps; state_dict, DCP and the optimizer must see plain tensors.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from adahop import convert_model
from adahop.nn import set_bf16_forward

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
WORLD = 2
TOKENS_PER_RANK = 32
STEPS = 4
RECIPES = {
    "iht": {"name": "mxfp4_hadamard"},
    "2d": {"name": "mxfp4", "weight_blocks": "2d"},
    "lv2": {"name": "adahop_lv2", "calibration_steps": 2},
    "lv1": {"name": "adahop_lv1", "calibration_steps": 2},
    "fp8": {"name": "adahop_lv1_fp8_forward", "calibration_steps": 2},
    "sr": {"name": "mxfp4", "backward_rounding": "stochastic"},  # refused: keeps the high-precision gather
    "late": {"name": "mxfp4_hadamard", "bf16_forward_after": 0.5},  # the forward in BF16 from step 3 on
    "autocast": {"name": "mxfp4_hadamard"},
    "checkpointed": {"name": "mxfp4_hadamard"},
    "telemetry": {"name": "mxfp4_hadamard"},
    "ragged": {"name": "mxfp4_hadamard"},
    "meta": {"name": "mxfp4_hadamard"},
    "accumulated": {"name": "adahop_lv2", "calibration_steps": 2},
    "oe_right": {"name": "mxfp4_hadamard", "forward_strategy": "oe_right", "oe_k": 8},
    "oe_right_k48": {"name": "mxfp4_hadamard", "forward_strategy": "oe_right", "oe_k": 48},
}
# Cases that also run differently (named after how): CPU bf16 autocast (W quantized from its bf16 cast); layer 0
# under activation checkpointing (backward's re-gather serves the recomputed forward); pattern hooks
# on step 2 (they read W, so it is gathered whole; they run after FSDP2 resharded the layer and gather its rows);
# ragged shapes (48 and 16 rows per rank: not whole MX blocks along out); built on the meta device,
# sharded, then materialized and initialized (torchtitan's order); two micro-batches a step, the
# first without gradient sync (calibration sums both into one vote; the freeze waits for the optimizer step).
OPTIONS = ("autocast", "checkpointed", "telemetry", "ragged", "meta", "accumulated")


def make_model(recipe: dict, ragged: bool = False) -> nn.Module:
    torch.manual_seed(0)
    hidden, out = (96, 32) if ragged else (128, 64)
    model = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, out))
    return convert_model(model, recipe)


def batch(step: int, rank: int) -> torch.Tensor:
    x = torch.randn(WORLD * TOKENS_PER_RANK, 64, generator=torch.Generator().manual_seed(step))
    x[:, 5] *= 30.0  # an outlier channel: X votes "col", so the frozen forward is IHT
    return x[rank * TOKENS_PER_RANK : (rank + 1) * TOKENS_PER_RANK]


def train(rank: int, name: str, low_precision: bool, checkpoint: str) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    from adahop.nn import adahop_layers, weight_operands_cached
    from adahop.nn.fsdp import gathered_format, low_precision_all_gather
    from adahop.nn.weight_cache import operand_cache
    from adahop.train.telemetry import sample_patterns

    recipe, option = RECIPES[name], name if name in OPTIONS else None
    with torch.device("meta" if option == "meta" else "cpu"):
        model = make_model(recipe, ragged=option == "ragged")
    if low_precision:
        assert low_precision_all_gather(model) == ["0", "2"]
    layers = adahop_layers(model)
    if option == "checkpointed":
        model[0] = checkpoint_wrapper(model[0])
    for layer in (model[0], model[2]):  # telemetry's hooks then read W outside its unit, as this rank's rows
        fully_shard(layer)
    fully_shard(model)
    if option == "meta":
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for layer in layers.values():
            layer.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(1)  # the stochastic-rounding keys
    losses, formats, quantized = [], [], []
    after = recipe.get("bf16_forward_after")
    for step in range(STEPS):
        if after is not None and step == int(after * STEPS):  # as the trainer switches
            set_bf16_forward(model)
        observed = sample_patterns(layers) if option == "telemetry" and step == 2 else contextlib.nullcontext()
        micro_batches = batch(step, rank).chunk(2) if option == "accumulated" else [batch(step, rank)]
        # The low-precision runs keep each shard's operands for the step (the reference does not).
        with weight_operands_cached(model) if low_precision else contextlib.nullcontext():
            for i, micro_batch in enumerate(micro_batches):
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
                with observed, torch.autocast("cpu", dtype=torch.bfloat16, enabled=option == "autocast"):
                    loss = model(micro_batch).float().mean()
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        formats.append([gathered_format(layer) for layer in layers.values()])
        quantized.append([operand_cache(layer).made for layer in layers.values()])
    state = model.state_dict()
    out = {
        "losses": torch.stack(losses),
        "weights": {k: v.full_tensor() for k, v in state.items() if k.endswith(("weight", "bias"))},
        "formats": formats,
        "shards_quantized": quantized,  # per step, each layer's shard quantizations so far
        "state_types": sorted(
            {type(v._local_tensor if hasattr(v, "_local_tensor") else v).__name__ for v in state.values()}
        ),
        "optim_types": sorted(
            {type(t._local_tensor).__name__ for s in optimizer.state.values() for t in s.values() if t.dim() > 0}
        ),
    }
    if checkpoint:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=checkpoint)
        fresh = make_model(recipe)  # other weights (drawn anew), loaded back from the checkpoint
        low_precision_all_gather(fresh)
        for layer in (fresh[0], fresh[2]):
            fully_shard(layer)
        fully_shard(fresh)
        loaded = fresh.state_dict()
        dcp.load(loaded, checkpoint_id=checkpoint)
        fresh.load_state_dict(loaded)
        out["reloaded"] = {k: v.full_tensor() for k, v in fresh.state_dict().items() if k.endswith("weight")}
        out["reloaded_loss"] = fresh(batch(0, rank)).square().mean().detach()
        out["trained_loss"] = model(batch(0, rank)).square().mean().detach()
    return out


def run_rank(rank: int, init: str, out: str, checkpoint_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {}
    for name in RECIPES:
        checkpoint = f"{checkpoint_dir}/{name}" if name == "iht" else ""
        results[name] = {
            "bf16": train(rank, name, low_precision=False, checkpoint=""),
            "low": train(rank, name, low_precision=True, checkpoint=checkpoint),
        }
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_low_precision")
    out = str(tmp / "result")
    mp.start_processes(run_rank, args=(f"file://{tmp}/rendezvous", out, str(tmp)), nprocs=WORLD, start_method="spawn")
    return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


@pytest.mark.parametrize("name", list(RECIPES))
def test_training_is_bit_identical_to_the_high_precision_gather(ranks, name):
    for rank in ranks:
        bf16, low = rank[name]["bf16"], rank[name]["low"]
        assert torch.equal(bf16["losses"], low["losses"]), name
        for key, value in bf16["weights"].items():
            assert torch.equal(value, low["weights"][key]), (name, key)
        assert bf16["formats"] == [["bf16", "bf16"]] * STEPS


def test_quantized_gather_is_used_where_the_plan_allows(ranks):
    formats = {name: ranks[0][name]["low"]["formats"] for name in RECIPES}
    assert formats["iht"] == [["quantized", "quantized"]] * STEPS
    assert formats["2d"] == [["quantized", "quantized"]] * STEPS
    assert formats["sr"] == [["bf16", "bf16"]] * STEPS  # noise keyed by place in the whole weight
    for name in ("autocast", "checkpointed", "meta", "oe_right", "oe_right_k48"):
        assert formats[name] == [["quantized", "quantized"]] * STEPS, name
    assert formats["telemetry"] == [["quantized", "quantized"]] * 2 + [["bf16", "bf16"]] + [["quantized", "quantized"]]
    assert formats["ragged"] == [["bf16", "bf16"]] * STEPS
    assert formats["late"] == [["quantized", "quantized"]] * 2 + [["bf16", "bf16"]] * 2  # a BF16 forward reads W whole
    # Calibration (2 steps; the plan freezes before step 2's update) gathers W whole. Then layer 0
    # plans an IHT forward and dgrad; layer 2 an OE-left forward, which needs the whole W, except
    # where the recipe forces a plain FP8 forward.
    for name in ("lv2", "lv1"):
        assert formats[name] == [["bf16", "bf16"]] * 2 + [["quantized", "bf16"]] * 2, name
    # Two micro-batches a step: the plan freezes at the optimizer step, never between them.
    assert formats["accumulated"] == [["bf16", "bf16"]] * 2 + [["quantized", "bf16"]] * 2
    assert formats["fp8"] == [["bf16", "bf16"]] * 2 + [["quantized", "quantized"]] * 2
    assert formats == {name: ranks[1][name]["low"]["formats"] for name in RECIPES}


def test_a_shard_is_quantized_once_per_optimizer_step(ranks):
    """Under ``weight_operands_cached`` every gather of a step (each micro-batch's forward, backward's
    re-gather, a checkpointed recompute) reuses the shard's operands: one quantization per quantized
    gather step, none on a high-precision one; the training stays bit-identical (test above)."""
    for rank in ranks:
        made = {name: rank[name]["low"]["shards_quantized"] for name in RECIPES}
        assert made["iht"] == [[1, 1], [2, 2], [3, 3], [4, 4]]
        assert made["checkpointed"] == [[1, 1], [2, 2], [3, 3], [4, 4]]
        assert made["accumulated"] == [[0, 0], [0, 0], [1, 0], [2, 0]]  # calibration, then layer 0 alone
        assert made["sr"] == [[0, 0]] * STEPS


def test_state_dict_checkpoint_and_optimizer_hold_plain_tensors(ranks):
    for rank in ranks:
        low = rank["iht"]["low"]
        assert low["state_types"] == ["Tensor"]
        assert low["optim_types"] == ["Tensor"]
        for key, value in low["reloaded"].items():
            assert torch.equal(value, low["weights"][key]), key
        assert torch.equal(low["reloaded_loss"], low["trained_loss"])


def test_weights_that_do_not_split_evenly_keep_the_high_precision_gather():
    from adahop.nn.fsdp import LowPrecisionShard, low_precision_all_gather

    model = make_model({"name": "mxfp4"}, ragged=True)  # out 96 and 32
    assert low_precision_all_gather(model, world_size=3) == ["0"]
    assert isinstance(model[0].weight, LowPrecisionShard) and type(model[2].weight) is nn.Parameter
    assert type(model.state_dict()["0.weight"]) is torch.Tensor


def test_a_weight_gathered_quantized_is_read_only_by_the_gemms_it_was_made_for():
    from adahop.formats import quantize_mx
    from adahop.gemm.operand import GemmOperand
    from adahop.nn.gathered import GatheredWeight, WeightOperands, gathered_operands
    from adahop.policy.strategies import LayerPlan

    w = torch.randn(64, 32)
    forward = GemmOperand(quantized=quantize_mx(w, axis=1))
    dgrad = GemmOperand(quantized=quantize_mx(w, axis=0))
    plan = LayerPlan.uniform("mxfp4")
    weight = GatheredWeight(WeightOperands(forward, dgrad, plan, torch.bfloat16), w.shape, torch.float32)
    assert gathered_operands(w, plan) is None  # a plain weight: the layer quantizes it itself
    with pytest.raises(RuntimeError, match="gathered quantized for plan"):
        gathered_operands(weight, plan)  # float32 now, quantized from bfloat16: autocast must cast first
    cast = weight.to(torch.bfloat16)  # the forward's autocast cast costs nothing
    assert type(cast) is GatheredWeight and cast.dtype == torch.bfloat16
    assert gathered_operands(cast, plan) == (forward, dgrad)
    with pytest.raises(RuntimeError, match="now runs"):
        gathered_operands(cast, LayerPlan.uniform("iht"))
    assert type(weight.detach()) is GatheredWeight
    for use in (lambda t: t + 1, lambda t: t.to(torch.float16), lambda t: t.sum()):
        with pytest.raises(RuntimeError, match="only AdaHOPLinear's GEMMs read it"):
            use(weight)


@pytest.mark.parametrize(
    "recipe",
    [
        {"name": "mxfp4"},
        {"name": "mxfp4_hadamard"},
        {"name": "mxfp4_hadamard", "hadamard_block_size": 64},
        {"name": "mxfp4", "weight_blocks": "2d"},
        {"name": "mxfp4_hadamard", "forward_fmt": "fp8_e4m3_rowwise"},
        {"name": "mxfp4_hadamard", "forward_strategy": "oe_right", "oe_k": 12},
        {"name": "mxfp4_hadamard", "forward_strategy": "oe_right", "oe_k": 40},  # more than a piece's rows
    ],
)
def test_shards_of_whole_blocks_quantize_to_the_whole_weights_operands(recipe):
    """The property the gather rests on: the ranks' pieces, concatenated along out, are the operands
    the layer quantizes from the whole weight; with rows that split a block along out they are not."""
    from adahop.gemm.operand import prepare_operand, prepare_weight_tiles
    from adahop.nn import AdaHOPLinear
    from adahop.nn.fsdp import QuantizedWeightGather

    layer = AdaHOPLinear(64, 128, recipe=recipe)
    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)
    w[::7] *= 10.0  # outlier rows in every piece, two rows tied
    w[20], w[100] = w[3], w[3]
    gather, (act, _, saved) = QuantizedWeightGather(), layer._specs
    oe_k = layer.recipe.oe_k
    if layer.recipe.weight_blocks == "2d":
        expected = prepare_weight_tiles(w, layer.plan.forward, layer.plan.dgrad, act)
    else:
        expected = (
            prepare_operand(w, layer.plan.forward, "R", act, oe_k=oe_k),
            prepare_operand(w.t(), layer.plan.dgrad, "R", saved, oe_k=oe_k),
        )
    whole_block = max(32, layer.recipe.hadamard_block_size if recipe["name"] == "mxfp4_hadamard" else 32)
    for rows in (whole_block, whole_block // 2):
        pieces = [gather.quantize(layer, shard) for shard in w.split(rows)]
        layouts = pieces[0][1]
        outputs = tuple(torch.cat(parts) for parts in zip(*(p[0] for p in pieces)))
        forward, dgrad, _ = gather.assemble(outputs, layouts, w.shape[0])
        equal = [
            got.quantized.shape == want.quantized.shape
            and all(
                torch.equal(a, b)
                for a, b in zip(vars(got.quantized).values(), vars(want.quantized).values())
                if torch.is_tensor(a)
            )
            for got, want in zip((forward, dgrad), expected)
        ]
        if expected[0].rows is not None:  # OE-right: the same top rows, in high precision
            assert torch.equal(forward.rows, expected[0].rows) and torch.equal(forward.extracted, expected[0].extracted)
            assert forward.dense is None
        if rows == whole_block:
            assert gather.refusal(layer, rows) is None and equal == [True, True]
        else:  # the forward's blocks still run along each row; dgrad's (or the tiles) straddle the pieces
            assert gather.refusal(layer, rows) is not None and equal == [layer.recipe.weight_blocks == "1d", False]
