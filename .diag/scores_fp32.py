"""Diagnose the two FP32 H=0 row-axis score failures (GPU only)."""
import sys, traceback
sys.path.insert(0, "tests")
import torch
DEV = "cuda" if torch.cuda.is_available() else "cpu"
from test_kernel_scores import planted, SMALL_TILES
from adahop.kernels.quantize import quantize_mx_triton
from adahop.kernels.quantize_fold import quantize_fold_fp8
from adahop.policy.selection import row_scores

def report(name, fn, x, **kw):
    print("==", name, x.dtype, tuple(x.shape), kw)
    q, s = fn(x.to(DEV), scores=True, **kw)
    plain = fn(x.to(DEV), **kw)
    for f in ("data", "scales", "row_scale", "lossy_per_row"):
        if hasattr(q, f):
            a, b = getattr(q, f).view(torch.uint8), getattr(plain, f).view(torch.uint8)
            d = (a != b).nonzero()
            print(f"  {f}: with/without scores differ at {d.shape[0]} places; first {d[:8].tolist()}")
    want = row_scores(x, 1).cpu(); got = s.cpu()
    print("  score dtype/shape", got.dtype, tuple(got.shape), "want", tuple(want.shape))
    nan_w, nan_g = want.isnan(), got.isnan()
    print("  NaN rows want", nan_w.nonzero().flatten().tolist(), "got", nan_g.nonzero().flatten().tolist())
    both = ~nan_w & ~nan_g
    bad = (got.view(torch.int32) != want.view(torch.int32)) & both
    for r in bad.nonzero().flatten().tolist()[:20]:
        print(f"  row {r}: got {got[r].item()!r} want {want[r].item()!r}; row has nan {x[r].isnan().any().item()} inf {x[r].isinf().any().item()}")
    # also compare codes to the reference op
    try:
        from adahop import ops
        with ops.reference_only():
            ref = fn(x.to(DEV), **kw)
        for f in ("data", "scales", "row_scale", "lossy_per_row"):
            if hasattr(ref, f):
                a, b = getattr(ref, f).view(torch.uint8), getattr(plain, f).view(torch.uint8)
                print(f"  {f} vs reference_only: {(a != b).sum().item()} differ")
    except Exception:
        traceback.print_exc()

x = planted(70, 128, torch.float32)
report("mx row H0 SR", quantize_mx_triton, x, fmt="mxfp4", axis=-1, hadamard_block_size=0, rounding="stochastic", seed=5, tiling=SMALL_TILES)
report("mx row H0 RN", quantize_mx_triton, x, fmt="mxfp4", axis=-1, hadamard_block_size=0, rounding="nearest", seed=5, tiling=SMALL_TILES)
report("mx row H0 SR bf16", quantize_mx_triton, x.bfloat16(), fmt="mxfp4", axis=-1, hadamard_block_size=0, rounding="stochastic", seed=5, tiling=SMALL_TILES)
x = planted(40, 96, torch.float32)
report("fold H0 RN", quantize_fold_fp8, x, hadamard_block_size=0, rounding="nearest", seed=3)
report("fold H0 RN bf16", quantize_fold_fp8, x.bfloat16(), hadamard_block_size=0, rounding="nearest", seed=3)
report("fold H32 RN fp32", quantize_fold_fp8, x, hadamard_block_size=32, rounding="nearest", seed=3)
