"""``adahop bench``: GPU benchmarks, each a ratio to its baseline measured in the same run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import environment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adahop bench", description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per linear-layer call")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        parser.error("benchmarks need a CUDA GPU")
    from . import linear

    report = {**environment(), "linear": linear.run(args.tokens)}
    report["linear_fwd_bwd_speedup_vs_bf16"] = report["linear"]["linear_fwd_bwd_speedup_vs_bf16"]
    report["saved_activation_compression"] = report["linear"]["saved_activation_compression"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0
