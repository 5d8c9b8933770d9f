"""``netoptim admin``: a command-line client of a node's gRPC admin service."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable
from typing import Any

TOKEN_ENV = "NETOPTIM_ADMIN_TOKEN"
"""Environment variable holding the admin token, for the node and for this client."""

_HYPER_FLAGS = (
    ("lr", "replace the learning rate the workers send"),
    ("lr_scale", "multiply the learning rate"),
    ("beta1", "AdamW beta1"),
    ("beta2", "AdamW beta2"),
    ("eps", "AdamW eps"),
    ("weight_decay", "decoupled weight decay"),
    ("max_grad_norm", "global gradient-norm clipping threshold (several nodes: set it on every node; it cannot switch clipping on or off there)"),
)


def add_admin_parser(subparsers: argparse._SubParsersAction) -> None:
    admin = subparsers.add_parser(
        "admin",
        help="call a node's gRPC admin service",
        description="Call the admin service of a running node (netoptim node --admin HOST:PORT). Exit status 0 on success, 1 when the call fails.",
    )
    admin.add_argument("--target", required=True, metavar="HOST:PORT", help='the node\'s admin address (the "admin" field of its ready file)')
    admin.add_argument("--token-file", default=None, metavar="FILE", help="read the node's bearer token from FILE (mode 600)")
    admin.add_argument(
        "--token",
        default=None,
        help=f"bearer token if the node requires one (default: ${TOKEN_ENV}); visible to every user of the host in ps: prefer --token-file",
    )
    admin.add_argument("--tls-ca", default=None, metavar="PEM", help="connect with TLS, trusting this CA certificate (the node's --tls-cert when self-signed)")
    admin.add_argument("--json", action="store_true", help="print the response as JSON, for scripts")
    admin.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer (default: %(default)s)")
    calls = admin.add_subparsers(
        dest="call", required=True, metavar="{status,workers,get-hparams,set-hparams,pause,resume,checkpoint,drain,reset,morph,shutdown,watch,health}"
    )
    calls.add_parser("status", help="what the node is doing")
    calls.add_parser("workers", help="the worker ranks the node has heard from")
    calls.add_parser("get-hparams", help="overrides in force and the hyperparameters of the last update")
    setter = calls.add_parser("set-hparams", help="override hyperparameters from the next update on")
    for name, text in _HYPER_FLAGS:
        setter.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float, default=None, help=text)
    setter.add_argument("--clear", action="store_true", help="drop every override first")
    pause = calls.add_parser("pause", help="stop applying updates; workers are told why")
    pause.add_argument("--reason", default="", help="shown to the waiting workers and in status")
    calls.add_parser("resume", help="apply held updates and go on")
    calls.add_parser("checkpoint", help="write a checkpoint (now, or at the end of the step in flight) and print its manifest")
    calls.add_parser("drain", help="finish the step in flight, checkpoint, take no later gradients")
    reset = calls.add_parser(
        "reset",
        help="let the node's job go so that it takes the next one (checkpointed first; its checkpoints move to finished/ under the "
        "checkpoint directory); asks for the node's id to confirm",
    )
    reset.add_argument("--yes", action="store_true", help="do not ask: confirm with the node's id as its status gives it (for scripts)")
    morph = calls.add_parser(
        "morph",
        help="ask ranks of an elastic job to leave, as a preemption notice would: each leaves at the next step its group agrees on and the job "
        "goes on narrower (growing takes a new worker process: docs/elastic.md)",
    )
    morph.add_argument("--leave", type=int, action="append", required=True, metavar="RANK", help="a rank to leave (repeat for several)")
    morph.add_argument("--reason", default="", help="shown to the ranks and logged")
    calls.add_parser("shutdown", help="stop the node")
    watch = calls.add_parser("watch", help="print one line per completed step")
    watch.add_argument("--count", type=int, default=0, help="stop after this many steps (default: until interrupted)")
    calls.add_parser("health", help="the standard gRPC health check")


def _print(args: argparse.Namespace, response: Any, render: Callable[[dict], str]) -> None:
    from google.protobuf.json_format import MessageToDict

    as_dict = MessageToDict(response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    print(json.dumps(as_dict) if args.json else render(as_dict), flush=True)


def _job_state(status: dict) -> str:
    state = status.get("job_state") or "idle"
    drain_step = int(status.get("drain_step", -1))
    if state in ("draining", "drained"):
        return f"{state} (last step {drain_step}; `admin resume` undoes it)"
    if state == "finished":
        return "finished (every rank closed its optimizer; the node takes the next job, or after `admin reset` with --next-job refuse)"
    return state


def _render_overrides(overrides: list[dict]) -> list[str]:
    return [f"override {o['name']}={o['value']} (set by {o['origin'] or 'an operator'})" for o in overrides]


def _render_status(status: dict) -> str:
    last = status["last_step"]
    lines = [
        f"node {status['node_id']} (netoptim {status['version']}), up {float(status['uptime_seconds']):.0f} s, data plane {status['data_address']}",
        f"step {status['step']}, {_job_state(status)}" + (f", PAUSED: {status['pause_reason']}" if status["paused"] else ""),
        f"job: {'registered' if status['registered'] else 'none yet'}, {status['world_size']} workers, {status['buckets_owned']} buckets, {int(status['bytes_owned']) / 2**20:.1f} MiB of state ({int(status['bytes_in_ram']) / 2**20:.1f} MiB in RAM"
        + (f", {int(status['bytes_on_disk']) / 2**20:.1f} MiB on disk)" if int(status.get("bytes_on_disk", 0)) else ")"),
        f"last step: {1e3 * last['wall_seconds']:.1f} ms (sum {1e3 * last['reduce_seconds']:.1f}, update {1e3 * last['update_seconds']:.1f}, send {1e3 * last['send_seconds']:.1f}; "
        f"{1e3 * float(last.get('tail_seconds', 0.0)):.1f} after the last gradient)"
        + (f", updates on {status['update_path']}" if status.get("update_path") else "")
        + (f", moments {status['moments']}" if status.get("moments") else ""),
    ]
    if int(last.get("buckets", 0)):  # a long tail: update threads held up by others on their cores
        lines.append(
            f"  of the update, {1e3 * last['pass_seconds']:.1f} ms in the passes of {last['buckets']} buckets "
            f"(a bucket's pass: median {last['pass_median_ms']:.2f} ms, p90 {last['pass_p90_ms']:.2f}, longest {last['pass_max_ms']:.2f})"
        )
    if int(status.get("morphs", 0)):
        pause = float(status.get("last_morph_pause_seconds", -1))
        lines.append(
            f"width changed {status['morphs']} time(s); last at step {status['last_morph_step']}, from {status['last_morph_from']} to "
            f"{status['world_size']} workers" + (f", {1e3 * pause:.1f} ms pause" if pause >= 0 else "")
        )
    if status.get("state_at_risk"):
        lines.append(f"WARNING: {status['state_at_risk']}")
    lines += _render_overrides(status.get("overrides", []))
    non_finite = status.get("non_finite")
    if non_finite:
        lines.append(_render_non_finite(non_finite))
    lines += [_render_worker(w) for w in status["workers"]]
    return "\n".join(lines)


def _render_non_finite(non_finite: dict) -> str:
    """The node's NaN/inf counters: policy, pushes refused, steps skipped, the last one."""
    line = f"non-finite gradients (--non-finite {non_finite['policy']}): {non_finite['refused_pushes']} push(es) refused, {non_finite['skipped_steps']} step(s) skipped"
    last = non_finite.get("last")
    if last:
        line += f"; last {last['action']} at step {last['step']}"
        if int(last["rank"]) >= 0:
            line += f": rank {last['rank']}, bucket {last['bucket']}, {last['values']} NaN/inf value(s)"
    return line


def _render_worker(worker: dict) -> str:
    seen = datetime.datetime.fromtimestamp(float(worker["last_seen_unix"]), tz=datetime.UTC)
    return f"  rank {worker['rank']}: last seen {seen:%Y-%m-%d %H:%M:%S} UTC"


def _render_hparams(response: dict) -> str:
    overrides = response.get("overrides", {})
    lines = ["overrides: " + (", ".join(f"{k}={v}" for k, v in overrides.items()) or "none"), *_render_overrides(response.get("origins", []))]
    lines += [
        f"group {g['group']}: lr={g['lr']} betas=({g['beta1']}, {g['beta2']}) eps={g['eps']} weight_decay={g['weight_decay']}"
        for g in response.get("last_applied", [])
    ]
    return "\n".join(lines)


def admin_token(token_file: str | None, token: str | None) -> str | None:
    """The bearer token for a node's admin service: read from ``token_file`` (``ValueError`` if others
    may read it or it is empty), else ``token``, else ``$NETOPTIM_ADMIN_TOKEN``; ``None``: none."""
    if token_file:
        from transport.secret_files import read_token_file

        return read_token_file(token_file)
    return token or os.environ.get(TOKEN_ENV) or None


def admin_channel(target: str, tls_ca: str | None) -> Any:
    """A gRPC channel to a node's admin service at ``target``: TLS trusting ``tls_ca`` where given."""
    import grpc

    if tls_ca:
        with open(tls_ca, "rb") as handle:
            return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=handle.read()))
    return grpc.insecure_channel(target)


def run_admin(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos import admin_pb2, admin_pb2_grpc

    try:
        token = admin_token(args.token_file, args.token)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with admin_channel(args.target, args.tls_ca) as channel:
        stub = admin_pb2_grpc.OptimizerNodeAdminStub(channel)
        call = {"metadata": metadata, "timeout": args.timeout}
        try:
            if args.call == "status":
                _print(args, stub.GetStatus(admin_pb2.GetStatusRequest(), **call), _render_status)
            elif args.call == "workers":
                _print(
                    args,
                    stub.ListWorkers(admin_pb2.ListWorkersRequest(), **call),
                    lambda r: "\n".join([f"world size {r['world_size']}"] + [_render_worker(w) for w in r["workers"]]),
                )
            elif args.call == "get-hparams":
                _print(args, stub.GetHyperparameters(admin_pb2.GetHyperparametersRequest(), **call), _render_hparams)
            elif args.call == "set-hparams":
                values = {name: getattr(args, name) for name, _ in _HYPER_FLAGS if getattr(args, name) is not None}
                request = admin_pb2.SetHyperparametersRequest(overrides=admin_pb2.Hyperparameters(**values), clear=args.clear)
                _print(args, stub.SetHyperparameters(request, **call), _render_hparams)
            elif args.call == "pause":
                _print(args, stub.Pause(admin_pb2.PauseRequest(reason=args.reason), **call), lambda r: f"paused at step {r['step']}")
            elif args.call == "resume":
                _print(
                    args,
                    stub.Resume(admin_pb2.ResumeRequest(), **call),
                    lambda r: f"resumed at step {r['step']}; {r['buckets_applied']} held bucket updates applied",
                )
            elif args.call in ("checkpoint", "drain"):
                rpc, request = (stub.Checkpoint, admin_pb2.CheckpointRequest()) if args.call == "checkpoint" else (stub.Drain, admin_pb2.DrainRequest())
                _print(args, rpc(request, metadata=metadata, timeout=max(args.timeout, 300.0)), lambda r: f"checkpoint of step {r['step']} at {r['path']}")
            elif args.call == "reset":
                status = stub.GetStatus(admin_pb2.GetStatusRequest(), **call)
                confirm = status.node_id
                if not args.yes:
                    print(f"node {status.node_id} is at step {status.step} ({status.job_state or 'idle'}); a reset lets its job go.", file=sys.stderr)
                    try:
                        confirm = input("type the node's id to confirm: ").strip()
                    except EOFError:
                        confirm = ""
                    if confirm != status.node_id:
                        print("netoptim admin reset: not confirmed; nothing was done", file=sys.stderr)
                        return 1
                _print(
                    args,
                    stub.Reset(admin_pb2.ResetRequest(confirm_node_id=confirm), **call),
                    lambda r: (
                        f"let job {r['job']} go at step {r['step']}" + (f"; its checkpoints are in {r['archived']}" if r["archived"] else "")
                        if r["job"]
                        else "no job was registered"
                    ),
                )
            elif args.call == "morph":
                _print(
                    args,
                    stub.Morph(admin_pb2.MorphRequest(leave=args.leave, reason=args.reason), **call),
                    lambda r: f"told rank(s) {r.get('told', [])} to leave; the job has {r['world_size']} workers until the agreed step",
                )
            elif args.call == "shutdown":
                _print(args, stub.Shutdown(admin_pb2.ShutdownRequest(), **call), lambda r: "the node is stopping")
            elif args.call == "watch":
                stream = stub.WatchSteps(admin_pb2.WatchStepsRequest(), metadata=metadata)
                stream.initial_metadata()  # subscribed: every step from now on is printed
                print(f"netoptim admin watch: watching {args.target}'s steps (Ctrl-C stops)", file=sys.stderr, flush=True)
                for count, event in enumerate(stream, start=1):
                    _print(
                        args,
                        event,
                        lambda e: f"step {e['step']}: {1e3 * e['timings']['wall_seconds']:.1f} ms (update {1e3 * e['timings']['update_seconds']:.1f})",
                    )
                    if args.count and count >= args.count:
                        stream.cancel()
                        break
                else:  # the stream ended without being asked to: the node stopped or drained away
                    print("netoptim admin watch: the node ended the stream (it stopped or is shutting down)", file=sys.stderr)
                    return 1
            elif args.call == "health":
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
                _print(args, reply, lambda r: r["status"])
            else:
                raise AssertionError(args.call)
        except grpc.RpcError as exc:
            print(f"netoptim admin {args.call}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
