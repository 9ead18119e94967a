"""The commands and flags that the README and docs/ show exist: each command the pages name (an
`engine` subcommand, a script under tools/ or tests/, a make target) is run once with `--help`,
and every flag the pages write in code (`--flag`) must be in the help of a command it goes with.

A flag inside a command (`engine replay TRACE --speed 2`) must be that command's. A flag alone
(`--max-num-seqs`) must be the engine's (`engine serve` or another subcommand), else one of the
commands named in its paragraph (a list item or table row is one), or a flag of another
program the pages name (FOREIGN). The help runs happen only where needed, at most one per
command, several at a time."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = {"serve", "proxy", "config", "admin", "replay", "trace", "export", "bench"}
TRACE_SOURCES = {"mooncake", "azure", "poisson"}
OUTPUT_WORDS = {"ready:", "worker"}  # `engine ready: URL ...`: lines the engine prints
# Flags of other programs the pages show: pip, Docker, kubectl, llama.cpp's tools and server.
FOREIGN = {
    *("--no-deps", "--target"),
    *("--rm", "--shm-size", "--stop-timeout"),
    "--from-literal",
    *("--outtype", "--spec-type", "--spec-draft-n-max"),
}
PLACEHOLDERS = {"--section.field"}  # "every setting is a flag --section.field VALUE"
SHELL_BLOCKS = {"", "sh", "bash", "shell", "console"}
FLAG = re.compile(r"(?<![\w-])--(?:\[no-\])?[a-z][a-z0-9._-]*[a-z0-9]")
ENGINE = re.compile(r"^(?:python3? -m engine|engine)(?=\s|$)(?P<rest>.*)")
SCRIPT = re.compile(
    r"^(?:python3? |bash )?(?P<path>(?:tools|tests)/[\w/]+\.(?:py|sh))\b(?P<rest>.*)"
)
MAKE = re.compile(r"^make (?P<target>[\w-]+)")


@dataclass(frozen=True)
class Snippet:
    page: Path
    paragraph: int  # paragraphs (and table rows) numbered through the page
    text: str


def snippets(page: Path) -> Iterator[Snippet]:
    """Each line of a shell code block (continuation lines joined) and each inline code span of
    a paragraph, list item or table row (a span may wrap onto the next line)."""
    fence: str | None = None
    paragraph, pending, prose = 0, "", ""
    for line in [*page.read_text().split("\n"), ""]:
        starts = not line.strip() or line.startswith(("|", "```", "- ", "* ", "#"))
        if fence is None and starts:
            for span in re.findall(r"`([^`]+)`", prose):
                yield Snippet(page, paragraph, span.strip())
            paragraph, prose = paragraph + 1, ""
        if line.strip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:]
        elif fence is None:
            prose += " " + line.strip()
        elif fence in SHELL_BLOCKS:
            text = (pending + " " + line.split(" # ")[0].strip()).strip().removeprefix("$ ")
            pending = text[:-1] if text.endswith("\\") else ""
            if not pending and text:
                yield Snippet(page, paragraph, text)


def command_of(text: str) -> tuple[str, ...] | None:
    """What to run with --help for a snippet that is a command; None for any other snippet."""
    if match := ENGINE.match(text):
        words = match["rest"].split()
        if not words or words[0].startswith("-") or words[0] not in SUBCOMMANDS | OUTPUT_WORDS:
            return ("-m", "engine", "serve")  # `python -m engine --model demo`, `engine MODEL`
        if words[0] in OUTPUT_WORDS:
            return None
        if words[0] == "trace" and len(words) > 2 and words[2] in TRACE_SOURCES:
            return ("-m", "engine", *words[:3])
        if words[0] == "bench" and len(words) > 1 and words[1].isalpha() and words[1].islower():
            return ("-m", "engine", *words[:2])  # not a placeholder: COMMAND, serve|step
        return ("-m", "engine", words[0])  # `config show --help` is `config --help`
    if (match := SCRIPT.match(text)) and is_script(match["path"]):
        return (match["path"],)
    return None  # a test file, a tool's library module, not a command at all


def is_script(path: str) -> bool:
    """A runnable script (a missing one too, so that the run reports it), not a module."""
    file = ROOT / path
    return not file.is_file() or file.suffix == ".sh" or "__main__" in file.read_text()


@functools.cache
def help_flags(command: tuple[str, ...]) -> frozenset[str]:
    """The flags `command --help` prints; an error if it fails (the command does not exist)."""
    if command[0].endswith(".sh"):
        assert (ROOT / command[0]).is_file(), f"{command[0]} does not exist"
        return frozenset()
    done = subprocess.run(
        [sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{' '.join(command)} --help failed:\n{done.stderr[-2000:]}"
    return frozenset(FLAG.findall(done.stdout))


ENGINE_COMMANDS = [("-m", "engine", c) for c in ("serve", "proxy", "admin", "replay", "export")]


def engine_flags() -> frozenset[str]:
    return frozenset().union(*(help_flags(c) for c in ENGINE_COMMANDS))


def flags_in(text: str) -> set[str]:
    """The flags a snippet gives its command: not those of a value passed on to another program
    (`--engine-args='--max-num-seqs 64'`, `--engine-args=--deterministic`)."""
    if text.startswith("engine: "):  # an error the engine prints (it may name a wrong flag)
        return set()
    text = re.sub(r"""'[^']*'|"[^"]*"|=\S+""", " ", text)
    return {flag.replace("[no-]", "") for flag in FLAG.findall(text)} - PLACEHOLDERS


def all_snippets() -> list[Snippet]:
    return [snippet for page in PAGES for snippet in snippets(page)]


def test_the_pages_name_commands_at_all() -> None:
    """The checker finds the commands it is meant to check (a broken parser would pass all)."""
    commands = {command_of(s.text) for s in all_snippets()} - {None}
    assert ("-m", "engine", "serve") in commands and ("-m", "engine", "replay") in commands
    assert any(c[0].startswith("tools/") for c in commands if c)


def test_every_command_and_flag_the_docs_show_exists() -> None:
    found = all_snippets()
    commands = {s: command_of(s.text) for s in found}
    # Helps certainly needed, a few at a time: the engine's, and those of commands shown with flags.
    needed = {c for s, c in commands.items() if c and (c[0] == "-m" or flags_in(s.text))}
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(help_flags, sorted(needed | set(ENGINE_COMMANDS))))
    makefile = (ROOT / "Makefile").read_text()
    problems: list[str] = []
    for snippet in found:
        where = f"{snippet.page.relative_to(ROOT)}: `{snippet.text}`"
        if match := MAKE.match(snippet.text):
            if not re.search(rf"^{match['target']}:", makefile, re.M):
                problems.append(f"{where}: no make target {match['target']}")
            continue
        command = commands[snippet]
        if command and not flags_in(snippet.text) and command[0] != "-m":
            if not (ROOT / command[0]).is_file():
                problems.append(f"{where}: no such file")
            continue
        unknown = flags_in(snippet.text) - (FOREIGN | (help_flags(command) if command else set()))
        if command is None:
            unknown -= engine_flags()
            if unknown:  # the commands of its paragraph (or table row)
                same = [
                    c
                    for s, c in commands.items()
                    if c and s.page == snippet.page and s.paragraph == snippet.paragraph
                ]
                unknown -= frozenset().union(*(help_flags(c) for c in same))
        problems += [f"{where}: {flag} is in no --help it goes with" for flag in sorted(unknown)]
    assert not problems, "\n".join(problems)


REPO_PATH = re.compile(r"^(?:engine|tests|tools|deploy|docs)/[\w./-]*$")


def test_every_repository_path_the_docs_name_exists() -> None:
    named = {(s.page, s.text.split()[0]) for s in all_snippets() if s.text}
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page, path in sorted(named)
        if REPO_PATH.match(path) and not (ROOT / path.rstrip(".")).exists()
    ]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize(
    ("text", "command"),
    [
        ("python -m engine --model demo --port 8080", ("-m", "engine", "serve")),
        ("engine trace import azure a.csv", ("-m", "engine", "trace", "import", "azure")),
        ("engine ready: http://127.0.0.1:8000 (model tiny)", None),
        ("tools/bench/serving.py --peer none", ("tools/bench/serving.py",)),
        ("tests/e2e/test_openai_api.py", None),
        ("engine bench step --batch-size 1", ("-m", "engine", "bench", "step")),
        ("engine bench serve|offline|step [flags]", ("-m", "engine", "bench")),
        ("--max-num-seqs", None),
    ],
)
def test_snippets_are_read_as_the_commands_they_are(
    text: str, command: tuple[str, ...] | None
) -> None:
    assert command_of(text) == command
