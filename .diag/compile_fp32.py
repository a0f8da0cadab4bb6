import sys, traceback, torch
sys.path.insert(0, "benchmarks/quantize")
from ptx_fingerprint import compile_sm90, POINTERS, FOLD_POINTERS, LAUNCH_OPTIONS, _scored
from adahop.kernels import quantize as q, quantize_fold as qf
from adahop.kernels.launch import quantize_spec
from adahop.kernels.quantize_general import _quantize_mx_kernel
from adahop.kernels.quantize_tiling import QuantizeTiling
P32 = {**POINTERS, "x_ptr": "*fp32"}; F32 = {**FOLD_POINTERS, "x_ptr": "*fp32"}
for dtype, ptrs, fptrs in ((torch.float32, P32, F32), (torch.bfloat16, POINTERS, FOLD_POINTERS)):
  for scores in (False, True):
    for rounding in ("nearest", "stochastic"):
      for hb in (0, 32):
        for tiling in (None, QuantizeTiling(block_m=32, block_n=32, num_warps=1)):
          spec = quantize_spec(dtype, True, "mxfp4", 32, "floor", rounding, hb, False, scores)
          shape = (70, 128)
          try:
            plan = q._launch_plan(*shape, (shape[1], 1), spec, True, False, None, tiling)
            c = _scored({k: v for k, v in plan.constexprs.items() if k not in LAUNCH_OPTIONS})
            o = {k: plan.constexprs[k] for k in LAUNCH_OPTIONS if plan.constexprs.get(k) is not None}
            if plan.kernel is _quantize_mx_kernel: c["stride_n"] = 1
            compile_sm90(plan.kernel, c, o, ptrs); print("ok  ", dtype, scores, rounding, hb, tiling is not None, plan.kernel.__name__)
          except Exception as e:
            print("FAIL", dtype, scores, rounding, hb, tiling is not None, type(e).__name__, str(e)[-300:].replace("\n"," | "))
        try:
          bm, bn, w = qf._tile(96, True)
          c = _scored(dict(BLOCK_M=bm, BLOCK_N=bn, SPEC=spec))
          compile_sm90(qf._quantize_fold_rows_kernel, c, {"num_warps": w, "maxnreg": qf.MAX_REGISTERS}, fptrs); print("ok   fold", dtype, scores, rounding, hb)
        except Exception as e:
          print("FAIL fold", dtype, scores, rounding, hb, type(e).__name__, str(e)[-300:].replace("\n"," | "))
