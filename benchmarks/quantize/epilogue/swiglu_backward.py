"""SwiGLU's backward (``x2 = F.silu(g) * u`` in ``models.llama.FeedForward``) computed and quantized straight into
the dgrad operands of w1 and w3 in one kernel: from the gradient ``d`` of the product it writes ``dg`` and ``du``
in bf16 (wgrad still needs them) and the row-wise folded FP8 operand of each, ``quantize_fold_fp8(dg)`` and
``quantize_fold_fp8(du)`` with their own stochastic-rounding keys, as ``nn.linear``'s backward prepares dY.

The gradients are eager autograd's, bit for bit. ``MulBackward0`` rounds ``d * u`` and ``d * silu(g)`` to bf16
(float32 products of two bf16 values are exact, so one rounding each; ``silu(g)`` is the forward's bf16 result).
``SiluBackward0`` is ``aten.silu_backward(bf16(d * u), g)``: in float32, ``s = 1 / (1 + exp(-g))``,
``dy * s * (1 + g * (1 - s))`` from left to right, one rounding to bf16 (the CPU kernel's vector and scalar paths,
and CUDA's ``ActivationSiluKernel.cu``, all compute this in float32; CUDA's nvcc contracts ``1 + g * (1 - s)`` into
a multiply-add, and so does Triton on the GPU). ``du`` reuses the forward's ``silu_product`` (table or math);
``dg`` computes ``exp`` (libdevice ``expf`` on the GPU, as eager CUDA; numpy's in the interpreter) and an IEEE
division. The result is rounded to 8 significant bits, so the float32 details (an ulp of ``exp``, the
contraction, Sleef's vector ``exp`` on the CPU) almost never reach it: on the CPU none of them changed one of
4.2M results (``2026-12-05-epilogue-prototype.md``).

One program holds whole rows, as ``quantize_fold_fp8`` does, and runs two phases: ``du`` (reads d and g), then
``dg`` (reads d, g again, from L2, and u); each phase is ``quantize_fold_fp8``'s own device code
(``quantize_fold_slices``), so each phase needs the registers the forward kernel needs. ``outputs`` picks one
phase, for the alternative of one launch per operand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from adahop.kernels.quantize_fold import MAX_REGISTERS, quantize_fold_fp8

from .device import bf16_bits, bf16_value, quantize_fold_slices, slice_offsets
from .launch import Epilogue, prepare, result
from .swiglu import SILU_METHODS, silu_product, silu_table

OUTPUTS = ("gate", "up")


@triton.jit
def silu_backward_bits(dy_bits, g_bits, NATIVE: tl.constexpr):
    """bf16 bits of eager's ``aten.silu_backward(dy, g)`` for bf16 bits ``dy`` and ``g``."""
    g = bf16_value(g_bits)
    if NATIVE:
        e = libdevice.exp(-g)  # CUDA's expf, as ATen's silu_backward calls it
    else:
        e = tl.exp(-g)
    s = tl.div_rn(1.0, 1.0 + e)
    return bf16_bits(bf16_value(dy_bits) * s * (1.0 + g * (1.0 - s)), NATIVE)


@triton.jit
def _grad_slice(d_ptr, g_ptr, u_ptr, grad_ptr, table_ptr, rows, blocks, M, N, k: tl.constexpr, GATE: tl.constexpr,
                WRITE: tl.constexpr, NATIVE: tl.constexpr):  # fmt: skip
    """Slice ``k`` of dg (``GATE``) or du, as bf16 bits; +0 where masked (all inputs +0), as
    ``quantize_fold_fp8``'s masked loads."""
    offs, ok = slice_offsets(rows, blocks, M, N, N, k)
    d, g = tl.load(d_ptr + offs, mask=ok, other=0), tl.load(g_ptr + offs, mask=ok, other=0)
    if GATE:
        u = tl.load(u_ptr + offs, mask=ok, other=0)
        grad = silu_backward_bits(bf16_bits(bf16_value(d) * bf16_value(u), NATIVE), g, NATIVE)
    else:
        grad = silu_product(g, d, table_ptr, NATIVE)
    if WRITE:
        tl.store(grad_ptr + offs, grad, mask=ok)
    return grad


@triton.jit
def _grad_operand(d_ptr, g_ptr, u_ptr, grad_ptr, table_ptr, signs_ptr, out_ptr, row_scale_ptr, lossy_ptr,
                  score_ptr, seed_ptr, rows, blocks, M, N, hadamard_scale, SPEC: tl.constexpr, GATE: tl.constexpr,
                  WRITE: tl.constexpr):  # fmt: skip
    NATIVE: tl.constexpr = SPEC.native_casts
    x0 = _grad_slice(d_ptr, g_ptr, u_ptr, grad_ptr, table_ptr, rows, blocks, M, N, 0, GATE, WRITE, NATIVE)
    x1 = _grad_slice(d_ptr, g_ptr, u_ptr, grad_ptr, table_ptr, rows, blocks, M, N, 1, GATE, WRITE, NATIVE)
    x2 = _grad_slice(d_ptr, g_ptr, u_ptr, grad_ptr, table_ptr, rows, blocks, M, N, 2, GATE, WRITE, NATIVE)
    x3 = _grad_slice(d_ptr, g_ptr, u_ptr, grad_ptr, table_ptr, rows, blocks, M, N, 3, GATE, WRITE, NATIVE)
    quantize_fold_slices(
        x0, x1, x2, x3, rows, blocks, M, N, tl.load(seed_ptr), signs_ptr, hadamard_scale,
        out_ptr, row_scale_ptr, lossy_ptr, score_ptr, SPEC,
    )  # fmt: skip


@triton.jit
def _swiglu_backward_quantize_fold_kernel(
    d_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, table_ptr, signs_ptr,
    dg_out_ptr, dg_row_scale_ptr, dg_lossy_ptr, dg_score_ptr, dg_seed_ptr,
    du_out_ptr, du_row_scale_ptr, du_lossy_ptr, du_score_ptr, du_seed_ptr,
    M, N, hadamard_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPEC: tl.constexpr,
    GATE: tl.constexpr, UP: tl.constexpr, WRITE_GRADS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.arange(0, BLOCK_N // 32)
    if UP:  # first: it reads d and g, which the gate's phase reads again (from L2)
        _grad_operand(d_ptr, g_ptr, u_ptr, du_ptr, table_ptr, signs_ptr, du_out_ptr, du_row_scale_ptr, du_lossy_ptr,
                      du_score_ptr, du_seed_ptr, rows, blocks, M, N, hadamard_scale, SPEC, False, WRITE_GRADS)  # fmt: skip
    if GATE:
        _grad_operand(d_ptr, g_ptr, u_ptr, dg_ptr, table_ptr, signs_ptr, dg_out_ptr, dg_row_scale_ptr, dg_lossy_ptr,
                      dg_score_ptr, dg_seed_ptr, rows, blocks, M, N, hadamard_scale, SPEC, True, WRITE_GRADS)  # fmt: skip


def swiglu_backward_quantize_fold(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed_gate: int | torch.Tensor | None = None,
    seed_up: int | torch.Tensor | None = None,
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
    scores: bool = False,
    write_grads: bool = True,
    silu: str = "table",
    outputs: tuple[str, ...] = OUTPUTS,
    max_registers: int = MAX_REGISTERS,
) -> dict[str, Epilogue]:
    """For bf16 [M, N] ``grad`` (dL/d(silu(gate) * up)), ``gate`` and ``up``: ``{"gate": .., "up": ..}``, each
    ``Epilogue(quantize_fold_fp8(dX, seed=seed_X, ...), scores, dX if write_grads)`` with dX eager autograd's
    gradient of gate or up; the other options as ``quantize_fold_fp8``'s, shared by both operands.
    ``outputs``: the operands to make (one, for one launch per operand); ``silu``: as ``swiglu_quantize_fold``'s;
    ``max_registers``: ptxas' cap (at ``quantize_fold_fp8``'s 80, both operands from one program spill on sm_90)."""
    if silu not in SILU_METHODS:
        raise ValueError(f"silu must be one of {SILU_METHODS}, got {silu!r}")
    if not outputs or set(outputs) - set(OUTPUTS):
        raise ValueError(f"outputs must be a non-empty subset of {OUTPUTS}, got {outputs!r}")
    tensors = (grad, gate, up)
    if any(t.dtype != torch.bfloat16 or t.shape != grad.shape for t in tensors):
        raise ValueError(
            "swiglu_backward_quantize_fold takes bf16 grad, gate and up of one shape; got "
            + ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in tensors)
        )
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("swiglu_backward_quantize_fold takes contiguous grad, gate and up (call .contiguous())")
    options = dict(scale_rule=scale_rule, rounding=rounding, hadamard_block_size=hadamard_block_size, signs=signs,
                   scores=scores, write_output=write_grads)  # fmt: skip
    seeds = {"gate": seed_gate, "up": seed_up}
    launches = {name: prepare("swiglu_backward_quantize_fold", grad, seed=seeds[name], **options) for name in outputs}
    first = next(iter(launches.values()))
    g_launch, u_launch = launches.get("gate", first), launches.get("up", first)  # an unused one is never written
    M, N = grad.shape
    _swiglu_backward_quantize_fold_kernel[(triton.cdiv(M, first.block_m),)](
        grad.view(torch.int16),
        gate.view(torch.int16),
        up.view(torch.int16),
        None if g_launch.output is None else g_launch.output.view(torch.int16),
        None if u_launch.output is None else u_launch.output.view(torch.int16),
        silu_table(grad.device) if silu == "table" else None,
        grad if first.signs is None else first.signs,
        g_launch.data, g_launch.row_scale.view(torch.int32), g_launch.lossy, g_launch.score, g_launch.seed_ptr,
        u_launch.data, u_launch.row_scale.view(torch.int32), u_launch.lossy, u_launch.score, u_launch.seed_ptr,
        M,
        N,
        first.hadamard_scale,
        BLOCK_M=first.block_m,
        BLOCK_N=first.block_n,
        SPEC=first.spec,
        GATE="gate" in launches,
        UP="up" in launches,
        WRITE_GRADS=write_grads,
        num_warps=first.warps,
        maxnreg=max_registers,
    )  # fmt: skip
    return {name: result(launch) for name, launch in launches.items()}


def swiglu_grads(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) as autograd computes them for ``F.silu(gate) * up`` (``MulBackward0``, then ``SiluBackward0``):
    eager, this is autograd's result bit for bit; compiled, it is what Inductor makes of SwiGLU's backward."""
    return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


def swiglu_backward_quantize_fold_reference(grad, gate, up, *, seed_gate=None, seed_up=None, write_grads=True,
                                            outputs=OUTPUTS, **options) -> dict[str, Epilogue]:  # fmt: skip
    """The composition the fused kernel replaces: eager's gradients, then ``quantize_fold_fp8`` of each."""
    options.pop("silu", None)
    dg, du = swiglu_grads(grad, gate, up)
    out = {}
    for name, dx, seed in (("gate", dg, seed_gate), ("up", du, seed_up)):
        if name in outputs:
            made = quantize_fold_fp8(dx, seed=seed, **options)
            folded, score = made if options.get("scores") else (made, None)
            out[name] = Epilogue(folded, score, dx if write_grads else None)
    return out
