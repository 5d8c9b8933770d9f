"""examples/kubernetes/: the core-API manifests validate against Kubernetes' own schemas (bundled
with kubernetes-validate: no network), the PyTorchJob has the structure the Kubeflow training
operator requires (its pod template checked as a core PodTemplate), every ``netoptim`` and
``torchrun`` command line and the nodes' TOML config parse with the real parsers, and the host
lists resolve, with job.discovery, to the StatefulSet's pods in order."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from gpu_worker.discovery import NODE_FILE_ENV, NODES_ENV, resolve_nodes
from netoptim.console import parse_command_line
from tests.examples.commands import check_netoptim, check_torchrun
from transport.secret_files import check_private

KUBERNETES_VERSION = "1.30"
"""The oldest Kubernetes the manifests are written for (gRPC probes are GA from 1.27, Indexed Jobs from 1.24)."""

NEWEST_VERSION = kubernetes_validate.utils.latest_version()
"""The newest the installed kubernetes-validate knows: nothing the manifests use was removed since."""

DIRECTORY = Path(__file__).resolve().parents[2] / "examples" / "kubernetes"
CORE_KINDS = {"ConfigMap", "Service", "StatefulSet", "Job"}


def load(name: str) -> dict[str, dict]:
    """The documents of ``name``.yaml by kind (each kind appears once per file here)."""
    docs = [doc for doc in yaml.safe_load_all((DIRECTORY / f"{name}.yaml").read_text()) if doc]
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), f"{name}.yaml: one document per kind"
    return by_kind


NODES, INDEXED, PYTORCHJOB = load("optimizer-nodes"), load("workers-indexed-job"), load("workers-pytorchjob")


def pod_spec(workload: dict) -> dict:
    if workload["kind"] == "PyTorchJob":
        return workload["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return workload["spec"]["template"]["spec"]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` references in command lines, from the container's environment."""
    return re.sub(r"\$\((\w+)\)", lambda match: env.get(match[1], f"value-of-{match[1]}"), text)


def container_env(container: dict) -> dict[str, str]:
    return {item["name"]: item.get("value", f"from-{item['name']}") for item in container.get("env", [])}


def shell_netoptim_commands(script: str) -> list[list[str]]:
    """Each ``netoptim ...`` command inside a shell script, up to the next ; | & or line end."""
    return [shlex.split(match) for match in re.findall(r"\bnetoptim\s[^;|&\n]*", script)]


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, NEWEST_VERSION])
@pytest.mark.parametrize("doc", [*NODES.values(), *INDEXED.values()], ids=lambda doc: f"{doc['kind']}/{doc['metadata']['name']}")
def test_core_manifests_match_the_kubernetes_schema(doc, version):
    assert doc["kind"] in CORE_KINDS
    kubernetes_validate.validate(doc, version, strict=True)


def test_pytorchjob_structure():
    job = PYTORCHJOB["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1" and job["metadata"]["name"]
    spec = job["spec"]
    assert set(spec) <= {"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"}
    elastic = spec["elasticPolicy"]
    known = {"minReplicas", "maxReplicas", "rdzvBackend", "rdzvPort", "rdzvHost", "rdzvId", "rdzvConf", "standalone", "nProcPerNode", "maxRestarts", "metrics"}
    assert set(elastic) <= known and elastic["rdzvBackend"] == "c10d"
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) <= {"Master", "Worker"} and replicas.get("Master", {}).get("replicas", 1) == 1
    worker = replicas["Worker"]
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    assert worker["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
    containers = worker["template"]["spec"]["containers"]
    assert all(c.get("image") for c in containers) and any(c["name"] == "pytorch" for c in containers)
    # The pod template itself is core API: validate it as a PodTemplate.
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"}, "template": worker["template"]}
    kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)


def test_node_command_line_and_config_parse(tmp_path):
    (container,) = pod_spec(NODES["StatefulSet"])["containers"]
    assert container["command"] == ["netoptim"]
    argv = [expand(arg, container_env(container)) for arg in container["args"]]
    config = tmp_path / "node.toml"
    config.write_text(NODES["ConfigMap"]["data"]["node.toml"])
    argv[argv.index("--config") + 1] = str(config)
    args = parse_command_line(argv)  # the node's own path: the [node] table, each key through its flag
    assert args.command == "node" and args.node_id == "from-POD_NAME"
    assert args.curve_secret_key and args.curve_allow, "a node reachable from the network needs CURVE"
    assert args.resume and args.checkpoint_dir == container_volume_path(container, "data")
    assert "NETOPTIM_ADMIN_TOKEN" in container_env(container), "an admin service on the pod's address needs a token"
    admin_port = int(args.admin.rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == admin_port, probe  # Kubernetes' native gRPC probe: grpc.health.v1
    annotations = NODES["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == args.metrics_port and args.metrics_host == "0.0.0.0"
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    ports = {p["name"]: p["port"] for p in NODES["Service"]["spec"]["ports"]}
    assert ports == {"data": int(args.listen.rsplit(":", 1)[1]), "admin": admin_port, "metrics": args.metrics_port}


def container_volume_path(container: dict, volume: str) -> str:
    return next(mount["mountPath"] for mount in container["volumeMounts"] if mount["name"] == volume)


def test_host_lists_are_the_statefulset_pods_in_order(tmp_path):
    statefulset, service = NODES["StatefulSet"], NODES["Service"]
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    data_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "data")
    name, count = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
    expected = tuple(f"tcp://{name}-{i}.{service['metadata']['name']}:{data_port}" for i in range(count))
    host_file = tmp_path / "nodes.txt"
    host_file.write_text(NODES["ConfigMap"]["data"]["nodes.txt"])
    assert resolve_nodes(environ={NODE_FILE_ENV: str(host_file)}).addresses == expected
    (indexed,) = pod_spec(INDEXED["Job"])["containers"]
    assert container_env(indexed)[NODE_FILE_ENV] == f"{container_volume_path(indexed, 'config')}/nodes.txt"
    (pytorch,) = pod_spec(PYTORCHJOB["PyTorchJob"])["containers"]
    assert resolve_nodes(environ={NODES_ENV: container_env(pytorch)[NODES_ENV]}).addresses == expected


@pytest.mark.parametrize("workload", [INDEXED["Job"], PYTORCHJOB["PyTorchJob"]], ids=["indexed-job", "pytorchjob"])
def test_worker_command_lines_parse(workload):
    spec = pod_spec(workload)
    (container,) = spec["containers"]
    assert container["command"] == ["torchrun"]
    launcher, recipe = check_torchrun([expand(arg, container_env(container)) for arg in container["args"]])
    assert recipe.nodes is None, "the workers take the nodes from the environment, through rank 0"
    assert launcher.nproc_per_node == str(container["resources"]["limits"]["nvidia.com/gpu"])
    assert recipe.curve_secret_key.startswith(container_volume_path(container, "worker-keys"))
    init = init_container(spec, "wait-for-nodes")
    commands = shell_netoptim_commands(init["args"][0])
    assert commands, "the init container waits for the nodes with netoptim admin"
    for argv in commands:
        assert check_netoptim(argv[1:]).call == "health"
    if workload["kind"] == "Job":
        job, service = workload, INDEXED["Service"]
        assert job["spec"]["completionMode"] == "Indexed" and launcher.rdzv_backend == "c10d"
        assert int(launcher.nnodes) == job["spec"]["completions"] == job["spec"]["parallelism"]
        host = f"{job['metadata']['name']}-0.{spec['subdomain']}"  # pod 0's stable name
        assert launcher.rdzv_endpoint == f"{host}:{service['spec']['ports'][0]['port']}"
        assert spec["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}


def init_container(spec: dict, name: str) -> dict:
    (init,) = [init for init in spec.get("initContainers", []) if init["name"] == name]
    return init


KEY_COPIES = {
    "node": (NODES["StatefulSet"], "node-key"),
    "indexed-job": (INDEXED["Job"], "worker-keys"),
    "pytorchjob": (PYTORCHJOB["PyTorchJob"], "worker-keys"),
}
"""Each pod's secret keys: the init container, of the same name as the volume in memory it copies
them into, and that volume; the Secret's volume is that name with -secret."""


@pytest.mark.parametrize("case", KEY_COPIES, ids=list(KEY_COPIES))
def test_secret_keys_are_private_copies_of_the_image_user(case, tmp_path):
    """The image runs as a user of its own, which reads a Secret's root-owned files only through
    fsGroup, and fsGroup makes them group-readable: a secret key the node and the workers refuse.
    The init container copies them, 0400 and the user's own, into a volume in memory; its command,
    run here on a file as the kubelet leaves it (0440), gives files the real check accepts."""
    workload, name = KEY_COPIES[case]
    spec = pod_spec(workload)
    security = spec["securityContext"]
    assert security["runAsNonRoot"] and security["fsGroup"] == security["runAsGroup"], "fsGroup: the user's group reads the Secret"
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert volumes[name]["emptyDir"]["medium"] == "Memory", "the copies stay off the disks"
    assert volumes[f"{name}-secret"]["secret"]["defaultMode"] == 0o400
    (container,) = spec["containers"]
    assert {mount["name"] for mount in container["volumeMounts"]} & {name, f"{name}-secret"} == {name}, "the container reads the copies only"
    copier = init_container(spec, name)
    assert copier["image"] == container["image"]
    mounts = {mount["name"]: mount["mountPath"] for mount in copier["volumeMounts"]}
    assert mounts[name] == container_volume_path(container, name)
    secret_dir, copy_dir = tmp_path / "secret", tmp_path / "copy"
    secret_dir.mkdir()
    copy_dir.mkdir()
    key = "node.key_secret" if case == "node" else "worker0.key_secret"
    (secret_dir / key).write_text("secret\n")
    (secret_dir / key).chmod(0o440)
    local = {mounts[f"{name}-secret"]: str(secret_dir), mounts[name]: str(copy_dir)}
    argv = [re.sub("|".join(map(re.escape, local)), lambda match: local[match[0]], arg) for arg in copier["command"] + copier.get("args", [])]
    subprocess.run(argv, check=True, timeout=30)
    check_private(str(copy_dir / key), "the copied key")
    assert (copy_dir / key).read_text() == "secret\n"
