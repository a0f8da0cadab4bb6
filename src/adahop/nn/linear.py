"""``AdaHOPLinear``: a drop-in ``nn.Linear`` whose three GEMMs each run their own strategy.

Life of a layer under an adaptive recipe:

1. **Calibration** (``plan is None``): the layer computes exactly like ``nn.Linear`` (BF16 under
   autocast); its backward adds the outlier statistics of X, W and dY to device buffers, and at
   each step boundary (before ``optimizer.step()``, or ``adahop.end_calibration_step``) they are
   merged over ranks into one vote per tensor (``adahop.policy.calibration``).
2. **Freeze**: at the step boundary where every tensor has ``recipe.calibration_steps`` votes,
   the majority patterns pick a (forward, dgrad, wgrad) strategy from the recipe's table; the plan
   never changes again and is saved in the state_dict (``_extra_state``, an int64 tensor:
   ``adahop.nn.state``).
3. **Training**: each GEMM runs BF16, MXFP4, IHT (inner Hadamard + MXFP4), OE-left or OE-right.

Fixed recipes (``bf16``, ``mxfp4``, ``mxfp4_hadamard``) skip calibration. X and W round to nearest,
dY rounds stochastically with Philox noise keyed by seeds drawn from torch's global generator,
so ``torch.manual_seed`` fixes them and a resumed run (RNG state restored) draws the same noise.
What backward needs is saved quantized: X along tokens (wgrad's K) and
W along ``out`` (dgrad's K), BF16 only for extracted outlier rows; a BF16 Wᵀ (dgrad in BF16, or
OE-left's other side) is cast again from the parameter in backward, not kept from the forward; a compiled
block can make Xᵀ in backward instead, from a recomputed X (``training.recompute_wgrad_operands``:
``nn.compiling``). ``recipe.backward_rounding =
"stochastic"`` rounds those two saved copies stochastically too, with seeds of their own.
``recipe.weight_blocks = "2d"`` quantizes W once in square tiles for the forward and dgrad (the
saved Wᵀ is then the forward's W, rounded as the forward rounds it).

NaN/Inf in an input block make that MX block NaN (scale code 255), so they propagate to the
outputs they touch, as they would in ``nn.Linear``; they are never silently zeroed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..gemm.matmul import tn_matmul
from ..formats import QuantSpec
from ..gemm.operand import GemmOperand, prepare_operand, prepare_weight_tiles
from ..policy.calibration import PatternVotes, Voter, add_step_buffers, close_voter, observe, open_voter
from ..policy.strategies import GEMMS, ROLES, LayerPlan, Strategy, plan_for_patterns
from ..recipes import DEFAULT_RECIPE, Recipe, get_recipe
from ..transforms import random_signs
from .compiling import wgrad_operand_region
from .gathered import gathered_operands
from .state import decode_state, encode_state, new_state
from .weight_cache import OFF, KeptOperands, OperandCache, caching, operand_cache

SEED_BOUND = 1 << 62


def draw_rounding_seeds(device: torch.device | str = "cpu", count: int = 2) -> torch.Tensor:
    """Philox keys for the dgrad and wgrad quantization of dY, then (``count=4``) for the saved
    Xᵀ and Wᵀ, from torch's generator of ``device``, in one call.

    Drawn once per training forward, so ``torch.manual_seed`` makes runs reproducible and a
    checkpoint that restores the RNG state resumes the exact same noise. A tensor (not a Python
    int) so a compiled graph does not specialise on its value; on the layer's own device so the
    step never waits on the host, and a step captured as a CUDA graph draws new keys (CUDA's
    Philox offset advances) on every replay.
    """
    return torch.randint(0, SEED_BOUND, (count,), dtype=torch.int64, device=device)


@dataclass(frozen=True)
class GemmConfig:
    """Everything the autograd function needs besides tensors."""

    plan: LayerPlan
    act: QuantSpec  # X and W as the forward GEMM reads them: round to nearest, recipe.forward_fmt
    grad: QuantSpec  # dY: stochastic rounding by default
    oe_k: int
    dgrad_seed: torch.Tensor
    wgrad_seed: torch.Tensor
    saved: QuantSpec  # Xᵀ and Wᵀ for the backward: recipe.backward_rounding
    xt_seed: torch.Tensor | int  # their Philox keys (0 when they round to nearest)
    wt_seed: torch.Tensor | int
    weight_tiles: bool  # recipe.weight_blocks == "2d"
    grad_fast_accum: bool  # recipe.grad_fast_accum: the dgrad and wgrad FP8 GEMMs' accumulation
    forward_reference: bool  # recipe.forward_gemm == "reference": no fold, float32 products
    weight_cache: OperandCache | None = None  # keeps W's operands while the parameter is unchanged
    weight_param: torch.Tensor | None = None  # the parameter (the forward's weight may be its autocast copy)


def _forward_folds(weight: torch.Tensor, cfg: GemmConfig) -> bool:
    """Whether the forward's L and R are quantized straight into folded FP8: both are used at once,
    on the fold_fp8 route (never under ``forward_gemm = "reference"``)."""
    return ops.folds_into_fp8(weight.device, weight.shape[0]) and not cfg.forward_reference


def _weight_operand(cfg: GemmConfig, slot: str, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, or what it made for this parameter and ``key`` earlier in the optimizer step."""
    if cfg.weight_cache is None:
        return make()
    return cfg.weight_cache.get(slot, cfg.weight_param, key, make)


def _dgrad_operand(weight: torch.Tensor, cfg: GemmConfig, seed: torch.Tensor | int = 0) -> GemmOperand:
    """Wᵀ as dgrad's R, without its high-precision form (a BF16 dgrad, or OE-left's other side): the
    autograd function casts that again from the parameter in backward, so neither the step's kept
    operands nor the saved tensors hold a BF16 copy of W."""
    wt = prepare_operand(weight.t(), cfg.plan.dgrad, "R", cfg.saved, oe_k=cfg.oe_k, seed=seed)
    return dataclasses.replace(wt, dense=None) if wt.dense is not None else wt


def _weight_operands(weight: torch.Tensor, cfg: GemmConfig, obtain: Callable[..., Any]) -> dict[str, Any]:
    """W's operands for the forward and dgrad GEMMs by slot, each from ``obtain(slot, key, make)``
    (which may keep it over the optimizer step's micro-batches): ``"tiles"`` (both from one 2-D tile
    quantization), else ``"forward"`` (R; none for a BF16 forward) and ``"dgrad"`` (Wᵀ; none when
    rounded with a key drawn per forward, ``recipe.backward_rounding = "stochastic"``: the
    autograd function makes that one, on every forward)."""
    plan = cfg.plan
    if cfg.weight_tiles:
        make = functools.partial(prepare_weight_tiles, weight, plan.forward, plan.dgrad, cfg.act)
        return {"tiles": obtain("tiles", (plan.forward, plan.dgrad, weight.dtype), make)}
    operands = {}
    if plan.forward is not Strategy.BF16:
        fold = _forward_folds(weight, cfg)
        make = functools.partial(prepare_operand, weight, plan.forward, "R", cfg.act, oe_k=cfg.oe_k, fold=fold)
        operands["forward"] = obtain("forward", (plan.forward, weight.dtype, fold), make)
    if not isinstance(cfg.wt_seed, torch.Tensor):
        operands["dgrad"] = obtain("dgrad", (plan.dgrad, weight.dtype), functools.partial(_dgrad_operand, weight, cfg))
    return operands


class _AdaHOPLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        source: torch.Tensor | None,
        cfg: GemmConfig,
        w_operands: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """``weight``: W as the GEMMs read it; ``source``: the parameter it was cast from (autocast), or None
        when it is the parameter. Kept for backward at no cost, so a high-precision Wᵀ is cast again there."""
        plan = cfg.plan
        # W's operands: gathered already quantized by FSDP2 (``nn.fsdp``), or made before this function
        # (``w_operands``: a compiled or captured forward keeps them there), or made here, kept over an
        # optimizer step's micro-batches where ``cfg.weight_cache`` is set.
        w_tiles = gathered_operands(weight, plan)
        if w_tiles is None:
            if w_operands is None:
                w_operands = _weight_operands(weight, cfg, functools.partial(_weight_operand, cfg))
            w_tiles = w_operands.get("tiles")
        if plan.forward is Strategy.BF16:
            y = F.linear(x, weight)
        else:
            fold = _forward_folds(weight, cfg)
            l = prepare_operand(x, plan.forward, "L", cfg.act, oe_k=cfg.oe_k, fold=fold)
            r = w_tiles[0] if w_tiles else w_operands["forward"]
            y = tn_matmul(l, r, x.dtype, reference=cfg.forward_reference)

        # Backward operands, prepared now from the high-precision tensors (quantize and
        # transpose do not commute): Xᵀ is wgrad's R, Wᵀ dgrad's R.
        with wgrad_operand_region(cfg.xt_seed):  # recomputed in backward where compiled to (nn.compiling)
            wgrad_r = prepare_operand(x.t(), plan.wgrad, "R", cfg.saved, oe_k=cfg.oe_k, seed=cfg.xt_seed)
        if w_tiles:
            dgrad_r = w_tiles[1]
        elif "dgrad" in w_operands:
            dgrad_r = w_operands["dgrad"]
        else:  # rounded with this forward's own key
            dgrad_r = _dgrad_operand(weight, cfg, seed=cfg.wt_seed)
        # A high-precision Wᵀ (dgrad in BF16, or beside OE-left's extracted rows) is cast again from
        # ``source`` in backward rather than kept: autocast's copy of W would stay alive until then.
        ctx.recast = w_tiles is None and plan.dgrad in (Strategy.BF16, Strategy.OE_LEFT)
        (w_parts, w_meta), (d_parts, d_meta) = wgrad_r.pack(), dgrad_r.pack()
        ctx.save_for_backward(*w_parts, *d_parts, (weight if source is None else source) if ctx.recast else None)
        ctx.split, ctx.metas, ctx.cfg = len(w_parts), (w_meta, d_meta), cfg
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.dgrad_fold = ops.folds_into_fp8(x.device, weight.shape[1])  # dgrad writes [T, in]
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        cfg, plan = ctx.cfg, ctx.cfg.plan
        *saved, source = ctx.saved_tensors
        wgrad_r = GemmOperand.unpack(saved[: ctx.split], ctx.metas[0])
        dgrad_r = GemmOperand.unpack(saved[ctx.split :], ctx.metas[1])
        x_dtype, w_dtype = ctx.dtypes
        if ctx.recast:  # the forward's cast, bit for bit; of the transposed view, so that a compiled graph
            dgrad_r.dense = source.t().to(w_dtype)  # does not merge it with the forward's cast and keep that
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            l = prepare_operand(
                grad_out, plan.dgrad, "L", cfg.grad, oe_k=cfg.oe_k, seed=cfg.dgrad_seed, fold=ctx.dgrad_fold
            )
            grad_x = tn_matmul(l, dgrad_r, x_dtype, fast_accum=cfg.grad_fast_accum)
        if ctx.needs_input_grad[1]:
            l = prepare_operand(grad_out.t(), plan.wgrad, "L", cfg.grad, oe_k=cfg.oe_k, seed=cfg.wgrad_seed)
            with wgrad_operand_region(cfg.xt_seed):  # reads what the partitioner recomputes, if told to
                grad_w = tn_matmul(l, wgrad_r, w_dtype, fast_accum=cfg.grad_fast_accum)
        return grad_x, grad_w, None, None, None


class AdaHOPLinear(nn.Linear):
    """``nn.Linear`` with AdaHOP's per-GEMM low-precision strategies (same parameters and keys)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: str | Recipe = DEFAULT_RECIPE,
        layer_id: int = 0,
        bf16_gemms: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._recipe = get_recipe(recipe)
        self.layer_id = layer_id
        # GEMMs kept in BF16 whatever the plan says (ablation); default: the recipe's for a layer
        # without a module name (convert_model passes those of the layer's name).
        self.bf16_gemms = self.recipe.bf16_gemms_for("") if bf16_gemms is None else tuple(bf16_gemms)
        unknown = sorted(set(self.bf16_gemms) - set(GEMMS))
        if unknown:
            raise ValueError(
                f"bf16_gemms {unknown} are not GEMMs; choose among {list(GEMMS)} (ROLE@PATTERN is for recipes)"
            )
        self.votes = PatternVotes()
        # Late switch of the forward to BF16 (recipe.bf16_forward_after; the trainer sets it from the
        # step, so it is not saved): the plan runs with its forward GEMM in BF16 while this is on.
        self.bf16_forward = False
        # W's operands kept over micro-batches where the forward is compiled or captured (weight_cache).
        self._kept_operands = KeptOperands()
        self._extra_state = new_state()
        # Random-sign Hadamard variant: one seeded vector for every layer and replica; a
        # non-persistent buffer so it follows .to(device) and leaves the state_dict keys alone.
        self.register_buffer("hadamard_signs", self._make_signs(device), persistent=False)
        self._voter: Voter | None = None
        self._build_specs()
        self.plan: LayerPlan | None = None
        if self.recipe.adaptive:
            add_step_buffers(self, in_features, out_features, device)
            self._voter = open_voter(Voter(self, self, self.votes, self.recipe.pattern_threshold, self._maybe_freeze))
        else:
            self.set_plan(self._with_forward_strategy(LayerPlan.uniform(Strategy(self.recipe.strategy))))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        recipe: str | Recipe = DEFAULT_RECIPE,
        layer_id: int = 0,
        bf16_gemms: tuple[str, ...] | None = None,
    ) -> AdaHOPLinear:
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            device="meta",
            recipe=recipe,
            layer_id=layer_id,
            bf16_gemms=bf16_gemms,
        )
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.hadamard_signs = layer._make_signs(linear.weight.device)
        if layer.recipe.adaptive:
            add_step_buffers(layer, linear.in_features, linear.out_features, linear.weight.device)
        layer._build_specs()
        return layer

    def _make_signs(self, device) -> torch.Tensor | None:
        r = self.recipe
        return random_signs(r.hadamard_block_size, r.hadamard_seed, device) if r.hadamard_signs else None

    @property
    def recipe(self) -> Recipe:
        return self._recipe

    @recipe.setter
    def recipe(self, value: object) -> None:
        raise AttributeError(
            "AdaHOPLinear.recipe is fixed when the layer is built (its hooks, specs and plan follow it); "
            "convert an unconverted model with the new recipe instead"
        )

    # ---- plan ---------------------------------------------------------------------------
    @property
    def calibrating(self) -> bool:
        return self.plan is None

    @property
    def running_plan(self) -> LayerPlan | None:
        """The plan the next forward runs: ``plan``, with its forward GEMM in BF16 while ``bf16_forward`` is on."""
        return self._plan_bf16_forward if self.bf16_forward and self.plan is not None else self.plan

    def check_plan(self, plan: LayerPlan) -> None:
        """Refuse a plan from elsewhere (a state_dict, ``load_plan``) that this layer's recipe would not
        run: a fixed recipe runs its one strategy, an adaptive one what its table picks from the plan's
        patterns (a plan without patterns, made by hand, is taken as it is). Such a plan was frozen under
        another recipe and would silently replace this one. ``set_plan`` itself takes any plan."""
        r = self.recipe
        if r.adaptive and plan.patterns is None:
            return
        if r.adaptive:
            want = plan_for_patterns(*(plan.patterns[role] for role in ROLES), r.table)
        else:
            want = LayerPlan.uniform(r.strategy)
        want = self._with_forward_strategy(want)
        got, want = plan.with_bf16(self.bf16_gemms).strategies(), want.with_bf16(self.bf16_gemms).strategies()
        if got != want:

            def show(strategies: dict[str, Strategy]) -> str:
                return ", ".join(f"{gemm}={s.value}" for gemm, s in strategies.items())

            raise ValueError(
                f"its plan ({show(got)}) is not what recipe {r.name!r} runs ({show(want)}): it was frozen under "
                "another recipe; build the model with that recipe"
            )

    def set_plan(self, plan: LayerPlan) -> None:
        """Freeze the (forward, dgrad, wgrad) strategies, ``bf16_gemms`` in BF16; ends calibration."""
        self.plan = plan.with_bf16(self.bf16_gemms)
        self._plan_bf16_forward = self.plan.with_bf16(("forward",))  # built once: forwards only read it
        if self._voter is not None:
            close_voter(self._voter)
            self._voter = None
            for name, buffer in list(self._buffers.items()):
                if name.startswith("_step_"):  # the step statistics are no longer needed
                    self._buffers[name] = buffer.new_empty(0)

    def _with_forward_strategy(self, plan: LayerPlan) -> LayerPlan:
        """``plan`` with the recipe's ``forward_strategy`` (if it names one) on the forward GEMM."""
        forced = self.recipe.forward_strategy
        return plan if forced is None else dataclasses.replace(plan, forward=Strategy(forced))

    def _maybe_freeze(self) -> None:
        """Called after each step's votes (merged over ranks, so every replica freezes the same plan)."""
        n = self.recipe.calibration_steps
        if all(self.votes.count(role) >= n for role in ROLES):
            self.set_plan(self._with_forward_strategy(self.votes.plan(self.recipe.table)))

    # ---- forward ------------------------------------------------------------------------
    def _build_specs(self) -> None:
        """The (X and W, dY, saved Xᵀ and Wᵀ) quantization specs, built when the signs buffer is
        set (here and after ``.to()``) rather than on every forward."""
        r, signs = self.recipe, self.hadamard_signs
        self._specs = (
            r.quant_spec(r.rounding, signs, forward=True),
            r.quant_spec(r.grad_rounding, signs),
            r.quant_spec(r.backward_rounding, signs),
        )

    def _apply(self, fn, recurse: bool = True):
        module = super()._apply(fn, recurse)
        signs = self.hadamard_signs
        if signs is not None:  # rebuilt, not moved: ``to_empty`` (meta-device init) leaves garbage
            self.hadamard_signs = self._make_signs(signs.device).to(signs.dtype)
        for name, buffer in list(self._buffers.items()):
            if name.startswith("_step_"):  # float64 counts, whatever the model is cast to; zeroed (to_empty)
                self._buffers[name] = torch.zeros_like(buffer, dtype=torch.float64)
        self._build_specs()
        return module

    @property
    def _seed_count(self) -> int:
        """Philox keys per training forward: dY's two, plus Xᵀ's and Wᵀ's when they round stochastically."""
        return 4 if self.recipe.backward_rounding == "stochastic" else 2

    def _gemm_config(self, seeds: torch.Tensor, plan: LayerPlan) -> GemmConfig:
        act, grad, saved = self._specs
        xt_seed, wt_seed = (seeds[2], seeds[3]) if len(seeds) == 4 else (0, 0)
        cache = operand_cache(self) if caching() else None
        if cache is not None and not cache.layer_weight:
            cache = None
        return GemmConfig(
            plan,
            act,
            grad,
            self.recipe.oe_k,
            dgrad_seed=seeds[0],
            wgrad_seed=seeds[1],
            saved=saved,
            xt_seed=xt_seed,
            wt_seed=wt_seed,
            weight_tiles=self.recipe.weight_blocks == "2d",
            grad_fast_accum=self.recipe.grad_fast_accum,
            forward_reference=self.recipe.forward_gemm == "reference",
            weight_cache=cache,
            weight_param=self.weight if cache is not None else None,
        )

    def _check_input(self, x: torch.Tensor) -> None:
        if self.weight.dim() != 2:
            raise ValueError(f"AdaHOPLinear needs a 2-D weight, got shape {tuple(self.weight.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"AdaHOPLinear expects a floating-point input, got {x.dtype}")
        if x.is_meta != self.weight.is_meta:  # both on meta: shapes only, as nn.Linear (see forward)
            what = "its input is" if x.is_meta else "its weight is"
            raise ValueError(
                f"AdaHOPLinear(layer_id={self.layer_id}): {what} on the meta device (no values) and the other "
                f"on {(self.weight if x.is_meta else x).device}; "
                + (
                    "pass a real tensor"
                    if x.is_meta
                    else "materialize the model first (model.to_empty(device=...), then initialize it)"
                )
            )
        quantizes = not (self.plan is not None and self.plan.all_bf16 or x.is_meta) and not torch.is_autocast_enabled(
            x.device.type
        )
        if quantizes and x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(
                f"AdaHOPLinear(in_features={self.in_features}, out_features={self.out_features}, "
                f"layer_id={self.layer_id}, recipe={self.recipe.name}) quantizes float32, bfloat16 or "
                f"float16 input, got {x.dtype}; cast the input and the model (model.float())"
            )
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"AdaHOPLinear expects input [..., {self.in_features}], got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if x.is_meta:  # the output's shape (e.g. for FLOP counting), as nn.Linear: nothing to quantize or vote
            return F.linear(x, self.weight, self.bias)
        if self.plan is None:
            y = F.linear(x, self.weight, self.bias)
            return observe(y, x, self.weight, self) if self.training else y
        plan = self.running_plan
        if plan.all_bf16:
            return F.linear(x, self.weight, self.bias)

        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        n = self._seed_count
        seeds = draw_rounding_seeds(x.device, count=n) if needs_grad else torch.zeros(n, dtype=torch.int64)
        cfg = self._gemm_config(seeds, plan)
        kept, w_operands = self._kept_operands, None
        with torch.autocast(x.device.type, enabled=False):
            if kept.mode != OFF and cfg.weight_cache is None:  # compiled or captured: kept here, not inside
                with torch.no_grad():
                    w_operands = _weight_operands(weight.detach(), cfg, kept.operand)
            source = None if weight is self.weight else self.weight  # not passed twice: dynamo refuses it
            y = _AdaHOPLinearFn.apply(x.reshape(-1, self.in_features), weight, source, cfg, w_operands)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    # ---- state ----------------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """The plan and votes as one fixed-shape int64 tensor (see ``adahop.nn.state``).

        The same tensor object on every call, updated in place, so a checkpointer that caches
        the state_dict once (torchtitan 0.2) sees the current plan after ``refresh_extra_state``.
        """
        return self.refresh_extra_state()

    def refresh_extra_state(self) -> torch.Tensor:
        return encode_state(self.plan, self.votes, self._extra_state)

    def set_extra_state(self, state: torch.Tensor | dict[str, Any]) -> None:
        plan, votes = decode_state(state)
        if plan is not None:
            self.check_plan(plan)
        self.votes.load_state_dict(votes)
        if plan is not None:
            self.set_plan(plan)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A plain nn.Linear checkpoint has no plan: load it and keep calibrating.
        missing_before = args[2] if len(args) > 2 else kwargs.get("missing_keys")
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        except ValueError as e:  # from set_extra_state: say which layer
            raise ValueError(f"{prefix + '_extra_state'}: {e}") from None
        key = prefix + "_extra_state"
        if key not in state_dict and missing_before is not None and key in missing_before:
            missing_before.remove(key)

    def extra_repr(self) -> str:
        plan = (
            "calibrating"
            if self.plan is None
            else (f"forward={self.plan.forward.value}, dgrad={self.plan.dgrad.value}, wgrad={self.plan.wgrad.value}")
        )
        return f"{super().extra_repr()}, recipe={self.recipe.name}, {plan}"
