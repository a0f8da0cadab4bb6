"""sm_90 compile check, registers and SASS instructions per element of the epilogue kernels, without a GPU.

Compiles (Triton's bundled ``ptxas``, pointers and sizes specialized as multiples of 16, as the JIT does at
training shapes) the fused SwiGLU and RMSNorm quantize-fold kernels at ``llama3_1b``'s row lengths, against
what they replace: ``quantize_fold_fp8``'s kernel on the same rows plus a stand-in for Inductor's producer
kernel (a pointwise ``silu(g) * u`` and a one-row-per-program RMSNorm written as Inductor writes them:
float32 math, one bf16 store); and SwiGLU's fused backward (both operands from one program, or one launch per
operand) against Inductor's pointwise backward (two bf16 stores) plus two ``quantize_fold_fp8`` calls.
Instructions per element count both sides of every branch once (the fold's
rare exact path included), as ``sass_counts.py`` does. Use the GPU machine's Triton (3.6.0 on the H200):

    env -u TRITON_INTERPRET PYTHONPATH=/tmp/triton36:src python3 benchmarks/quantize/epilogue/sm90_counts.py [--only backward]
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/quantize: sass_counts, epilogue

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from adahop.kernels import quantize_fold as qf  # noqa: E402
from adahop.kernels.launch import quantize_spec  # noqa: E402
from epilogue.rmsnorm import _rmsnorm_quantize_fold_kernel  # noqa: E402
from epilogue.swiglu import _swiglu_quantize_fold_kernel  # noqa: E402
from epilogue.swiglu_backward import _swiglu_backward_quantize_fold_kernel  # noqa: E402
from sass_counts import per_element, resource_usage  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
SHAPES = {"swiglu": 8192, "rmsnorm": 2048}  # llama3_1b: the hidden (w2's K) and the model dim
POINTWISE_BLOCK, POINTWISE_WARPS = 1024, 4  # Inductor's usual pointwise tile


@triton.jit
def inductor_style_silu_mul(g_ptr, u_ptr, out_ptr, n, XBLOCK: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    g = tl.load(g_ptr + offs, mask=offs < n).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=offs < n).to(tl.float32)
    tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(tl.bfloat16), mask=offs < n)


@triton.jit
def inductor_style_rmsnorm(h_ptr, w_ptr, out_ptr, eps, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    x = tl.load(h_ptr + offs).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + tl.arange(0, N)).to(tl.float32)
    tl.store(out_ptr + offs, (x * r * w).to(tl.bfloat16))


@triton.jit
def inductor_style_swiglu_backward(d_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, XBLOCK: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    d = tl.load(d_ptr + offs, mask=offs < n).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=offs < n).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=offs < n).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(dg_ptr + offs, (d * u * s * (1.0 + g * (1.0 - s))).to(tl.bfloat16), mask=offs < n)
    tl.store(du_ptr + offs, (d * g * s).to(tl.bfloat16), mask=offs < n)


def compile_for_sm90(kernel, types: dict, constexprs: dict, options: dict):
    """``kernel`` for sm_90 with argument ``types`` (the rest are ``constexprs``), aligned as at training shapes."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    aligned = [n for n, t in signature.items() if t.startswith("*") or t == "i32"]
    source = ASTSource(
        kernel,
        signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(source, target=SM90, options=options)


FOLD_TYPES = {"signs_ptr": "*fp32", "out_ptr": "*u8", "row_scale_ptr": "*i32", "lossy_ptr": "*i32",
              "seed_ptr": "*i64", "M": "i32", "N": "i32", "stride_m": "i32", "hadamard_scale": "fp32"}  # fmt: skip


def variants():
    """(name, compiled kernel, elements per program) of every kernel the comparison needs."""
    for rounding in ("nearest", "stochastic"):
        for hb in (0, 32):
            spec = quantize_spec(torch.bfloat16, True, "mxfp4", 32, "floor", rounding, hb, False, False)
            tag = f"{'RN' if rounding == 'nearest' else 'SR'} H{hb}"
            for producer, n in SHAPES.items():
                block_m, block_n, warps = qf._tile(n, True)
                options = {"num_warps": warps, "maxnreg": qf.MAX_REGISTERS}
                base = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPEC=spec, score_ptr=None)
                compiled = compile_for_sm90(
                    qf._quantize_fold_rows_kernel, {**FOLD_TYPES, "x_ptr": "*i16"}, base, options
                )
                yield f"quantize_fold_fp8 {producer} rows {tag}", compiled, block_m * block_n
                for write in (False, True):
                    out = "+bf16" if write else ""
                    if producer == "swiglu":
                        types = {**FOLD_TYPES, "gate_ptr": "*i16", "up_ptr": "*i16", "product_ptr": "*i16",
                                 "table_ptr": "*i16"}  # fmt: skip
                        constexprs = {**base, "WRITE_PRODUCT": write, **({} if write else {"product_ptr": None})}
                        for silu, table in (("table", {}), ("math", {"table_ptr": None})):
                            compiled = compile_for_sm90(
                                _swiglu_quantize_fold_kernel, types, {**constexprs, **table}, options
                            )
                            yield f"fused swiglu{out} silu {silu} {tag}", compiled, block_m * block_n
                    else:
                        types = {**FOLD_TYPES, "h_ptr": "*fp32", "weight_ptr": "*fp32", "x_ptr": "*i16", "eps": "fp32"}
                        constexprs = {**base, "H_BF16": False, "W_BF16": False, "WRITE_X": write,
                                      **({} if write else {"x_ptr": None})}  # fmt: skip
                        options_nf = {**options, "enable_fp_fusion": False}
                        compiled = compile_for_sm90(_rmsnorm_quantize_fold_kernel, types, constexprs, options_nf)
                        yield f"fused rmsnorm{out} {tag}", compiled, block_m * block_n
    types = {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32"}
    yield (
        "inductor-style silu(g) * u",
        compile_for_sm90(inductor_style_silu_mul, types, {"XBLOCK": POINTWISE_BLOCK}, {"num_warps": POINTWISE_WARPS}),
        POINTWISE_BLOCK,
    )
    types = {"h_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*bf16", "eps": "fp32"}
    n = SHAPES["rmsnorm"]
    yield "inductor-style rmsnorm", compile_for_sm90(inductor_style_rmsnorm, types, {"N": n}, {"num_warps": 8}), n


def backward_variants():
    """SwiGLU's backward at w1/w3's dY rows (llama3_1b's hidden): fused, both operands from one program (the
    bf16 gradients written, as wgrad needs them) or one launch per operand, against Inductor's pointwise backward
    and ``quantize_fold_fp8``'s kernel on the same rows (the split runs it twice)."""
    n = SHAPES["swiglu"]
    block_m, block_n, warps = qf._tile(n, True)
    options = {"num_warps": warps, "maxnreg": qf.MAX_REGISTERS}
    names = ("dg_out_ptr", "dg_row_scale_ptr", "dg_lossy_ptr", "dg_seed_ptr", "du_out_ptr", "du_row_scale_ptr",
             "du_lossy_ptr", "du_seed_ptr")  # fmt: skip
    types = {name: FOLD_TYPES[name[3:]] for name in names}
    types.update(d_ptr="*i16", g_ptr="*i16", u_ptr="*i16", dg_ptr="*i16", du_ptr="*i16", table_ptr="*i16",
                 signs_ptr="*fp32", M="i32", N="i32", hadamard_scale="fp32")  # fmt: skip
    for rounding in ("nearest", "stochastic"):
        for hb in (0, 32):
            spec = quantize_spec(torch.bfloat16, True, "mxfp4", 32, "floor", rounding, hb, False, False)
            tag = f"{'RN' if rounding == 'nearest' else 'SR'} H{hb}"
            base = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPEC=spec, score_ptr=None)
            compiled = compile_for_sm90(qf._quantize_fold_rows_kernel, {**FOLD_TYPES, "x_ptr": "*i16"}, base, options)
            yield f"quantize_fold_fp8 dY rows {tag}", compiled, block_m * block_n
            # One kernel for both operands at the quantizer's register cap and above it; one launch per operand.
            for label, gate, up, registers in (("both", True, True, qf.MAX_REGISTERS), ("both", True, True, 96),
                                               ("both", True, True, 128), ("dg", True, False, qf.MAX_REGISTERS),
                                               ("du", False, True, qf.MAX_REGISTERS)):  # fmt: skip
                constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPEC=spec, GATE=gate, UP=up, WRITE_GRADS=True,
                                  dg_score_ptr=None, du_score_ptr=None)  # fmt: skip
                compiled = compile_for_sm90(
                    _swiglu_backward_quantize_fold_kernel, types, constexprs, {**options, "maxnreg": registers}
                )
                cap = "" if registers == qf.MAX_REGISTERS else f" maxnreg {registers}"
                yield f"fused swiglu-bw {label}+bf16 {tag}{cap}", compiled, block_m * block_n
    types = {"d_ptr": "*bf16", "g_ptr": "*bf16", "u_ptr": "*bf16", "dg_ptr": "*bf16", "du_ptr": "*bf16", "n": "i32"}
    compiled = compile_for_sm90(
        inductor_style_swiglu_backward, types, {"XBLOCK": POINTWISE_BLOCK}, {"num_warps": POINTWISE_WARPS}
    )
    yield "inductor-style swiglu backward", compiled, POINTWISE_BLOCK


def main() -> None:
    only_backward = sys.argv[1:] == ["--only", "backward"]
    print(f"triton {triton.__version__}, sm_90; rows of {SHAPES} elements; per program: warps, elements;")
    print("per thread: registers, stack bytes; shared memory bytes; instructions per element; the most frequent")
    for name, compiled, elements in itertools.chain(() if only_backward else variants(), backward_variants()):
        total, ops = per_element(compiled, elements)
        threads = 32 * compiled.metadata.num_warps
        usage = resource_usage(compiled)
        top = ", ".join(f"{op} {k * threads / elements:.2f}" for op, k in ops.most_common(6))
        print(f"{name:<34} w{compiled.metadata.num_warps:<2} {elements:6d} | reg {usage['REG']:3d} stack "
              f"{usage['STACK']:3d} smem {compiled.metadata.shared:6d} | {total:6.2f}  {top}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
