"""Where the CLI's tables print: the terminal's width on a terminal, never cut at 80 columns in a log."""

from __future__ import annotations

from rich.console import Console

# Columns of a table printed into a pipe or a file (Slurm and CI logs): wide enough that no layer name
# or recipe label is cut; a table is only as wide as its content needs.
LOG_WIDTH = 400


def make_console() -> Console:
    """A rich ``Console`` for tables: rich's own on a terminal; ``LOG_WIDTH`` columns when the output
    is not a terminal, where rich would otherwise cut it at 80."""
    console = Console()
    return console if console.is_terminal else Console(width=LOG_WIDTH)
