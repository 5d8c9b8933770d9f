"""The container image, built from the Dockerfile and run: ``netoptim --version``; a node that
answers on its ports (data plane, admin service, the image's HEALTHCHECK); and two workers run from
the same image, with torchrun as the entry point, that train against it.

Run with ``python -m pytest -m container tests/packaging`` where a container runtime runs and the
base image and the package indexes are reachable (the default selection leaves these tests out).
Selected where no runtime answers, they fail and say so: they do not skip. NETOPTIM_CONTAINER_CLI
names another docker-compatible command (e.g. podman); NETOPTIM_TORCH_INDEX_URL is passed to the
build as TORCH_INDEX_URL (a mirror of PyTorch's CPU index).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import netoptim
from tests.packaging.dockerfile import ROOT

pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

CLI = os.environ.get("NETOPTIM_CONTAINER_CLI", "docker")
TEST_TAG = f"{netoptim.DISTRIBUTION}:test-{uuid.uuid4().hex[:8]}"
"""A tag of its own, removed at the end: the test leaves the user's images as they were."""


def run(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``CLI ARGS...``; with ``check``, an ``AssertionError`` with its output when it fails."""
    result = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{CLI} {' '.join(args)} exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def require_runtime() -> None:
    """Fail (not skip) with what is missing when no container runtime answers."""
    if shutil.which(CLI) is None:
        pytest.fail(f"the container tests need a container runtime: {CLI!r} is not on PATH (NETOPTIM_CONTAINER_CLI names another)", pytrace=False)
    result = subprocess.run([CLI, "info"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        pytest.fail(
            f"the container tests need a running container runtime: `{CLI} info` failed:\n{result.stderr.strip()}\n"
            "Start the daemon, or leave these tests out (the default: -m 'not slow and not container').",
            pytrace=False,
        )


BUILD: dict[str, str] = {}
"""How the image's build went: "tag" once built, "error" once failed (the other tests fail at once)."""


def built_image() -> str:
    """The Dockerfile's image, built once under a tag of its own. Called in the tests' bodies, not
    as a fixture, so that a missing runtime fails each test rather than erroring in its setup."""
    require_runtime()
    if "error" in BUILD:
        pytest.fail(BUILD["error"], pytrace=False)
    if "tag" not in BUILD:
        build_args = []
        if os.environ.get("NETOPTIM_TORCH_INDEX_URL"):
            build_args = ["--build-arg", f"TORCH_INDEX_URL={os.environ['NETOPTIM_TORCH_INDEX_URL']}"]
        result = run("build", *build_args, "-t", TEST_TAG, str(ROOT), timeout=1500, check=False)
        if result.returncode != 0:
            BUILD["error"] = f"{CLI} build failed (exit {result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            pytest.fail(BUILD["error"], pytrace=False)
        BUILD["tag"] = TEST_TAG
    return BUILD["tag"]


@pytest.fixture(scope="module", autouse=True)
def remove_the_test_image() -> Iterator[None]:
    yield
    if "tag" in BUILD:
        run("rmi", BUILD.pop("tag"), check=False)


@contextmanager
def node_container(image: str) -> Iterator[str]:
    """A node container on the image's ports, published on this host's loopback; its name."""
    name = f"netoptim-node-test-{uuid.uuid4().hex[:8]}"
    # The image's own command line, with --insecure: its loopback-only publication is the trusted network.
    command = ["node", "--listen", "tcp://0.0.0.0:5555", "--insecure", "--admin", "0.0.0.0:7000", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"]
    run("run", "-d", "--name", name, "-p", "127.0.0.1::5555", "-p", "127.0.0.1::7000", "-p", "127.0.0.1::9400", image, *command)
    try:
        yield name
    finally:
        logs = run("logs", name, check=False)
        print(f"node container {name}:\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}")
        run("rm", "-f", name, check=False)


def published(container: str, port: int) -> str:
    """``127.0.0.1:PORT`` where this host reaches the container's ``port``."""
    (line, *_) = run("port", container, f"{port}/tcp").stdout.split()
    return line


def netoptim_here(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The ``netoptim`` command of this checkout, run on this host."""
    return subprocess.run([sys.executable, "-m", "netoptim", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_version():
    image = built_image()
    result = run("run", "--rm", image, "--version")
    assert result.stdout.startswith(f"netoptim {netoptim.__version__} "), result.stdout
    assert run("run", "--rm", "--entrypoint", "id", image, "-u").stdout.strip() != "0", "the image runs as a user of its own"


def test_node_answers_and_workers_from_the_same_image_train():
    image = built_image()
    with node_container(image) as name:
        check_node_and_workers(image, name)


def check_node_and_workers(image: str, node: str) -> None:
    admin, data = published(node, 7000), published(node, 5555)
    deadline = time.monotonic() + 180
    while True:
        health = netoptim_here("admin", "--target", admin, "--timeout", "5", "health")
        if health.returncode == 0:
            break
        assert time.monotonic() < deadline, f"the node's admin service at {admin} does not answer: {health.stdout}{health.stderr}"
        time.sleep(2)
    assert "SERVING" in health.stdout
    doctor = netoptim_here("doctor", "--no-host", "--node", f"tcp://{data}", timeout=120)
    assert doctor.returncode == 0, f"the node's data plane at tcp://{data}:\n{doctor.stdout}{doctor.stderr}"

    # Workers: the same image with torchrun as the entry point, in the node's network namespace.
    workers = run(
        "run", "--rm", "--network", f"container:{node}", "--entrypoint", "torchrun", image,
        "--standalone", "--nproc-per-node", "2", "-m", "netoptim.recipes.train_gpt",
        "--nodes", "tcp://127.0.0.1:5555", "--steps", "3", "--sample-tokens", "0",
        timeout=600,
    )  # fmt: skip
    assert "3 steps in" in workers.stdout and "over 2 workers" in workers.stdout, workers.stdout

    # The image's HEALTHCHECK (its first run comes one interval, 30 s, after the start).
    deadline = time.monotonic() + 120
    while (status := run("inspect", "--format", "{{.State.Health.Status}}", node).stdout.strip()) != "healthy":
        assert status in ("starting", "healthy") and time.monotonic() < deadline, f"the node container's health: {status}"
        time.sleep(3)
