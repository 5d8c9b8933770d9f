"""One address, one node: a second ``netoptim node`` on an address a running node holds (data port,
ipc path, admin port, metrics port) exits non-zero at once, naming the address, and the first node
keeps serving. Also: port numbers out of range, ``--resume`` from a directory that is not there, and
docs/operations.md naming only flags the commands have."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from netoptim.console import build_parser
from netoptim.launch.processes import NodeProcess
from transport.wire import Header, MsgType
from transport.zeromq.backend import ZmqTransport

REFUSAL_DEADLINE_S = 15.0
"""A node refused its address must say so within this; it imports torch first (~3 s on a busy host)."""


def run_second_node(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run a node that is expected to fail at start; returns its result and how long it took. A node
    that starts anyway is killed at the deadline (``TimeoutExpired`` fails the test)."""
    ready = tmp_path / "second.ready.json"
    command = [sys.executable, "-m", "netoptim", "node", "--threads", "1", "--ready-file", str(ready), *args]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=REFUSAL_DEADLINE_S)
    elapsed = time.monotonic() - started
    assert not ready.exists(), "a refused node must not announce itself ready"
    return result, elapsed


def assert_still_serving(node: NodeProcess) -> None:
    """The first node answers on each of its planes: admin health, data-plane ECHO, metrics."""
    assert node.process is not None and node.process.poll() is None, node.log_text()[-3000:]
    with grpc.insecure_channel(node.admin_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    transport = ZmqTransport()
    client = transport.connect(node.address)
    try:
        client.send(Header(msg_type=MsgType.ECHO))
        answer = client.recv(10.0)
        assert answer is not None and answer.header.msg_type == MsgType.ECHO, "the first node's data plane does not answer"
    finally:
        client.close()
        transport.close()
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to 127.0.0.1, whatever the environment's proxy
    with direct.open(node.metrics_url, timeout=10) as response:
        assert response.status == 200 and b"netoptim_steps_total" in response.read()


def start_first(start_node, listen: str = "tcp://127.0.0.1:0") -> NodeProcess:
    """A running node with admin and metrics on OS-chosen ports."""
    return start_node("first", listen=listen, extra_args=("--admin", "127.0.0.1:0", "--metrics-port", "0"))


def assert_refused(result: subprocess.CompletedProcess, elapsed: float, *expected: str) -> None:
    assert result.returncode == 1, result.stderr[-3000:]
    assert elapsed < REFUSAL_DEADLINE_S
    for text in expected:
        assert text in result.stderr, result.stderr[-3000:]
    assert "or stop the other node" in result.stderr


def test_a_second_node_on_the_same_data_port_is_refused(start_node, tmp_path):
    first = start_first(start_node)
    result, elapsed = run_second_node(tmp_path, "--listen", first.address)
    assert_refused(result, elapsed, f"data address {first.address} is in use by another process", "pick another --listen port")
    assert_still_serving(first)


def test_a_second_node_on_the_same_ipc_path_is_refused(start_node, tmp_path):
    # ZeroMQ unlinks whatever is at an ipc:// path it binds: unchecked, the second node would take the
    # first one's socket without an error.
    first = start_first(start_node, listen=f"ipc://{tmp_path}/node.sock")
    result, elapsed = run_second_node(tmp_path, "--listen", first.address)
    assert_refused(result, elapsed, f"data address {first.address} is in use by another process", "pick another --listen path")
    assert (tmp_path / "node.sock").is_socket()
    assert_still_serving(first)


def test_a_stale_ipc_socket_file_is_replaced(start_node, tmp_path):
    stale = tmp_path / "node.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leftover:  # a socket file nobody listens on, as a kill -9 leaves
        leftover.bind(str(stale))
    assert stale.is_socket()
    assert_still_serving(start_first(start_node, listen=f"ipc://{stale}"))


def test_a_second_node_on_the_same_admin_port_is_refused(start_node, tmp_path):
    first = start_first(start_node)
    result, elapsed = run_second_node(tmp_path, "--admin", first.admin_address)
    assert_refused(result, elapsed, f"admin address {first.admin_address} is in use by another process", "pick another --admin port")
    assert_still_serving(first)


def test_a_second_node_on_the_same_metrics_port_is_refused(start_node, tmp_path):
    first = start_first(start_node)
    port = str(urllib.parse.urlsplit(first.metrics_url).port)
    result, elapsed = run_second_node(tmp_path, "--metrics-port", port)
    assert_refused(result, elapsed, f"metrics address 127.0.0.1:{port} is in use by another process", "pick another --metrics-port")
    assert_still_serving(first)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--listen", "tcp://127.0.0.1:99999"), "port 99999 is out of range"),
        (("--listen", "tcp://127.0.0.1"), "needs a port"),
        (("--admin", "127.0.0.1:99999"), "port 99999 is out of range"),
        (("--metrics-port", "99999"), "99999 is not a port"),
    ],
    ids=["listen", "listen-no-port", "admin", "metrics"],
)
def test_a_port_out_of_range_is_refused(tmp_path, args, message):
    result, _ = run_second_node(tmp_path, *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-3000:]


def test_resume_from_a_missing_directory_exits_1_naming_it(tmp_path):
    missing = tmp_path / "no-such-checkpoints"
    result, _ = run_second_node(tmp_path, "--checkpoint-dir", str(missing), "--resume")
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"the checkpoint directory to resume from does not exist: {missing}" in result.stderr and "leave out --resume" in result.stderr
    assert not missing.exists()


def test_resume_from_an_empty_directory_starts_fresh(start_node, tmp_path):
    empty = tmp_path / "checkpoints"
    empty.mkdir()
    node = start_node(extra_args=("--checkpoint-dir", str(empty), "--resume"))
    assert f"--resume: no intact checkpoint under {empty}; starting fresh" in node.log_text()


# ---------------------------------------------------------------- docs/operations.md and the CLI agree


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_operations_doc_names_only_real_flags_and_every_node_flag():
    from netoptim.recipes.train_gpt_pipeline import build_parser as pipeline_parser  # the doc's --cuts is the pipeline recipe's

    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    parsers = [*_parsers(build_parser()), pipeline_parser()]
    known = {option for parser in parsers for action in parser._actions for option in action.option_strings}
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", doc))
    # the container section's docker and torchrun commands: those programs' own flags
    others = {"--rm", "--name", "--user", "--entrypoint", "--build-arg", "--no-healthcheck", "--standalone", "--nproc-per-node"}
    assert mentioned - known - others == set(), "docs/operations.md mentions flags no command has"
    node = next(parser for parser in parsers if parser.prog == "netoptim node")
    node_flags = {option for action in node._actions for option in action.option_strings if option.startswith("--") and option != "--help"}
    table = doc.split("## Starting a node", 1)[1].split("\n## ", 1)[0]
    in_table = {flag for row in table.splitlines() if row.startswith("| `--") for flag in re.findall(r"--[a-z][a-z0-9-]*", row.split("|")[1])}
    assert node_flags - in_table == set(), "netoptim node flags missing from the flag table of docs/operations.md"


def test_every_netoptim_command_the_docs_show_uses_real_flags():
    """Each ``netoptim SUBCOMMAND ...`` the README and docs/ show (inline or in a code block, with
    its continuation lines) names flags its command (or the training recipes) has."""
    from netoptim.recipes.train_gpt import build_parser as recipe_parser
    from netoptim.recipes.train_gpt_pipeline import build_parser as pipeline_parser

    root = Path(__file__).parents[2]
    parsers = {parser.prog.split(" ")[1]: parser for parser in _parsers(build_parser()) if len(parser.prog.split(" ")) == 2}
    common = {option for parser in (build_parser(), recipe_parser(), pipeline_parser()) for action in parser._actions for option in action.option_strings}
    wrong = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = path.read_text().replace("\\\n", " ")  # a command continued over lines is one command
        for command in re.findall(r"(?<![\w/.-])netoptim ([a-z][a-z-]*)([^`\n]*)", text):
            name, rest = command
            parser = parsers.get(name)
            if parser is None:
                continue  # "netoptim trains ..." in prose
            children = {p.prog.split(" ")[-1]: p for p in _parsers(parser) if p is not parser}
            child = next((children[token] for token in rest.split() if token in children), None)  # `admin --target T morph ...`
            named = (parser, child) if child is not None else tuple(_parsers(parser))  # `bench ... --plot`: a flag of any of its modes
            known = {o for p in named if p is not None for action in p._actions for o in action.option_strings} | common
            wrong += [f"{path.name}: netoptim {name}{rest[:60]}: {flag}" for flag in re.findall(r"(?<![\w=-])--[a-z][a-z0-9-]*", rest) if flag not in known]
            node_flags = {o for action in parsers["node"]._actions for o in action.option_strings}
            wrong += [
                f"{path.name}: netoptim {name}{rest[:60]}: {flag}" for flag in re.findall(r"--node-arg=(--[a-z][a-z0-9-]*)", rest) if flag not in node_flags
            ]
    assert not wrong, "\n".join(wrong)
