"""AIS's objects as the ais-k8s operator renders them, and the cluster DNS's, checked without Kubernetes."""

from __future__ import annotations

import json

from testbed.k8s import ais, dns
from testbed.k8s.node import DISK
from testbed.k8s.topology import CONTROL_PLANE, DNS_IP

IMAGE = "198.51.100.10:5000/ais-wds-aisnode:test"


def objects(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in ais.manifests(IMAGE) if o["kind"] == kind}


def pod_spec(role: str) -> dict:
    return objects("StatefulSet")[f"ais-{role}"]["spec"]["template"]["spec"]


def test_targets_are_one_per_node_with_a_hostpath_mountpath_and_the_downward_api() -> None:
    statefulset = objects("StatefulSet")["ais-target"]["spec"]
    assert statefulset["replicas"] == 2 and statefulset["podManagementPolicy"] == "Parallel"
    spec = pod_spec("target")
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == \
        statefulset["selector"]["matchLabels"]
    container = spec["containers"][0]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"MY_NODE": "spec.nodeName", "MY_POD": "metadata.name", "K8S_NS": "metadata.namespace"}
    disk = next(v for v in spec["volumes"] if "hostPath" in v)
    assert disk["hostPath"] == {"path": f"{DISK}/mp1", "type": "DirectoryOrCreate"}
    assert {"name": disk["name"], "mountPath": ais.MOUNTPATH} in container["volumeMounts"]
    assert container["ports"][0]["hostPort"] == ais.PORTS["target"] == 51081
    assert "nodeSelector" not in spec  # the scheduler places targets; the anti-affinity keeps them apart


def test_the_init_container_writes_each_pods_config_from_the_operators_templates() -> None:
    for role in ("proxy", "target"):
        (init,) = pod_spec(role)["initContainers"]
        assert init["command"] == ["aisinit"] and f"-role={role}" in init["args"]
        env = {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in init["env"]}
        assert env["MY_SERVICE"] == f"ais-{role}" and env["AIS_PUBLIC_HOSTNAME"] == "status.hostIP"
        template = json.loads(objects("ConfigMap")[f"ais-{role}"]["data"]["ais_local.json"])
        assert template["host_net"]["hostname_intra_data"] == "${AIS_DATA_HOSTNAME}"  # aisinit: the pod's DNS name
    assert json.loads(objects("ConfigMap")["ais-target"]["data"]["ais_local.json"])["fspaths"] == {ais.MOUNTPATH: ""}


def test_the_primary_is_named_by_dns_and_the_proxy_stays_on_the_control_plane_node() -> None:
    config = json.loads(objects("ConfigMap")["ais-global-cm"]["data"]["ais.json"])
    assert config["proxy"]["primary_url"] == "http://ais-proxy-0.ais-proxy.ais.svc.cluster.local:51082"
    assert pod_spec("proxy")["nodeSelector"] == {"kubernetes.io/hostname": CONTROL_PLANE.name}
    assert "-ntargets=2" in pod_spec("proxy")["containers"][0]["args"]
    for role in ("proxy", "target"):
        service = objects("Service")[f"ais-{role}"]["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True


def test_ais_gets_the_operators_rbac_through_its_service_account() -> None:
    (role,) = objects("Role").values()
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods", "services"],
         "verbs": ["get", "list", "watch", "create", "update", "delete"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    ]
    (binding,) = objects("RoleBinding").values()
    assert binding["subjects"][0]["name"] == "ais-sa" and pod_spec("target")["serviceAccountName"] == "ais-sa"


def test_the_cluster_dns_answers_at_the_address_the_kubelets_give_pods() -> None:
    service = next(o for o in dns.manifests("coredns:test") if o["kind"] == "Service")
    assert service["spec"]["clusterIP"] == DNS_IP and service["metadata"]["name"] == "kube-dns"
    assert "kubernetes cluster.local" in dns.COREFILE and "forward" not in dns.COREFILE
