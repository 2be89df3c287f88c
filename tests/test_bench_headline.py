"""``make bench``'s tables: README.md's and docs/performance.md's headline tables are generated from the
newest run under bench/results/headline/ (bench/headline.py), and a hand edit or a newer run shows."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from bench import headline, report


def test_the_readme_and_performance_tables_are_the_newest_runs() -> None:
    assert headline.stale() == []


@pytest.mark.parametrize("doc", [headline.README, headline.PERFORMANCE], ids=["README", "performance"])
def test_a_changed_figure_or_an_older_run_is_caught(doc: Path) -> None:
    newest = report.newest_run(headline.ROOT)
    text = doc.read_text()
    _, generated = headline.current(doc)
    # The first images/s figure of the table ("| compute limit (2 threads) | 1,234 |"), one higher.
    row = re.search(r"^\| compute limit \(\d+ threads\) \| ([\d,]+) \|", generated, re.M)
    assert row is not None
    figure = int(row.group(1).replace(",", ""))
    edited = generated.replace(row.group(0), row.group(0).replace(row.group(1), f"{figure + 1:,}"))
    assert headline.problems(doc, newest, text) == []
    assert headline.problems(doc, newest, text.replace(generated, edited)) == [
        f"{doc.relative_to(headline.REPO)}: its table differs from {newest.relative_to(headline.REPO)}/results.json "
        "(python -m bench.headline --docs)"]


@pytest.mark.parametrize("name", ["README.md", "docs/performance.md"])
def test_a_table_goes_stale_when_a_newer_run_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    name: str) -> None:
    """Two runs of its own in tmp_path: a table made from the older one is stale once the newer one exists."""
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
    doc.write_text(f"# Title\n\n{headline.block(older, doc)}\n\nAfter the table.\n")
    assert report.newest_run(root) == newer
    assert headline.problems(doc, older) == []
    assert headline.stale((doc,)) == [
        f"{name}: its table is from bench/results/headline/{older.name}, the newest run is "
        f"bench/results/headline/{newer.name} (python -m bench.headline --docs)"]
    headline.write_docs((doc,))
    assert headline.stale((doc,)) == []
    assert "at commit 2222222" in doc.read_text().replace("\n", " ")
    assert doc.read_text().startswith("# Title\n\n") and doc.read_text().endswith("\n\nAfter the table.\n")


def test_the_readme_table_keeps_to_120_characters_and_performance_has_every_row() -> None:
    newest = report.newest_run(headline.ROOT)
    short, full = headline.block(newest, headline.README), headline.block(newest, headline.PERFORMANCE)
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
    assert headline.loaded({"cpus_usable": 2, "load_average_start": [0.98, 0.5, 0.2], "load_average_end": [6.21]})
    assert headline.loaded({"cpus_usable": 2, "load_average_start": [2.0], "load_average_end": [0.1]})
    assert not headline.loaded({"cpus_usable": 2, "load_average_start": [1.9], "load_average_end": [0.4]})
    assert not headline.loaded({"cpus_usable": 2, "load_average_end": [1.0]})  # runs before the start was kept
    newest = report.newest_run(headline.ROOT)
    machine = json.loads((newest / "results.json").read_text())["meta"]["machine"]
    text = " ".join(headline.block(newest, headline.PERFORMANCE).splitlines())
    assert ("Taken under load" in text) == headline.loaded(machine)


def test_a_new_run_replaces_the_older_ones(tmp_path: Path) -> None:
    for name in ("20261121-1832-88f6bb0", "20261127-2026-45ac9ec", "20261128-0100-1234567"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text("{}")
    newest = report.newest_run(tmp_path)
    removed = headline.replace_older(tmp_path, newest)
    assert [p.name for p in removed] == ["20261121-1832-88f6bb0", "20261127-2026-45ac9ec"]
    assert [p.name for p in tmp_path.iterdir()] == ["20261128-0100-1234567"]
