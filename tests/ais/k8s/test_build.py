"""What build.py writes and when it builds again, without Go, network or apt (the build itself: make k8s-tools)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testbed.k8s import build, gobuilds

KUBERNETES_GO_MOD = """\
module k8s.io/kubernetes

go 1.24.0

require (
	k8s.io/api v0.0.0
	k8s.io/client-go v0.0.0
)

replace (
	k8s.io/api => ./staging/src/k8s.io/api
	k8s.io/client-go => ./staging/src/k8s.io/client-go
	k8s.io/kubelet => ./staging/src/k8s.io/kubelet
	k8s.io/sample-cli-plugin => ./staging/src/k8s.io/sample-cli-plugin
	k8s.io/sample-controller => ./staging/src/k8s.io/sample-controller
	github.com/example/fork => github.com/example/fork v1.2.3
)

replace k8s.io/cri-api => ./staging/src/k8s.io/cri-api
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache, and a fake host iptables: these tests check the cache logic, not the host's tools."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    fake = tmp_path / "host" / "iptables"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setattr(build, "host_iptables", lambda: fake)
    return tmp_path / "cache"


def test_staging_replaces_are_read_from_the_go_mod_less_the_unserved_ones() -> None:
    assert build.staging_replaces(KUBERNETES_GO_MOD) == [
        "k8s.io/api", "k8s.io/client-go", "k8s.io/cri-api", "k8s.io/kubelet",
    ]


def test_go_mod_requires_kubernetes_and_replaces_each_staging_module() -> None:
    text = build.go_mod_text(["k8s.io/client-go", "k8s.io/api"])
    lines = [line.strip() for line in text.splitlines()]
    assert "require k8s.io/kubernetes v1.34.4" in lines
    assert "k8s.io/api => k8s.io/api v0.34.4" in lines
    assert "k8s.io/client-go => k8s.io/client-go v0.34.4" in lines
    assert sum("=>" in line for line in lines) == 2
    assert lines[0].startswith("module ") and "go 1.24.0" in lines


def test_tools_go_imports_each_command_under_the_tools_tag() -> None:
    text = build.tools_go_text()
    assert text.startswith("//go:build tools\n")
    for command in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy", "kubelet", "kubectl"):
        assert f'_ "k8s.io/kubernetes/cmd/{command}"' in text


def test_ldflags_stamp_the_version_where_kubectl_and_the_servers_read_it() -> None:
    flags = build.ldflags().split(" -X ")
    for package in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version"):
        assert f"{package}.gitVersion=v1.34.4" in flags
        assert f"{package}.gitMajor=1" in flags
        assert f"{package}.gitMinor=34" in flags


def _fake_cache(cache: Path) -> None:
    """Every file a finished build leaves, each part stamped as it would be made now."""
    bin_dir, root = cache / "bin", cache / "debs" / "root"
    for path in [bin_dir / name for name in (*build.COMMANDS.values(), *gobuilds.stamps())]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    for name in ("containerd", "containerd-shim-runc-v2", "ctr", "etcd", "etcdctl", "docker-registry"):
        (root / "usr/bin").mkdir(parents=True, exist_ok=True)
        (root / "usr/bin" / name).write_text("")
    (root / "usr/sbin").mkdir(parents=True)
    (root / "usr/sbin/runc").write_text("")
    (root / "usr/lib/cni").mkdir(parents=True)
    for plugin in build.CNI_PLUGINS:
        (root / "usr/lib/cni" / plugin).write_text("")
    (bin_dir / "kubernetes.build").write_text(build.kubernetes_stamp())
    for name, stamp in gobuilds.stamps().items():
        (bin_dir / f"{name}.build").write_text(stamp)
    (cache / "debs" / "root.stamp").write_text(build.debs_stamp(build.deb_packages()))


def _no_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "find_go", lambda: None)


def test_a_finished_build_is_reused_without_go(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cache(cache)
    _no_go(monkeypatch)
    tools = build.install_kubernetes()
    assert tools.kubelet == cache / "bin" / "kubelet"
    assert tools.containerd_shim == cache / "debs/root/usr/bin/containerd-shim-runc-v2"
    assert all(path.is_absolute() and path.exists() for path in tools.paths().values())
    assert tools.version == "v1.34.4"
    assert tools.iptables == cache.parent / "host" / "iptables"
    assert gobuilds.go_programs() == {name: cache / "bin" / name for name in ("pause", "coredns", "aisinit")}


def test_without_iptables_the_error_names_it_and_the_fix_before_any_build(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cache that needs a rebuild and no Go: the iptables check must come first, not after minutes of building.
    monkeypatch.setattr(build, "host_iptables", lambda: None)
    _no_go(monkeypatch)
    with pytest.raises(build.KubernetesUnavailable) as error:
        build.install_kubernetes()
    assert "kube-proxy needs iptables" in str(error.value)
    assert "apt-get install iptables" in str(error.value) and "make test-k8s" in str(error.value)
    _fake_cache(cache)
    with pytest.raises(build.KubernetesUnavailable, match="kube-proxy needs iptables"):
        build.cached_tools()


def test_the_host_lookup_finds_iptables_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "iptables"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert build.host_iptables() == fake


def test_a_changed_kubernetes_stamp_means_a_rebuild(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cache(cache)
    _no_go(monkeypatch)
    (cache / "bin" / "kubernetes.build").write_text(build.kubernetes_stamp().replace("v1.34.4", "v1.34.3"))
    assert build.cached_tools() is None
    with pytest.raises(build.KubernetesUnavailable, match=r"Go >= 1\.24") as error:
        build.install_kubernetes()
    assert "Kubernetes v1.34.4" in str(error.value) and "https://go.dev/dl" in str(error.value)


def test_a_missing_binary_means_a_rebuild(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cache(cache)
    _no_go(monkeypatch)
    (cache / "bin" / "kube-scheduler").unlink()
    with pytest.raises(build.KubernetesUnavailable, match=r"Go >= 1\.24"):
        build.install_kubernetes()


@pytest.mark.parametrize(("name", "change"), [("pause", ("PAUSE_SOURCE", gobuilds.PAUSE_SOURCE + "\n// changed\n")),
                                            ("coredns", ("COREDNS_VERSION", "v1.12.0")),
                                            ("aisinit", ("AISNODE_VERSION", "v1.4.9"))])
def test_a_changed_go_program_means_a_rebuild(cache: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                              change: tuple[str, str]) -> None:
    _fake_cache(cache)
    _no_go(monkeypatch)
    assert gobuilds.go_program(name) == cache / "bin" / name
    monkeypatch.setattr(gobuilds, *change)
    with pytest.raises(build.KubernetesUnavailable, match=r"Go >= 1\.24"):
        gobuilds.go_program(name)


def test_coredns_is_built_with_the_plugins_of_a_clusters_corefile_in_coredns_order() -> None:
    from testbed.k8s.dns import COREFILE

    source = gobuilds.coredns_main()
    directives = re.findall(r'^\t"(\w+)",$', source, flags=re.MULTILINE)
    assert directives == list(gobuilds.COREDNS_PLUGINS)
    used = re.findall(r"^    (\w+)", COREFILE, flags=re.MULTILINE)
    assert sorted(used) == sorted(directives)  # each directive the Corefile uses is built in, and nothing else
    assert "forward" not in used  # nothing outside the cluster is asked
    for package in gobuilds.COREDNS_PLUGINS.values():
        assert f'_ "github.com/coredns/coredns/plugin/{package}"' in source


def test_a_changed_package_list_means_a_new_unpack(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cache(cache)
    monkeypatch.setitem(build.DEBS, "containerd", "1.7.0-1")
    monkeypatch.setattr(build, "_debian_tools", lambda: None)
    with pytest.raises(build.KubernetesUnavailable, match=r"containerd=1\.7\.0-1"):
        build.install_kubernetes()


def test_without_apt_the_error_names_each_package_and_version(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cache(cache)
    (cache / "debs" / "root.stamp").unlink()
    monkeypatch.setattr(build, "_debian_tools", lambda: None)
    with pytest.raises(build.KubernetesUnavailable) as error:
        build.install_kubernetes()
    for name, version in build.DEBS.items():
        assert f"{name}={version}" in str(error.value)
