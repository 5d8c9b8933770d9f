"""The values a node keeps for a worker that restarts in the middle of a step, whichever way it keeps
them: copied at the bucket's first gradient (fp32 wire, several workers), written by the update
pass (one worker), the outgoing 16-bit copy kept as it was sent (bf16 wire), or, with same-host
workers reading the job's parameter board (fp32 or bf16), left where they are on the board (two slots a
bucket: the update writes the other one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from protos.job.placement import ParamSpec
from tests.optimizer_node.raw_client import JOB, RawWorker
from transport.wire import WIRE_DTYPES, ErrorCode, Header, MsgType, tensor_header
from transport.zeromq.backend import ZmqTransport


@pytest.mark.parametrize("path", ["tcp", "same-host"])
@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_restarted_rank_gets_the_values_of_the_step_it_redoes(start_node, wire, world_size, path):
    job = dataclasses.replace(JOB, world_size=world_size, wire_dtype=wire)
    if path == "same-host":  # buckets large enough for the board (4 KiB or more), laid out as JOB's
        job = dataclasses.replace(job, bucket_numel=4096, params=(ParamSpec("w", (6400,), "float32", 0), ParamSpec("b", (320,), "float32", 0)))
    dtype = WIRE_DTYPES[wire]
    node = start_node()
    transport = ZmqTransport()
    address = node.address if path == "tcp" else node.same_host_address
    ranks = [RawWorker(transport, address, rank) for rank in range(world_size)]
    try:
        assert ranks[0].hello(job).meta["needs_init"] == [0, 1]
        generator = torch.Generator().manual_seed(world_size)
        initial = [torch.randn(bucket.numel, generator=generator) for bucket in job.plan()]
        for bucket_id, values in enumerate(initial):
            assert ranks[0].request(tensor_header(MsgType.INIT, values, rank=0, bucket_id=bucket_id), values).msg_type == MsgType.ACK
        for worker in ranks[1:]:
            assert worker.hello(job).meta["needs_init"] == []
        if path == "same-host":  # two round trips each: the board is offered, mapped, and the node told
            for worker in ranks:
                for _ in range(2):
                    worker.request(Header(msg_type=MsgType.QUERY, rank=worker.rank))
        if wire != "float32":  # the workers' first pull makes the node's outgoing copy of bucket 0, not of bucket 1
            for worker in ranks:
                assert torch.equal(worker.pull(0), initial[0].to(dtype))

        # Step 0: every rank pushes bucket 0, which is updated; bucket 1 waits. Then rank 0 dies.
        grads = [torch.randn(initial[0].numel(), generator=generator).to(dtype) for _ in ranks]
        for rank in reversed(range(world_size)):
            ranks[rank].push(0, 0, grads[rank])
        for worker in ranks:
            header, values = worker.reply()
            assert header.msg_type == MsgType.PARAMS and header.bucket_id == 0 and header.step == 1
        updated = values
        if path == "same-host":  # the values came off the node's board
            assert all(worker.client.shared.board is not None and worker.client.shared.board.read_bytes > 0 for worker in ranks)
        ranks[0].client.close()

        restarted = RawWorker(transport, address, 0)
        ranks[0] = restarted
        meta = restarted.hello(job).meta
        assert meta["resume_step"] == 0 and meta["contributed"] == [0]
        for bucket_id in (0, 1):  # bucket 0 from the kept values, bucket 1 as it is
            header, values = restarted.request(Header(msg_type=MsgType.PULL, rank=0, bucket_id=bucket_id, meta={"at_step": 0}))
            assert header.msg_type == MsgType.PARAMS and header.step == 0
            assert torch.equal(values, initial[bucket_id].to(dtype)), f"bucket {bucket_id}"
        assert torch.equal(ranks[-1].pull(0) if world_size > 1 else restarted.pull(0), updated), "the kept values are a copy"

        # The step ends; once a gradient of step 1 arrives, nobody can need step 0 again.
        for rank in reversed(range(world_size)):
            ranks[rank].push(1, 0, torch.ones(initial[1].numel(), dtype=dtype))
        for worker in ranks:
            assert worker.reply()[0].step == 1
        ranks[0].push(0, 1, torch.ones(initial[0].numel(), dtype=dtype))
        if world_size == 1:
            assert ranks[0].reply()[0].step == 2
        reply = restarted.request(Header(msg_type=MsgType.PULL, rank=0, bucket_id=1, meta={"at_step": 0}))
        assert reply.msg_type == MsgType.ERROR and reply.meta["code"] == ErrorCode.STALE_STEP, reply
    finally:
        for worker in ranks:
            worker.client.close()
        transport.close()
