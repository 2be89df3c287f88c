"""docs/deploy.md, typed as written, against a real AIS with ETL: its curl and wds-transform
commands run as they are (taken from the document's text, so the two cannot drift), each ``ais`` command
runs as its aistore SDK equivalent; and the Troubleshooting rows give the answers they promise."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from testbed.etl_cluster import EtlCluster
from transformer.client import unregister

from .conftest import REAL_KUBERNETES
from .test_register import running_pods, stage, wait_stage

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]
REPO = Path(__file__).resolve().parents[3]
ETL = "wds-transform"


def section_commands(title: str) -> list[str]:
    """The commands of the fenced bash blocks under the docs/deploy.md heading ``title`` (continuations joined,
    trailing comments dropped)."""
    text = (REPO / "docs" / "deploy.md").read_text()
    body = re.split(r"\n#{1,3} ", text.split(f"\n{title}\n", 1)[1], maxsplit=1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s{2,}#\s.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def bucket_of(uri: str) -> str:
    assert uri.startswith("ais://"), uri
    return uri[len("ais://"):].split("/", 1)[0]


class Deploy:
    """Runs docs/deploy.md's commands: shell ones for real, ``ais`` ones through the SDK."""

    def __init__(self, client, cluster: EtlCluster, folder: Path):
        self.client, self.cluster, self.folder = client, cluster, folder
        self.env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "AIS_ENDPOINT": cluster.url,
                    "HOME": str(folder)}

    def run(self, command: str, spec: Path | None = None) -> subprocess.CompletedProcess | object:
        words = shlex.split(command)
        if words[0] == "ais":
            return self.ais(words[1:], spec)
        assert words[0] in ("curl", "wds-transform"), f"a docs/deploy.md command this test does not know: {command}"
        done = subprocess.run(["bash", "-c", command], cwd=self.folder, env=self.env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        return done

    def ais(self, args: list[str], spec: Path | None):
        from aistore.sdk.etl import ETLConfig

        client = self.client
        match args:
            case ["bucket", "create", uri]:
                return client.bucket(bucket_of(uri)).create()
            case ["put", path, uri]:
                return client.bucket(bucket_of(uri)).object(Path(path).name).get_writer().put_file(self.folder / path)
            case ["etl", "init", "-f", path]:
                message = yaml.safe_load((spec or REPO / path).read_text())
                if REAL_KUBERNETES:  # the spec's 8 CPUs and 8 GiB per pod, two pods per ETL, two ETLs at once on
                    # a 2-CPU, 24 GB node: the second ETL's pods would stay Pending until init_timeout
                    message["resources"] = {kind: {**values, "cpu": "500m", "memory": "2Gi"}
                                            for kind, values in message["resources"].items()}
                return client.etl(message["name"])._client.request("PUT", path="etl", json=message, timeout=600)
            case ["etl", "show"]:
                return {info.id: info.stage for info in client.cluster().list_etls()}
            case ["etl", "object", etl, uri, out]:
                name = uri.split("/", 3)[3]
                data = client.bucket(bucket_of(uri)).object(name).get_reader(etl=ETLConfig(etl)).read_all()
                (self.folder / out).write_bytes(data)
                return data
            case ["etl", "bucket", etl, source, destination, "--wait"]:
                job = client.bucket(bucket_of(source)).transform(etl, to_bck=client.bucket(bucket_of(destination)))
                return client.job(job, job_kind="etl-bck").wait(timeout=300, verbose=False)
            case ["ls", uri]:
                return sorted(entry.name for entry in client.bucket(bucket_of(uri)).list_all_objects())
        pytest.fail(f"a docs/deploy.md command with no SDK equivalent in this test: ais {' '.join(args)}")


@pytest.fixture(scope="module")
def deployed(etl_client, etl_cluster: EtlCluster, tmp_path_factory: pytest.TempPathFactory):
    """Sections 2 and 3 of Deploy, in order, from an empty cluster."""
    deploy = Deploy(etl_client, etl_cluster, tmp_path_factory.mktemp("readme-deploy"))
    results = {}
    for command in section_commands("## 2. Register the ETL with AIS"):
        if command.startswith("export AIS_ENDPOINT="):
            continue  # the cluster's own address is in deploy.env
        results[command] = deploy.run(command)
    for command in section_commands("## 3. Read shards through it"):
        results[command] = deploy.run(command)
    yield deploy, results
    unregister(etl_client, ETL)


def result(results: dict, start: str):
    return next(value for command, value in results.items() if command.startswith(start))


def test_deploy_ends_with_a_whole_shard_on_disk_and_an_offline_copy_listed(deployed) -> None:
    deploy, results = deployed
    assert result(results, "ais etl show")[ETL] == "Running"
    inspect = result(results, "wds-transform inspect out.tar")
    assert "whole: the end marker matches" in inspect.stdout
    with tarfile.open(deploy.folder / "out.tar") as archive:
        names = archive.getnames()
    assert sum(name.endswith(".npy") for name in names) == 100 and names[-1] == "__etl__/end.json"
    assert result(results, "ais etl bucket").success
    assert result(results, "ais ls ais://shards-npy") == ["demo-000000.tar", "demo-000001.tar"]


def test_curl_without_L_saves_the_redirect_page(deployed) -> None:
    deploy, _ = deployed
    (curl,) = [c for c in section_commands("## 3. Read shards through it") if c.startswith("curl")]
    assert " -fsSL " in curl
    deploy.run(curl.replace(" -fsSL ", " -fsS ").replace("-o out.tar", "-o moved.tar"))
    page = (deploy.folder / "moved.tar").read_bytes()
    assert len(page) < 1000 and b"Moved Permanently" in page, page[:300]


def test_troubleshooting_a_bad_setting_names_it_then_rm_and_init(deployed, etl_client, tmp_path: Path) -> None:
    deploy, _ = deployed
    spec = yaml.safe_load((REPO / "k8s/etl-spec.yaml").read_text())
    spec["name"] = "wds-bad-setting"
    for entry in spec["runtime"]["env"]:
        if entry["name"] == "ETL_DTYPE":
            entry["value"] = "float64"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec))
    from aistore.sdk.errors import AISError

    with pytest.raises(AISError) as caught:
        deploy.run(f"ais etl init -f {bad}", spec=bad)
    message = caught.value.message
    assert "ETL init failed" in message or "pod_status" in message, message
    assert "invalid setting ETL_DTYPE" in message and "exitCode: 2" in message, message
    assert stage(etl_client, "wds-bad-setting") == "Aborted"
    etl_client.etl("wds-bad-setting").delete()  # ais etl rm wds-bad-setting
    spec["runtime"]["env"] = [e for e in spec["runtime"]["env"] if e["name"] != "ETL_DTYPE"]
    bad.write_text(yaml.safe_dump(spec))
    deploy.run(f"ais etl init -f {bad}", spec=bad)
    assert stage(etl_client, "wds-bad-setting") == "Running"
    etl_client.etl("wds-bad-setting").delete()


def test_troubleshooting_an_aborted_etl(deployed, etl_client, etl_cluster: EtlCluster) -> None:
    """The Aborted row: show errors and view-logs answer not found; the job says why; start brings it back,
    as a new run that has recorded no error yet."""
    from aistore.sdk.errors import AISError
    from aistore.sdk.etl import ETLConfig

    with pytest.raises(AISError) as missing:  # an inline read of no object: an error of this run
        etl_client.bucket("shards").object("no-such-shard.tar").get_reader(etl=ETLConfig(ETL)).read_all()
    assert missing.value.status_code == 404, missing.value
    recorded = [(e.obj_name, e.msg) for e in etl_client.etl(ETL).view().obj_errors or []]
    assert ("ais://shards/no-such-shard.tar", "object not found") in recorded, recorded
    job = next(info.xaction_id for info in etl_client.cluster().list_etls() if info.id == ETL)
    etl_cluster.kube.oom_kill(running_pods(etl_cluster, ETL)[0])
    wait_stage(etl_client, ETL, "Aborted")
    for call in (lambda: etl_client.etl(ETL).view(), lambda: etl_client.etl(ETL).logs()):
        with pytest.raises(AISError) as caught:
            call()
        assert caught.value.status_code == 404, caught.value
    # ais show job <job id> --all
    details = etl_client.job(job).get_details()
    reasons = " ".join(snap.abort_err for snaps in details.root.values() for snap in snaps)
    assert "OOMKilled" in reasons and "exitCode: 137" in reasons, reasons
    etl_client.etl(ETL).start()  # ais etl start wds-transform
    assert stage(etl_client, ETL) == "Running" and len(running_pods(etl_cluster, ETL)) == 2
    details = etl_client.etl(ETL).view()  # ais etl show errors wds-transform: answers again
    assert details.init_msg.name == ETL and not details.obj_errors, details.obj_errors
