"""The headline benchmark, re-measured at HEAD by one command: ``make bench`` (``python -m bench.headline``).

It runs ``python -m bench.run`` at the size below (a few minutes on 2 cores) into a folder named for the
run's start and commit, ``bench/results/headline/<date>-<time>-<commit>/``, whose report records the
commit, the date, the machine's CPUs and the load average at the start and the end. It then replaces the
older run (one run is kept; git keeps the ones before it), keeping the replaced run's ``results.json`` beside
the new report as ``previous.json``, and rewrites every generated section of README.md and docs/ (``SECTIONS_OF``)
from the new run: the text between ``<!-- headline NAME: <run>/results.json (bench.headline writes it) -->``
and ``<!-- end of the headline NAME -->``, rendered by bench/figures.py. No figure of the headline run is
written by hand anywhere else: tests/test_bench_headline.py fails when a section differs from what its run's
``results.json`` gives, when a document lacks one of its sections, or when a document names a headline run
outside them.

    python -m bench.headline            # measure, replace the older run, then rewrite the sections
    python -m bench.headline --docs     # only rewrite the sections from the newest run
    python -m bench.headline --check    # exit 1, naming the file and section, when one is not its run's
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import figures, report, run

REPO = Path(__file__).resolve().parents[1]
ROOT = run.HEADLINE_ROOT
# imagenet-train only (the tables show it alone), 3 rounds: about 5 minutes on 2 quiet cores.
ARGS = ("--presets", "imagenet-train", "--rounds", "3", "--budget", "900")
README = REPO / "README.md"
PERFORMANCE = REPO / "docs" / "performance.md"
BEGIN = re.compile(r"<!-- headline (?P<name>[a-z0-9]+): (?P<source>\S+) \(bench\.headline writes it\) -->\n")
# Each document's generated sections: one deleted, its figures typed by hand instead, shows as missing.
SECTIONS_OF = {"README.md": ("table",),
               "docs/performance.md": ("summary", "table", "memory", "client", "targets"),
               "docs/benchmarks.md": ("previous",),
               "docs/design.md": ("gap",),
               "docs/design-decoding.md": ("uint8", "decoders")}
# A headline run named in prose: its folder (a link to its report, say), which make bench removes.
RUN_NAMED = re.compile(r"headline/\d{8}-\d{4}-[0-9a-f]{7,}")


def end(name: str) -> str:
    return f"<!-- end of the headline {name} -->"


@dataclass
class Section:
    """One generated section as it stands in a document: its name, its run's folder, and its whole text."""

    name: str
    folder: Path
    start: int
    stop: int
    text: str


def sections(doc: Path, text: str | None = None) -> list[Section]:
    """The generated sections of ``doc`` (or of ``text``, read as that doc), in order."""
    text = doc.read_text() if text is None else text
    found = []
    for begin in BEGIN.finditer(text):
        name = begin.group("name")
        stop = text.find(end(name), begin.end())
        if stop < 0:
            raise ValueError(f"{doc.relative_to(REPO)}: the headline {name} has no '{end(name)}'")
        stop += len(end(name))
        found.append(Section(name, REPO / Path(begin.group("source")).parent, begin.start(), stop,
                             text[begin.start():stop]))
    return found


def block(name: str, folder: Path, doc: Path) -> str:
    """Section ``name`` of ``doc`` as the run in ``folder`` gives it, markers included."""
    relative = folder.relative_to(REPO).as_posix()
    link = "../" * len(doc.relative_to(REPO).parts[:-1])
    body = figures.SECTIONS[name](figures.Run.read(folder), folder, relative, link, doc != README)
    marker = f"<!-- headline {name}: {relative}/results.json (bench.headline writes it) -->"
    return "\n".join([marker, *body, end(name)])


def outside(doc: Path, text: str) -> list[str]:
    """Where ``text`` (``doc``'s) names a headline run outside its generated sections."""
    kept = text
    for section in reversed(sections(doc, text)):
        kept = kept[:section.start] + "\n" * section.text.count("\n") + kept[section.stop:]
    return [f"{doc.relative_to(REPO)}:{number}: names a headline run ({found.group(0)}) outside a generated section: "
            "make bench removes it; cite the generated sections instead"
            for number, line in enumerate(kept.splitlines(), 1) for found in RUN_NAMED.finditer(line)]


def problems(doc: Path, newest: Path, text: str | None = None) -> list[str]:
    """Why ``doc``'s generated sections (or ``text``'s, read as that doc) are not what the run ``newest`` gives."""
    text = doc.read_text() if text is None else text
    name = doc.relative_to(REPO).as_posix()
    found = sections(doc, text)
    missing = [s for s in SECTIONS_OF.get(name, ()) if s not in {f.name for f in found}]
    issues = [f"{name}: no generated {s} section (<!-- headline {s}: ... -->): python -m bench.headline --docs "
              "writes it once the markers are there" for s in missing]
    for section in found:
        if section.folder != newest:
            issues.append(f"{name}: its {section.name} is from {section.folder.relative_to(REPO)}, the newest run is "
                          f"{newest.relative_to(REPO)} (python -m bench.headline --docs)")
        elif section.text != block(section.name, section.folder, doc):
            issues.append(f"{name}: its {section.name} differs from {section.folder.relative_to(REPO)}/results.json "
                          "(python -m bench.headline --docs)")
    return issues + outside(doc, text)


def documents() -> tuple[Path, ...]:
    """Every document that may cite a headline run: the README, docs/, and the kept runs' index."""
    return (README, *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "results" / "README.md")


def stale(docs: tuple[Path, ...] | None = None) -> list[str]:
    """Each document whose generated sections are not what the newest run gives, and why."""
    newest = report.newest_run(ROOT)
    return [problem for doc in (documents() if docs is None else docs) for problem in problems(doc, newest)]


def write_docs(docs: tuple[Path, ...] | None = None) -> None:
    """Every generated section of ``docs`` rewritten from the newest run."""
    newest = report.newest_run(ROOT)
    for doc in documents() if docs is None else docs:
        text = doc.read_text()
        for section in reversed(sections(doc, text)):
            text = text[:section.start] + block(section.name, newest, doc) + text[section.stop:]
        doc.write_text(text)


def replace_older(root: Path, newest: Path) -> list[Path]:
    """Remove every run under ``root`` but ``newest`` (bench/results keeps one run of an experiment), keeping the
    latest of them as ``newest/previous.json`` for the comparison; the removed."""
    removed = [run_dir for run_dir in sorted(root.iterdir()) if run_dir.is_dir() and run_dir != newest]
    replaced = [run_dir for run_dir in removed if (run_dir / "results.json").exists()]
    if replaced:
        shutil.copyfile(replaced[-1] / "results.json", newest / "previous.json")
    for run_dir in removed:
        shutil.rmtree(run_dir)
    return removed


def _report(problems: list[str]) -> int:
    """Each problem on stderr; the exit status: 1 when there is any."""
    print(*problems, sep="\n", file=sys.stderr, end="\n" if problems else "")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__.splitlines()[0])
    parser.add_argument("--docs", action="store_true", help="only rewrite the sections from the newest run")
    parser.add_argument("--check", action="store_true", help="only check the sections against their runs")
    args = parser.parse_args(argv)
    if args.check:
        return _report(stale())
    if not args.docs:
        folder = ROOT / report.run_name(time.time())
        done = run.main([*ARGS, "--out", str(folder)])
        if done != 0:
            return done
        for older in replace_older(ROOT, folder):
            print(f"{older.relative_to(REPO)} removed: one run is kept (its results.json as previous.json beside the "
                  "new one), git keeps the older ones", file=sys.stderr)
    write_docs()
    print(f"generated sections rewritten from {report.newest_run(ROOT).relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
