"""The GPU check's script on this machine (``python -m bench.gpu --smoke``), so it cannot rot between runs
on a GPU machine: every part ran (the CUDA ones skip without CUDA), and its verdicts can fail.

Not a timed test: figures are not checked, only that each part produced them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from bench import gpu

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-out")
    work = tmp_path_factory.mktemp("gpu-work")
    # Its tests part on two small files: the example's tests are left out (they need the service).
    tests = ["tests/client/test_example.py", "tests/client/test_download_links.py"]
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--out", str(out), "--work", str(work),
                           "--tests", *tests], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_every_part_ran_and_the_cuda_ones_say_why_not(smoke: tuple[dict, str]) -> None:
    results, text = smoke
    parts = results["parts"]
    assert results["ok"] and text.startswith("# GPU check: passed")
    cuda = torch.cuda.is_available()
    for name in ("tests", "prefetch", "shards", "loaders", "training"):
        assert parts[name]["status"] == "passed", (name, parts[name])
    assert parts["bandwidth"]["status"] == ("passed" if cuda else "skipped")
    tests = parts["tests"]
    assert tests["counts"]["passed"] > 0 and not tests["failed"]
    left_out = {entry["test"].rsplit("::", 1)[1]: entry["reason"] for entry in tests["left_out"]}
    assert "test_training_example_runs_locally_and_resumes_mid_epoch" in left_out
    assert all("service" in reason or "engine" in reason for reason in left_out.values())
    rows = parts["prefetch"]["equal_to_cpu"]
    assert len(rows) == 4 and all(row["ok"] for row in rows)
    readers = {(row["dtype"], row["reader"]) for row in parts["loaders"]["rows"] if row["samples"] > 0}
    assert {reader for _, reader in readers} == {"one-copy floor (one core)", "make_loader, num_workers=0",
                                                 "make_loader, num_workers=1", "web_loader, num_workers=0"}
    assert {dtype for dtype, _ in readers} == {"uint8", "float32"}
    assert all(row["max_abs_difference"] <= 0.5 for row in parts["loaders"]["rows"])
    assert all(row["batches_compared"] == row["batches"] > 0 for row in parts["loaders"]["rows"])
    assert results["meta"]["finished"] is True and results["cut"] == []
    assert [row["dtype"] for row in parts["training"]["fed"]] == ["uint8", "float32"]
    assert all(row["steps"] > 0 and "steady_wait_s" in row for row in parts["training"]["fed"])


def test_the_shards_are_what_the_loader_reads_as_the_pods(tmp_path: Path) -> None:
    from transformer.client import make_loader

    paths = gpu.write_shards(tmp_path, "uint8", 2, 5, 8)
    images = gpu.distinct_images(8)
    seen = []
    for batch, labels in make_loader([str(p) for p in paths], 4, num_workers=0, shuffle_buffer=0,
                                     shuffle_shards=False):
        for image, label in zip(batch, labels.tolist()):
            assert torch.equal(image, torch.from_numpy(images[label % gpu.DISTINCT]))
            seen.append(label)
    assert seen == list(range(10))  # the end marker matched: no shard was refused


def test_the_tests_part_fails_on_a_failure_and_on_an_unexpected_skip(tmp_path: Path) -> None:
    suite = tmp_path / "test_some.py"
    suite.write_text("import pytest\n\n"
                     "def test_fine():\n    pass\n\n"
                     "def test_broken():\n    assert 1 == 2\n\n"
                     "def test_cuda():\n    pytest.skip('needs CUDA')\n\n"
                     "def test_other():\n    pytest.skip('no network')\n")
    result = gpu.run_tests([str(suite)], 60, tmp_path, cuda=False)
    assert result["counts"] == {"passed": 1, "failed": 1, "skipped": 2} and result["exit_code"] == 1
    assert result["status"] == "failed" and result["reason"] == "no test failed; no unexpected skip"
    assert [e["test"].rsplit("::", 1)[1] for e in result["failed"]] == ["test_broken"]
    unexpected = next(c for c in result["checks"] if c["check"] == "no unexpected skip")["detail"]
    assert unexpected.endswith("test_other: no network")
    passing = [{"test": "t::a", "outcome": "passed"}]
    assert "status" not in gpu.verdict(passing + [{"test": "t::b", "outcome": "skipped", "reason": "needs CUDA"}],
                                       0, cuda=False)
    on_gpu = gpu.verdict(passing + [{"test": "t::b", "outcome": "skipped", "reason": "needs CUDA"}], 0, cuda=True)
    assert on_gpu["reason"] == "no unexpected skip"  # with CUDA, a CUDA test must run
    assert gpu.verdict([], None, cuda=True)["reason"] == "pytest finished; tests ran"
    (tmp_path / "test_broken_import.py").write_text("import not_a_module_anywhere\n")
    broken = gpu.run_tests([str(tmp_path / "test_broken_import.py")], 60, tmp_path, cuda=False)
    assert broken["exit_code"] == 2 and broken["counts"] == {"error": 1}
    assert "not_a_module_anywhere" in broken["failed"][0]["reason"]


def wheel(folder: Path, name: str, requires: list[str]) -> Path:
    """A minimal pure-Python wheel of one module ``name`` that says ``VALUE = 7``."""
    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": b"VALUE = 7\n",
             f"{info}/METADATA": ("Metadata-Version: 2.1\nName: " + name + "\nVersion: 1.0\n"
                                  + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in {**files, f"{info}/RECORD": record.encode()}.items():
            archive.writestr(member, data)
    return path


def test_carried_wheels_go_first_on_the_path_and_unmet_requirements_are_named(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "carried_probe", ["numpy>=1", "absent-package-xyz>=1", "numpy<1; python_version<'3'",
                                    "other>=1; extra == 'more'"])
    found = gpu.install(wheels, tmp_path / "site")
    assert found["installed"] == ["carried_probe==1.0"]
    assert found["unmet"] == ["carried_probe needs absent-package-xyz>=1: not installed"]
    assert found["status"] == "failed" and found["reason"] == "every requirement of the wheels met"
    assert "carried_probe" not in sys.modules  # this process's path is left as it is: the run goes on in a child
    env = gpu.carried_env(tmp_path / "site")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site")
    child = subprocess.run([sys.executable, "-c", "import carried_probe; print(carried_probe.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    assert Path(child.stdout.strip()).parent == tmp_path / "site"
    with pytest.raises(RuntimeError, match="no wheels"):
        gpu.install(tmp_path / "site", tmp_path / "elsewhere")


def test_every_loader_batch_is_compared_with_the_source() -> None:
    compare = gpu.expectation("float32", 8)
    images = torch.from_numpy(gpu.as_float32(gpu.distinct_images(8)))
    labels = [torch.arange(i * 4, i * 4 + 4) for i in range(8)]
    batches = [(images[batch % gpu.DISTINCT].clone(), batch) for batch in labels]
    right = gpu.deliver(batches, 60, compare)
    assert right["batches"] == right["batches_compared"] == 8 and right["max_abs_difference"] <= 0.5
    batches[6][0][1] += 0.1  # the seventh batch: one image off by about 6 uint8 steps
    wrong = gpu.deliver(batches, 60, compare)
    assert wrong["batches_compared"] == 8 and wrong["max_abs_difference"] > 5


def test_a_part_or_case_out_of_time_is_cut_not_failed(tmp_path: Path) -> None:
    results: dict = {"parts": {}, "meta": {"smoke": False, "budget_s": 10}}
    gone = gpu.Budget(0)
    gpu.run_part(results, "tests", lambda: {"counts": {"passed": 1}}, gpu.Budget(60), 0, tmp_path)
    gpu.run_part(results, "training", lambda: {}, gone, 10, tmp_path)
    assert results["parts"]["training"]["status"] == "cut"
    loaders = gpu.floor_and_loaders({"uint8": [tmp_path / "never-read.tar"]}, 4, [0], 0, 30, gone, 8, 1)
    assert loaders["status"] == "cut" and {row["status"] for row in loaders["rows"]} == {"cut: out of time"}
    gpu.verdict_of(results, smoke=False)
    assert results["ok"] and results["cut"] == ["training"]
    assert gpu.markdown(results).startswith("# GPU check: passed, cut for time: training")
    results["parts"]["tests"]["status"] = "failed"
    gpu.verdict_of(results, smoke=False)
    assert not results["ok"] and gpu.markdown(results).startswith("# GPU check: FAILED")


def test_results_are_written_after_each_part(tmp_path: Path) -> None:
    results: dict = {"parts": {}, "meta": {"smoke": True, "budget_s": 10}}
    gpu.run_part(results, "tests", lambda: {"counts": {"passed": 3}}, gpu.Budget(60), 0, tmp_path)
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["parts"]["tests"]["counts"] == {"passed": 3} and written["meta"]["finished"] is False
    assert (tmp_path / "results.md").read_text().startswith("# GPU check: passed (so far: the run has not finished)")
    gpu.run_part(results, "prefetch", lambda: {"status": "failed", "reason": "overwritten"}, gpu.Budget(60), 0,
                 tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["parts"]["prefetch"]["status"] == "failed"


def test_the_overlap_has_a_threshold() -> None:
    hidden: dict = {"status": "passed"}
    gpu.check_overlap(hidden, {"dtype": "uint8", "overlap": 0.93})
    assert hidden["status"] == "passed"
    serial: dict = {"status": "passed"}
    gpu.check_overlap(serial, {"dtype": "float32", "overlap": 0.04})
    assert serial["status"] == "failed" and "overlap >= 0.5" in serial["reason"]
    broken: dict = {"status": "passed"}
    gpu.check_overlap(broken, {"dtype": "uint8", "error": "stopped after 45 s"})
    assert broken["status"] == "failed" and "prefetch_overlap.py ran (uint8)" in broken["reason"]


def test_a_module_missing_there_fails_the_imports_part_naming_it() -> None:
    found = gpu.import_all({"json": "bench/gpu/run.py:1", "not_a_module_anywhere": "elsewhere.py:7"})
    assert found["status"] == "failed" and list(found["failed"]) == ["not_a_module_anywhere"]
    detail = found["checks"][0]["detail"]
    assert "not_a_module_anywhere (imported at elsewhere.py:7): ModuleNotFoundError" in detail
    assert "status" not in gpu.import_all({"json": "bench/gpu/run.py:1"})
