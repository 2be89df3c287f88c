"""A fake Kubernetes API and kubelet: just what AIS 5.0's targets call to run an ETL.

Its pods run as processes or containers (``testbed/pods.py``).

aisnode (``github.com/NVIDIA/aistore`` v1.5.0, built with ``-tags etl``) drives each ETL pod through
client-go (v0.35). These are the calls it makes, and so everything this server answers; any other
request gets a ``404`` Status and is recorded in ``FakeKubernetes.unexpected`` (the fixture fails on it):

=================================================================  =============================================
request                                                            AIS source (module v1.5.0)
=================================================================  =============================================
``GET  /api/v1/namespaces/{ns}/pods/{name}``                        ``ext/etl/boot.go`` (the target's own pod,
                                                                   ``$MY_POD``: its volumes are copied into the
                                                                   ETL pod; the ETL pod's ``hostIP``),
                                                                   ``ext/etl/transform.go`` ``checkPodReady``,
                                                                   ``cmn/k8s/client.go`` ``Health``
``GET  /api/v1/namespaces/{ns}/pods?fieldSelector=metadata.name=X`` ``cmn/k8s/client.go`` ``CheckExists`` (wait
                                                                   until a deleted pod is gone)
``GET  ...pods?fieldSelector=metadata.name=X&watch=true``           ``ext/etl/pod_watcher.go`` (a terminated
                                                                   container aborts the ETL)
``POST /api/v1/namespaces/{ns}/services``, ``.../pods``             ``ext/etl/boot.go`` ``createEntity``
``GET  /api/v1/namespaces/{ns}/services/{name}``                    ``ext/etl/boot.go`` ``_getPort`` (nodePort)
``GET  /api/v1/namespaces/{ns}/services?fieldSelector=...``         ``cmn/k8s/client.go`` ``CheckExists``
``DELETE .../services/{name}``, ``.../pods/{name}``                 ``ext/etl/transform.go`` ``CleanupEntities``
                                                                   (before a start, on stop and delete)
``GET  /api/v1/namespaces/{ns}/pods/{name}/log``                    ``cmn/k8s/client.go`` ``Logs`` (``ais etl
                                                                   view-logs``)
``GET  /apis/metrics.k8s.io/v1beta1/namespaces/{ns}/pods/{name}``   ``cmn/k8s/metrics.go`` (``ais etl metrics``)
``GET  /apis/metrics.k8s.io/v1beta1/pods``                          ``cmn/k8s/client.go``
                                                                   ``CheckMetricsAvailability``
=================================================================  =============================================

Wire format: client-go's typed clients send ``Accept: application/vnd.kubernetes.protobuf,application/json``
and protobuf request bodies (``k8s\\0`` + ``runtime.Unknown``); this server reads the Pod and Service
fields AIS writes (field numbers from ``k8s.io/api/core/v1/generated.proto``) and answers JSON, which
client-go accepts, watch streams included. The API is served over https with a throw-away CA, which
aisnode trusts through the service-account ``ca.crt`` (``rest.InClusterConfig``).

The kubelet: a pod is scheduled on the node its required node affinity names (AIS sets
``kubernetes.io/hostname In [$MY_NODE]``), so its ``status.hostIP`` is that node's address; its
container runs (a local process of this venv, or a podman container of the image: ``pods.py``) with
the container's environment, listening on hostIP and the NodePort of the service that selects it
(``serve --host --port``; there is no kube-proxy: the container listens on the node port itself, in the
test's network namespace), its ``hostPath`` volumes, its output as the pod's log, and it becomes
``Ready`` once ``GET /health`` on its port answers ``200`` (probed every 0.2 s, where Kubernetes
would use the probe's period, 10 s). When the container exits, it is reported terminated with its
exit code, reason (``Completed``, ``Error``, or ``OOMKilled`` after ``oom_kill``) and termination
message: the file the container wrote at its termination-message path or, under
``terminationMessagePolicy: FallbackToLogsOnError`` (which AIS sets) and a failure, the end of its
log (80 lines, 2048 bytes at most), as the kubelet does. Pods are not restarted. Not modelled:
scheduling on resources, image pulls, resource limits, restarts, probes other than ``/health``, and
the NodePort proxy. ``make test-k8s`` runs the same suite on a real Kubernetes (``testbed/k8s/``);
docs/kubernetes.md says where the two agree and where they do not.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from .kube_protobuf import POD, SERVICE, decode_body
from .pods import Container, PodRuntime

# --- objects ---------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, reason: str, message: str, kind: str = "", name: str = "") -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": {"name": name, "kind": kind}, "code": code}


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float) -> object:
    """``predicate()``'s first true value, asked every ``interval`` s; a TimeoutError naming ``what`` after that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f} s")
        time.sleep(interval)


@dataclass
class Pod:
    """One pod: its object as the API shows it, and, once scheduled, the container that runs it."""

    obj: dict
    static: bool = False  # the AIS nodes' own pods: shown, never run
    folder: Path | None = None
    container: Container | None = None
    runtime: str = ""  # "process" or "container": how it ran
    user: tuple[int, int] | None = None  # (uid, gid) its main process ran as, once ready
    port: int = 0
    host: str = ""
    oom: bool = False
    deleted: bool = False

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]

    @property
    def log(self) -> Path | None:
        return self.folder / "log" if self.folder else None

    @property
    def termination_log(self) -> Path | None:
        return self.folder / "termination-log" if self.folder else None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.is_file() else ""

    @property
    def running(self) -> bool:
        """Its container is running (started, not yet exited)."""
        return self.container is not None and self.container.process.poll() is None

    @property
    def pid(self) -> int:
        """The host pid of the container's main process (for its CPU and memory)."""
        return self.container.pid


@dataclass
class FakeKubernetes:
    """The API server (``start``) and the kubelet of every node. ``nodes``: node name -> host IP.

    ``runtime`` runs each pod's container (``pods.ProcessRuntime`` or ``pods.ContainerRuntime``);
    ``runtimes`` names another for the pods of some images (a benchmark runs both side by side).
    """

    root: Path
    nodes: dict[str, str]
    runtime: PodRuntime
    runtimes: dict[str, PodRuntime] = field(default_factory=dict)  # image name -> its runtime, if not ``runtime``
    namespace: str = "default"
    ready_interval: float = 0.2
    pods: dict[str, Pod] = field(default_factory=dict)
    started: list[Pod] = field(default_factory=list)  # every pod whose container started, deleted ones too
    services: dict[str, dict] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _version: int = 1
    _server: ThreadingHTTPServer | None = None
    _closing: bool = False
    _used_ports: set[int] = field(default_factory=set)
    _events: list[tuple[str, dict]] = field(default_factory=list)  # every pod change, for the watches

    # -- the API server ---------------------------------------------------------------------------------

    def start(self, cert: Path, key: Path, host: str = "127.0.0.1") -> int:
        """Serve https on ``host`` (a free port, returned)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        fake = self

        class Handler(_Handler):
            kube = fake

        self._server = _Server((host, 0), Handler)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(target=self._server.serve_forever, name="fake-kube-api", daemon=True).start()
        return self._server.server_address[1]

    def stop(self) -> None:
        """Kill every pod still running, end the watches, stop serving."""
        with self._lock:
            self._closing = True
            pods = list(self.pods.values())
            self._lock.notify_all()
        for pod in pods:
            self._kill(pod, grace=2.0)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def add_static_pod(self, name: str, node: str, volumes: list[tuple[str, str]]) -> None:
        """An AIS node's own pod (``$MY_POD``): one container whose mounts the ETL pods copy."""
        obj = {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": self.namespace, "labels": {"app": "ais"}},
            "spec": {"containers": [{"name": "ais-node", "image": "aistore/aisnode:v1.5.0",
                                     "volumeMounts": [{"name": n, "mountPath": p} for n, p in volumes]}],
                     "volumes": [{"name": n, "hostPath": {"path": p}} for n, p in volumes], "nodeName": node},
            "status": {"phase": "Running", "hostIP": self.nodes[node], "podIP": self.nodes[node],
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }
        with self._lock:
            self._stamp(obj)
            self.pods[name] = Pod(obj, static=True)

    def etl_pods(self) -> list[Pod]:
        with self._lock:
            return [pod for pod in self.pods.values() if not pod.static]

    def pods_of(self, etl: str) -> list[Pod]:
        """The running ETL pods of ``etl`` (AIS names them ``<etl>-<target id>``)."""
        return [pod for pod in self.etl_pods() if pod.name.startswith(f"{etl}-")]

    def wait(self, predicate: Callable[[], object], timeout: float, what: str) -> object:
        return wait_until(predicate, timeout, f"fake Kubernetes: {what}", 0.05)

    # -- state changes (under the lock) ----------------------------------------------------------------

    def _stamp(self, obj: dict) -> None:
        self._version += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self._version)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta.setdefault("namespace", self.namespace)

    def _changed(self, pod: Pod, kind: str = "MODIFIED") -> None:
        self._stamp(pod.obj)
        self._events.append((kind, json.loads(json.dumps(pod.obj))))
        self._lock.notify_all()

    def _free_port(self, host: str) -> int:
        """A node port from Kubernetes' range, 30000-32767: below Linux's ephemeral ports (32768-60999), so no
        outgoing connection takes it between its allocation and the pod's bind, as one from port 0 could."""
        for port in range(30000, 32768):
            if port in self._used_ports:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            self._used_ports.add(port)
            return port
        raise RuntimeError("fake Kubernetes: no free node port in 30000-32767")

    def create_service(self, obj: dict) -> tuple[int, dict]:
        name = obj.get("metadata", {}).get("name", "")
        with self._lock:
            if name in self.services:
                return 409, status_body(409, "AlreadyExists", f'services "{name}" already exists', "services", name)
            obj = {"kind": "Service", "apiVersion": "v1", **obj}
            spec = obj.setdefault("spec", {})
            host = next(iter(self.nodes.values()))
            for port in spec.get("ports", []):
                if spec.get("type") == "NodePort" and not port.get("nodePort"):
                    port["nodePort"] = self._free_port(host)
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
            spec["clusterIP"] = "10.96.0.10"
            self._stamp(obj)
            self.services[name] = obj
            return 201, obj

    def create_pod(self, obj: dict) -> tuple[int, dict]:
        name = obj.get("metadata", {}).get("name", "")
        with self._lock:
            if name in self.pods:
                return 409, status_body(409, "AlreadyExists", f'pods "{name}" already exists', "pods", name)
            obj = {"kind": "Pod", "apiVersion": "v1", **obj}
            obj["status"] = {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False"}, {"type": "Ready", "status": "False"}]}
            pod = Pod(obj)
            self._stamp(obj)
            self.pods[name] = pod
            self._changed(pod, "ADDED")
        threading.Thread(target=self._kubelet, args=(pod,), name=f"kubelet-{name}", daemon=True).start()
        return 201, obj

    def delete(self, kind: str, name: str) -> tuple[int, dict]:
        with self._lock:
            store = self.pods if kind == "pods" else self.services
            obj = store.get(name)
            if obj is None or (kind == "pods" and obj.static):
                return 404, status_body(404, "NotFound", f'{kind} "{name}" not found', kind, name)
            del store[name]
            if kind == "services":
                self._stamp(obj)
                return 200, obj
            obj.deleted = True
            self._changed(obj, "DELETED")
        self._kill(obj, grace=0.0)  # AIS deletes with a grace period of 0
        return 200, obj.obj

    def _kill(self, pod: Pod, grace: float) -> None:
        if pod.container is not None:
            pod.container.stop(grace)

    def oom_kill(self, pod: Pod) -> None:
        """Kill the pod's process as the kernel's OOM killer would (reason ``OOMKilled``, exit 137)."""
        pod.oom = True
        self.kill(pod)

    def kill(self, pod: Pod) -> None:
        """SIGKILL the pod's container, as a node that loses it would (reason ``Error``, exit 137)."""
        pod.container.signal(signal.SIGKILL)

    def running_pods(self, etl: str | None = None) -> list[Pod]:
        """The ETL pods (of ``etl``, if given) whose container is running now."""
        return [pod for pod in (self.pods_of(etl) if etl else self.etl_pods()) if pod.running]

    # -- the kubelet -----------------------------------------------------------------------------------

    def _node_of(self, obj: dict) -> str | None:
        terms = (obj.get("spec", {}).get("affinity", {}).get("nodeAffinity", {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))
        for term in terms:
            for req in term.get("matchExpressions", []):
                if req.get("key") == "kubernetes.io/hostname" and req.get("operator") == "In":
                    for node in req.get("values", []):
                        if node in self.nodes:
                            return node
        return None if terms else next(iter(self.nodes))

    def _service_port(self, obj: dict) -> int:
        labels = obj["metadata"].get("labels", {})
        for service in self.services.values():
            selector = service["spec"].get("selector") or {}
            if selector and all(labels.get(k) == v for k, v in selector.items()):
                return service["spec"]["ports"][0]["nodePort"]
        return 0

    def _kubelet(self, pod: Pod) -> None:
        with self._lock:
            node = self._node_of(pod.obj)
            if node is None or pod.deleted:
                pod.obj["status"]["conditions"][0].update(reason="Unschedulable",
                                                           message="no node matches the pod's node affinity")
                self._changed(pod)
                return
            pod.host = self.nodes[node]
            pod.port = self._service_port(pod.obj)
            container = pod.obj["spec"]["containers"][0]
            pod.obj["spec"]["nodeName"] = node
            pod.obj["status"].update(hostIP=pod.host, podIP=pod.host, startTime=_now())
            pod.obj["status"]["conditions"][0]["status"] = "True"
            pod.folder = self.root / "pods" / pod.name / pod.obj["metadata"]["uid"]
            pod.folder.mkdir(parents=True)
            env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
            runtime = self.runtimes.get(container.get("image", ""), self.runtime)
            pod.container = runtime.start(
                pod.name, container.get("image", ""), container.get("command") or [], container.get("args") or [],
                env, self._mounts(pod.obj["spec"], container), pod.termination_log, pod.log, pod.folder,
                (pod.host, pod.port))
            pod.runtime = runtime.kind
            self.started.append(pod)
            pod.obj["status"]["phase"] = "Running"
            pod.obj["status"]["containerStatuses"] = [{
                "name": container.get("name", ""), "image": container.get("image", ""), "ready": False,
                "restartCount": 0, "started": True, "state": {"running": {"startedAt": _now()}}}]
            self._changed(pod)
        ready = False
        while pod.running and not pod.deleted and not self._closing:
            if not ready and self._healthy(pod):
                ready = True
                pod.user = _ids(pod.pid)
                with self._lock:
                    pod.obj["status"]["conditions"][1]["status"] = "True"
                    pod.obj["status"]["containerStatuses"][0]["ready"] = True
                    self._changed(pod)
            time.sleep(self.ready_interval)
        code = pod.container.process.wait()
        with self._lock:
            if pod.deleted or self._closing:
                return
            self._terminated(pod, container, code)

    @staticmethod
    def _mounts(spec: dict, container: dict) -> list[tuple[str, str, bool]]:
        """(host path, mount path, read-only) of each ``hostPath`` volume the container mounts."""
        paths = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", []) if v.get("hostPath", {}).get("path")}
        return [(paths[m["name"]], m["mountPath"], bool(m.get("readOnly"))) for m in container.get("volumeMounts", [])
                if m.get("name") in paths]

    def _healthy(self, pod: Pod) -> bool:
        try:
            with socket.create_connection((pod.host, pod.port), timeout=1) as sock:
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: {pod.host}:{pod.port}\r\nConnection: close\r\n\r\n"
                             .encode())
                return sock.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            return False

    def _terminated(self, pod: Pod, container: dict, code: int) -> None:
        exit_code = 128 - code if code < 0 else code  # a signal, as a container runtime reports it
        reason = "OOMKilled" if pod.oom else ("Completed" if exit_code == 0 else "Error")
        message = ""
        if pod.termination_log.is_file():
            message = pod.termination_log.read_text(errors="replace")[-4096:]
        if not message and exit_code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = "\n".join(pod.log_text().splitlines()[-80:])[-2048:]
        status = pod.obj["status"]
        status["conditions"][1]["status"] = "False"
        status["containerStatuses"][0].update(ready=False, started=False, state={"terminated": {
            "exitCode": exit_code, "reason": reason, "message": message,
            "startedAt": status["containerStatuses"][0]["state"].get("running", {}).get("startedAt", _now()),
            "finishedAt": _now()}})
        if pod.obj["spec"].get("restartPolicy") in ("Never", "OnFailure") and (exit_code or reason != "Completed"):
            status["phase"] = "Failed"
        self._changed(pod)

    # -- watches ---------------------------------------------------------------------------------------

    def watch(self, name: str) -> Iterator[tuple[str, dict]]:
        """Events for pod ``name``: ADDED for the pod as it is now, then each change, until closed."""
        with self._lock:
            start = len(self._events)
            pod = self.pods.get(name)
            current = json.loads(json.dumps(pod.obj)) if pod is not None else None
        if current is not None:
            yield "ADDED", current
        seen = start
        while True:
            with self._lock:
                while seen == len(self._events) and not self._closing:
                    self._lock.wait(timeout=30)
                if self._closing:
                    return
                batch = self._events[seen:]
                seen = len(self._events)
            for kind, obj in batch:
                if obj["metadata"]["name"] == name:
                    yield kind, obj


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up (a watch AIS stops) is no error


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    kube: FakeKubernetes

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, code: int, body: dict | str, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> tuple[list[str], dict[str, list[str]]]:
        url = urlsplit(self.path)
        self.kube.requests.append(f"{self.command} {url.path}")
        return [p for p in url.path.split("/") if p], parse_qs(url.query)

    def _unexpected(self) -> None:
        self.kube.unexpected.append(f"{self.command} {self.path}")
        self._send(404, status_body(404, "NotFound", f"the fake Kubernetes API does not serve {self.path}"))

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        parts, query = self._route()
        kube = self.kube
        if parts[:2] == ["apis", "metrics.k8s.io"]:
            return self._metrics(parts)
        if len(parts) < 5 or parts[:4] != ["api", "v1", "namespaces", kube.namespace]:
            return self._unexpected()
        kind, rest = parts[4], parts[5:]
        if kind not in ("pods", "services"):
            return self._unexpected()
        if not rest:
            selector = query.get("fieldSelector", [""])[0]
            name = selector.split("=", 1)[1] if selector.startswith("metadata.name=") else None
            if query.get("watch", [""])[0] in ("true", "1"):
                return self._watch(name) if kind == "pods" and name else self._unexpected()
            with kube._lock:
                store = kube.pods if kind == "pods" else kube.services
                items = [(p.obj if kind == "pods" else p) for n, p in store.items() if name in (None, n)]
                body = {"kind": "PodList" if kind == "pods" else "ServiceList", "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(kube._version)}, "items": items}
                return self._send(200, body)
        with kube._lock:
            store = kube.pods if kind == "pods" else kube.services
            found = store.get(rest[0])
            if found is None:
                return self._send(404, status_body(404, "NotFound", f'{kind} "{rest[0]}" not found', kind, rest[0]))
            if len(rest) == 1:
                return self._send(200, found.obj if kind == "pods" else found)
        if kind == "pods" and rest[1:] == ["log"]:
            return self._send(200, found.log_text(), "text/plain")
        return self._unexpected()

    def _watch(self, name: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        try:
            for kind, obj in self.kube.watch(name):
                line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        self.close_connection = True

    def _metrics(self, parts: list[str]) -> None:
        if parts[2:] == ["v1beta1", "pods"]:
            return self._send(200, {"kind": "PodMetricsList", "apiVersion": "metrics.k8s.io/v1beta1", "items": []})
        if len(parts) == 7 and parts[2:4] == ["v1beta1", "namespaces"] and parts[5] == "pods":
            pod = self.kube.pods.get(parts[6])
            if pod is None or not pod.running:
                return self._send(404, status_body(404, "NotFound", f'podmetrics "{parts[6]}" not found'))
            cpu, memory = _usage(pod.pid)
            return self._send(200, {
                "kind": "PodMetrics", "apiVersion": "metrics.k8s.io/v1beta1",
                "metadata": {"name": pod.name, "namespace": self.kube.namespace}, "timestamp": _now(),
                "window": "10s", "containers": [{"name": pod.obj["spec"]["containers"][0].get("name", ""),
                                                 "usage": {"cpu": cpu, "memory": memory}}]})
        return self._unexpected()

    def do_POST(self) -> None:  # noqa: N802
        parts, _ = self._route()
        if len(parts) != 5 or parts[:4] != ["api", "v1", "namespaces", self.kube.namespace]:
            return self._unexpected()
        kind = parts[4]
        schema = {"pods": POD, "services": SERVICE}.get(kind)
        if schema is None:
            return self._unexpected()
        try:
            obj = decode_body(self._body(), self.headers.get("Content-Type", ""), schema)
        except (ValueError, IndexError) as exc:
            return self._send(400, status_body(400, "BadRequest", f"cannot decode the {kind} body: {exc}"))
        code, body = (self.kube.create_pod if kind == "pods" else self.kube.create_service)(obj)
        self._send(code, body)

    def do_DELETE(self) -> None:  # noqa: N802
        parts, _ = self._route()
        self._body()  # DeleteOptions: gracePeriodSeconds 0, as AIS always sends
        if len(parts) != 6 or parts[:4] != ["api", "v1", "namespaces", self.kube.namespace] \
                or parts[4] not in ("pods", "services"):
            return self._unexpected()
        self._send(*self.kube.delete(parts[4], parts[5]))


def _ids(pid: int) -> tuple[int, int] | None:
    """The effective uid and gid of a process."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(status["Uid"].split()[1]), int(status["Gid"].split()[1])
    except (OSError, KeyError, IndexError, ValueError):
        return None


def _usage(pid: int) -> tuple[str, str]:
    """CPU (cores, as nanocores averaged over the process's life) and resident memory of a process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu_seconds = (int(stat[11]) + int(stat[12])) / ticks
        started = int(stat[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        rss = int(stat[21]) * os.sysconf("SC_PAGE_SIZE")
        cores = cpu_seconds / max(uptime - started, 1e-3)
        return f"{int(cores * 1e9)}n", f"{rss // 1024}Ki"
    except (OSError, IndexError, ValueError):
        return "0", "0"
