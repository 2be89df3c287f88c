"""The README and docs/ stay short enough to read and point only at things that exist.

Checked: the README's length (lines, and characters per line); every relative link in README.md and
docs/*.md (the file, and the heading its #anchor names); every inline-code repo path there (`docs/...`,
`bench/...`, `transformer/...`, `tests/...`, `k8s/...`, `examples/...`); every docs/ path and every repo
file path named in the sources (Python under transformer/, bench/, tests/ and examples/, and the
Dockerfile, Makefile, pyproject.toml, k8s/ and scripts/); every ``python -m bench...`` module named in
the docs, the kept runs' reports under bench/results/, and transformer/, bench/, tests/ and examples/.
The generated tables are checked where they are generated: the settings table in tests/test_config.py, the headline
tables in tests/test_bench_headline.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 200
MAX_README_WIDTH = 120
SOURCE_FOLDERS = ("transformer", "bench", "tests", "testbed", "examples")
BUILD_FILES = ("Dockerfile", "Makefile", "pyproject.toml")
REPO_PATH = re.compile(r"(?:docs|bench|transformer|tests|testbed|k8s|examples)/\S*")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# A docs/ path, or a repo file named by its path from the root (tests/..., bench/..., ...).
BENCH_COMMAND = re.compile(r"python3? -m (bench(?:\.\w+)+)")
DOCS_IN_SOURCE = re.compile(r"(?<![\w/.%-])(?:docs/[\w.-]+(?:/[\w.-]+)*|"
                            r"(?:tests|testbed|bench|transformer|examples)/[\w/.-]+\.(?:py|md))")


def documents() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks (commands and sample output, not references)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(prose(path.read_text()))}


def exists(relative: str) -> bool:
    if "*" in relative or "?" in relative:
        return any(REPO.glob(relative))
    return (REPO / relative).exists()


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """The relative links of `path` (or of `text`, read as if it were that file) that lead nowhere."""
    broken = []
    for target in LINK.findall(prose(path.read_text() if text is None else text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    return broken


def broken_code_paths(text: str) -> list[str]:
    broken = []
    for _, span in CODE_SPAN.findall(prose(text)):
        span = span.strip()
        if REPO_PATH.fullmatch(span) and not exists(span.partition("#")[0]):
            broken.append(span)
    return broken


def source_files() -> list[Path]:
    files = [f for folder in SOURCE_FOLDERS for f in (REPO / folder).rglob("*.py")]
    files += [*(REPO / "k8s").rglob("*.yaml"), *(REPO / "scripts").glob("*"), *(REPO / n for n in BUILD_FILES)]
    return sorted(f for f in files if f != Path(__file__).resolve() and "__pycache__" not in f.parts)


def docs_named_in(path: Path) -> set[str]:
    return {m.rstrip(".") for m in DOCS_IN_SOURCE.findall(path.read_text(errors="replace"))}


def long_lines(text: str, width: int = MAX_README_WIDTH) -> list[str]:
    return [f"line {n}: {len(line)} characters" for n, line in enumerate(text.splitlines(), 1) if len(line) > width]


def test_the_readme_stays_under_its_length_limit() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (limit {MAX_README_LINES}): move detail to docs/"


def test_no_readme_line_is_wider_than_its_limit() -> None:
    assert long_lines(README.read_text()) == [], f"README.md: lines over {MAX_README_WIDTH} characters"


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_heading(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_repo_path_in_inline_code_exists(path: Path) -> None:
    assert broken_code_paths(path.read_text()) == []


def test_every_docs_path_named_in_the_sources_exists() -> None:
    missing = sorted((str(f.relative_to(REPO)), name) for f in source_files() for name in docs_named_in(f)
                     if not (REPO / name).exists())
    assert missing == []


def bench_modules_missing(text: str) -> list[str]:
    """The ``python -m bench...`` modules named in ``text`` that are not in the repo."""
    return sorted({name for name in BENCH_COMMAND.findall(text) if not module_exists(name)})


def module_exists(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def command_files() -> list[Path]:
    """Where ``python -m bench...`` command lines are written: the docs, kept runs' reports, and the sources."""
    sources = [f for f in source_files()
               if any(f.is_relative_to(REPO / d) for d in ("transformer", "bench", "tests", "examples"))]
    return [*documents(), *sorted((REPO / "bench" / "results").rglob("*.md")), *sources]


def test_every_bench_command_names_a_module() -> None:
    missing = [(str(f.relative_to(REPO)), name) for f in command_files()
               for name in bench_modules_missing(f.read_text(errors="replace"))]
    assert missing == []


# The packages docs/development.md's Layout maps module by module.
MAPPED_ROOMS = ("transformer", "transformer/server", "transformer/client", "bench", "bench/gpu", "testbed",
                "testbed/k8s", "scripts")
ROOM = re.compile(r"^( *)([\w.-]+(?:/[\w.-]+)*/)(?:\s|$)")


def layout_rooms(text: str) -> dict[str, set[str]]:
    """development.md's Layout block: each room (a folder heading a line, a subfolder indented under it) and the
    module file names its lines give."""
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    rooms: dict[str, set[str]] = {}
    current = top = None
    for line in block.splitlines():
        heading = ROOM.match(line)
        if heading:
            name = heading.group(2).rstrip("/")
            current = name if not heading.group(1) else f"{top}/{name}"
            top = name if not heading.group(1) else top
            line = line[heading.end():]
        elif line and not line.startswith(" "):
            current = None
        if current:
            rooms.setdefault(current, set()).update(re.findall(r"\b[\w]+\.py\b", line))
    return rooms


def unmapped(rooms: dict[str, set[str]]) -> list[str]:
    """Each module of a mapped room the map leaves out, and each name it gives that is no module there."""
    problems = []
    for room in MAPPED_ROOMS:
        modules = {p.name for p in (REPO / room).glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
        named = rooms.get(room, set())
        problems += [f"{room}/{name}: not in the map" for name in sorted(modules - named)]
        problems += [f"{room}/{name}: in the map, not in the tree" for name in sorted(named - modules)]
    return problems


def test_the_development_layout_names_every_module_in_its_room() -> None:
    assert unmapped(layout_rooms((REPO / "docs" / "development.md").read_text())) == []


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """A check that never fails checks nothing: each one, fed a broken reference, reports it."""
    assert slug("Partial JPEG decoding (`crop_decode`)") == "partial-jpeg-decoding-crop_decode"
    assert slug("WebSocket (ws://): what AIS does with each reply") == "websocket-ws-what-ais-does-with-each-reply"
    doc = REPO / "docs" / "contract.md"
    assert broken_links(doc, "[x](contract.md#no-such-heading) [y](#which-comm-type-to-choose)") == [
        "contract.md#no-such-heading: no heading #no-such-heading in docs/contract.md"]
    assert broken_links(doc, "[x](missing.md) [y](reliability.md) [z](https://example.com/x)") == [
        "missing.md: no such file"]
    assert broken_links(README, "[x](../outside.md)") == ["../outside.md: no such file"]
    assert broken_code_paths("`bench/nothing.py` `docs/` `bench/run.py` `tests/test_*.py` `k8s/none/`") == [
        "bench/nothing.py", "k8s/none/"]
    assert broken_code_paths("```\n`bench/nothing.py`\n```\n") == []
    assert long_lines("short\n" + "x" * 121 + "\n" + "y" * 120) == ["line 2: 121 characters"]
    source = tmp_path / "x.py"
    source.write_text('"""See docs/missing.md and docs/contract.md."""\nURL = f"/docs/dir/a.tar"\n')
    assert docs_named_in(source) == {"docs/missing.md", "docs/contract.md"}
    assert bench_modules_missing("python -m bench.run --smoke; `python -m bench.nothing`; "
                                 "python3 -m bench.experiments.ab python -m bench.experiments") == ["bench.nothing"]
    layout = "## Layout\n\n```\ntransformer/    core\n  config.py  settings  stale.py  gone\nbench/    x\n```\n"
    problems = unmapped(layout_rooms(layout))
    assert "transformer/stale.py: in the map, not in the tree" in problems
    assert "transformer/engine.py: not in the map" in problems and "bench/run.py: not in the map" in problems
    assert "transformer/config.py: not in the map" not in problems
