"""The deployment files, checked without Docker or kind.

deploy/kubernetes: rendered by kubectl's kustomize and accepted by the real kube-apiserver in a
server-side dry run with strict field validation (and refused when a field is wrong); its
command line and configuration parsed by knit-proxyd's own option parser; its RBAC checked
against the requests proxyd/ makes (the lists and watches of proxyd/watch.py), then bound for
real and asked with `kubectl auth can-i`.
deploy/kind/cluster.yaml: decoded strictly into kind's own types (build/tools/kindconfig).
Dockerfile: BuildKit's checks and parser (build/tools/dockerfilelint), its build context after
.dockerignore, and its bundle step run here. The kind-e2e workflow: actionlint with shellcheck,
its matrix against proxyd.config.MODES, its versions against the pins, its overlay rendered.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.lab.controlplane import ControlPlane
from deploy.lab.paths import BUILD, CONTROLPLANE_BIN, ROOT
from deploy.lab.process import eventually
from proxyd import config as proxy_config
from proxyd import watch

MANIFESTS = ROOT / "deploy" / "kubernetes"
KIND_CONFIG = ROOT / "deploy" / "kind" / "cluster.yaml"
WORKFLOW = ROOT / ".github" / "workflows" / "kind-e2e.yaml"
KUBECTL = CONTROLPLANE_BIN / "kubectl"
TOOLS = BUILD / "tools"
SERVICE_ACCOUNT = "system:serviceaccount:kube-system:knit"
EXPECTED_OBJECTS = {
    ("CustomResourceDefinition", None, "clusternetworkpolicies.policy.networking.k8s.io"),
    ("ServiceAccount", "kube-system", "knit"),
    ("ClusterRole", None, "knit"),
    ("ClusterRoleBinding", None, "knit"),
    ("ConfigMap", "kube-system", "knit-config"),
    ("DaemonSet", "kube-system", "knit"),
}
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|build-essential|libc6-dev|python3-dev|make|binutils)\b")
PINNED_IMAGE = re.compile(r"^[a-z0-9./_-]+:\d+\.\d+\.\d+(-[a-z0-9.-]+)?(@sha256:[0-9a-f]{64})?$")


def run(*argv: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(arg) for arg in argv], capture_output=True, text=True, check=False, timeout=120
    )
    if check and result.returncode != 0:
        pytest.fail(f"{shlex.join(map(str, argv))} failed:\n{result.stdout}{result.stderr}")
    return result


def kubectl(plane: ControlPlane, *args: str | Path, check: bool = True) -> str:
    result = run(KUBECTL, "--kubeconfig", plane.kubeconfig, *args, check=check)
    return result.stdout + result.stderr


def render(directory: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(run(KUBECTL, "kustomize", directory).stdout) if doc]


def find(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [obj for obj in objects if obj["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render(MANIFESTS)


@pytest.fixture(scope="module")
def pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "DaemonSet")["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod: dict[str, Any]) -> dict[str, Any]:
    (knit,) = pod["containers"]
    return knit


@pytest.fixture
def manifests_copy(tmp_path: Path) -> Path:
    """deploy/kubernetes under tmp_path/deploy/kubernetes, to change."""
    copy = tmp_path / "deploy" / "kubernetes"
    shutil.copytree(MANIFESTS, copy)
    return copy


# ---------------------------------------------------------------- deploy/kubernetes


def test_kustomization_renders_the_daemonset_its_account_role_and_config(objects, container):
    found = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects}
    assert found == EXPECTED_OBJECTS
    assert container["image"] == "knit:dev"  # what `make image` builds


def test_the_apiserver_accepts_every_object_in_a_server_dry_run(control_plane):
    out = kubectl(control_plane, "apply", "--dry-run=server", "--validate=strict", "-k", MANIFESTS)
    kinds = {
        "CustomResourceDefinition": "customresourcedefinition.apiextensions.k8s.io",
        "ServiceAccount": "serviceaccount",
        "ClusterRole": "clusterrole.rbac.authorization.k8s.io",
        "ClusterRoleBinding": "clusterrolebinding.rbac.authorization.k8s.io",
        "ConfigMap": "configmap",
        "DaemonSet": "daemonset.apps",
    }
    expected = {
        f"{kinds[kind]}/{name} created (server dry run)" for kind, _, name in EXPECTED_OBJECTS
    }
    assert set(out.strip().splitlines()) == expected


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"hostNetwrok": True}, 'unknown field "spec.template.spec.hostNetwrok"'),
        (
            {"dnsPolicy": "Sometimes"},
            'spec.template.spec.dnsPolicy: Unsupported value: "Sometimes"',
        ),
        (
            {"tolerations": [{"operator": "Exists", "effect": "Sometimes"}]},
            'spec.template.spec.tolerations[0].effect: Unsupported value: "Sometimes"',
        ),
    ],
)
def test_the_dry_run_refuses_a_wrong_field(control_plane, manifests_copy, change, refusal):
    path = manifests_copy / "daemonset.yaml"
    daemonset = yaml.safe_load(path.read_text())
    daemonset["spec"]["template"]["spec"].update(change)
    path.write_text(yaml.safe_dump(daemonset))
    out = kubectl(
        control_plane,
        *("apply", "--dry-run=server", "--validate=strict", "-k", manifests_copy),
        check=False,
    )
    assert refusal in out
    assert "daemonset.apps/knit created" not in out


def test_the_daemonset_runs_on_every_node_unprivileged(objects, pod, container):
    daemonset = find(objects, "DaemonSet")
    assert daemonset["metadata"]["namespace"] == "kube-system"
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    assert pod["hostNetwork"] is True
    # the node's resolver: cluster DNS is reached through knit itself
    assert pod["dnsPolicy"] == "Default"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["serviceAccountName"] == "knit"
    assert container["securityContext"] == {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {
            "drop": ["ALL"],
            "add": ["NET_ADMIN", "NET_RAW", "SYS_ADMIN"],
        },
    }
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    # /proc/sys is read-only in a non-privileged container: sysctls go through the node's
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KNIT_PROC_SYS"] == "/host/proc/sys"


def test_only_the_module_loading_init_container_holds_sys_module(pod):
    (loader,) = pod["initContainers"]
    assert loader["name"] == "load-modules"
    assert loader["image"] == pod["containers"][0]["image"]
    assert loader["securityContext"] == {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_MODULE"]},
    }
    assert [(m["mountPath"], m.get("readOnly")) for m in loader["volumeMounts"]] == [
        ("/lib/modules", True)
    ]
    assert "modprobe br_netfilter" in loader["command"][-1]
    for other in pod["containers"]:
        assert "SYS_MODULE" not in other["securityContext"]["capabilities"]["add"]


def test_the_daemon_writes_only_to_its_mounts(pod, container):
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == tmp["name"]]
    assert "emptyDir" in volume


def test_the_daemon_has_a_memory_limit(container):
    assert container["resources"]["limits"] == {"memory": "1Gi"}


def test_the_daemonset_probes_kube_proxys_health_endpoints(container):
    assert container["ports"] == [{"name": "healthz", "containerPort": 10256, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "healthz"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}


def test_the_daemonset_mounts_the_node_paths_it_needs(pod, container):
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    containers = pod["initContainers"] + [container]
    mounts = {m["name"]: m for c in containers for m in c["volumeMounts"]}
    wanted = {
        "/etc/cni/net.d": ("/etc/cni/net.d", "DirectoryOrCreate"),
        "/opt/cni/bin": ("/opt/cni/bin", "DirectoryOrCreate"),
        "/var/lib/cni": ("/var/lib/cni", "DirectoryOrCreate"),
        "/run/knit": ("/run/knit", "DirectoryOrCreate"),
        "/proc/sys/net": ("/host/proc/sys/net", "Directory"),
        "/lib/modules": ("/lib/modules", None),
        "/run/xtables.lock": ("/run/xtables.lock", "FileOrCreate"),
    }
    got = {
        host["path"]: (mounts[name]["mountPath"], host.get("type"))
        for name, host in host_paths.items()
    }
    assert got == wanted
    by_path = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert not by_path["/host/proc/sys/net"].get("readOnly")
    assert "/lib/modules" not in by_path
    (config,) = [v for v in pod["volumes"] if v["name"] == by_path["/etc/knit"]["name"]]
    assert config["configMap"]["name"] == "knit-config"


def daemon_argv(container: dict[str, Any], config_file: Path, node: str) -> list[str]:
    """The container's arguments as the kubelet expands them, with the ConfigMap's file."""
    env = {"NODE_NAME": node}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]
    return [f"--config={config_file}" if arg.startswith("--config=") else arg for arg in argv]


def test_the_daemon_accepts_the_daemonsets_command_line_and_configmap(objects, container, tmp_path):
    assert container["command"] == ["knit-proxyd"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "knit-proxyd" in scripts
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in (
        container["env"]
    )
    assert "--config=/etc/knit/config.yaml" in container["args"]

    text = find(objects, "ConfigMap")["data"]["config.yaml"]
    document = yaml.safe_load(text)
    assert (document["apiVersion"], document["kind"]) == (
        "kubeproxy.config.k8s.io/v1alpha1",
        "KubeProxyConfiguration",
    )
    config_file = tmp_path / "config.yaml"
    config_file.write_text(text)
    loaded = proxy_config.load(daemon_argv(container, config_file, "kind-worker"))
    assert loaded.hostname_override == "kind-worker"
    assert loaded.kubeconfig == ""  # in-cluster, with the DaemonSet's API server address
    assert loaded.proxy_mode == "iptables"
    assert loaded.cluster_cidr == ("10.244.0.0/16",)
    assert loaded.healthz_bind_address == "0.0.0.0:10256"
    assert (loaded.min_sync_period, loaded.sync_period) == (1.0, 30.0)
    assert (loaded.cni_conf_dir, loaded.cni_bin_dir) == ("/etc/cni/net.d", "/opt/cni/bin")
    assert loaded.cni_data_dir == "/var/lib/cni/networks"
    assert (loaded.cni_socket, loaded.cni_bundle) == ("/run/knit/cni.sock", "/opt/knit/cni-bundle")
    assert loaded.routing == "auto"


@pytest.mark.parametrize(
    ("old", "new", "refusal"),
    [
        (None, None, None),
        ("masqueradeBit:", "masqueradebit:", 'unknown field "iptables.masqueradebit"'),
        ("masqueradeBit: 14", "masqueradeBit: 40", "must be within the range [0, 31]"),
    ],
)
def test_kube_proxy_accepts_the_configmaps_configuration(objects, tmp_path, old, new, refusal):
    """kube-proxy's own strict loading and validation (build/tools/kubeproxyconfig): the
    file is a KubeProxyConfiguration, not just something knit's parser reads."""
    text = find(objects, "ConfigMap")["data"]["config.yaml"]
    config_file = tmp_path / "config.yaml"
    config_file.write_text(text if old is None else text.replace(old, new))
    result = run(TOOLS / "kubeproxyconfig", config_file, check=refusal is None)
    if refusal is not None:
        assert result.returncode == 1
        assert refusal in result.stderr


def test_the_daemonset_reaches_the_api_server_without_a_service_proxy(container):
    env = {e["name"]: e.get("value") for e in container["env"]}
    # kind's control-plane endpoint for the cluster `make kind-up` creates
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == (
        "knit-control-plane",
        "6443",
    )
    assert "KIND_CLUSTER := knit\n" in (ROOT / "Makefile").read_text()


def watched() -> set[tuple[str, str]]:
    """(API group, resource) of every list+watch in proxyd/watch.py."""
    found = set()
    for name in dir(watch):
        function = getattr(watch, name)
        if not callable(function) or getattr(function, "__module__", "") != watch.__name__:
            continue
        if function.__annotations__.get("return") not in ("Resource", watch.Resource):
            continue
        argc = function.__code__.co_argcount
        path = function(*["placeholder"] * argc).path.strip("/").split("/")
        found.add(("", path[2]) if path[0] == "api" else (path[1], path[3]))
    return found


def request_verbs() -> set[str]:
    """The verbs of the daemon's API requests. No module of the daemon imports the kubernetes
    client; its requests go through its own client (kubeapi.py), whose one request is a GET;
    of the daemon's modules only daemon.py (which builds the client) and watch.py (the
    reflector, a GET of a Resource's collection: watched() checks the paths) use it: a list,
    or a watch with watch=true."""
    # proxyd/explain/ is the kubectl plugin: it runs with the user's credentials, not the
    # daemon's ServiceAccount, which the role is for
    daemon_modules = [
        path
        for path in (ROOT / "proxyd").rglob("*.py")
        if "explain" not in path.relative_to(ROOT).parts
    ]

    def importing(pattern: str) -> set[str]:
        return {
            path.relative_to(ROOT).as_posix()
            for path in daemon_modules
            if re.search(pattern, path.read_text(), re.MULTILINE)
        }

    assert importing(r"^\s*(from|import) kubernetes\b") == set()
    kubeapi = r"^\s*from proxyd(\.kubeapi import| import .*\bkubeapi\b)"
    assert importing(kubeapi) == {"proxyd/daemon.py", "proxyd/watch.py"}
    client = ast.parse((ROOT / "proxyd" / "kubeapi.py").read_text())
    requests = [
        node.args[0]
        for node in ast.walk(client)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "request"
        and node.args
    ]
    assert [ast.literal_eval(method) for method in requests] == ["GET"]
    queries = ast.unparse(ast.parse((ROOT / "proxyd" / "watch.py").read_text()))
    assert "('watch', 'true')" in queries and "('limit', str(PAGE_SIZE))" in queries
    return {"list", "watch"}


def test_the_role_grants_exactly_what_the_daemon_requests(objects):
    resources = watched()
    granted = set()
    for rule in find(objects, "ClusterRole")["rules"]:
        assert sorted(rule["verbs"]) == sorted(request_verbs()), rule
        granted |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted == resources
    binding = find(objects, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == "knit"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "knit", "namespace": "kube-system"}
    ]


@pytest.fixture
def bound_account(control_plane: ControlPlane) -> Iterator[None]:
    """The ServiceAccount, ClusterRole and binding created for real, and the CRD of the
    custom resource the role names (kubectl asks about a resource it knows), removed
    afterwards."""
    files = [
        MANIFESTS / "clusternetworkpolicies.yaml",
        MANIFESTS / "serviceaccount.yaml",
        MANIFESTS / "rbac.yaml",
    ]
    args = [arg for path in files for arg in ("-f", str(path))]
    kubectl(control_plane, "apply", *args)
    try:
        yield
    finally:
        kubectl(control_plane, "delete", "--wait=true", *args)


def can(plane: ControlPlane, verb: str, resource: str) -> bool:
    out = kubectl(plane, "auth", "can-i", verb, resource, f"--as={SERVICE_ACCOUNT}", check=False)
    return out.strip().splitlines()[0] == "yes"


def test_the_service_account_may_watch_what_knit_watches_and_nothing_more(
    control_plane, bound_account
):
    names = [f"{resource}.{group}" if group else resource for group, resource in watched()]
    for name in sorted(names):
        for verb in sorted(request_verbs()):
            # the authorizer's cache takes the new binding in a moment after it is created
            eventually(functools.partial(can, control_plane, verb, name), what=f"{verb} {name}")
    for name in sorted(names):
        assert not can(control_plane, "get", name), f"get {name}: the daemon only lists"
    for verb, name in [
        ("create", "events"),
        ("create", "events.events.k8s.io"),
        ("update", "nodes"),
        ("patch", "nodes/status"),
        ("delete", "pods"),
        ("update", "networkpolicies.networking.k8s.io"),
        ("update", "clusternetworkpolicies.policy.networking.k8s.io"),
        ("get", "secrets"),
        ("create", "services"),
    ]:
        assert not can(control_plane, verb, name), f"{verb} {name}"


# ---------------------------------------------------------------- deploy/kind


def kindconfig(path: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(TOOLS / "kindconfig", path, check=check)


def test_kind_accepts_the_cluster_config(objects):
    report = json.loads(kindconfig(KIND_CONFIG).stdout)
    cluster, networking = report["cluster"], report["cluster"]["networking"]
    assert networking["disableDefaultCNI"] is True
    assert networking["kubeProxyMode"] == "none"
    assert networking["serviceSubnet"] == "10.96.0.0/16"
    # the masquerade boundary knit-proxyd is configured with is kind's pod subnet
    config = yaml.safe_load(find(objects, "ConfigMap")["data"]["config.yaml"])
    assert networking["podSubnet"] == config["clusterCIDR"] == "10.244.0.0/16"
    assert [node["role"] for node in cluster["nodes"]] == ["control-plane", "worker", "worker"]
    # the node image of the pinned kind release, by digest
    assert {node["image"] for node in cluster["nodes"]} == {report["defaultImage"]}
    assert "@sha256:" in report["defaultImage"]


@pytest.mark.parametrize(
    ("old", "new", "refusal"),
    [
        ("disableDefaultCNI", "disableDefaultCni", "field disableDefaultCni not found"),
        ("kubeProxyMode: none", "kubeProxyMode: userspace", 'invalid kubeProxyMode "userspace"'),
        ("podSubnet: 10.244.0.0/16", "podSubnet: 10.244.0.0/33", "invalid podSubnet"),
        ("role: control-plane", "role: worker", "must have at least one control-plane node"),
    ],
)
def test_the_kind_config_check_refuses_what_kind_refuses(tmp_path, old, new, refusal):
    bad = tmp_path / "cluster.yaml"
    bad.write_text(KIND_CONFIG.read_text().replace(old, new))
    result = kindconfig(bad, check=False)
    assert result.returncode == 1
    assert refusal in result.stderr


# ---------------------------------------------------------------- Dockerfile


def dockerfile_report(path: Path) -> dict[str, Any]:
    return json.loads(run(TOOLS / "dockerfilelint", path).stdout)


@pytest.fixture(scope="module")
def dockerfile() -> dict[str, Any]:
    return dockerfile_report(ROOT / "Dockerfile")


def base_image(stage: dict[str, Any], meta_args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: meta_args[m.group(1)], stage["base"])


def commands(stage: dict[str, Any], name: str) -> list[str]:
    return [c["code"] for c in stage["commands"] if c["name"] == name]


def test_the_dockerfile_passes_buildkits_checks(dockerfile):
    assert dockerfile["warnings"] == []


def test_the_dockerfile_check_reports_problems(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian AS b\nfrom b as c\nENV A $UNDEFINED\nCMD echo hi\n")
    rules = {w["rule"] for w in dockerfile_report(bad)["warnings"]}
    assert {"ConsistentInstructionCasing", "UndefinedVar", "JSONArgsRecommended"} <= rules


def test_the_dockerfile_is_multi_stage_on_pinned_bases(dockerfile):
    stages, meta = dockerfile["stages"], dockerfile["metaArgs"]
    names = [stage["name"] for stage in stages]
    assert names == ["portmap", "client", "builder", ""]
    for stage in stages:
        image = base_image(stage, meta)
        assert PINNED_IMAGE.match(image), f"{stage['name'] or 'final'} stage: {image} is not pinned"
    assert base_image(stages[0], meta).startswith("golang:")
    assert base_image(stages[1], meta).startswith("python:3.11.")
    assert base_image(stages[2], meta).startswith("python:3.11.")


def test_the_final_stage_has_no_build_tools(dockerfile):
    *earlier, final = dockerfile["stages"]
    meta = dockerfile["metaArgs"]
    builder = {stage["name"]: stage for stage in earlier}["builder"]
    # the builder's base (so the venv's interpreter is there), not the builder itself
    assert base_image(final, meta) == base_image(builder, meta)
    assert final["base"] not in {stage["name"] for stage in earlier}
    assert any(BUILD_TOOLS.search(code) for code in commands(builder, "RUN"))
    for code in commands(final, "RUN"):
        assert not BUILD_TOOLS.search(code), code
    (install,) = commands(final, "RUN")
    assert {"iptables", "nftables", "kmod"} <= set(install.split())
    for code in commands(final, "COPY"):
        assert "--from=builder" in code
    assert commands(final, "USER") == ["USER root"]
    assert commands(final, "ENTRYPOINT") == ['ENTRYPOINT ["knit-proxyd"]']


def test_the_go_stage_builds_portmap_from_the_pinned_module(dockerfile):
    go = dockerfile["stages"][0]
    assert commands(go, "COPY") == ["COPY tests/go/go.mod tests/go/go.sum ./"]
    (build,) = commands(go, "RUN")
    assert "github.com/containernetworking/plugins/plugins/meta/portmap" in build
    assert "-mod=readonly" in " ".join(commands(go, "ENV"))
    go_mod = (ROOT / "tests" / "go" / "go.mod").read_text()
    assert re.search(r"github.com/containernetworking/plugins v\d+\.\d+\.\d+", go_mod)


def test_the_client_stage_builds_the_client_as_the_makefile_does(dockerfile):
    client = dockerfile["stages"][1]
    assert commands(client, "COPY") == ["COPY Makefile ./", "COPY cni/client.c cni/"]
    *_, build = commands(client, "RUN")
    assert build == "RUN make BUILD=/build /build/cni/knit"
    builder = dockerfile["stages"][2]
    assert "COPY --from=client /build/cni/knit /knit-client" in commands(builder, "COPY")


def test_the_build_context_is_the_project_and_nothing_else(dockerfile):
    sources = [
        path.relative_to(ROOT).as_posix()
        for package in ("cni", "proxyd")
        for path in (ROOT / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    ]
    expected = {"pyproject.toml", "README.md", "Makefile", "tests/go/go.mod", "tests/go/go.sum"}
    expected.update(sources)
    assert set(dockerfile["context"]) == expected


def test_the_builders_bundle_step_builds_a_bundle_with_portmap(dockerfile, tmp_path):
    builder = dockerfile["stages"][2]
    (bundle,) = [code for code in commands(builder, "RUN") if "cni.bundle" in code]
    argv = shlex.split(bundle.removeprefix("RUN "))
    assert argv == [
        *("python", "-m", "cni.bundle", "--output", "/opt/knit/cni-bundle"),
        *("--client", "/knit-client", "--plugin", "/portmap"),
    ]
    output = tmp_path / "cni-bundle"
    argv[0] = sys.executable
    argv[argv.index("/opt/knit/cni-bundle")] = str(output)
    argv[argv.index("/knit-client")] = str(BUILD / "cni" / "knit")
    argv[argv.index("/portmap")] = str(BUILD / "refcni" / "portmap")
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=300)
    assert (output / "plugins" / "portmap").is_file()
    assert (output / "bin" / "knit").read_bytes() == (BUILD / "cni" / "knit").read_bytes()
    assert json.loads((output / "manifest.json").read_text())["version"]


# ---------------------------------------------------------------- the kind-e2e workflow


@pytest.fixture(scope="module")
def workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW.read_text())


def actionlint(path: Path, shellcheck: str) -> subprocess.CompletedProcess[str]:
    return run(TOOLS / "actionlint", f"-shellcheck={shellcheck}", path, check=False)


def test_the_workflow_passes_actionlint():
    result = actionlint(WORKFLOW, "")
    assert result.returncode == 0, result.stdout


def test_the_workflows_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck is not None, "shellcheck is missing (make test installs it)"
    result = actionlint(WORKFLOW, shellcheck)
    assert result.returncode == 0, result.stdout


def test_actionlint_reports_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        WORKFLOW.read_text().replace("${{ matrix.mode }}", "${{ matrix.proxy_mode }}", 1)
    )
    result = actionlint(broken, "")
    assert result.returncode == 1
    assert 'property "proxy_mode" is not defined' in result.stdout


def test_the_workflow_runs_every_proxy_mode(workflow):
    assert workflow["jobs"]["e2e"]["strategy"]["matrix"]["mode"] == list(proxy_config.MODES)


def test_the_workflow_installs_the_pinned_kind_and_its_kubernetes(workflow):
    env = workflow["env"]
    go_mod = (ROOT / "tests" / "go" / "lint" / "go.mod").read_text()
    assert f"sigs.k8s.io/kind {env['KIND_VERSION']}\n" in go_mod
    images = {node["image"] for node in yaml.safe_load(KIND_CONFIG.read_text())["nodes"]}
    assert {image.split("@")[0] for image in images} == {
        f"kindest/node:{env['KUBERNETES_VERSION']}"
    }


def test_the_workflow_focuses_on_network_and_conformance_tests(workflow):
    focus, skip = re.compile(workflow["env"]["E2E_FOCUS"]), re.compile(workflow["env"]["E2E_SKIP"])
    kept = [
        "[sig-network] Services should be rejected when no endpoints exist",
        "[sig-network] Services should implement service.kubernetes.io/service-proxy-name",
        "[sig-network] Networking Granular Checks: Services should function for pod-Service: udp",
        "[sig-network] Networking should check kube-proxy urls",
        "[sig-network] KubeProxy should set TCP CLOSE_WAIT timeout [Privileged]",
        "[sig-network] Conntrack should be able to preserve UDP traffic when server pod cycles "
        "for a ClusterIP service",
        "[sig-apps] Deployment deployment should support rollover [Conformance]",
    ]
    dropped = [
        "[sig-network] Services should be able to create a functioning NodePort service [Serial]",
        "[sig-network] LoadBalancers should be able to change the type of a service [Slow]",
        "[sig-network] Netpol NetworkPolicy between server and client [Feature:NetworkPolicy]",
        "[sig-network] SCTP [LinuxOnly] should create a ClusterIP Service with SCTP ports",
        "[sig-storage] CSI mock volume should be ready [Conformance] [Disruptive]",
    ]
    assert [name for name in kept if focus.search(name) and not skip.search(name)] == kept
    assert [name for name in dropped if focus.search(name) and not skip.search(name)] == []
    affinity_timeout = (
        "[sig-network] Services should have session affinity timeout work for service with "
        "type clusterIP [LinuxOnly] [Conformance]"
    )
    assert focus.search(affinity_timeout) and not skip.search(affinity_timeout)
    ipvs_skip = re.compile(f"{workflow['env']['E2E_SKIP']}|{workflow['env']['E2E_SKIP_IPVS']}")
    assert ipvs_skip.search(affinity_timeout)
    assert [name for name in kept if ipvs_skip.search(name)] == []


def test_the_workflows_mode_overlay_sets_the_daemons_proxy_mode(
    control_plane, manifests_copy, workflow, tmp_path
):
    """The overlay the workflow writes, rendered and dry-run applied beside a copy of
    deploy/kubernetes, gives knit-proxyd a command line that selects the job's mode."""
    (step,) = [
        s for s in workflow["jobs"]["e2e"]["steps"] if s.get("name") == "Select the proxy mode"
    ]
    script = step["run"]
    body = script.split("<<EOF\n", 1)[1].split("\nEOF\n", 1)[0]
    overlay_dir = re.search(r'overlay="([^"]+)"', script).group(1)
    for mode in proxy_config.MODES:
        overlay = tmp_path / overlay_dir.replace("$MODE", mode)
        overlay.mkdir(parents=True)
        (overlay / "kustomization.yaml").write_text(body.replace("$MODE", mode))
        rendered = render(overlay)
        (knit,) = find(rendered, "DaemonSet")["spec"]["template"]["spec"]["containers"]
        assert knit["args"][-1] == f"--proxy-mode={mode}"
        config_file = tmp_path / "config.yaml"
        config_file.write_text(find(rendered, "ConfigMap")["data"]["config.yaml"])
        assert proxy_config.load(daemon_argv(knit, config_file, "node")).proxy_mode == mode
        out = kubectl(
            control_plane, "apply", "--dry-run=server", "--validate=strict", "-k", overlay
        )
        assert "daemonset.apps/knit created (server dry run)" in out


# ---------------------------------------------------------------- Makefile


def test_make_kind_up_builds_creates_loads_applies_and_waits():
    make = ("make", "-s", "-n", "--no-print-directory", "-C", ROOT)
    out = run(*make, "kind-up", "KNIT_MANIFESTS=build/e2e-iptables")
    kubectl_kind = "kubectl --context kind-knit"
    assert out.stdout.splitlines() == [
        "docker build -t knit:dev .",
        "kind create cluster --config deploy/kind/cluster.yaml --name knit",
        "kind load docker-image knit:dev --name knit",
        f"{kubectl_kind} apply -k build/e2e-iptables",
        f"{kubectl_kind} -n kube-system rollout status daemonset/knit --timeout=5m",
        f"{kubectl_kind} -n kube-system rollout status deployment/coredns --timeout=5m",
    ]
    down = run(*make, "kind-down")
    assert down.stdout.splitlines() == ["kind delete cluster --name knit"]
