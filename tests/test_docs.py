"""The documentation (README.md and docs/*.md) against the repository: links and commands.

- Every relative Markdown link, ``[text](path)`` or ``[text](path#anchor)`` (images too), resolves
  to a file or folder inside the repository, and an anchor names a heading of the target page
  (GitHub's slugs). Links inside code (fenced blocks, inline spans) and external URLs are not
  checked.
- The README's quick start runs ``python launch.py``: its overrides compose with Hydra as
  ``launch.py`` composes them, and the composed config is the demo the README describes.
- Every ``python launch.py ...`` command in a fenced code block of the README or docs/ composes
  too, so an override the config does not accept fails here.
- CI's ``.ci/run`` runs the README's test command.

Fast and light: Hydra composes ``conf/`` without running anything; torch is not imported.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

_FENCE = re.compile(r"^\s*(```+|~~~+)(.*)$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target), with an optional "title"; text holds no brackets.
_LINK = re.compile(r"!?\[[^\[\]]*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


@dataclass(frozen=True)
class CodeBlock:
    page: Path
    line: int  # 1-based line of the opening fence
    section: str  # the heading the block is under ("" before the first heading)
    text: str


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose_lines(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        match = _FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker[0] * 3
                continue
            if marker.startswith(fence) and not match.group(2).strip():
                fence = None
                continue
        if fence is None:
            yield number, line


def code_blocks(page: Path) -> list[CodeBlock]:
    blocks: list[CodeBlock] = []
    section = ""
    fence: str | None = None
    start = 0
    body: list[str] = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence, start, body = match.group(1)[0] * 3, number, []
                continue
            heading = _HEADING.match(line)
            if heading:
                section = heading.group(2)
        elif match and match.group(1).startswith(fence) and not match.group(2).strip():
            blocks.append(CodeBlock(page, start, section, "\n".join(body)))
            fence = None
        else:
            body.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text without Markdown (links keep their text, code spans
    their content), lower case, punctuation dropped except hyphens and underscores, spaces to
    hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on ``page``; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _prose_lines(page):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of each link in ``page``'s prose, inline code spans left out."""
    for number, line in _prose_lines(page):
        prose = _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        for match in _LINK.finditer(prose):
            yield number, match.group(1)


def link_problems(page: Path) -> list[str]:
    problems = []
    root = ROOT.resolve()
    for number, target in links(page):
        where = f"{_rel(page)}:{number}: ({target})"
        if _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page.resolve()
        if not resolved.is_relative_to(root):
            problems.append(f"{where} points outside the repository")
            continue
        if not resolved.exists():
            problems.append(f"{where} does not exist")
            continue
        if anchor:
            if resolved.suffix != ".md" or resolved.is_dir():
                problems.append(f"{where} has an anchor but is not a Markdown page")
            elif anchor not in anchors(resolved):
                problems.append(f"{where}: no heading with anchor #{anchor} in {_rel(resolved)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve_inside_the_repository(page: Path) -> None:
    assert not link_problems(page), "\n".join(link_problems(page))


def test_readme_links_every_docs_page() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README)}
    missing = [_rel(page) for page in DOCS if page.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_slug_follows_github() -> None:
    assert slug("Elastic HSDP: no spare left") == "elastic-hsdp-no-spare-left"
    assert slug("The job store's security") == "the-job-stores-security"
    assert slug("`module`, `datamodule` and scripts") == "module-datamodule-and-scripts"
    assert slug("The batch cache (tier 2)") == "the-batch-cache-tier-2"
    assert slug("Hydra cannot compose the config (exit 1)") == "hydra-cannot-compose-the-config-exit-1"


# --- commands -------------------------------------------------------------------------------------

# Hydra's own flags, which select what the app prints, not the config: dropped before composing.
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i"}
_FLAGS = {"--help", "-h", "--hydra-help", "--resolve", "--version"}


@dataclass(frozen=True)
class LaunchCommand:
    where: str  # page:line, for the test's id
    overrides: tuple[str, ...]
    config_dirs: tuple[Path, ...]
    skipped: str | None  # why the command cannot be composed as written (None: it can)


def _logical_lines(text: str) -> Iterator[str]:
    """Lines with shell continuations (a trailing backslash) joined."""
    pending = ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield pending + line
        pending = ""
    if pending:
        yield pending


def _launch_command(where: str, segment: str) -> LaunchCommand:
    """The command after ``python launch.py`` up to the end of its shell command.

    Skip rule: a command whose arguments cannot be composed as written is skipped, saying why:
    placeholders (``<node 0>``, ``...``, an upper-case word such as ``DIR`` or ``fault.rank=R``
    standing for a value), Hydra's multirun (``-m``, ``--multirun``: a sweep, not one config), and
    ``--config-dir`` with a directory that is not in this repository (a user's own). Hydra's flags
    that only choose what to print (``--cfg job``, ``--help``) are dropped; the rest composes.
    """
    if "<" in segment or "..." in segment:
        return LaunchCommand(where, (), (), "placeholder")
    try:
        tokens = shlex.split(segment, comments=True)
    except ValueError as err:
        return LaunchCommand(where, (), (), f"not shell syntax: {err}")
    overrides: list[str] = []
    config_dirs: list[Path] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, value = token.partition("=")
        if token in ("&&", "||", "|", ";"):
            break
        if token in ("-m", "--multirun"):
            return LaunchCommand(where, (), (), "multirun")
        if name in ("--config-dir", "-cd"):
            if not eq:
                i += 1
                value = tokens[i] if i < len(tokens) else ""
            directory = (ROOT / value).resolve()
            if not value or not directory.is_dir() or not directory.is_relative_to(ROOT.resolve()):
                return LaunchCommand(where, (), (), f"--config-dir {value} is not in this repository")
            config_dirs.append(directory)
        elif name in _FLAGS_WITH_VALUE:
            i += 0 if eq else 1
        elif token in _FLAGS:
            pass
        elif token.startswith("-"):
            return LaunchCommand(where, (), (), f"unknown flag {token}")
        elif not eq or re.fullmatch(r"[A-Z][A-Z_]*", value) or re.fullmatch(r"[A-Z][A-Z_]*", token):
            return LaunchCommand(where, (), (), f"placeholder {token}")
        else:
            overrides.append(token)
        i += 1
    return LaunchCommand(where, tuple(overrides), tuple(config_dirs), None)


def launch_commands(blocks: list[CodeBlock]) -> list[LaunchCommand]:
    """Every ``python launch.py`` command in ``blocks`` (shell prompts and prefixes such as
    ``PYTHONPATH=...`` allowed; a line may chain several commands with ``&&``)."""
    found = []
    for block in blocks:
        for line in _logical_lines(block.text):
            for match in re.finditer(r"(?:^|[\s;&|$])python3? launch\.py(?=\s|$)", line):
                rest = line[match.end() :]
                rest = re.split(r"&&|\|\||;|\|", rest, maxsplit=1)[0]
                found.append(_launch_command(f"{_rel(block.page)}:{block.line}", rest))
    return found


def compose_launch(command: LaunchCommand, run_dir: Path) -> dict[str, Any]:
    """Compose ``conf/config.yaml`` with the command's overrides as ``launch.py`` does
    (``@hydra.main(version_base="1.3", config_path="conf", config_name="config")``, ``tier=N``
    quoted), resolved. ``--config-dir DIR`` adds DIR to the search path beside the project root."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from ckless_lightning.run import quote_tier

    overrides = [f"run_dir={run_dir}", *(quote_tier(o) for o in command.overrides)]
    if command.config_dirs:
        paths = ",".join(f"file://{d}" for d in (*command.config_dirs, ROOT))
        overrides.append(f"hydra.searchpath=[{paths}]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            with open_dict(cfg):
                del cfg["hydra"]
            container = OmegaConf.to_container(cfg, resolve=True)
    finally:
        GlobalHydra.instance().clear()
    assert isinstance(container, dict)
    return container


def _section_blocks(page: Path, heading: str) -> list[CodeBlock]:
    return [block for block in code_blocks(page) if block.section == heading]


ALL_COMMANDS = [command for page in PAGES for command in launch_commands(code_blocks(page))]


@pytest.fixture(autouse=True)
def _project_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKLESS_PROJECT_ROOT", str(ROOT))  # conf/config.yaml's search path


def test_quick_start_command_composes_to_the_demo(tmp_path: Path) -> None:
    commands = launch_commands(_section_blocks(README, "Quick start"))
    assert commands, "no `python launch.py` command in the README's Quick start code blocks"
    first = commands[0]
    assert first.skipped is None, first
    cfg = compose_launch(first, tmp_path / "run")
    # What the README says the command does: llama3_tiny, 4 CPU ranks, 40 steps, tier 4, rank 1
    # killed in step 25.
    assert cfg["recipe"] == "llama3_tiny"
    assert cfg["cluster"]["nnodes"] * cfg["cluster"]["nproc_per_node"] == 4
    assert cfg["cluster"]["accelerator"] == "cpu"
    assert cfg["trainer"]["max_steps"] == 40
    assert cfg["tier"] == 4
    assert (cfg["fault"]["type"], cfg["fault"]["rank"], cfg["fault"]["step"]) == ("kill", 1, 25)
    from ckless_lightning.runtime.config import job_config_from_dict

    job_config_from_dict(cfg)  # and it validates, as launch.py validates it before anything starts


def test_docs_have_launch_commands() -> None:
    composable = [c for c in ALL_COMMANDS if c.skipped is None]
    assert len(composable) >= 20, [c.where for c in ALL_COMMANDS]


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: f"{c.where}:{' '.join(c.overrides)}")
def test_launch_command_composes(command: LaunchCommand, tmp_path: Path) -> None:
    if command.skipped is not None:
        pytest.skip(command.skipped)
    compose_launch(command, tmp_path / "run")


def test_an_unknown_override_fails_to_compose(tmp_path: Path) -> None:
    from hydra.errors import ConfigCompositionException

    (command,) = launch_commands([CodeBlock(README, 0, "", "python launch.py trainer.max_stepz=3")])
    with pytest.raises(ConfigCompositionException):
        compose_launch(command, tmp_path / "run")


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    (command,) = [line for line in ci.splitlines() if "python -m pytest" in line and "pip install" in line]
    readme_lines = [line for b in _section_blocks(README, "Quick start") for line in b.text.splitlines()]
    unquiet = command.replace(" -q ", " ").strip()
    assert any(line.strip().endswith(unquiet) for line in readme_lines), (
        f"the README's quick start has no command ending in {unquiet!r} (.ci/run's, without -q)"
    )
