"""The cluster's throw-away certificates and kubeconfigs, made with the ``openssl`` command line.

One CA signs, as a cluster installer does:
- the apiserver's serving certificate (the names and addresses a client may dial: the control-plane node's
  address, the ``kubernetes`` Service's first IP and DNS names);
- one client certificate per identity, each the one Kubernetes' default RBAC already knows: the admin
  (``system:masters``), each node's kubelet (``system:node:<node>`` in ``system:nodes``, the identity the
  NodeRestriction admission plugin limits to its own node), kube-proxy (``system:kube-proxy``), the
  controller-manager and the scheduler;
- the service-account signing key pair.

Each identity gets a kubeconfig (``<name>.kubeconfig``) that names the apiserver on the control-plane node.
EC P-256 keys: quick to make on two cores, and every component accepts them.
"""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import requests

_OPENSSL = """\
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:kubernetes, DNS:kubernetes.default, DNS:kubernetes.default.svc, \
DNS:kubernetes.default.svc.{domain}, DNS:localhost, IP:127.0.0.1, IP:{api_ip}, IP:{service_ip}
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
"""

ADMIN = "admin"
PROXY = "kube-proxy"
CONTROLLER_MANAGER = "kube-controller-manager"
SCHEDULER = "kube-scheduler"


def kubelet_identity(node: str) -> str:
    return f"kubelet-{node}"


def _subjects(nodes: list[str]) -> dict[str, str]:
    """Identity (file name) -> the certificate's subject; Kubernetes reads the user from CN and groups from O."""
    subjects = {ADMIN: "/O=system:masters/CN=admin",
                PROXY: "/CN=system:kube-proxy",
                CONTROLLER_MANAGER: "/CN=system:kube-controller-manager",
                SCHEDULER: "/CN=system:kube-scheduler"}
    subjects.update({kubelet_identity(node): f"/O=system:nodes/CN=system:node:{node}" for node in nodes})
    return subjects


def _openssl(folder: Path, *args: str) -> None:
    done = subprocess.run(["openssl", *args], cwd=folder, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")


def _ec_key(folder: Path, name: str) -> None:
    _openssl(folder, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{name}.key")


def make_pki(folder: Path, nodes: list[str], api_ip: str, service_ip: str, server: str,
             domain: str = "cluster.local") -> None:
    """Everything above into ``folder``; ``server`` is the apiserver's URL written into each kubeconfig."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "openssl.cnf").write_text(_OPENSSL.format(api_ip=api_ip, service_ip=service_ip, domain=domain))
    _ec_key(folder, "ca")
    _openssl(folder, "req", "-x509", "-new", "-key", "ca.key", "-out", "ca.crt", "-days", "3",
             "-subj", "/CN=ais-wds-k8s-ca", "-config", "openssl.cnf", "-extensions", "ca")
    for name, subject, ext in [("apiserver", "/CN=kube-apiserver", "server"),
                               *((name, subject, "client") for name, subject in _subjects(nodes).items())]:
        _ec_key(folder, name)
        _openssl(folder, "req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
                 "-config", "openssl.cnf")
        _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "3", "-extfile", "openssl.cnf", "-extensions", ext)
    _ec_key(folder, "sa")
    _openssl(folder, "pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")
    for name in _subjects(nodes):
        (folder / f"{name}.kubeconfig").write_text(kubeconfig(folder, name, server))


def kubeconfig(folder: Path, user: str, server: str) -> str:
    def b64(name: str) -> str:
        return base64.b64encode((folder / name).read_bytes()).decode()

    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "ais",
        "clusters": [{"name": "ais", "cluster": {"server": server, "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate-data": b64(f"{user}.crt"),
                                          "client-key-data": b64(f"{user}.key")}}],
        "contexts": [{"name": "ais", "context": {"cluster": "ais", "user": user}}],
    }, indent=1)


def admin_session(folder: Path) -> requests.Session:
    """HTTPS to the API as its admin, trusting the cluster's CA alone (``trust_env`` off: requests would let
    ``REQUESTS_CA_BUNDLE`` replace ``verify``, and a proxy variable route the call out of the namespace)."""
    session = requests.Session()
    session.trust_env = False
    session.cert = (str(folder / f"{ADMIN}.crt"), str(folder / f"{ADMIN}.key"))
    session.verify = str(folder / "ca.crt")
    return session
