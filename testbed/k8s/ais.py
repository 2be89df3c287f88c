"""AIS itself as pods on the two-node cluster, as the NVIDIA/ais-k8s operator renders an ``AIStore`` named ``ais``.

What is the operator's (``operator/internal/resources/aistore``):
- a ServiceAccount ``ais-sa`` with its Role (pods and services: get, list, watch, create, update, delete; pods/log:
  get) and RoleBinding: aisnode's Kubernetes client runs from inside the cluster with that token;
- ConfigMaps: the local-config template of each role and the cluster-config override (``ais-global-cm``: the
  primary's DNS URL, and what the spec's ``configToUpdate`` says);
- a headless Service per role (``publishNotReadyAddresses``) and a StatefulSet per role (parallel pod management):
  the init container ``populate-env`` runs ``aisinit``, which writes each pod's configs with its DNS names as the
  intra-cluster hostnames (``<pod>.<service>.<namespace>.svc.cluster.local``) and the node's address as its public
  one (hostPort); the main container runs ``aisnode`` with ``MY_NODE``, ``MY_POD`` and ``K8S_NS`` from the downward
  API, the operator's probes and security context; targets have a required pod anti-affinity on the hostname (one
  per node) and a ``hostPath`` mountpath.

What is fitted to this machine (the rest is the operator's defaults):
- ``configToUpdate``: disk-space watermarks near 100% and ``memsys.min_free`` of 512 MiB, since the disk and
  memory are shared with everything else on the machine; and a ``distributed_sort`` section, which the aisnode the
  project builds (with dSort) requires and ``aisinit``'s defaults leave out;
- the init container asks for 0.1 CPU and 64 MiB (the operator: 1 CPU and 1 GiB, a whole node's CPU here);
- the proxy is pinned to the control-plane node (a ``nodeSelector``), so losing node-1 loses a target, not the
  cluster's gateway;
- state and logs in emptyDir (the operator's ``stateStorage: emptyDir``).

``start_ais`` applies it all and waits until the proxy reports both targets joined; the returned ``AisCluster``
is what the real-ETL suite asks of a cluster (``testbed/etl_cluster.py``'s ``EtlCluster`` for the fake
Kubernetes): its URL, its daemons, where each target's mountpath lies on the host, the Kubernetes view.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..ais_view import AisView
from ..cluster import AisnodeUnavailable, cluster_config
from .build import KubernetesUnavailable
from .cluster import Cluster
from .kube import MainProcess, RealKubernetes
from .node import DISK
from .topology import API_URL, CONTROL_PLANE, DOMAIN

NAMESPACE = "ais"
NAME = "ais"  # the AIStore resource's name: every object's prefix
PORTS = {"proxy": 51080, "target": 51081}  # public, and the hostPort
CONTROL_PORT, DATA_PORT = 51082, 51083
MOUNTPATH = "/ais/mp1"
CONFIG_DIR, TEMPLATE_DIR, GLOBAL_DIR, STATE_DIR, LOGS_DIR = (
    "/var/ais_config", "/var/ais_config_template", "/var/global_config", "/etc/ais", "/var/log/ais")


def service(role: str) -> str:
    return f"{NAME}-{role}"


def pod_dns(pod: str, role: str) -> str:
    return f"{pod}.{service(role)}.{NAMESPACE}.svc.{DOMAIN}"


def primary_url() -> str:
    return f"http://{pod_dns(f'{NAME}-proxy-0', 'proxy')}:{CONTROL_PORT}"


def global_config() -> dict:
    """The operator's ``ConfigToSet``: the primary by DNS name, then ``configToUpdate``."""
    return {"proxy": {"primary_url": primary_url(), "original_url": primary_url(),
                      "discovery_url": f"http://{service('proxy')}.{NAMESPACE}.svc.{DOMAIN}:{CONTROL_PORT}"},
            **{key: cluster_config(primary_url())[key] for key in ("space", "distributed_sort")},
            "memsys": {"min_free": "512MiB"}}


def local_template(role: str) -> dict:
    template = {"confdir": STATE_DIR, "log_dir": LOGS_DIR,
                "host_net": {"hostname": "${AIS_PUBLIC_HOSTNAME}", "hostname_intra_control": "${AIS_INTRA_HOSTNAME}",
                             "hostname_intra_data": "${AIS_DATA_HOSTNAME}", "port": str(PORTS[role]),
                             "port_intra_control": str(CONTROL_PORT), "port_intra_data": str(DATA_PORT)},
                "fspaths": {}, "test_fspaths": {"root": "", "count": 0, "instance": 0}}
    if role == "target":
        template["fspaths"] = {MOUNTPATH: ""}
    return template


def _field(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _labels(role: str, selector: bool = False) -> dict:
    labels = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/component": role}
    return labels if selector else {**labels, "app": NAME, "component": role}


def statefulset(role: str, image: str, replicas: int) -> dict:
    common = [_field("MY_NODE", "spec.nodeName"), _field("MY_POD", "metadata.name"),
              _field("K8S_NS", "metadata.namespace")]
    init_env = [_field("HOST_IPS", "status.hostIPs"), {"name": "AIS_K8S_CLUSTER_DOMAIN", "value": DOMAIN},
                {"name": "ENABLE_EXTERNAL_ACCESS", "value": "false"}, *common,
                {"name": "MY_SERVICE", "value": service(role)}, _field("AIS_PUBLIC_HOSTNAME", "status.hostIP")]
    probe = {"httpGet": {"path": "/v1/health?readiness=true", "port": PORTS[role], "scheme": "HTTP"},
             "periodSeconds": 5, "timeoutSeconds": 5, "successThreshold": 1}
    restricted = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    mounts = [{"name": "config-mount", "mountPath": CONFIG_DIR},
              {"name": "logs-dir", "mountPath": LOGS_DIR, **({"subPathExpr": "$(MY_POD)"} if role == "target" else {})},
              {"name": "state-mount", "mountPath": STATE_DIR}]
    volumes = [{"name": "config-template", "configMap": {"name": service(role)}},
               {"name": "config-mount", "emptyDir": {}},
               {"name": "config-global", "configMap": {"name": f"{NAME}-global-cm"}},
               {"name": "logs-dir", "emptyDir": {}}, {"name": "state-mount", "emptyDir": {}}]
    spec: dict = {
        "serviceAccountName": f"{NAME}-sa",
        "securityContext": {"runAsNonRoot": False, "seccompProfile": {"type": "RuntimeDefault"}},
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": _labels(role, selector=True)},
             "topologyKey": "kubernetes.io/hostname"}]}},
        "initContainers": [{
            "name": "populate-env", "image": image, "imagePullPolicy": "Always", "command": ["aisinit"],
            "args": [f"-role={role}", f"-local_config_template={TEMPLATE_DIR}/ais_local.json",
                     f"-output_local_config={CONFIG_DIR}/ais_local.json",
                     f"-cluster_config_override={GLOBAL_DIR}/ais.json",
                     f"-output_cluster_config={CONFIG_DIR}/ais.json"],
            "env": init_env,
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}},
            "volumeMounts": [{"name": "config-template", "mountPath": TEMPLATE_DIR},
                             {"name": "config-mount", "mountPath": CONFIG_DIR},
                             {"name": "config-global", "mountPath": GLOBAL_DIR}],
            "securityContext": {**restricted, "readOnlyRootFilesystem": True}}],
        "containers": [{
            "name": "ais-node", "image": image, "imagePullPolicy": "Always", "command": ["aisnode"],
            "args": [f"-config={CONFIG_DIR}/ais.json", f"-local_config={CONFIG_DIR}/ais_local.json", f"-role={role}",
                     *(["-ntargets=2"] if role == "proxy" else [])],
            "env": common, "ports": [{"name": "http", "containerPort": PORTS[role], "hostPort": PORTS[role],
                                      "protocol": "TCP"}],
            "securityContext": restricted, "volumeMounts": mounts,
            "startupProbe": {**probe, "failureThreshold": 30},
            "livenessProbe": {**probe, "httpGet": {**probe["httpGet"], "path": "/v1/health"},
                              "initialDelaySeconds": 60, "failureThreshold": 10},
            "readinessProbe": {**probe, "failureThreshold": 5}}],
        "volumes": volumes,
    }
    if role == "target":
        spec["containers"][0]["volumeMounts"].append({"name": "host-data-mount-0", "mountPath": MOUNTPATH})
        spec["volumes"].append({"name": "host-data-mount-0",
                                "hostPath": {"path": f"{DISK}/mp1", "type": "DirectoryOrCreate"}})
    else:
        spec["nodeSelector"] = {"kubernetes.io/hostname": CONTROL_PLANE.name}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": service(role), "namespace": NAMESPACE, "labels": _labels(role)},
            "spec": {"selector": {"matchLabels": _labels(role, selector=True)}, "serviceName": service(role),
                     "podManagementPolicy": "Parallel", "replicas": replicas,
                     "updateStrategy": {"type": "OnDelete"},
                     "template": {"metadata": {"labels": _labels(role)}, "spec": spec}}}


def manifests(image: str) -> list[dict]:
    meta = {"namespace": NAMESPACE}
    objects: list[dict] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {**meta, "name": f"{NAME}-sa"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {**meta, "name": f"{NAME}-role"},
         "rules": [{"apiGroups": [""], "resources": ["pods", "services"],
                    "verbs": ["get", "list", "watch", "create", "update", "delete"]},
                   {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {**meta, "name": f"{NAME}-rb"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{NAME}-role"},
         "subjects": [{"kind": "ServiceAccount", "name": f"{NAME}-sa", "namespace": NAMESPACE}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{NAME}-global-cm"},
         "data": {"ais.json": json.dumps(global_config())}},
    ]
    for role, replicas in (("proxy", 1), ("target", 2)):
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": service(role)},
                        "data": {"ais_local.json": json.dumps(local_template(role))}})
        objects.append({"apiVersion": "v1", "kind": "Service",
                        "metadata": {**meta, "name": service(role), "labels": {"app.kubernetes.io/name": NAME}},
                        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                                 "selector": _labels(role, selector=True),
                                 "ports": [{"name": "pub", "port": PORTS[role], "targetPort": PORTS[role]},
                                           {"name": "control", "port": CONTROL_PORT, "targetPort": CONTROL_PORT},
                                           {"name": "data", "port": DATA_PORT, "targetPort": DATA_PORT}]}})
        objects.append(statefulset(role, image, replicas))
    return objects


@dataclass
class Daemon:
    """One aisnode pod, as the tests and benchmarks know an AIS node: role, public URL (the node's address and the
    hostPort), intra-data URL (its DNS name), its process and output."""

    role: str
    pod: str
    node: str
    url: str
    data_url: str
    logs: Path  # the pod's log folder (its emptyDir), as the host sees the node's kubelet folder
    kube: RealKubernetes = field(repr=False)

    @property
    def process(self) -> MainProcess:
        """aisnode's process, as the host sees it."""
        pod = self.kube.pod_named(self.pod)
        return pod.container if pod is not None else MainProcess(0, -1)

    @property
    def output(self) -> Path:
        """aisnode's stdout and stderr: its container's newest log on its node (CRI lines)."""
        pod, node = self.kube.pod_named(self.pod), self.kube.cluster.nodes[self.node]
        folder = node.inside_path("/var/log/pods") / f"{NAMESPACE}_{self.pod}_{pod.uid if pod else ''}" / "ais-node"
        logs = sorted(folder.glob("*.log"), key=lambda log: int(log.stem)) if folder.is_dir() else []
        return logs[-1] if logs else folder / "0.log"

    def log_tail(self, chars: int = 3000) -> str:
        log = self.logs / f"ais{self.role}.INFO"
        return f"--- {self.pod} ({log}):\n{log.read_text(errors='replace')[-chars:]}" if log.is_file() else ""


@dataclass
class AisCluster(AisView):
    """AIS's pods on the two-node cluster, with what the real-ETL suite asks of its cluster."""

    cluster: Cluster
    kube: RealKubernetes
    proxy: Daemon
    targets: list[Daemon]  # ordered by node: targets[i] runs on node-i
    mountpaths: list[Path]  # targets[i]'s mountpath, on the host
    _stopped: bool = field(default=False, repr=False)

    @property
    def node(self):
        return self.cluster

    @property
    def mountpath(self) -> str:
        """Every target's mountpath, as its pods and the ETL pods see it."""
        return MOUNTPATH

    @property
    def pod_mountpaths(self) -> list[Path]:
        """Each target's mountpath as its ETL pods see it (``mountpaths`` are where the host sees them)."""
        return [Path(MOUNTPATH)] * len(self.targets)

    def target_logs(self) -> str:
        return "\n".join(target.log_tail(10**9) for target in self.targets)

    def lose_node(self, name: str) -> None:
        """``name`` lost at once: its kubelet, containerd, kube-proxy and every pod on it (an AIS target, ETL pods)
        killed with its namespaces; its disk stays, as a powered-off machine's would."""
        left = self.cluster.kill_node(name)
        if left:
            raise KubernetesUnavailable(f"{name}'s cgroups not removed: {left}")

    def bring_back(self, name: str, timeout: float = 300.0) -> None:
        """``name`` started again (same address, disk and kubelet folder): Ready, its AIS pod restarted by its
        kubelet, both targets in the cluster map again, and the rebalance their return starts finished."""
        started = time.monotonic()
        self.cluster.restart_node(name, timeout)
        self.kube.wait(lambda: len([p for p in self.kube.ais_pods() if p.ready]) == 3, timeout, "AIS's pods Ready")
        wait_joined(self, max(10.0, timeout - (time.monotonic() - started)))
        cluster = self.client().cluster()
        self.kube.wait(lambda: not cluster.list_running_jobs(job_kind="rebalance"), timeout, "the rebalance done")

    def stop(self, timeout: float = 60.0) -> list[str]:
        """Delete AIS's StatefulSets (SIGTERM to each aisnode); then the cluster. Returns what had to be forced:
        ETL pods AIS never deleted, AIS pods still there after ``timeout``, containers that outlived their pods."""
        if self._stopped:
            return []
        self._stopped = True
        forced = [f"pod {pod.name} was never deleted by AIS" for pod in self.kube.etl_pods()]
        for role in ("target", "proxy"):
            self.cluster.kubectl("-n", NAMESPACE, "delete", "statefulset", service(role), "--wait=false")
        try:
            self.kube.wait(lambda: not self.kube.ais_pods(), timeout, "AIS's pods gone")
        except TimeoutError:
            forced += [f"AIS pod {pod.name} still there {timeout:.0f} s after its StatefulSet was deleted"
                       for pod in self.kube.ais_pods()]
        self.kube.stop()
        forced += [f"container {name} outlived its pod" for name in self.kube.leftover_containers()]
        forced += [f"cgroup not removed: {left}" for left in self.cluster.stop()]
        return forced

    def __enter__(self) -> AisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _daemons(cluster, kube: RealKubernetes, role: str) -> list[Daemon]:
    pods = cluster.session().get(f"{API_URL}/api/v1/namespaces/{NAMESPACE}/pods",
                                 params={"labelSelector": f"app.kubernetes.io/component={role}"}, timeout=10).json()
    daemons = []
    for pod in pods["items"]:
        name, node = pod["metadata"]["name"], pod["spec"].get("nodeName", "")
        logs = (cluster.root / node / "kubelet" / "pods" / pod["metadata"]["uid"] / "volumes" /
                "kubernetes.io~empty-dir" / "logs-dir")
        daemons.append(Daemon(role, name, node, f"http://{pod['status'].get('hostIP', '')}:{PORTS[role]}",
                              f"http://{pod_dns(name, role)}:{DATA_PORT}", logs / name if role == "target" else logs,
                              kube))
    return sorted(daemons, key=lambda daemon: daemon.node)


def _joined(proxy: Daemon, targets: int) -> str:
    """'' once the primary is ready with ``targets`` joined, each answering; else what is missing."""
    with httpx.Client(timeout=3.0) as http:
        health = http.get(f"{proxy.url}/v1/health", params={"prr": "true"})
        if health.status_code != 200:
            return f"primary health: {health.status_code} {health.text[:200]}"
        smap = http.get(f"{proxy.url}/v1/daemon", params={"what": "smap"}).json()
        joined = smap.get("tmap") or {}
        if len(joined) != targets:
            return f"targets in the cluster map: {len(joined)}"
        for snode in joined.values():
            url = snode["public_net"]["direct_url"]
            if not http.get(f"{url}/v1/health").is_success:
                return f"target {url} not healthy"
    return ""


def wait_joined(ais: AisCluster, timeout: float) -> None:
    deadline, last = time.monotonic() + timeout, "no answer yet"
    while time.monotonic() < deadline:
        try:
            last = _joined(ais.proxy, len(ais.targets))
            if not last:
                return
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise AisnodeUnavailable(f"AIS on Kubernetes not ready within {timeout:.0f} s ({last}):\n{ais.logs()}")


def start_ais(cluster, image: str, timeout: float = 240.0) -> AisCluster:
    """AIS's objects applied; returns once its three pods run and the proxy reports both targets joined."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                          "items": manifests(image)}))
    kube = RealKubernetes(cluster, cluster.root / "kube", NAMESPACE)
    kube.start()
    started = time.monotonic()
    try:
        kube.wait(lambda: len([p for p in kube.ais_pods() if p.ready]) == 3, timeout, "AIS's three pods Ready")
    except TimeoutError as exc:
        kube.stop()
        raise KubernetesUnavailable(f"{exc}: {[(p.name, p.obj.get('status', {})) for p in kube.ais_pods()]}\n"
                                    f"{cluster.log_tail()}") from None
    (proxy,), targets = _daemons(cluster, kube, "proxy"), _daemons(cluster, kube, "target")
    mountpaths = [cluster.root / "disks" / target.node / "mp1" for target in targets]
    ais = AisCluster(cluster, kube, proxy, targets, mountpaths)
    wait_joined(ais, max(10.0, timeout - (time.monotonic() - started)))
    return ais
