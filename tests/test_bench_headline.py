"""``make bench``'s tables: README.md's and docs/performance.md's headline tables are generated from the
newest run under bench/results/headline/ (bench/headline.py), and a hand edit or a newer run shows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bench import figures, headline, report


def test_every_generated_section_is_the_newest_runs() -> None:
    assert headline.stale() == []


def _edited(generated: str, old: str, new: str) -> str:
    assert old in generated, (old, generated)
    return generated.replace(old, new, 1)


# A figure of each generated section, as the section prints it, and a different one: every figure the documents
# show from the headline run is in a section, and an edit of any shows.
EDITS = [("README.md", "table", r"\| compute limit \(\d+ threads\) \| ([\d,]+) \|"),
         ("docs/performance.md", "table", r"\| compute limit \(\d+ threads\) \| ([\d,]+) \|"),
         ("docs/performance.md", "summary", r"delivered (\d+)%"),
         ("docs/performance.md", "memory", r"\| ([\d,]+) MB \|\n"),
         ("docs/performance.md", "client", r"client-side\s+decoding ([\d,]+);"),
         ("docs/benchmarks.md", "previous", r"\| compute limit, images/s \(median of its rounds\) \| ([\d,]+) \|"),
         ("docs/performance.md", "targets", r"vs ([\d,]+) MB, 0\.\d\d\)"),
         ("docs/design.md", "gap", r"\| compute limit: decode, v2 transforms, `\.npy` \| (\d\.\d\d) \|"),
         ("docs/design-decoding.md", "uint8", r"reaches (\d+)% of the uint8"),
         ("docs/design-decoding.md", "decoders", r"\| simplejpeg \| (\d\.\d\d\d) \|")]


@pytest.mark.parametrize(("name", "section", "pattern"), EDITS, ids=[f"{n}-{s}" for n, s, _ in EDITS])
def test_a_changed_figure_in_any_section_is_caught(name: str, section: str, pattern: str) -> None:
    doc = headline.REPO / name
    newest = report.newest_run(headline.ROOT)
    text = doc.read_text()
    generated = next(s.text for s in headline.sections(doc, text) if s.name == section)
    found = re.search(pattern, generated)
    assert found is not None, (section, pattern)
    figure = found.group(1)
    other = "4588" if figure != "4588" else "4589"
    edited = generated[:found.start(1)] + other + generated[found.end(1):]
    assert headline.problems(doc, newest, text) == []
    assert headline.problems(doc, newest, text.replace(generated, edited)) == [
        f"{name}: its {section} differs from {newest.relative_to(headline.REPO)}/results.json "
        "(python -m bench.headline --docs)"]


def test_the_peers_peak_rss_in_the_targets_cannot_be_edited_by_hand() -> None:
    """The issue that started all this: 4,477 MB (the peer's peak RSS, 4 shards) typed as 4588 in the Targets."""
    doc, newest = headline.PERFORMANCE, report.newest_run(headline.ROOT)
    text = doc.read_text()
    peak = max(r["peak_rss_mb"] for r in figures.Run.read(newest).table if r["system"] == "peer")
    shown = f"{peak:,.0f} MB"
    targets = next(s.text for s in headline.sections(doc, text) if s.name == "targets")
    assert shown in targets
    assert headline.problems(doc, newest, text.replace(targets, _edited(targets, shown, "4588 MB"))) != []


def test_a_section_removed_or_a_run_named_outside_one_is_caught() -> None:
    doc, newest = headline.PERFORMANCE, report.newest_run(headline.ROOT)
    text = doc.read_text()
    targets = next(s for s in headline.sections(doc, text) if s.name == "targets")
    # The section's figures typed back by hand, without its markers.
    by_hand = text.replace(targets.text, "\n".join(targets.text.splitlines()[1:-1]))
    assert headline.problems(doc, newest, by_hand) == [
        "docs/performance.md: no generated targets section (<!-- headline targets: ... -->): python -m bench.headline "
        "--docs writes it once the markers are there"]
    relative = newest.relative_to(headline.REPO).as_posix()
    cited = text + f"\nThe peer's peak RSS in [the report](../{relative}/results.md).\n"
    found = headline.problems(doc, newest, cited)
    assert len(found) == 1 and found[0].startswith("docs/performance.md:") and "outside a generated section" in found[0]


@pytest.mark.parametrize("name", ["README.md", "docs/performance.md"])
def test_a_section_goes_stale_when_a_newer_run_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      name: str) -> None:
    """Two runs of its own in tmp_path: a section made from the older one is stale once the newer one exists."""
    results = json.loads((report.newest_run(headline.ROOT) / "results.json").read_text())
    root = tmp_path / "bench" / "results" / "headline"
    older, newer = root / "20261127-2114-1111111", root / "20261130-0900-2222222"
    for run_folder, git in ((older, "1111111"), (newer, "2222222")):
        run_folder.mkdir(parents=True)
        results["meta"]["git"] = git
        (run_folder / "results.json").write_text(json.dumps(results))
    monkeypatch.setattr(headline, "REPO", tmp_path)
    monkeypatch.setattr(headline, "ROOT", root)
    monkeypatch.setattr(headline, "README", tmp_path / "README.md")
    doc = tmp_path / name
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(f"# Title\n\n{headline.block('table', older, doc)}\n\nAfter the table.\n")
    assert report.newest_run(root) == newer
    assert headline.problems(doc, older) == [] or headline.problems(doc, older)[0].startswith(f"{name}: no generated")
    stale = [p for p in headline.stale((doc,)) if "no generated" not in p]
    assert stale == [f"{name}: its table is from bench/results/headline/{older.name}, the newest run is "
                     f"bench/results/headline/{newer.name} (python -m bench.headline --docs)"]
    headline.write_docs((doc,))
    assert [p for p in headline.stale((doc,)) if "no generated" not in p] == []
    assert "at commit 2222222" in doc.read_text().replace("\n", " ")
    assert doc.read_text().startswith("# Title\n\n") and doc.read_text().endswith("\n\nAfter the table.\n")


def test_the_readme_table_keeps_to_120_characters_and_performance_has_every_row() -> None:
    newest = report.newest_run(headline.ROOT)
    short, full = headline.block("table", newest, headline.README), headline.block("table", newest,
                                                                                   headline.PERFORMANCE)
    assert max(len(line) for line in short.splitlines()) <= 120
    assert "no GIL" in full and "no GIL" not in short and "latency p50 / p99" in full
    results = json.loads((newest / "results.json").read_text())
    assert f"at commit {results['meta']['git']}" in " ".join(short.splitlines())
    assert f"load average {results['meta']['machine']['load_average_start'][0]} at the start" in full.replace("\n", " ")


def test_the_newest_run_is_the_latest_folder_with_results(tmp_path: Path) -> None:
    for name in ("20261121-1832-1111111", "20261127-2026-2222222", "20261130-0900-0000000"):
        (tmp_path / name).mkdir()
    for name in ("20261121-1832-1111111", "20261127-2026-2222222"):
        (tmp_path / name / "results.json").write_text("{}")
    assert report.newest_run(tmp_path) == tmp_path / "20261127-2026-2222222"  # the latest holds no results
    single = tmp_path / "single"
    (single / "20261127-2114-3333333").mkdir(parents=True)
    (single / "20261127-2114-3333333" / "results.json").write_text("{}")
    assert report.newest_run(single) == single / "20261127-2114-3333333"  # one kept run is the newest
    with pytest.raises(FileNotFoundError, match="no run with a results.json"):
        report.newest_run(tmp_path / "20261130-0900-0000000")
    started = time.mktime((2026, 11, 27, 20, 26, 0, 0, 0, -1))
    assert re.fullmatch(r"20261127-2026-[0-9a-f]{7,}", report.run_name(started))


def test_a_run_records_the_commit_it_started_at() -> None:
    """The checkout may move on while a run measures: the report names the commit taken at the start."""
    import argparse

    args = argparse.Namespace(workers=2, concurrency=4, rounds=1, shards=1, samples=1, big_mib=1, smoke=True,
                              presets=("imagenet-train",))
    started = {"git": "abc1234", "commit": "abc1234" + "0" * 33}
    meta = report.metadata(["--smoke"], args, time.time(), started)
    assert (meta["git"], meta["commit"]) == (started["git"], started["commit"])
    assert meta["settings"]["presets"] == ["imagenet-train"]
    assert set(report.git_state()) == {"git", "commit"}


def test_presets_choose_what_each_round_measures(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import run

    assert run.parse_args(["--presets", "imagenet-train"]).presets == ("imagenet-train",)
    assert run.parse_args([]).presets == run.PRESETS
    assert run.parse_args([]).out is None  # main() names the folder for the run's start and commit
    with pytest.raises(SystemExit):
        run.parse_args(["--presets", "imagenet-train,resize-225"])
    assert "--presets: resize-225; choose from imagenet-train, imagenet-val" in capsys.readouterr().err
    assert headline.ARGS[:2] == ("--presets", "imagenet-train")


def test_a_loaded_run_says_so_above_its_table() -> None:
    assert figures.loaded({"cpus_usable": 2, "load_average_start": [0.98, 0.5, 0.2], "load_average_end": [6.21]})
    assert figures.loaded({"cpus_usable": 2, "load_average_start": [2.0], "load_average_end": [0.1]})
    assert not figures.loaded({"cpus_usable": 2, "load_average_start": [1.9], "load_average_end": [0.4]})
    assert not figures.loaded({"cpus_usable": 2, "load_average_end": [1.0]})  # runs before the start was kept
    newest = report.newest_run(headline.ROOT)
    machine = json.loads((newest / "results.json").read_text())["meta"]["machine"]
    text = " ".join(headline.block("table", newest, headline.PERFORMANCE).splitlines())
    assert ("Taken under load" in text) == figures.loaded(machine)


def test_a_new_run_replaces_the_older_ones_keeping_the_last_as_previous(tmp_path: Path) -> None:
    for name in ("20261121-1832-88f6bb0", "20261127-2026-45ac9ec", "20261128-0100-1234567"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"meta": {"git": name[-7:]}}))
    newest = report.newest_run(tmp_path)
    removed = headline.replace_older(tmp_path, newest)
    assert [p.name for p in removed] == ["20261121-1832-88f6bb0", "20261127-2026-45ac9ec"]
    assert [p.name for p in tmp_path.iterdir()] == ["20261128-0100-1234567"]
    assert json.loads((newest / "previous.json").read_text()) == {"meta": {"git": "45ac9ec"}}


def test_bench_run_never_writes_into_the_headline_folder_by_itself() -> None:
    from bench import run

    started = time.time()
    default = run.out_folder(None, started)
    assert default.parent == run.SCRATCH and not default.is_relative_to(run.HEADLINE_ROOT)
    assert not default.is_relative_to(headline.REPO / "bench" / "results")
    assert run.out_folder(Path("/tmp/x"), started) == Path("/tmp/x")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(default / "results.json")], cwd=headline.REPO)
    assert ignored.returncode == 0, "bench-out/ must be ignored by git"


def _other_figures(value: object, factor: float = 1.07) -> object:
    """A run's figures, each float moved by ``factor`` (counts, rounds and the metadata kept)."""
    if isinstance(value, dict):
        return {k: v if k == "meta" else _other_figures(v, factor) for k, v in value.items()}
    if isinstance(value, list):
        return [_other_figures(v, factor) for v in value]
    return value * factor if isinstance(value, float) else value


def test_make_bench_on_a_newer_run_leaves_the_doc_tests_green(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What make bench does once it has measured, on a synthetic newer run in a copy of the repository: the older run
    replaced (kept as previous.json), every generated section rewritten; then the checks make test runs on the
    documents pass there, and nothing names the replaced run's folder."""
    from tests import test_docs

    # The working tree as make bench leaves it, before a commit: tracked files and new ones git does not ignore.
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=headline.REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (headline.REPO / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(headline.REPO / name, tmp_path / name)
    kept = report.newest_run(headline.ROOT)
    root = tmp_path / kept.parent.relative_to(headline.REPO)
    results = _other_figures(json.loads((kept / "results.json").read_text()))
    results["meta"].update({"git": "abcdef1", "commit": "abcdef1" + "0" * 33, "started": "2026-12-01 09:00:00 UTC"})
    newer = root / "20261201-0900-abcdef1"
    newer.mkdir()
    (newer / "results.json").write_text(json.dumps(results))
    report.write_markdown(results, newer / "results.md")
    for name, value in (("REPO", tmp_path), ("ROOT", root), ("README", tmp_path / "README.md"),
                        ("PERFORMANCE", tmp_path / "docs" / "performance.md")):
        monkeypatch.setattr(headline, name, value)
    assert headline.stale() != []  # every section is the older run's
    assert [p.name for p in headline.replace_older(root, newer)] == [kept.name]
    headline.write_docs()
    assert headline.stale() == []
    assert json.loads((newer / "previous.json").read_text())["meta"]["git"] == json.loads(
        (kept / "results.json").read_text())["meta"]["git"]
    monkeypatch.setattr(test_docs, "REPO", tmp_path)
    monkeypatch.setattr(test_docs, "README", tmp_path / "README.md")
    for doc in test_docs.documents():
        assert test_docs.broken_links(doc) == [], doc
        assert test_docs.broken_code_paths(doc.read_text()) == [], doc
    readme = (tmp_path / "README.md").read_text()
    assert test_docs.long_lines(readme) == [] and len(readme.splitlines()) <= test_docs.MAX_README_LINES
    assert "at commit abcdef1" in readme.replace("\n", " ")
    for doc in [*test_docs.documents(), tmp_path / "bench" / "results" / "README.md"]:
        assert kept.name not in doc.read_text(), doc
