"""Security: FQN confinement, no open proxy, no code from the request, hostile ws peers.

The pod's NodePort is reachable from the node network, so every request is treated as hostile:
``etl_fqn`` may only name an object file under the AIS mountpath layout (and ``ETL_FQN_ROOTS``),
hpull fetches only ``AIS_TARGET_URL/<one escaped segment>``, and nothing in the spec path evaluates,
unpickles or imports what a request says.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from testbed import inputs
from testbed.fake_ais import AisDisk, FakeTarget, go_path_escape
from testbed.service import Service
from testbed.shardgen import make_tar, read_tar
from tests.contract.harness import escaped_uname, fqn_query

PACKAGE = Path(__file__).resolve().parents[2] / "transformer"


# ------------------------------------------------------------------------------------- etl_fqn


def test_fqn_without_the_ais_layout_is_403(client: httpx.Client, disk: AisDisk, still_serving: Service) -> None:
    plain = disk.root / "plain" / "shard.tar"  # under the allowed root, but no @provider/bucket/%ob
    plain.parent.mkdir(parents=True, exist_ok=True)
    plain.write_bytes(make_tar(inputs.good_members(1)))
    response = client.put(f"/train/shard.tar?{fqn_query(str(plain))}", content=b"")
    assert response.status_code == 403
    assert "does not have the AIS layout" in response.text


def test_fqn_outside_the_roots_is_403(client: httpx.Client, tmp_path: Path, still_serving: Service) -> None:
    outside = AisDisk(tmp_path).put("train", "elsewhere.tar", make_tar(inputs.good_members(1)))  # perfect layout
    response = client.put(f"/train/elsewhere.tar?{fqn_query(outside)}", content=b"")
    assert response.status_code == 403
    assert "outside the allowed roots (ETL_FQN_ROOTS)" in response.text


def test_fqn_dot_dot_cannot_leave_the_roots(client: httpx.Client, disk: AisDisk, still_serving: Service) -> None:
    sneaky = disk.fqn("train", "../" * 12 + "etc/passwd")
    response = client.put(f"/train/x?{fqn_query(sneaky)}", content=b"")
    assert response.status_code == 403, response.text
    assert "root:" not in response.text


def test_fqn_symlink_out_of_the_roots_is_403(client: httpx.Client, disk: AisDisk, tmp_path: Path,
                                             still_serving: Service) -> None:
    secret = tmp_path / "secret.tar"
    secret.write_bytes(make_tar([("token.txt", b"do not read")]))
    link = Path(disk.fqn("train", "link.tar"))
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(secret)
    response = client.put(f"/train/link.tar?{fqn_query(str(link))}", content=b"")
    assert response.status_code == 403
    assert b"do not read" not in response.content


def test_relative_or_missing_fqn(client: httpx.Client, disk: AisDisk, still_serving: Service) -> None:
    relative = client.put(f"/train/r.tar?{fqn_query('mp1/@ais/train/%ob/r.tar')}", content=b"")
    assert relative.status_code == 400 and "not an absolute path" in relative.text
    missing = client.put(f"/train/gone.tar?{fqn_query(disk.fqn('train', 'gone.tar'))}", content=b"")
    assert missing.status_code == 404 and "no such object file" in missing.text


# --------------------------------------------------------------------------------- no open proxy


def test_hpull_fetches_only_from_ais_target_url(client: httpx.Client, target: FakeTarget,
                                                still_serving: Service) -> None:
    target.objects["ais/@#/src/a.tar"] = make_tar(inputs.good_members(1))
    response = client.get(f"/{escaped_uname('src', 'a.tar')}")
    assert response.status_code == 200
    (fetch,) = target.recorded("GET")
    assert fetch.raw_path == f"{target.etl_path}/{escaped_uname('src', 'a.tar')}"


def test_hpull_path_that_looks_like_a_url_still_goes_to_the_target(client: httpx.Client, target: FakeTarget,
                                                                   still_serving: Service) -> None:
    raw = go_path_escape("http://169.254.169.254/latest/meta-data")  # one escaped segment
    response = client.get(f"/{raw}")
    assert response.status_code in (404, 502)
    (fetch,) = target.recorded("GET")  # the fake target got it: the host never changes
    assert fetch.raw_path == f"{target.etl_path}/{raw}"


@pytest.mark.parametrize("path", ["/ais/@%23/src/a.tar", "/v1/etl/_object/wds-etl", "/x/y"])
def test_hpull_path_of_several_segments_is_refused(path: str, client: httpx.Client, target: FakeTarget,
                                                   still_serving: Service) -> None:
    # Several segments could walk the fetch to another target endpoint, with our ETL secret in the URL.
    response = client.get(path)
    assert response.status_code == 400
    assert "is not one escaped uname segment" in response.text
    assert target.recorded() == []


# ------------------------------------------------------------------------------ nothing executable


def test_yaml_tags_in_a_transforms_string_are_not_constructed(client: httpx.Client, tmp_path: Path,
                                                              still_serving: Service) -> None:
    marker = tmp_path / "pwned"
    payload = {"transforms": f'!!python/object/apply:os.system ["touch {marker}"]'}
    response = client.put("/train/y.tar", content=make_tar(inputs.good_members(1)),
                          params={"etl_args": json.dumps(payload)})
    assert response.status_code == 400
    assert response.text.startswith("invalid etl_args field 'transforms'")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["Compose", "Lambda", "__class__", "torchvision.transforms.v2.Lambda",
                                  "ToTensor", "eval"])
def test_only_allow_listed_transform_names_resolve(name: str, client: httpx.Client, still_serving: Service) -> None:
    response = client.put("/train/n.tar", content=make_tar(inputs.good_members(1)),
                          params={"etl_args": json.dumps({"transforms": [name]})})
    assert response.status_code == 400
    assert "is not allowed" in response.text


FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "import_module", "getattr_static"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "importlib", "joblib"}
SAFE_IMPORTLIB = {"resources", "metadata"}
# Pickle only between the server process and the worker processes it started, and between those workers,
# over socketpairs the server made and no other process holds (a shard's options, its samples' descriptions,
# its report, its error); multiprocessing pickles a Process's arguments the same way. Nothing from a request
# or a shard is ever unpickled.
PRIVATE_PICKLE = {"server/processes.py", "server/remote.py", "server/worker.py", "server/links.py", "server/ipc.py"}


def _source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_eval_pickle_or_dynamic_import_in_the_package(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    forbidden = FORBIDDEN_MODULES - ({"pickle"} if str(path.relative_to(PACKAGE)) in PRIVATE_PICKLE else set())
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & forbidden, where
        elif isinstance(node, ast.ImportFrom):
            if node.module == "importlib" and {a.name for a in node.names} <= SAFE_IMPORTLIB:
                continue  # reading packaged data files is not importing code by name
            assert (node.module or "").split(".")[0] not in forbidden, where
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            banned = FORBIDDEN_CALLS if isinstance(func, ast.Name) else FORBIDDEN_CALLS - {"compile"}  # re.compile
            assert name not in banned, f"{where}: {name}()"
            if name == "load" and isinstance(func, ast.Attribute):
                owner = ast.unparse(func.value)
                assert owner not in ("torch", "yaml", "pickle"), f"{where}: {owner}.load (unpickles / unsafe tags)"
                if owner in ("np", "numpy"):
                    flags = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    assert flags.get("allow_pickle") == "False", f"{where}: np.load without allow_pickle=False"


def test_the_transform_allow_list_is_a_fixed_table_of_torchvision_classes() -> None:
    from torchvision.transforms import v2

    from transformer.spec import ALLOWED

    for name, cls in ALLOWED.items():
        assert getattr(v2, name) is cls and isinstance(cls, type) and issubclass(cls, v2.Transform)
    assert not {"Lambda", "Compose", "RandomApply", "RandomChoice", "RandomOrder"} & set(ALLOWED)


# ----------------------------------------------------------------------------------- ws peers


def _ws(service: Service):
    return connect(f"ws://127.0.0.1:{service.port}/ws", max_size=None, compression=None, open_timeout=10,
                   close_timeout=5)


def test_ws_content_frame_without_a_control_message_closes_1003(still_serving: Service) -> None:
    shard = make_tar(inputs.good_members(1))
    with _ws(still_serving) as ws:
        ws.send(shard)  # raw tar bytes where the JSON control message belongs
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd.code == 1003
    assert "control message" in closed.value.rcvd.reason
    with _ws(still_serving) as ws:  # a well-behaved peer is served right after
        ws.send(json.dumps({"path": "ok.tar"}).encode())
        ws.send(shard)
        assert [n for n, _ in read_tar(ws.recv(timeout=30))] == ["s00000.npy", "s00000.cls"]


def test_ws_fqn_outside_the_roots_is_a_binary_403_reply(still_serving: Service, tmp_path: Path) -> None:
    outside = AisDisk(tmp_path).put("train", "w.tar", make_tar(inputs.good_members(1)))
    with _ws(still_serving) as ws:
        ws.send(json.dumps({"path": "w.tar", "fqn": go_path_escape(outside)}).encode())
        reply = ws.recv(timeout=10)
        assert isinstance(reply, bytes), f"an error became a Text reply: {reply!r}"
        error = json.loads(reply)
        assert error["status"] == 403 and "is outside the allowed" in error["message"]
        ws.send(json.dumps({"path": "ok.tar"}).encode())  # the same connection serves the next request
        ws.send(make_tar(inputs.good_members(1)))
        assert [n for n, _ in read_tar(ws.recv(timeout=30))] == ["s00000.npy", "s00000.cls"]


def test_ws_text_frame_with_garbage_closes_1003(still_serving: Service) -> None:
    with _ws(still_serving) as ws:
        ws.send("\x00\xff not json")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd.code == 1003

