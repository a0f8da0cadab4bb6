"""The documentation holds together: every relative link and every repository path named in README.md,
docs/*.md and benchmarks/*/README.md exists, and every ``adahop ...`` command in their shell blocks parses.

Commands are parsed in-process with the command's own argparse parser and never run: ``adahop train``
also resolves its config (the TOML file, every ``--section.field=value``), the others stop right after
their parser accepts the arguments.
"""

from __future__ import annotations

import argparse
import glob
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    + list((ROOT / "docs").glob("*.md"))
    + list((ROOT / "benchmarks").glob("*/README.md"))
)
COMMAND_DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A repository path: a top-level folder of this repository (or `adahop/...`, the package under src/),
# then path characters; braces and globs are expanded, placeholders are skipped.
TOP = r"(?:src|tests|docs|benchmarks|configs|examples|\.ci|adahop)"
REPO_PATH = re.compile(rf"(?<![\w./$-]){TOP}/[\w./*{{}},\-]*")
TOP_FILES = re.compile(r"(?<![\w./-])(?:pyproject\.toml|LICENSE|CITATION\.cff)(?![\w.-])")
# Removed raw results are cited by the commit that holds them (benchmarks/README.md), not the tree.
HISTORICAL = ("benchmarks/results/",)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _rel(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def _expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for part in match.group(1).split(",") for p in _expand_braces(head + part + tail)]


def _exists(path: str, base: Path = ROOT) -> bool:
    """A file or folder, a glob that matches one, or a stem (``--out .../compare`` writes compare.*)."""
    target = str(base / path)
    if any(c in path for c in "*?["):
        return bool(glob.glob(target))
    return Path(target).exists() or bool(glob.glob(glob.escape(target) + ".*"))


def _repo_paths(text: str) -> set[str]:
    paths = set()
    for match in REPO_PATH.finditer(text):
        path = match.group(0).rstrip(".,:;")
        if path.endswith("/...") or path.startswith(HISTORICAL) or "}" in path and "{" not in path:
            continue
        if path.startswith("adahop/"):
            path = "src/" + path
        paths.update(_expand_braces(path))
    paths.update(TOP_FILES.findall(text))
    return paths


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_exist(doc: Path) -> None:
    text = FENCE.sub("", doc.read_text())  # links inside code blocks are code
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#")[0]
        if path and not _exists(path, doc.parent):
            missing.append(target)
    assert not missing, f"{_rel(doc)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_repository_paths_exist(doc: Path) -> None:
    missing = sorted(p for p in _repo_paths(doc.read_text()) if not _exists(p))
    assert not missing, f"{_rel(doc)} names repository paths that do not exist: {missing}"


def test_path_rules_catch_a_missing_path_and_skip_placeholders() -> None:
    text = (
        "see `src/adahop/nope.py`, `benchmarks/step/2026-12-04-h200-step/gpu-tests-*.txt`, "
        "`benchmarks/quality/2026-12-04-h200-quality-phase{3,4}/README.md`, `adahop/formats/fast.py`, "
        "`benchmarks/results/gone.md` at commit 7168c6c, runs/tiny-bf16/, `data/*.jsonl`"
    )
    paths = _repo_paths(text)
    assert "src/adahop/formats/fast.py" in paths and "benchmarks/results/gone.md" not in paths
    assert [p for p in paths if not _exists(p)] == ["src/adahop/nope.py"]
    assert not any(p.startswith(("runs", "data")) for p in paths)


# ---- adahop commands --------------------------------------------------------------------------------


def _commands(doc: Path) -> list[list[str]]:
    """Each ``adahop ...`` invocation of the doc's shell blocks, as its arguments after ``adahop``."""
    commands = []
    for lang, body in FENCE.findall(doc.read_text()):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue
            segment: list[str] = []
            for token in tokens + ["&&"]:
                if token not in ("&&", "||", ";", "|"):
                    segment.append(token)
                    continue
                args = _adahop_args(segment)
                if args is not None and "..." not in args:
                    commands.append(args)
                segment = []
    return commands


def _adahop_args(segment: list[str]) -> list[str] | None:
    while segment and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", segment[0]):
        segment = segment[1:]  # VAR=value prefixes
    if segment[:1] == ["adahop"]:
        return segment[1:]
    if "-m" in segment and segment[segment.index("-m") + 1 : segment.index("-m") + 2] == ["adahop"]:
        return segment[segment.index("-m") + 2 :]  # python -m adahop, torchrun ... -m adahop
    return None


class _Parsed(Exception):
    """Raised where a subcommand's parser accepted its arguments, so the command itself never runs."""


def _parse(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from adahop import cli

    if not args or args[0] in ("-h", "--help", "--version"):
        assert cli.main(args) == 0
        return
    if args[0] == "train":
        from adahop.train.cli import build_parser, parse_overrides, resolve_config
        from adahop.train.config import ConfigError

        parser = build_parser()
        known, rest = parser.parse_known_args(args[1:])
        if known.config is not None and not REPO_PATH.fullmatch(str(known.config)):
            known.config = None  # a placeholder such as my.toml: the flags are still checked
        try:
            resolve_config(known, parse_overrides(rest, parser))
        except ConfigError as e:
            parser.error(str(e))
        return
    assert args[0] in cli.COMMANDS, f"no command {args[0]!r}"
    parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = []

    def checked_parse_args(self, *a, **k):
        depth.append(1)
        raise _Parsed(parse_args(self, *a, **k))

    def checked_parse_known_args(self, *a, **k):
        result = parse_known_args(self, *a, **k)
        if not depth:  # called directly, not through parse_args
            raise _Parsed(result)
        return result

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", checked_parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", checked_parse_known_args)
    with pytest.raises(_Parsed):
        cli.main(args)


@pytest.mark.parametrize("doc", COMMAND_DOCS, ids=_rel)
def test_adahop_commands_parse(doc: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for args in _commands(doc):
        try:
            with monkeypatch.context() as patch:
                _parse(args, patch)
        except SystemExit as e:
            if e.code == 0:  # --help
                continue
            pytest.fail(f"{_rel(doc)}: `adahop {shlex.join(args)}` does not parse: {capsys.readouterr().err.strip()}")
        except Exception as e:
            if isinstance(e, pytest.fail.Exception):
                raise
            pytest.fail(f"{_rel(doc)}: `adahop {shlex.join(args)}` does not parse: {type(e).__name__}: {e}")


def test_readme_shows_the_quickstart_and_the_main_commands() -> None:
    commands = [args[0] if args else "" for args in _commands(ROOT / "README.md")]
    for name in ("train", "compare", "analyze", "eval", "bench"):
        assert name in commands, f"README.md shows no `adahop {name}` command"


def test_a_command_that_does_not_parse_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    bad_commands = (
        ["train", "--no-such-flag"],
        ["train", "--optim.no_such_field=1"],
        ["train", "--config", "configs/no_such.toml"],
        ["compare", "--bogus"],
    )
    for bad in bad_commands:
        with pytest.raises(SystemExit), monkeypatch.context() as patch:
            _parse(bad, patch)


def test_readme_python_snippet_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Python API block, with a tiny model and loader in place of the user's."""
    import torch
    from torch import nn

    import adahop

    text = (ROOT / "README.md").read_text()
    snippet = next(body for lang, body in FENCE.findall(text) if lang == "python" and "convert_model" in body)

    class MyTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.up, self.down = nn.Embedding(64, 64), nn.Linear(64, 128), nn.Linear(128, 64)
            self.output = nn.Linear(64, 64)  # the LM head, kept in high precision by name

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logits = self.output(self.down(torch.relu(self.up(self.embed(tokens)))))
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (40, 4, 17))
    loader = [(t[:, :-1], t[:, 1:]) for t in tokens]  # more steps than calibration takes
    monkeypatch.chdir(tmp_path)
    namespace = {"MyTransformer": MyTransformer, "loader": loader}
    exec(compile(snippet, "README.md", "exec"), namespace)
    plan = adahop.model_plan(namespace["model"])
    assert sorted(plan) == ["down", "up"] and (tmp_path / "plan.json").exists()
    assert adahop.model_plan(namespace["other"]).to_json() == plan.to_json()


def test_quickstart_commands_and_extras() -> None:
    """The README keeps the two set-up commands CI runs (.ci/run), and every extra a doc installs exists."""
    import tomllib

    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 -e . && adahop train\n" in readme
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q -n 2 --dist loadfile\n' in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'torch==2.13.0 -e ".[test]"' in ci and "python3 -m pytest -q -n 2 --dist loadfile " in ci
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for doc in DOCS:
        named = {e for group in re.findall(r'-e "\.\[([\w,-]+)\]"', doc.read_text()) for e in group.split(",")}
        assert named <= extras, f"{_rel(doc)} installs extras pyproject.toml does not define: {named - extras}"
