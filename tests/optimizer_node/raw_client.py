"""A hand-driven worker for node tests: speaks the protocol message by message, so tests can send
exactly the bad input they mean to."""

from __future__ import annotations

import secrets

import torch

from optimizer_node.update.adamw import AdamWHyper, adamw_update
from protos.job.placement import ParamSpec
from protos.job.spec import JobSpec
from transport.wire import Header, MsgType, tensor_header
from transport.zeromq.backend import ZmqClient, ZmqTransport

HYPER = AdamWHyper(1e-2, 0.9, 0.999, 1e-8, 0.1)
# Two parameters, bucket size 128: bucket 0 = w[0:128], bucket 1 = w[128:200] + b[0:10].
JOB = JobSpec(
    world_size=2,
    num_nodes=1,
    bucket_numel=128,
    wire_dtype="float32",
    max_grad_norm=None,
    params=(ParamSpec("w", (200,), "float32", 0), ParamSpec("b", (10,), "float32", 0)),
)


class RawWorker:
    def __init__(self, transport: ZmqTransport, address: str, rank: int) -> None:
        self.client: ZmqClient = transport.connect(address)
        self.rank = rank
        self.incarnation = secrets.randbits(63) | 1  # a process of its own

    def request(self, header: Header, payload: torch.Tensor | None = None, timeout_s: float = 10.0) -> Header:
        self.client.send(header, payload)
        return self.reply(timeout_s)

    def reply(self, timeout_s: float = 10.0):
        message = self.client.recv(timeout_s)
        assert message is not None, "the node did not answer"
        return message.header if not message.tensors else (message.header, torch.cat([v for _, v in message.tensors]).clone())

    def hello(self, job: JobSpec = JOB) -> Header:
        return self.request(Header(msg_type=MsgType.HELLO, rank=self.rank, meta={"job": job.to_wire(), "node_index": 0, "incarnation": self.incarnation}))

    def push(self, bucket_id: int, step: int, grad: torch.Tensor, hyper: AdamWHyper = HYPER, *, finite: bool = False) -> None:
        """A PUSH; ``finite``: with a GPU worker's word that the gradient is finite (``meta["finite"]``)."""
        meta = {"hyper": hyper.to_wire()} | ({"finite": True} if finite else {})
        self.client.send(tensor_header(MsgType.PUSH, grad, rank=self.rank, step=step, bucket_id=bucket_id, meta=meta), grad)

    def pull(self, bucket_id: int) -> torch.Tensor:
        header, values = self.request(Header(msg_type=MsgType.PULL, rank=self.rank, bucket_id=bucket_id))
        assert header.msg_type == MsgType.PARAMS
        return values


class Mirror:
    """What the node's state must be: the same math applied locally."""

    def __init__(self, initial: list[torch.Tensor]) -> None:
        self.buckets = JOB.plan()
        self.param = [t.clone() for t in initial]
        self.exp_avg = [torch.zeros_like(t) for t in initial]
        self.exp_avg_sq = [torch.zeros_like(t) for t in initial]
        self.step_tensor = [torch.zeros(()) for _ in initial]

    def apply(self, bucket_id: int, grads: list[torch.Tensor]) -> None:
        total = grads[0].clone()
        for grad in grads[1:]:
            total += grad
        segments = [(s.bucket_offset, s.numel) for s in self.buckets[bucket_id].segments]
        adamw_update(
            self.param[bucket_id],
            total,
            self.exp_avg[bucket_id],
            self.exp_avg_sq[bucket_id],
            self.step_tensor[bucket_id],
            HYPER,
            segments=segments,
            grad_divisor=torch.tensor(float(len(grads))),
        )
