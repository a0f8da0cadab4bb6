"""Issue #30's lever "quantize where the tensor is produced", as a measured prototype outside ``src``:
kernels that compute a producer's output (the SwiGLU product, RMSNorm) and write it straight into the
folded FP8 operand of ``adahop.kernels.quantize_fold.quantize_fold_fp8`` in the same pass
(``2026-12-05-epilogue-prototype.md``)."""
