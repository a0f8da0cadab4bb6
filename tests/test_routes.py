"""``policy.routes.gemm_route``, the one place a GEMM's route is chosen, pinned case by case on CPU
(the GPU's compute capability is faked), and ``adahop.ops`` running exactly the route it names."""

import pytest
import torch

from adahop import ops
from adahop.formats import quantize_mx
from adahop.kernels.fold import fold_to_fp8_reference
from adahop.policy import routes
from adahop.policy.routes import KERNEL_ROUTES, GemmRoute, gemm_route

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
HOPPER, AMPERE = (9, 0), (8, 0)


@pytest.fixture
def gpu(monkeypatch):
    """Set the compute capability a CUDA device reports."""
    return lambda capability: monkeypatch.setattr(routes, "device_capability", lambda device: capability)


# (device, capability, n, fmt, block size) -> route
CASES = [
    (CPU, None, 4096, "mxfp4", 32, GemmRoute.REFERENCE),
    (CPU, None, 40, "mxfp8_e4m3", 32, GemmRoute.REFERENCE),
    (CUDA, HOPPER, 4096, "mxfp4", 32, GemmRoute.FOLD_FP8),
    (CUDA, HOPPER, 14336, "mxfp4", 32, GemmRoute.FOLD_FP8),
    (CUDA, HOPPER, 40, "mxfp4", 32, GemmRoute.DEQUANT_BF16),  # cuBLAS FP8 refuses N % 16 != 0
    (CUDA, HOPPER, 4096, "mxfp8_e4m3", 32, GemmRoute.REFERENCE),  # the kernels are MXFP4 only
    (CUDA, HOPPER, 4096, "mxfp4", 16, GemmRoute.REFERENCE),  # ... with blocks of 32
    (CUDA, AMPERE, 4096, "mxfp4", 32, GemmRoute.DEQUANT_BF16),
    (CUDA, AMPERE, 40, "mxfp4", 32, GemmRoute.DEQUANT_BF16),
    # Row-wise FP8 (no blocks): cuBLAS's row-wise scaled GEMM where it runs, else the reference.
    (CPU, None, 4096, "fp8_e4m3_rowwise", 32, GemmRoute.REFERENCE),
    (CUDA, HOPPER, 4096, "fp8_e4m3_rowwise", 32, GemmRoute.FOLD_FP8),
    (CUDA, HOPPER, 40, "fp8_e4m3_rowwise", 32, GemmRoute.REFERENCE),
    (CUDA, AMPERE, 4096, "fp8_e4m3_rowwise", 32, GemmRoute.REFERENCE),
]


@pytest.mark.parametrize("device, capability, n, fmt, block_size, route", CASES)
def test_every_case_gets_its_named_route(gpu, device, capability, n, fmt, block_size, route):
    gpu(capability)
    assert gemm_route(device, n, fmt, block_size) is route
    assert gemm_route(device, n, fmt, block_size, kernels=False) is GemmRoute.REFERENCE


def test_route_names():
    assert [r.value for r in GemmRoute] == ["fold_fp8", "triton_fp8", "dot_scaled", "dequant_bf16", "reference"]
    assert GemmRoute.REFERENCE not in KERNEL_ROUTES


@pytest.mark.parametrize("capability, n, folds", [(HOPPER, 64, True), (HOPPER, 40, False), (AMPERE, 64, False)])
def test_operands_are_quantized_into_fp8_exactly_where_the_route_is_fold_fp8(gpu, capability, n, folds):
    gpu(capability)
    assert ops.folds_into_fp8(CUDA, n) is folds
    assert ops.folds_into_fp8(CPU, n) is False
    with ops.reference_only():
        assert ops.route_of(CUDA, n) is GemmRoute.REFERENCE
        assert ops.folds_into_fp8(CUDA, n) is False


def _operands():
    gen = torch.Generator().manual_seed(0)
    return quantize_mx(torch.randn(8, 64, generator=gen)), quantize_mx(torch.randn(16, 64, generator=gen))


def test_cuda_implementation_runs_the_route_it_is_given(monkeypatch):
    """``adahop::mx_matmul``'s CUDA implementation (called here on CPU tensors) takes the reference or
    hands the named route, and the caller's accumulation, to the kernels, with no choice of its own."""
    from adahop.kernels import gemm

    a, b = _operands()
    ran = []

    def route_matmul(a, b, out_dtype, route, fast_accum):
        ran.append((route, fast_accum))
        return torch.zeros(())

    monkeypatch.setattr(gemm, "route_matmul", route_matmul)
    want = a.dequantize() @ b.dequantize().T
    args = (a.data, a.scales, b.data, b.scales, "mxfp4", 32, torch.float32)
    assert torch.equal(ops._mx_matmul_cuda(*args, True), want)  # CPU tensors: the reference
    assert ran == []
    for route in KERNEL_ROUTES:
        monkeypatch.setattr(ops, "route_of", lambda *_, route=route: route)
        for fast_accum in (True, False):
            ops._mx_matmul_cuda(*args, fast_accum)
    assert ran == [(route, fast_accum) for route in KERNEL_ROUTES for fast_accum in (True, False)]


def test_folded_operands_take_fold_fp8_or_the_reference_and_nothing_else(monkeypatch):
    a, b = _operands()
    fa, fb = fold_to_fp8_reference(a), fold_to_fp8_reference(b)
    want = a.dequantize() @ b.dequantize().T
    torch.testing.assert_close(ops.folded_matmul(fa, b, torch.float32), want, rtol=1e-6, atol=1e-5)
    monkeypatch.setattr(ops, "route_of", lambda *_: GemmRoute.DEQUANT_BF16)
    with pytest.raises(ValueError, match="need the fold_fp8 route, and dequant_bf16 was chosen"):
        ops.folded_matmul(fa, fb, torch.float32)


def test_the_route_is_a_constant_of_a_compiled_graph(gpu):
    """Under ``torch.compile`` the choice is evaluated once at trace time, without a graph break; the
    graph's constant is equal to the route, not the same object (so ``ops`` compares with ==)."""
    gpu(HOPPER)

    @torch.compile(fullgraph=True, backend="eager")
    def scaled(x):
        route = ops.route_of(CUDA, x.shape[0])
        return x * 2 if route == GemmRoute.FOLD_FP8 else x * 3

    x = torch.ones(32)
    assert torch.equal(scaled(x), x * 2)
