"""The 4-bit preparation of a training step against its memory floor, per kernel family.

Bytes are derived from the model's shapes and its frozen plan, not measured: for every converted
linear layer and every GEMM it does not run in BF16, the passes that prepare its operands on the
Hopper route (``policy.routes``: fold_fp8), with the bytes each pass reads and writes.

| operand (GEMM)       | pass                                        | shape read     |
|----------------------|---------------------------------------------|----------------|
| X, W (forward)       | quantize-fold rows, straight into E4M3      | [T, in], [out, in] |
| X, W (FP8 forward)   | quantize FP8 rows (``forward_fmt``)         | [T, in], [out, in] |
| Xᵀ (wgrad), Wᵀ (dgrad), saved | quantize cols, packed MXFP4        | [T, in], [out, in] |
| dY (dgrad)           | quantize-fold rows                          | [T, out]       |
| dYᵀ (wgrad)          | quantize cols                               | [T, out]       |
| Wᵀ (dgrad)           | fold of the packed operand                  | [in, out]      |
| dYᵀ and Xᵀ (wgrad)   | fold of each packed operand                 | [out, T], [in, T] |
| OE-left / OE-right   | + selection of the top rows from the scores | rows           |

Compiled blocks merge equal calls (``ops``: layers sharing an input, ``wq``/``wk``/``wv`` and
``w1``/``w3``, quantize it once when their strategies agree), and with them the folds of that one
Xᵀ (``ops.fold_fp8`` is its own graph node; ``shared_folds``: runs recorded before 2026-12-05 folded
inside each wgrad GEMM, once per consumer). Under gradient accumulation W's passes run once per
optimizer step where its operands are kept (``training.weight_operands_once_per_step``). Time per family comes from the profiled step's kernels, and the
calls the model predicts sit beside the calls the profiler counted, so a model that no longer
matches the code shows. Not modelled: the casts that feed the quantizers (the FP32 master weight
to BF16 is autocast's, as in BF16) and the gather of extracted outlier rows (k rows per operand), and the separate Hadamard pass of an FP8
forward with one (its quantizer does not fuse it).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ..formats.rowwise import ROWWISE_FP8, ROWWISE_K_ALIGN
from ..policy.strategies import Strategy

INPUT_BYTES = 2  # the quantizers read BF16 (autocast)
SCALE_BYTES_PER_ROW = 8  # a folded row's float32 scale and int32 count of underflowed elements
SCORE_BYTES = 4  # a float32 outlier score per stored row, when the pass records scores
MX_BLOCK = 32
LAUNCH_BOUND_MS = 0.05  # below this a family's floor is a launch's latency, not its bytes: no "x floor"

QUANTIZE_FOLD = "quantize-fold rows"
QUANTIZE_FP8 = "quantize FP8 rows"
QUANTIZE_COLS = "quantize cols"
QUANTIZE_ROWS = "quantize rows"
FOLD = "fold"
SELECT = "select top rows"
# Preparation kernels by name fragment, first match wins.
KERNEL_FAMILIES = (
    (QUANTIZE_FOLD, ("_quantize_fold_rows_kernel",)),
    (QUANTIZE_FP8, ("_quantize_rowwise_kernel",)),
    (QUANTIZE_COLS, ("_quantize_cols_kernel",)),
    (QUANTIZE_ROWS, ("_quantize_rows_kernel", "_quantize_mx_kernel")),
    (FOLD, ("_fold_kernel",)),
    (SELECT, ("_top_rows_kernel",)),
)
FAMILIES = tuple(label for label, _ in KERNEL_FAMILIES)
# Layers that read one input tensor in a Llama block: compiled, their equal quantize calls merge.
SHARED_INPUTS = {"wq": "attention", "wk": "attention", "wv": "attention", "w1": "feed_forward", "w3": "feed_forward"}


def kernel_family(kernel: str) -> str | None:
    """The preparation family of a kernel name, or None for any other kernel."""
    for label, keys in KERNEL_FAMILIES:
        if any(k in kernel for k in keys):
            return label
    return None


@dataclass(frozen=True)
class Layer:
    """One converted linear layer: its module name, shape and frozen strategies."""

    name: str
    in_features: int
    out_features: int
    forward: str
    dgrad: str
    wgrad: str
    forward_fmt: str | None = None  # the recipe's: None is the MXFP4 of the other GEMMs


@dataclass
class FamilyBytes:
    calls: int = 0
    bytes: int = 0


def _quantize_bytes(rows: int, k: int, *, folded: bool, scores: bool) -> int:
    """One quantize pass over ``rows`` x ``k`` BF16 values: packed MXFP4 (4 bits and an E8M0 scale
    per 32) or folded E4M3 (a byte each and a row scale)."""
    read = INPUT_BYTES * rows * k
    write = rows * k + SCALE_BYTES_PER_ROW * rows if folded else rows * k // 2 + math.ceil(k / MX_BLOCK) * rows
    return read + write + (SCORE_BYTES * rows if scores else 0)


def _fp8_rows_bytes(rows: int, k: int, *, scores: bool) -> int:
    """Row-wise E4M3 of ``rows`` x ``k`` BF16 values: a byte each (K padded) and a float32 row scale."""
    padded = -(-k // ROWWISE_K_ALIGN) * ROWWISE_K_ALIGN
    return INPUT_BYTES * rows * k + rows * padded + 4 * rows + (SCORE_BYTES * rows if scores else 0)


def _fold_bytes(rows: int, k: int) -> int:
    """Fold a packed MXFP4 operand (``rows`` x ``k``) into E4M3 and row scales."""
    return rows * k // 2 + math.ceil(k / MX_BLOCK) * rows + rows * k + SCALE_BYTES_PER_ROW * rows


def preparation_passes(
    layers: list[Layer],
    tokens: int,
    *,
    micro_steps: int = 1,
    weight_micro_steps: int | None = None,
    merged: bool = True,
    shared_folds: bool = True,
    oe_k: int = 64,
) -> dict[str, FamilyBytes]:
    """Calls and bytes per family of one optimizer step of ``micro_steps`` micro-batches of
    ``tokens`` tokens; ``merged``: equal quantize calls of layers sharing an input counted once
    (compiled blocks), and, with ``shared_folds``, the folds of the Xᵀ they share.
    ``weight_micro_steps``: the micro-batches that quantize W (1 where W's operands are kept over
    the step, ``training.weight_operands_once_per_step``; ``micro_steps`` by default); the kept Wᵀ
    is still folded in each backward (``ops.fold_fp8`` keeps no fold)."""
    weight_micro_steps = micro_steps if weight_micro_steps is None else weight_micro_steps
    per_batch: dict[str, FamilyBytes] = defaultdict(FamilyBytes)
    per_weight: dict[str, FamilyBytes] = defaultdict(FamilyBytes)  # the passes on W, Wᵀ
    seen: set[tuple] = set()

    def add(family: str, nbytes: int, key: tuple | None = None, weight: bool = False) -> None:
        if key is not None and merged:
            if key in seen:
                return
            seen.add(key)
        out = per_weight if weight else per_batch
        out[family].calls += 1
        out[family].bytes += nbytes

    def select(rows: int, key: tuple | None = None, weight: bool = False) -> None:
        """The top rows of the scores the quantize pass ``key`` recorded: merged where that pass is."""
        add(SELECT, SCORE_BYTES * rows + 8 * min(oe_k, rows), None if key is None else ("select", *key), weight)

    T = tokens
    for layer in layers:
        block, _, leaf = layer.name.rpartition(".")
        source = (block.rpartition(".")[0], SHARED_INPUTS.get(leaf, leaf))  # the input X, by block
        n_in, n_out = layer.in_features, layer.out_features
        fwd, dgrad, wgrad = (Strategy.parse(s) for s in (layer.forward, layer.dgrad, layer.wgrad))
        if fwd is not Strategy.BF16:
            rotate = fwd is not Strategy.MXFP4
            x_scores, w_scores = fwd is Strategy.OE_LEFT, fwd is Strategy.OE_RIGHT
            key = ("X", source, layer.forward_fmt, rotate, x_scores)
            if layer.forward_fmt == ROWWISE_FP8:
                add(QUANTIZE_FP8, _fp8_rows_bytes(T, n_in, scores=x_scores), key)
                add(QUANTIZE_FP8, _fp8_rows_bytes(n_out, n_in, scores=w_scores), weight=True)
            else:
                add(QUANTIZE_FOLD, _quantize_bytes(T, n_in, folded=True, scores=x_scores), key)
                add(QUANTIZE_FOLD, _quantize_bytes(n_out, n_in, folded=True, scores=w_scores), weight=True)
            if x_scores:
                select(T, key)
            if w_scores:
                select(n_out, weight=True)
        if wgrad is not Strategy.BF16:  # Xᵀ, saved for wgrad (R); its dYᵀ (L) in backward
            rotate = wgrad is not Strategy.MXFP4
            xt_scores, dyt_scores = wgrad is Strategy.OE_RIGHT, wgrad is Strategy.OE_LEFT
            key = ("Xt", source, rotate, xt_scores)
            add(QUANTIZE_COLS, _quantize_bytes(n_in, T, folded=False, scores=xt_scores), key)
            add(QUANTIZE_COLS, _quantize_bytes(n_out, T, folded=False, scores=dyt_scores))
            add(FOLD, _fold_bytes(n_out, T))
            add(FOLD, _fold_bytes(n_in, T), ("fold", *key) if shared_folds else None)
            if xt_scores:
                select(n_in, key)
            if dyt_scores:
                select(n_out)
        if dgrad is not Strategy.BF16:  # Wᵀ saved for dgrad (R), dY (L) in backward
            wt_scores, dy_scores = dgrad is Strategy.OE_RIGHT, dgrad is Strategy.OE_LEFT
            add(QUANTIZE_COLS, _quantize_bytes(n_in, n_out, folded=False, scores=wt_scores), weight=True)
            add(QUANTIZE_FOLD, _quantize_bytes(T, n_out, folded=True, scores=dy_scores))
            add(FOLD, _fold_bytes(n_in, n_out))
            if wt_scores:
                select(n_in, weight=True)
            if dy_scores:
                select(T)
    out: dict[str, FamilyBytes] = defaultdict(FamilyBytes)
    for passes, times in ((per_batch, micro_steps), (per_weight, weight_micro_steps)):
        for family, fam in passes.items():
            out[family].calls += fam.calls * times
            out[family].bytes += fam.bytes * times
    return dict(out)


def one_read_floor_bytes(
    layers: list[Layer], tokens: int, *, micro_steps: int = 1, weight_micro_steps: int | None = None
) -> int:
    """Bytes if every source tensor (X per shared input, W, dY) were read once for all its
    orientations and every GEMM operand written once as the E4M3 its GEMM reads (no packed copy,
    no separate fold): the floor of a fused design, not of this code. W's share counts
    ``weight_micro_steps`` times (``preparation_passes``)."""
    weight_micro_steps = micro_steps if weight_micro_steps is None else weight_micro_steps
    per_batch, per_weight, sources = 0, 0, set()
    T = tokens

    def written(shapes: list[tuple[int, int]]) -> int:
        return sum(r * k + SCALE_BYTES_PER_ROW * r for r, k in shapes)

    for layer in layers:
        block, _, leaf = layer.name.rpartition(".")
        source = (block.rpartition(".")[0], SHARED_INPUTS.get(leaf, leaf))
        n_in, n_out = layer.in_features, layer.out_features
        fwd, dgrad, wgrad = (Strategy.parse(s) != Strategy.BF16 for s in (layer.forward, layer.dgrad, layer.wgrad))
        if (fwd or wgrad) and source not in sources:
            sources.add(source)
            per_batch += INPUT_BYTES * T * n_in
        per_batch += INPUT_BYTES * T * n_out * (dgrad or wgrad)
        per_batch += written([(T, n_in)] * fwd + [(T, n_out)] * dgrad + [(n_out, T), (n_in, T)] * wgrad)
        per_weight += INPUT_BYTES * n_out * n_in * (fwd or dgrad) + written(
            [(n_out, n_in)] * fwd + [(n_in, n_out)] * dgrad
        )
    return per_batch * micro_steps + per_weight * weight_micro_steps


def roofline(result: dict, copy_gb_per_s: float) -> dict | None:
    """Per family: modelled calls and bytes, profiled calls and ms, achieved TB/s and time over the
    floor (bytes at ``copy_gb_per_s``); their sums against the step's CUDA time. None for a run
    without converted layers (BF16, the peers) or whose layers all run in BF16."""
    layers = [Layer(**layer) for layer in result.get("layers", [])]
    profiled = result.get("profile", {}).get("preparation", {})
    if not layers or "tokens_per_micro_step" not in result:
        return None
    accum = result.get("accum", 1)
    passes = preparation_passes(
        layers,
        result["tokens_per_micro_step"],
        micro_steps=accum,
        weight_micro_steps=1 if result.get("weight_operands_once_per_step") else accum,
        merged=result.get("merged", True),
        shared_folds=result.get("shared_folds", False),  # absent: a run recorded before folds were shared
    )
    if not passes:  # every GEMM in BF16
        return None
    rows = {}
    for family in FAMILIES:
        model, prof = passes.get(family, FamilyBytes()), profiled.get(family, {"ms": 0.0, "calls": 0})
        if not model.calls and not prof["calls"]:
            continue
        floor_ms = model.bytes / copy_gb_per_s / 1e6
        rows[family] = {
            "calls_model": model.calls,
            "calls_profiled": prof["calls"],
            "gb": model.bytes / 1e9,
            "ms": prof["ms"],
            "tb_per_s": model.bytes / prof["ms"] / 1e9 if prof["ms"] else None,
            "floor_ms": floor_ms,
            "x_floor": prof["ms"] / floor_ms if floor_ms >= LAUNCH_BOUND_MS else None,
        }
    total_bytes = sum(p.bytes for p in passes.values())
    total_ms = sum(r["ms"] for r in rows.values())
    floor_ms = total_bytes / copy_gb_per_s / 1e6
    one_read_ms = one_read_floor_bytes(
        layers,
        result["tokens_per_micro_step"],
        micro_steps=accum,
        weight_micro_steps=1 if result.get("weight_operands_once_per_step") else accum,
    )
    cuda_ms = result.get("profile", {}).get("cuda_ms")
    return {
        "copy_gb_per_s": copy_gb_per_s,
        "families": rows,
        "total": {
            "gb": total_bytes / 1e9,
            "ms": total_ms,
            "tb_per_s": total_bytes / total_ms / 1e9 if total_ms else None,
            "floor_ms": floor_ms,
            "x_floor": total_ms / floor_ms if floor_ms else None,
            "one_read_floor_ms": one_read_ms / copy_gb_per_s / 1e6,
            "fraction_of_step": total_ms / cuda_ms if cuda_ms else None,
            "step_cuda_ms": cuda_ms,
        },
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(name: str, table: dict) -> list[str]:
    """One run's roofline as a markdown table."""
    total = table["total"]
    lines = [
        "",
        f"Preparation roofline of `{name}` (bytes from the shapes and the plan; time from the profiled step; "
        f"floor: the bytes at the measured copy bandwidth, {table['copy_gb_per_s'] / 1e3:.2f} TB/s):",
        "",
        "| kernel family | calls (model / profiled) | GB moved | ms | TB/s | floor ms | x floor |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for family, r in table["families"].items():
        mismatch = "" if r["calls_model"] == r["calls_profiled"] else " (differ)"
        lines.append(
            f"| {family} | {r['calls_model']} / {r['calls_profiled']}{mismatch} | {r['gb']:.2f} | {r['ms']:.2f} | "
            f"{_fmt(r['tb_per_s'], '.2f')} | {r['floor_ms']:.2f} | {_fmt(r['x_floor'], '.2f')} |"
        )
    share = _fmt(None if total["fraction_of_step"] is None else 100 * total["fraction_of_step"], ".1f")
    lines += [
        f"| **all** | | {total['gb']:.2f} | {total['ms']:.2f} | {_fmt(total['tb_per_s'], '.2f')} | "
        f"{total['floor_ms']:.2f} | {_fmt(total['x_floor'], '.2f')} |",
        "",
        f"Preparation is {share}% of the step's {_fmt(total['step_cuda_ms'], '.1f')} CUDA ms; a fused design "
        f"(each source read once for both orientations, each operand written once as E4M3) has a floor of "
        f"{total['one_read_floor_ms']:.2f} ms.",
    ]
    return lines
