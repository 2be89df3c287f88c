"""Every kept run under bench/results/ says which commit's code it measured and when, and the history bears it out;
bench/results/README.md's table says the same; and a document that cites a run older than the code says so."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# The forms the reports use: "Commit: abc1234", "at commit abc1234", "(git abc1234)", "git abc1234", "at abc1234".
COMMIT = re.compile(r"(?:\bCommit:|\bcommit|\bgit|\bat)\s+([0-9a-f]{7,40})\b")
DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")
HEADER_LINES = 12
# A citation of a kept run in a document, by the link to its report.
CITED = re.compile(r"bench/results/([\w-]+)/")
OLDER = "older than the code"


def reports() -> list[Path]:
    """Each kept run's report: results.md (scaling.md for bench.scaling), the headline's newest run's among them."""
    found = []
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        runs = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.name == "headline" else [folder]
        for run in runs:
            report = next((run / name for name in ("results.md", "scaling.md") if (run / name).exists()), None)
            assert report is not None, f"{run.relative_to(REPO)}: no results.md (or scaling.md)"
            found.append(report)
    return found


def stated(report: Path) -> tuple[str, str]:
    """(commit, date) that ``report`` states near its top."""
    head = "\n".join(report.read_text().splitlines()[:HEADER_LINES])
    commit, date = COMMIT.search(head), DATE.search(head)
    name = report.relative_to(REPO) if report.is_relative_to(REPO) else report
    assert commit and date, f"{name}: no commit and date in its first {HEADER_LINES} lines"
    return commit.group(1), date.group(1)


def committed(commit: str) -> str | None:
    """The day ``commit`` was made (YYYY-MM-DD), None when the history has no such commit."""
    done = subprocess.run(["git", "log", "-1", "--format=%cs", f"{commit}^{{commit}}", "--"], cwd=REPO,
                          capture_output=True, text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None


def problem(report: Path) -> str | None:
    """Why ``report``'s commit and date are not borne out by the history, or None."""
    commit, date = stated(report)
    day = committed(commit)
    name = report.relative_to(REPO) if report.is_relative_to(REPO) else report
    if day is None:
        return f"{name}: commit {commit} is not in the history"
    if date < day:
        return f"{name}: dated {date}, before its commit {commit} ({day})"
    return None


@pytest.mark.parametrize("report", reports(), ids=lambda p: str(p.parent.relative_to(RESULTS)))
def test_every_kept_run_says_its_commit_and_date(report: Path) -> None:
    assert problem(report) is None


def test_a_report_without_them_or_with_a_wrong_one_is_caught(tmp_path: Path) -> None:
    report = tmp_path / "results.md"
    report.write_text("# A run\n\n`python -m bench.run`\n\nno commit here\n")
    with pytest.raises(AssertionError, match="no commit and date"):
        stated(report)
    real = reports()[0]
    commit, date = stated(real)
    report.write_text(f"Commit: {commit}, date: 2020-01-01.\n")
    assert problem(report).endswith(f"dated 2020-01-01, before its commit {commit} ({committed(commit)})")
    report.write_text("Commit: 0123456, date: 2026-11-30.\n")
    assert problem(report).endswith("commit 0123456 is not in the history")


def index() -> dict[str, str]:
    """bench/results/README.md's table: folder -> its 'commit, date' cell."""
    rows = {}
    for line in (RESULTS / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0].strip("`").rstrip("/")] = cells[3]
    return rows


def test_the_index_lists_every_kept_run_with_its_commit_and_date() -> None:
    rows = index()
    folders = {p.name for p in RESULTS.iterdir() if p.is_dir()}
    assert {name.split("/")[0] for name in rows} == folders
    for report in reports():
        folder = report.parent.relative_to(RESULTS).parts[0]
        if folder == "headline":
            continue  # its row names the newest run in general: make bench replaces it
        cell = rows[folder]
        commit, date = stated(report)
        assert re.search(rf"\b{commit}\b", cell) and date in cell, f"bench/results/README.md, {folder}: {cell!r}"


def citations(doc: Path) -> list[tuple[str, str]]:
    """(run folder, paragraph) for each paragraph of ``doc`` that cites a kept run other than the headline's."""
    found = []
    for paragraph in re.split(r"\n\s*\n", doc.read_text()):
        for folder in sorted(set(CITED.findall(paragraph))):
            if folder != "headline" and (RESULTS / folder).is_dir():
                found.append((folder, paragraph))
    return found


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def stale(folder: str) -> bool:
    """Whether the pod's code (transformer/) changed after the commit the run measured."""
    commit, _ = stated(next(r for r in reports() if r.parent.name == folder))
    done = subprocess.run(["git", "log", "--oneline", "-1", f"{commit}..HEAD", "--", "transformer"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    return bool(done.stdout.strip())


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_citation_of_a_run_older_than_the_code_says_so(doc: Path) -> None:
    missing = [f"{folder}: {paragraph[:160]!r}" for folder, paragraph in citations(doc)
               if stale(folder) and OLDER not in " ".join(paragraph.split())]
    assert not missing, f"{doc.relative_to(REPO)}: paragraphs citing a run older than the code without saying " \
                        f"'{OLDER}':\n" + "\n".join(missing)
