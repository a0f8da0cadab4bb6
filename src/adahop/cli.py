"""``adahop`` command line: ``train``, ``compare``, ``analyze``, ``eval``, ``export``, ``bench``.

Each subcommand lives with the code it drives and parses its own arguments.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("adahop.train.cli", "pretrain a Llama-style model with a recipe"),
    "compare": ("adahop.analysis.compare", "plot and tabulate loss curves of several runs"),
    "analyze": ("adahop.analysis.analyze", "per-layer outlier report, heatmaps and strategies"),
    "eval": ("adahop.analysis.evaluate", "held-out loss and perplexity, as trained and in BF16"),
    "export": ("adahop.integrations.hf_export", "write a run's model as a Hugging Face transformers Llama"),
    "bench": ("adahop.bench", "GPU benchmarks: GEMM routes, quantization, AdaHOPLinear"),
}


def _usage() -> str:
    lines = ["usage: adahop <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'adahop <command> --help' for a command's options, 'adahop --version' for the version."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from . import __version__

        print(f"adahop {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"adahop: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
