"""The control plane and the image registry, started by the control-plane node's pid 1 (``node.py``).

- etcd on the node's loopback;
- the image registry (distribution) on the node's address: every node pulls from it;
- kube-apiserver on the node's address, with ``Node,RBAC`` authorization and the ``NodeRestriction`` admission
  plugin (a kubelet may change only its own node and the pods bound to it);
- kube-controller-manager, each controller with a service account of its own (as kubeadm runs it), and
  kube-scheduler, each with its own client certificate.
"""

from __future__ import annotations

import json
from pathlib import Path

import requests

from . import pki
from .topology import API_PORT, API_URL, CLUSTER_CIDR, REGISTRY, SERVICE_CIDR
from .topology import node as node_spec


def registry_config(storage: Path) -> str:
    return json.dumps({"version": 0.1, "log": {"level": "warn"},
                       "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
                       "http": {"addr": REGISTRY}})


def apiserver_flags(pem: Path, address: str) -> list[str]:
    return [
        "--etcd-servers=http://127.0.0.1:2379", f"--advertise-address={address}", f"--bind-address={address}",
        f"--secure-port={API_PORT}", f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--service-node-port-range=30000-32767",
        f"--tls-cert-file={pem / 'apiserver.crt'}", f"--tls-private-key-file={pem / 'apiserver.key'}",
        f"--client-ca-file={pem / 'ca.crt'}", "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--service-account-issuer=https://kubernetes.default.svc",
        f"--service-account-key-file={pem / 'sa.pub'}", f"--service-account-signing-key-file={pem / 'sa.key'}",
        f"--kubelet-client-certificate={pem / (pki.ADMIN + '.crt')}",
        f"--kubelet-client-key={pem / (pki.ADMIN + '.key')}",
        "--kubelet-preferred-address-types=InternalIP", "--allow-privileged=true", "--profiling=false", "--v=1",
        # Debian's etcd 3.4 lets the watch cache fall behind: a watch without a resourceVersion then ends within
        # 3 s ("Too large resource version"), and AIS 5.0's pod watcher spins on the closed channel (a CPU per ETL
        # and target). Watches served by etcd itself stay open.
        "--watch-cache=false",
    ]


def start_control_plane(supervisor, config) -> None:
    """etcd, the registry, the apiserver (until ready), the controller-manager and the scheduler."""
    root, tools, pem = Path(config.root), config.tools, Path(config.pki)
    storage = Path(config.state) / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    (root / "registry.json").write_text(registry_config(storage))
    supervisor.start("etcd", tools["etcd"], "--data-dir", str(root / "etcd"), "--listen-client-urls",
                     "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
                     "--listen-peer-urls", "http://127.0.0.1:2380", "--log-level", "warn")
    supervisor.start("registry", tools["registry"], "serve", str(root / "registry.json"))
    supervisor.start("kube-apiserver", tools["apiserver"], *apiserver_flags(pem, node_spec(config.name).ip))
    session = pki.admin_session(pem)
    supervisor.wait_for("apiserver /readyz", lambda: session.get(f"{API_URL}/readyz", timeout=2).ok, 90)
    supervisor.start("kube-controller-manager", tools["controller_manager"],
                     f"--kubeconfig={pem / (pki.CONTROLLER_MANAGER + '.kubeconfig')}",
                     f"--authentication-kubeconfig={pem / (pki.CONTROLLER_MANAGER + '.kubeconfig')}",
                     f"--authorization-kubeconfig={pem / (pki.CONTROLLER_MANAGER + '.kubeconfig')}",
                     "--leader-elect=false", "--use-service-account-credentials=true",
                     f"--service-account-private-key-file={pem / 'sa.key'}", f"--root-ca-file={pem / 'ca.crt'}",
                     f"--cluster-cidr={CLUSTER_CIDR}", f"--service-cluster-ip-range={SERVICE_CIDR}",
                     "--bind-address=127.0.0.1", "--v=1")
    supervisor.start("kube-scheduler", tools["scheduler"], f"--kubeconfig={pem / (pki.SCHEDULER + '.kubeconfig')}",
                     f"--authentication-kubeconfig={pem / (pki.SCHEDULER + '.kubeconfig')}",
                     f"--authorization-kubeconfig={pem / (pki.SCHEDULER + '.kubeconfig')}",
                     "--leader-elect=false", "--bind-address=127.0.0.1", "--v=1")
    supervisor.wait_for("registry", lambda: requests.get(f"http://{REGISTRY}/v2/", timeout=2).ok, 30)
