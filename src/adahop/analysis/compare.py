"""``adahop compare RUN_DIR...``: loss curves of several runs in one PNG, and their gap to BF16.

Runs of one recipe (same recipe fields, any seed) form a group: the table gives its mean final
validation loss with the spread across seeds (std, n) and the gap to the BF16 group with its
standard error, paired by seed when every seed has a BF16 run (else the two means' Welch error),
and its t statistic with the two-sided p-value (Student's t, paired; Welch's otherwise). A gap is
beyond the noise only when it is at least ``NOISE_SIGMAS`` standard errors and p <= ``P_LIMIT``
(with 3 seeds a paired gap has 2 degrees of freedom: |t| >= 4.30). Runs that
share a seed (other ``training.rounding_seed_offset`` streams, reruns) are averaged into their
seed, and their spread is reported as the noise at a fixed seed. The plot draws each group's
mean curve with a band of one standard deviation across its runs. ``--against LABEL`` also gives
every group's gap to that group, by the same rules: an ablation against the recipe it changes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..atomic import save_figure, write_atomic
from .console import make_console
from .runs import RunRecord, read_run

SMOOTHING = 0.9  # EMA factor for the plotted train curves (raw curves drawn faintly)
NOISE_SIGMAS = 2.0  # a gap to BF16 below this many standard errors is inside the noise
P_LIMIT = 0.05  # ... and so is one whose two-sided p-value is above this
LEGEND_ROW_INCHES = 0.18  # one row of the legend under the panels
LEGEND_MARGIN_INCHES = 0.15  # between that legend and the panels' axis labels


def _ema(values: list[float], beta: float = SMOOTHING) -> list[float]:
    """Exponential moving average, bias-corrected (as TensorBoard does) so it does not lag at the start."""
    out, avg = [], 0.0
    for t, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**t))
    return out


def comparison_rows(runs: list[RunRecord]) -> list[dict]:
    """Final train/val loss of each run and its gap to the bf16 run of the same seed (else the
    first bf16 run), if there is one."""
    bf16 = [r for r in runs if r.recipe == "bf16"]
    rows = []
    for r in runs:
        base = next((b for b in bf16 if b.seed == r.seed), bf16[0] if bf16 else None)
        row = {
            "run": str(r.path),
            "recipe": r.recipe,
            "label": r.group or r.recipe,  # e.g. "adahop_lv1 (bf16_gemms=['forward'])": the tables show it
            "seed": r.seed,
            "steps": r.train_steps[-1] if r.train_steps else 0,
            "final_train_loss": r.final_train_loss(),
            "final_val_loss": r.final_val_loss(),
        }
        if base is not None:
            row["train_gap_to_bf16"] = row["final_train_loss"] - base.final_train_loss()
            row["val_gap_to_bf16"] = row["final_val_loss"] - base.final_val_loss()
        rows.append(row)
    return rows


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for fewer than two values)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def group_runs(runs: list[RunRecord]) -> dict[str, list[RunRecord]]:
    """Runs by recipe (``RunRecord.group``), in the order each recipe first appears."""
    groups: dict[str, list[RunRecord]] = {}
    for r in runs:
        groups.setdefault(r.group or r.recipe, []).append(r)
    return groups


Sample = tuple[int | None, float]  # (seed, value) of one run


def seed_means(samples: Iterable[Sample]) -> tuple[dict, float | None]:
    """The value per seed (runs that share a seed, such as rounding streams or reruns, averaged;
    a run of unknown seed is a seed of its own; NaN and None values left out), and the pooled
    standard deviation of the runs that share a seed (None when none does): the noise at a
    fixed seed, against which a gap between recipes is read."""
    by_seed: dict = {}
    for i, (seed, value) in enumerate(samples):
        if value is not None and not math.isnan(value):
            by_seed.setdefault(("run", i) if seed is None else seed, []).append(value)
    shared = [v for v in by_seed.values() if len(v) > 1]
    dof = sum(len(v) - 1 for v in shared)
    pooled = math.sqrt(sum(statistics.variance(v) * (len(v) - 1) for v in shared) / dof) if dof else None
    return {seed: statistics.fmean(v) for seed, v in by_seed.items()}, pooled


def gap_between(mine: Iterable[Sample], base: Iterable[Sample]) -> dict:
    """Gap of ``mine`` to ``base``: ``gap`` (mean), ``stderr`` (None below two seeds), ``pairing``,
    ``t``, ``p`` (two-sided) and ``dof`` of its t-test, ``verdict`` and ``same_seed_std``
    (``mine``'s noise at a fixed seed, see ``seed_means``). Paired by seed when every seed of
    ``mine`` has a ``base`` value (the mean per-seed gap, its standard error over seeds, Student's t
    with n - 1 degrees of freedom), else the difference of the two means with Welch's error and
    degrees of freedom."""
    (m, same_seed_std), (b, _) = seed_means(mine), seed_means(base)
    if m and all(isinstance(seed, int) for seed in m) and m.keys() <= b.keys():
        gap, sd = _mean_std([m[seed] - b[seed] for seed in m])
        stderr, pairing = (None if sd is None else sd / math.sqrt(len(m))), "paired"
        dof = len(m) - 1
    else:
        (gm, sm), (gb, sb) = _mean_std(list(m.values())), _mean_std(list(b.values()))
        gap, pairing = gm - gb, "unpaired"
        stderr = dof = None
        if sm is not None and sb is not None:
            vm, vb = sm**2 / len(m), sb**2 / len(b)
            stderr = math.sqrt(vm + vb)
            dof = (vm + vb) ** 2 / (vm**2 / (len(m) - 1) + vb**2 / (len(b) - 1)) if vm + vb else None
    t, p = _t_test(gap, stderr, dof)
    return {
        "gap": gap,
        "stderr": stderr,
        "pairing": pairing,
        "t": t,
        "p": p,
        "dof": dof,
        "verdict": _verdict(gap, stderr, p),
        "same_seed_std": same_seed_std,
    }


def _t_test(gap: float, stderr: float | None, dof: float | None) -> tuple[float | None, float | None]:
    """t = gap / stderr and its two-sided p-value under Student's t with ``dof`` degrees of freedom."""
    if stderr is None or dof is None or math.isnan(gap) or math.isnan(stderr):
        return None, None
    if stderr == 0:  # every seed gave the same gap
        return (math.copysign(math.inf, gap), 0.0) if gap else (0.0, 1.0)
    from scipy.stats import t as student_t

    t = gap / stderr
    return t, float(2 * student_t.sf(abs(t), dof))


def _verdict(gap: float, se: float | None, p: float | None = None) -> str:
    if se is None or math.isnan(se) or math.isnan(gap):
        return "no error bar (n < 2)"
    beyond = abs(gap) >= NOISE_SIGMAS * se and (p is None or p <= P_LIMIT)
    return "beyond the noise" if beyond else "inside the noise"


def verdict_cell(g: dict) -> str:
    """``verdict (t, p, pairing)`` of a ``gap_between`` result."""
    test = "" if g.get("p") is None else f"t {g['t']:.2f}, p {g['p']:.3f}, "
    return f"{g['verdict']} ({test}{g['pairing']})"


def recipe_rows(runs: list[RunRecord], against: str | None = None) -> list[dict]:
    """One row per recipe: final validation loss over its seeds (runs of one seed averaged), the
    spread of runs that share a seed, and the gap to the BF16 recipe; ``against``: a recipe label
    whose gap every other row also gets (``row["against"]``), e.g. an ablation's base recipe."""
    groups = group_runs(runs)
    check_labels([against] if against is not None else [], groups)
    base = bf16_group(groups)

    def finals(label: str) -> list[Sample]:
        return [(r.seed, r.final_val_loss()) for r in groups[label]]

    rows = []
    for label, rs in groups.items():
        values, same_seed_std = seed_means(finals(label))
        mean, std = _mean_std(list(values.values()))
        row = {
            "recipe": label,
            "n": len(rs),
            "seeds": [r.seed for r in rs],
            "steps": sorted({r.train_steps[-1] if r.train_steps else 0 for r in rs}),
            "final_val_loss_mean": mean,
            "final_val_loss_std": std,
            "same_seed_std": same_seed_std,
        }
        if base is not None and label != base:
            g = gap_between(finals(label), finals(base))
            row |= {
                "val_gap_to_bf16": g["gap"],
                "gap_stderr": g["stderr"],
                "gap_t": g["t"],
                "gap_p": g["p"],
                "pairing": g["pairing"],
                "verdict": g["verdict"],
            }
        elif label == base:
            row |= {"val_gap_to_bf16": 0.0, "verdict": "baseline"}
        if against is not None and label != against:
            row["against"] = {"recipe": against} | gap_between(finals(label), finals(against))
        rows.append(row)
    return rows


def _band(curves: list[tuple[list[int], list[float]]]) -> tuple[list[int], list[float], list[float]]:
    """(steps every curve logged, mean, std across curves; 0 for one curve)."""
    steps = sorted(set.intersection(*(set(s) for s, _ in curves)))
    at = [dict(zip(s, v)) for s, v in curves]
    stats = [_mean_std([c[step] for c in at]) for step in steps]
    return steps, [m for m, _ in stats], [sd or 0.0 for _, sd in stats]


def _plot_band(ax, curves: list[tuple[list[int], list[float]]], color: str, label: str, marker: str = "") -> None:
    steps, mean, std = _band(curves)
    ax.plot(steps, mean, marker + "-", color=color, markersize=3, label=label)
    ax.fill_between(
        steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color=color, alpha=0.2
    )


def check_labels(labels: Iterable[str], groups: dict[str, list[RunRecord]]) -> None:
    """An ``--against`` label must name a group of these runs (``group_runs``)."""
    for label in labels:
        if label not in groups:
            raise ValueError(f"--against {label!r} is not a recipe of these runs; the recipes are {list(groups)}")


def bf16_group(groups: dict[str, list[RunRecord]]) -> str | None:
    """The label of the BF16 recipe's group (``group_runs``), if the runs have one."""
    return next((g for g, rs in groups.items() if rs[0].recipe == "bf16"), None)


def paired_val_gaps(runs: list[RunRecord]) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """Per recipe, at each validation step that it and BF16 logged: its validation gap to BF16 of
    the same seed (``gap_between``, paired) and the standard error (0 for one seed). Recipes with a
    seed that BF16 lacks are left out."""
    groups = group_runs(runs)
    base = bf16_group(groups)
    if base is None:
        return {}
    gaps = {}
    for label, rs in groups.items():
        seeds = {r.seed for r in rs}
        partners = [b for b in groups[base] if b.seed in seeds]
        if label == base or None in seeds or not seeds <= {b.seed for b in partners}:
            continue
        curves = [(r.seed, dict(zip(r.val_steps, r.val_loss))) for r in rs]
        base_curves = [(b.seed, dict(zip(b.val_steps, b.val_loss))) for b in partners]
        steps = sorted(set.intersection(*(set(c) for _, c in curves + base_curves)))
        at = [
            gap_between(((seed, c[step]) for seed, c in curves), ((seed, c[step]) for seed, c in base_curves))
            for step in steps
        ]
        if steps:
            gaps[label] = (steps, [g["gap"] for g in at], [g["stderr"] or 0.0 for g in at])
    return gaps


def plot_runs(runs: list[RunRecord], path: Path) -> None:
    """Train (EMA) and validation curves: each recipe's mean over its seeds, a band of one std;
    with a BF16 recipe, a third panel: each recipe's validation gap to BF16 paired by seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.lines import Line2D

    gaps = paired_val_gaps(runs)
    groups = group_runs(runs)
    # One legend under the panels (a legend per panel hid the curves once ablation labels grew long), and a
    # palette with a colour per recipe up to 20.
    legend_cols = 2 if len(groups) > 4 else max(len(groups), 1)
    legend_inches = LEGEND_ROW_INCHES * math.ceil(len(groups) / legend_cols)
    height = 4.8 + legend_inches
    fig, axes = plt.subplots(1, 3 if gaps else 2, figsize=(19 if gaps else 13, height))
    ax_train, ax_val = axes[0], axes[1]
    palette = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20").colors
    handles = []
    for i, (label, rs) in enumerate(groups.items()):
        color, name = palette[i % len(palette)], label if len(rs) == 1 else f"{label} (n={len(rs)})"
        handles.append(Line2D([], [], color=color, marker="o", markersize=3, label=name))
        for r in rs:
            ax_train.plot(r.train_steps, r.train_loss, color=color, alpha=0.15, linewidth=0.8)
        if any(r.train_steps for r in rs):
            _plot_band(ax_train, [(r.train_steps, _ema(r.train_loss)) for r in rs], color, name)
        if all(r.val_steps for r in rs):
            _plot_band(ax_val, [(r.val_steps, r.val_loss) for r in rs], color, name, marker="o")
        if label in gaps:
            steps, mean, stderr = gaps[label]
            axes[2].errorbar(steps, mean, yerr=stderr, fmt="o-", color=color, markersize=3, capsize=3, label=name)
    ax_train.set(title=f"train loss (EMA {SMOOTHING}; band: ±1 std over seeds)", xlabel="step", ylabel="loss")
    ax_val.set(title="validation loss (band: ±1 std over seeds)", xlabel="step", ylabel="loss")
    if gaps:
        axes[2].axhline(0.0, color="black", linewidth=0.8)
        axes[2].set(title="validation gap to BF16, same seed (bars: ±1 s.e.)", xlabel="step", ylabel="loss - BF16")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.legend(handles=handles, loc="lower center", ncol=legend_cols, fontsize=8, frameon=False)
    # Zoom the train panel on the second half, where the recipes separate.
    tails = [v for r in runs for v in _ema(r.train_loss)[len(r.train_loss) // 2 :]]
    if tails:
        lo, hi = min(tails), max(tails)
        pad = 0.5 * (hi - lo) + 1e-3
        ax_train.set_ylim(lo - pad, hi + 4 * pad)
    fig.tight_layout(rect=(0, (legend_inches + LEGEND_MARGIN_INCHES) / height, 1, 1))
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def _fmt(v: float, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:+.4f}" if signed else f"{v:.4f}"


def markdown_table(rows: list[dict]) -> str:
    has_gap = any("train_gap_to_bf16" in r for r in rows)
    head = "| recipe | seed | steps | final train loss | final val loss |"
    sep = "|---|---:|---:|---:|---:|"
    if has_gap:
        head += " train gap to bf16 | val gap to bf16 |"
        sep += "---:|---:|"
    lines = [head, sep]
    for r in rows:
        line = f"| {r['label']} | {r['seed']} | {r['steps']} | {_fmt(r['final_train_loss'])} | {_fmt(r['final_val_loss'])} |"
        if has_gap:
            line += f" {_fmt(r.get('train_gap_to_bf16'), True)} | {_fmt(r.get('val_gap_to_bf16'), True)} |"
        lines.append(line)
    return "\n".join(lines)


def print_table(rows: list[dict], console: Console) -> None:
    table = Table(title="final losses (train: mean of the last 10% of logged steps; gap: to bf16 of the same seed)")
    for col in ("recipe", "seed", "steps", "train loss", "val loss", "train gap", "val gap"):
        table.add_column(col, justify="left" if col == "recipe" else "right", overflow="fold")  # whole labels
    for r in rows:
        table.add_row(
            escape(r["label"]),  # labels hold "[...]" (bf16_gemms=['wgrad']): text, not markup
            str(r["seed"]),
            str(r["steps"]),
            _fmt(r["final_train_loss"]),
            _fmt(r["final_val_loss"]),
            _fmt(r.get("train_gap_to_bf16"), True),
            _fmt(r.get("val_gap_to_bf16"), True),
        )
    console.print(table)


def _pm(mean: float, err: float | None, signed: bool = False) -> str:
    return _fmt(mean, signed) if err is None or math.isnan(err) else f"{_fmt(mean, signed)} ± {err:.4f}"


def _recipe_cells(row: dict) -> list[str]:
    """recipe, n, mean ± std of the final val loss, same-seed std, gap ± standard error, verdict."""
    gap = _pm(row["val_gap_to_bf16"], row.get("gap_stderr"), signed=True) if "val_gap_to_bf16" in row else "-"
    verdict = row.get("verdict", "-")
    if "pairing" in row:
        verdict = verdict_cell({"t": row.get("gap_t"), "p": row.get("gap_p")} | row)
    mean = _pm(row["final_val_loss_mean"], row["final_val_loss_std"])
    return [row["recipe"], str(row["n"]), mean, _fmt(row.get("same_seed_std")), gap, verdict]


RECIPE_HEAD = [
    "recipe",
    "n",
    "final val loss (mean ± std)",
    "std at a seed",
    "val gap to bf16 (± s.e.)",
    "verdict",
]


def recipe_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(RECIPE_HEAD) + " |", "|---|---:|---:|---:|---:|---|"]
    lines += ["| " + " | ".join(_recipe_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def _against_cells(row: dict) -> list[str]:
    """recipe, n, gap to the ``against`` recipe ± standard error, verdict."""
    g = row["against"]
    return [row["recipe"], str(row["n"]), _pm(g["gap"], g["stderr"], signed=True), verdict_cell(g)]


def against_markdown(rows: list[dict]) -> str:
    """The gap of every recipe to the ``against`` one (empty without it)."""
    rows = [r for r in rows if "against" in r]
    if not rows:
        return ""
    label = rows[0]["against"]["recipe"]
    lines = [f"| recipe | n | val gap to {label} (± s.e.) | verdict |", "|---|---:|---:|---|"]
    lines += ["| " + " | ".join(_against_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def print_recipe_table(rows: list[dict], console: Console) -> None:
    # The same-seed column only where runs share a seed: a terminal has less room than a file.
    keep = [
        i
        for i, col in enumerate(RECIPE_HEAD)
        if col != "std at a seed" or any(r.get("same_seed_std") is not None for r in rows)
    ]
    table = Table(title=f"by recipe across seeds (inside the noise: |gap| < {NOISE_SIGMAS:g} s.e. or p > {P_LIMIT:g})")
    for i in keep:
        col = RECIPE_HEAD[i]
        table.add_column(col, justify="right" if col in ("n",) or "±" in col else "left", overflow="fold")
    for r in rows:
        cells = _recipe_cells(r)
        table.add_row(*(escape(cells[i]) for i in keep))
    console.print(table)
    against = [r for r in rows if "against" in r]
    if against:
        table = Table(title=f"gap to {against[0]['against']['recipe']}, paired by seed where it can be")
        for col in ("recipe", "n", "val gap (± s.e.)", "verdict"):
            table.add_column(col, justify="left" if col in ("recipe", "verdict") else "right", overflow="fold")
        for r in against:
            table.add_row(*(escape(c) for c in _against_cells(r)))
        console.print(table)


OUTPUTS = ("loss.png", "compare.md", "runs.json", "recipes.json")  # what ``compare`` writes in its folder


def compare(run_dirs: list[str | Path], out: str | Path, against: str | None = None) -> tuple[list[dict], list[dict]]:
    """Write into the folder ``out`` (made if needed) ``loss.png``, ``compare.md``, ``runs.json`` (one
    row per run) and ``recipes.json`` (one row per recipe); returns both lists of rows. ``against``: a
    recipe label every other recipe is also compared with (``recipe_rows``)."""
    runs = [read_run(d) for d in run_dirs]
    rows, recipes = comparison_rows(runs), recipe_rows(runs, against)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a folder (made if needed)")
    out.mkdir(parents=True, exist_ok=True)
    png, md, runs_json, recipes_json = (out / name for name in OUTPUTS)
    plot_runs(runs, png)
    tables = [markdown_table(rows), recipe_markdown(recipes), against_markdown(recipes)]
    write_atomic(md, "\n\n".join(t for t in tables if t) + "\n")
    write_atomic(runs_json, json.dumps(rows, indent=2) + "\n")
    write_atomic(recipes_json, json.dumps(recipes, indent=2) + "\n")
    return rows, recipes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adahop compare", description=__doc__)
    parser.add_argument("runs", nargs="+", help="run directories written by 'adahop train'")
    parser.add_argument("--out", default="compare", help=f"output folder for {', '.join(OUTPUTS)} (default: ./compare)")
    parser.add_argument(
        "--against",
        metavar="LABEL",
        help="also give every recipe's gap to this one (a label of the recipe table, e.g. adahop_lv1)",
    )
    args = parser.parse_args(argv)
    console = make_console()
    try:
        rows, recipes = compare(args.runs, args.out, args.against)
    except (FileNotFoundError, ValueError) as e:
        print(f"adahop compare: error: {e}", file=sys.stderr)
        return 2
    print_table(rows, console)
    print_recipe_table(recipes, console)
    console.print(f"wrote {', '.join(OUTPUTS)} in {args.out}/")
    return 0
