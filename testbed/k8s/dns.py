"""The cluster DNS: CoreDNS (``gobuilds.py``) as kubeadm deploys it, behind the ``kube-dns`` Service at ``DNS_IP``.

The kubelets give every pod ``DNS_IP`` as its resolver (``clusterDNS``), so names such as
``<pod>.<service>.<namespace>.svc.cluster.local`` (a StatefulSet's pods behind a headless Service: what AIS's
nodes call each other) resolve to pod addresses. The Corefile is kubeadm's, less ``forward``: a name outside
the cluster is answered at once (REFUSED) instead of being asked of a server nobody may reach. One replica, on
the control-plane node (a production cluster runs two or more, spread over nodes).
"""

from __future__ import annotations

import json

from .topology import API_URL, CONTROL_PLANE, DNS_IP, DOMAIN

COREFILE = f"""\
.:53 {{
    errors
    health {{
       lameduck 5s
    }}
    ready
    kubernetes {DOMAIN} in-addr.arpa ip6.arpa {{
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }}
    prometheus :9153
    cache 30 {{
       disable success {DOMAIN}
       disable denial {DOMAIN}
    }}
    loop
    reload
    loadbalance
}}
"""


def manifests(image: str) -> list[dict]:
    """kubeadm's CoreDNS objects: its RBAC, the Corefile, the Deployment and the ``kube-dns`` Service."""
    labels = {"k8s-app": "kube-dns"}
    meta = {"name": "coredns", "namespace": "kube-system"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system"}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"Corefile": COREFILE}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "serviceAccountName": "coredns", "dnsPolicy": "Default", "priorityClassName":
                      "system-cluster-critical", "nodeSelector": {"kubernetes.io/hostname": CONTROL_PLANE.name},
                      "containers": [{
                          "name": "coredns", "image": image, "imagePullPolicy": "IfNotPresent",
                          "args": ["-conf", "/etc/coredns/Corefile"],
                          "resources": {"requests": {"cpu": "10m", "memory": "70Mi"}, "limits": {"memory": "170Mi"}},
                          "volumeMounts": [{"name": "config-volume", "mountPath": "/etc/coredns", "readOnly": True}],
                          "ports": [{"containerPort": 53, "name": "dns", "protocol": "UDP"},
                                    {"containerPort": 53, "name": "dns-tcp", "protocol": "TCP"},
                                    {"containerPort": 9153, "name": "metrics", "protocol": "TCP"}],
                          "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                              "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}},
                          "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}, "initialDelaySeconds": 5,
                                            "timeoutSeconds": 5, "failureThreshold": 5},
                          "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 1}}],
                      "volumes": [{"name": "config-volume", "configMap": {"name": "coredns"}}]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
         "spec": {"selector": labels, "clusterIP": DNS_IP,
                  "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                            {"name": "metrics", "port": 9153, "protocol": "TCP"}]}},
    ]


def start_dns(cluster, image: str, timeout: float) -> None:
    """Apply the objects; returns once CoreDNS is Ready (its ``ready`` plugin: the Kubernetes API read) and the
    ``kube-dns`` Service leads to it."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                          "items": manifests(image)}))
    session = cluster.session()

    def serving() -> bool:
        slices = session.get(f"{API_URL}/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices",
                             params={"labelSelector": "kubernetes.io/service-name=kube-dns"}, timeout=5).json()
        return any(endpoint.get("conditions", {}).get("ready") for item in slices.get("items", [])
                   for endpoint in item.get("endpoints") or [])

    cluster.wait("the cluster DNS", serving, timeout)
