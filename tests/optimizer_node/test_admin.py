"""The admin plane through a real gRPC channel to a real node process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import threading
import time

import grpc
import pytest
import torch
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gpu_worker import RemoteAdamW
from netoptim.cli.admin import _render_status
from protos import admin_pb2, admin_pb2_grpc
from tests.cli import run_netoptim

TOKEN = "s3cret-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]


@pytest.fixture
def admin_node(start_node):
    node = start_node(extra_args=("--admin", "127.0.0.1:0", "--admin-token", TOKEN))
    channel = grpc.insecure_channel(node.admin_address)
    yield node, admin_pb2_grpc.OptimizerNodeAdminStub(channel), channel
    channel.close()


def make_optimizer(node, model: torch.nn.Module, **options) -> RemoteAdamW:
    return RemoteAdamW(model.parameters(), lr=0.1, nodes=[node.address], rank=0, world_size=1, **options)


def one_step(model: torch.nn.Module, opt: RemoteAdamW) -> None:
    model(torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def test_health_and_reflection(admin_node):
    node, _, channel = admin_node
    assert node.admin_address.startswith("127.0.0.1:")
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)  # no token needed
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=AUTH, timeout=10)
    services = {s.name for r in responses for s in r.list_services_response.service}
    assert {"netoptim.admin.v1.OptimizerNodeAdmin", "grpc.health.v1.Health"} <= services


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer wrong")], [("authorization", TOKEN)]], ids=["none", "wrong", "no-bearer"])
def test_calls_without_the_right_token_are_unauthenticated(admin_node, metadata):
    _, stub, _ = admin_node
    with pytest.raises(grpc.RpcError) as info:
        stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        next(iter(stub.WatchSteps(admin_pb2.WatchStepsRequest(), metadata=metadata, timeout=10)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_status_workers_and_step_stream(admin_node):
    node, stub, _ = admin_node
    status = stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=10)
    assert not status.registered and status.step == 0 and status.data_address == node.address
    events: list[admin_pb2.StepEvent] = []
    stream = stub.WatchSteps(admin_pb2.WatchStepsRequest(), metadata=AUTH)
    reader = threading.Thread(target=lambda: events.extend(e for _, e in zip(range(3), stream, strict=False)))
    reader.start()
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(node, model)
    for _ in range(3):
        one_step(model, opt)
    reader.join(30)
    stream.cancel()
    assert [e.step for e in events] == [1, 2, 3] and all(e.timings.wall_seconds > 0 for e in events)
    status = stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=10)
    assert status.registered and status.step == 3 and status.world_size == 1 and status.buckets_owned == 1
    assert status.bytes_owned == 12 * 15 and status.last_step.update_seconds > 0
    last = status.last_step  # one bucket: its pass is the whole of the step's passes, within the update
    assert last.buckets == 1 and 0 < last.pass_seconds <= last.update_seconds
    assert last.pass_median_ms == last.pass_p90_ms == last.pass_max_ms == pytest.approx(1e3 * last.pass_seconds)
    assert 0 < last.tail_seconds <= last.wall_seconds  # one bucket, one push: the tail starts with the first gradient too
    shown = _render_status(MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
    assert "in the passes of 1 buckets (a bucket's pass: median" in shown and " after the last gradient)" in shown
    # the compiled loop is checked in the background from the node's start; torch ops meanwhile
    assert status.update_path in ("compiled", "torch-ops, checking the compiled loop", "torch-ops")
    deadline = time.monotonic() + 120
    while "checking" in status.update_path and time.monotonic() < deadline:
        time.sleep(0.2)
        status = stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=10)
    assert status.update_path == ("compiled" if importlib.util.find_spec("numba") else "torch-ops")
    workers = stub.ListWorkers(admin_pb2.ListWorkersRequest(), metadata=AUTH, timeout=10)
    assert [w.rank for w in workers.workers] == [0] and workers.workers[0].last_seen_unix > 0
    opt.close()


def test_hyperparameters_override_and_validation(admin_node):
    node, stub, _ = admin_node
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(node, model, weight_decay=0.5)
    one_step(model, opt)
    applied = stub.GetHyperparameters(admin_pb2.GetHyperparametersRequest(), metadata=AUTH, timeout=10).last_applied
    assert [(g.group, g.lr, g.weight_decay) for g in applied] == [(0, pytest.approx(0.1), pytest.approx(0.5))]
    for bad, word in [
        (admin_pb2.Hyperparameters(lr=-1.0), "learning rate"),
        (admin_pb2.Hyperparameters(beta1=1.0), "beta1"),
        (admin_pb2.Hyperparameters(lr_scale=-2), "lr_scale"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            stub.SetHyperparameters(admin_pb2.SetHyperparametersRequest(overrides=bad), metadata=AUTH, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in info.value.details()
    # lr = 0 from the next step: AdamW (decoupled decay included) leaves the parameters as they are.
    reply = stub.SetHyperparameters(admin_pb2.SetHyperparametersRequest(overrides=admin_pb2.Hyperparameters(lr=0.0)), metadata=AUTH, timeout=10)
    assert reply.overrides.HasField("lr") and reply.overrides.lr == 0.0 and not reply.overrides.HasField("beta1")
    listed = stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=10).overrides  # with who set it, and when
    assert [(o.name, o.value) for o in listed] == [("lr", 0.0)] and listed[0].origin.startswith("netoptim admin set-hparams at 20")
    before = [p.detach().clone() for p in model.parameters()]
    one_step(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    cleared = stub.SetHyperparameters(admin_pb2.SetHyperparametersRequest(clear=True), metadata=AUTH, timeout=10)
    assert not cleared.overrides.HasField("lr") and not stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=10).overrides
    one_step(model, opt)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.close()


def test_pause_tells_waiting_workers_why_and_resume_applies_the_held_update(admin_node):
    node, stub, _ = admin_node
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(node, model, timeout_s=2)
    assert stub.Pause(admin_pb2.PauseRequest(reason="maintenance"), metadata=AUTH, timeout=10).step == 0
    status = stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=10)
    assert status.paused and status.pause_reason == "maintenance"
    model(torch.ones(2, 4)).pow(2).sum().backward()
    with pytest.raises(TimeoutError, match=r"updates paused by its operator \(maintenance\)"):
        opt.step()
    resumed = stub.Resume(admin_pb2.ResumeRequest(), metadata=AUTH, timeout=10)
    assert resumed.buckets_applied == 1 and resumed.step == 1
    opt.close()


def test_shutdown_stops_the_node(admin_node):
    node, stub, _ = admin_node
    stub.Shutdown(admin_pb2.ShutdownRequest(), metadata=AUTH, timeout=10)
    assert node.process.wait(20) == 0


def admin_cli(*args: str, in_process: bool = True) -> subprocess.CompletedProcess:
    return run_netoptim("admin", *args, in_process=in_process, timeout=60)


def test_admin_command_line(admin_node):
    node, _, _ = admin_node
    target = ("--target", node.admin_address, "--token", TOKEN)
    result = admin_cli(*target, "--json", "status", in_process=False)  # the console command itself
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["data_address"] == node.address
    result = admin_cli(*target, "status")
    assert result.returncode == 0 and "step 0" in result.stdout
    result = admin_cli(*target, "set-hparams", "--lr-scale", "0.5")
    assert result.returncode == 0 and "lr_scale=0.5" in result.stdout
    assert "override lr_scale=0.5 (set by netoptim admin set-hparams at" in admin_cli(*target, "get-hparams").stdout
    result = admin_cli(*target, "reset", in_process=False)  # no one at the keyboard: not confirmed
    assert result.returncode == 1 and "not confirmed" in result.stderr
    result = admin_cli(*target, "reset", "--yes")
    assert result.returncode == 0 and "no job was registered" in result.stdout
    result = admin_cli(*target, "set-hparams", "--beta2", "1.5")
    assert result.returncode == 1 and "INVALID_ARGUMENT" in result.stderr and "beta2" in result.stderr
    result = admin_cli("--target", node.admin_address, "--token", "nope", "status")
    assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr
    result = admin_cli("--target", node.admin_address, "health")
    assert result.returncode == 0 and "SERVING" in result.stdout
    assert admin_cli(*target, "shutdown").returncode == 0
    assert node.process.wait(20) == 0


def test_prometheus_metrics(start_node):
    import urllib.request

    node = start_node(extra_args=("--metrics-port", "0"))
    assert node.metrics_url.startswith("http://127.0.0.1:")
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(node, model)
    for _ in range(2):
        one_step(model, opt)

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(node.metrics_url, timeout=10).read().decode()
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}

    assert scrape()["netoptim_workers_connected"] == 1
    opt.close()  # its BYE: the worker has left
    deadline = time.monotonic() + 10
    while (values := scrape())["netoptim_workers_connected"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert values["netoptim_steps_total"] == 2 and values["netoptim_workers_connected"] == 0
    assert values["netoptim_bytes_received_total"] == 4 * 15 * 3  # initial values + two gradients of 15 fp32
    assert values["netoptim_bytes_sent_total"] == 4 * 15 * 3  # one pull + two updates
    assert values['netoptim_bucket_update_latency_seconds_bucket{le="+Inf"}'] == 2
    assert values['netoptim_last_step_seconds{part="update"}'] > 0


def test_tls_admin_service(start_node, tmp_path):
    key, cert = tmp_path / "node.key", tmp_path / "node.pem"
    made = subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        capture_output=True,
        timeout=60,
    )
    if made.returncode != 0:
        pytest.skip("openssl could not make a test certificate")
    node = start_node(extra_args=("--admin", "127.0.0.1:0", "--admin-token", TOKEN, "--tls-cert", str(cert), "--tls-key", str(key)))
    secure = grpc.secure_channel(node.admin_address, grpc.ssl_channel_credentials(root_certificates=cert.read_bytes()))
    status = admin_pb2_grpc.OptimizerNodeAdminStub(secure).GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=10)
    assert status.data_address == node.address
    with pytest.raises(grpc.RpcError) as info:  # plaintext is refused
        admin_pb2_grpc.OptimizerNodeAdminStub(grpc.insecure_channel(node.admin_address)).GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    result = admin_cli("--target", node.admin_address, "--token", TOKEN, "--tls-ca", str(cert), "status")
    assert result.returncode == 0 and "step 0" in result.stdout


def test_max_grad_norm_override(admin_node):
    node, stub, _ = admin_node
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(node, model)
    assert opt.last_grad_norm is None
    for bad, word in [(-1.0, "positive"), (float("inf"), "positive")]:
        with pytest.raises(grpc.RpcError) as info:
            stub.SetHyperparameters(
                admin_pb2.SetHyperparametersRequest(overrides=admin_pb2.Hyperparameters(max_grad_norm=bad, lr=0.5)), metadata=AUTH, timeout=10
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in info.value.details()
    overrides = stub.GetHyperparameters(admin_pb2.GetHyperparametersRequest(), metadata=AUTH, timeout=10).overrides
    assert not overrides.HasField("lr") and not overrides.HasField("max_grad_norm")  # the rejected call changed nothing
    # A one-node job can switch clipping on: the next step reports the norm and clips to it.
    reply = stub.SetHyperparameters(admin_pb2.SetHyperparametersRequest(overrides=admin_pb2.Hyperparameters(max_grad_norm=1e-3)), metadata=AUTH, timeout=10)
    assert reply.overrides.max_grad_norm == pytest.approx(1e-3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1, fused=True)
    one_step(model, opt)
    reference(torch.ones(2, 4)).pow(2).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    ref_opt.step()
    assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    opt.close()


def test_clipping_cannot_be_switched_on_one_node_of_several(admin_node, start_node):
    node, stub, _ = admin_node
    other = start_node("other")
    opt = RemoteAdamW(torch.nn.Linear(40, 40).parameters(), nodes=[node.address, other.address], rank=0, world_size=1, bucket_numel=1024)
    with pytest.raises(grpc.RpcError) as info:
        stub.SetHyperparameters(admin_pb2.SetHyperparametersRequest(overrides=admin_pb2.Hyperparameters(max_grad_norm=1.0)), metadata=AUTH, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "without clipping over 2 nodes" in info.value.details()
    opt.close()


def test_overrides_are_checkpointed_with_their_origin_and_listed_after_a_resume(start_node, tmp_path):
    checkpoints = ("--admin", "127.0.0.1:0", "--admin-token", TOKEN, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1")
    node = start_node("first", extra_args=checkpoints)
    with grpc.insecure_channel(node.admin_address) as channel:
        stub = admin_pb2_grpc.OptimizerNodeAdminStub(channel)
        stub.SetHyperparameters(admin_pb2.SetHyperparametersRequest(overrides=admin_pb2.Hyperparameters(lr_scale=0.5)), metadata=AUTH, timeout=10)
        set_by = stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=10).overrides[0].origin
        model = torch.nn.Linear(4, 3)
        opt = make_optimizer(node, model)
        one_step(model, opt)
        opt.close()
    assert node.stop() == 0
    manifest = json.loads((tmp_path / "ckpt" / f"step-{1:010d}" / "manifest.json").read_text())
    assert manifest["overrides"] == {"lr_scale": 0.5} and manifest["override_origins"] == {"lr_scale": set_by}
    resumed = start_node("resumed", extra_args=(*checkpoints, "--resume"))
    with grpc.insecure_channel(resumed.admin_address) as channel:
        listed = admin_pb2_grpc.OptimizerNodeAdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), metadata=AUTH, timeout=10).overrides
    assert [(o.name, o.value, o.origin) for o in listed] == [("lr_scale", 0.5, f"{set_by}, restored from step-{1:010d}")]
