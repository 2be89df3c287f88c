"""An AIS cluster with ETL as the real-ETL suite and the benchmarks through AIS see it, whatever runs it.

Two clusters have this view: AIS as processes with the fake Kubernetes (``etl_cluster.EtlCluster``) and AIS as
pods on the real two-node Kubernetes (``k8s/ais.AisCluster``). Each has a ``proxy`` and ``targets`` (with
``url``, ``data_url`` and ``log_tail``) and ``kube``, the Kubernetes view that lists the ETL pods.
"""

from __future__ import annotations


class AisView:
    @property
    def url(self) -> str:
        return self.proxy.url

    def client(self, **kwargs):
        from aistore.sdk import Client

        kwargs.setdefault("timeout", (5, 300))
        return Client(self.url, **kwargs)

    def nodes(self) -> list:
        return [*self.targets, self.proxy]

    def logs(self) -> str:
        return "\n".join(node.log_tail() for node in self.nodes())

    def target_of(self, pod) -> int:
        """Which target (0 or 1) an ETL pod serves: the one its ``AIS_TARGET_URL`` (intra-data URL) names."""
        env = {e["name"]: e.get("value", "") for e in pod.obj["spec"]["containers"][0].get("env", [])}
        url = env["AIS_TARGET_URL"]
        return next(i for i, target in enumerate(self.targets) if url.startswith(target.data_url + "/"))

    def pod_on_target(self, etl: str, index: int):
        """The running pod of ``etl`` that serves target ``index``."""
        return next(pod for pod in self.kube.running_pods(etl) if self.target_of(pod) == index)
