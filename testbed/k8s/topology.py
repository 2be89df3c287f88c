"""The two-node cluster's names and addresses: documentation ranges (RFC 5737), routed nowhere.

- The nodes sit on one network segment, 198.51.100.0/24: a bridge in the network namespace of the process
  that started the cluster (the "machine room"), whose address is the nodes' default gateway;
- each node has a pod CIDR of its own, half of 203.0.113.0/24, and a route to the other node's pods
  through that node's address, as a host-gateway network plugin installs them;
- Services are 192.0.2.0/24: the first address is the ``kubernetes`` Service, ``DNS_IP`` the cluster DNS.

node-0 runs the control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) and the image
registry besides its kubelet, containerd and kube-proxy; node-1 runs only a node's own.
"""

from __future__ import annotations

from dataclasses import dataclass

LAN_GATEWAY = "198.51.100.1"
LAN_BRIDGE = "ais-lan"
CLUSTER_CIDR = "203.0.113.0/24"
SERVICE_CIDR = "192.0.2.0/24"
API_SERVICE_IP = "192.0.2.1"  # the first address of the Service range: the "kubernetes" Service
DNS_IP = "192.0.2.10"
DOMAIN = "cluster.local"
API_PORT = 6443


@dataclass(frozen=True)
class NodeSpec:
    name: str
    ip: str
    pod_cidr: str
    control_plane: bool = False


NODES = (
    NodeSpec("node-0", "198.51.100.10", "203.0.113.0/25", control_plane=True),
    NodeSpec("node-1", "198.51.100.11", "203.0.113.128/25"),
)
CONTROL_PLANE = NODES[0]
API_URL = f"https://{CONTROL_PLANE.ip}:{API_PORT}"
REGISTRY = f"{CONTROL_PLANE.ip}:5000"
# Image names that mean the cluster's registry on every node: its address, and the names the project's specs
# and tests use (docker.io/library/..., localhost:5000/...), so that nothing is asked of any registry outside.
REGISTRY_ALIASES = (REGISTRY, "docker.io", "127.0.0.1:5000", "localhost:5000")
PAUSE_IMAGE = f"{REGISTRY}/ais-wds-pause:1"


def node(name: str) -> NodeSpec:
    return next(spec for spec in NODES if spec.name == name)
