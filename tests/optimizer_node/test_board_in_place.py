"""The update pass writes a bucket's new values onto the parameter board in the wire dtype, fp32 or
bf16 (its cast), so nothing is copied onto the board on the send path once the job runs; the values
same-host workers read there are the oracle's, bit for bit, and a worker on TCP gets the same bits
(sent from the board's slot)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from optimizer_node.update.adamw import adamw_update
from protos.job.placement import ParamSpec
from tests.optimizer_node.raw_client import HYPER, JOB, RawWorker
from tests.optimizer_node.test_metrics import scrape
from transport.wire import WIRE_DTYPES, Header, MsgType, tensor_header
from transport.zeromq.backend import ZmqTransport

STEPS = 3


@pytest.mark.parametrize(("wire", "masters"), [("float32", True), ("bfloat16", True), ("float32", False)], ids=["fp32", "bf16", "fp32-copied"])
def test_updates_are_written_onto_the_board_in_place_in_the_wire_dtype(start_node, wire, masters):
    # two workers, one on the node's host (reads the board) and one on TCP; buckets large enough to leave alone
    job = dataclasses.replace(JOB, world_size=2, wire_dtype=wire, bucket_numel=4096, params=(ParamSpec("w", (6400,), "float32", 0),))
    dtype = WIRE_DTYPES[wire]
    node = start_node(extra_args=("--metrics-port", "0", *(() if masters else ("--no-masters-on-board",))))
    transport = ZmqTransport()
    local, remote = RawWorker(transport, node.same_host_address, 0), RawWorker(transport, node.address, 1)
    try:
        assert local.hello(job).meta["needs_init"] == [0, 1]
        generator = torch.Generator().manual_seed(7)
        params = [torch.randn(bucket.numel, generator=generator) for bucket in job.plan()]
        for bucket_id, values in enumerate(params):
            assert local.request(tensor_header(MsgType.INIT, values, rank=0, bucket_id=bucket_id), values).msg_type == MsgType.ACK
        assert remote.hello(job).meta["needs_init"] == []
        for _ in range(2):  # two round trips: the board is offered, mapped, and the node told
            local.request(Header(msg_type=MsgType.QUERY, rank=0))
        for bucket_id, values in enumerate(params):  # the first values are copied onto the board as they are sent
            assert torch.equal(local.pull(bucket_id), values.to(dtype)) and torch.equal(remote.pull(bucket_id), values.to(dtype))
        copied_at_start = scrape(node.metrics_url)["netoptim_same_host_board_copied_bytes_total"]
        assert copied_at_start == sum(values.numel() for values in params) * dtype.itemsize

        moments = [(torch.zeros_like(values), torch.zeros_like(values), torch.zeros(())) for values in params]
        for step in range(STEPS):
            for bucket_id, values in enumerate(params):
                grads = [torch.randn(values.numel(), generator=generator).to(dtype) for _ in range(2)]
                remote.push(bucket_id, step, grads[1])
                local.push(bucket_id, step, grads[0])
                # the oracle: torch's fused AdamW on the two gradients summed in fp32 in rank order, divided by two
                total = grads[0].to(torch.float32) + grads[1].to(torch.float32)
                adamw_update(values, total, *moments[bucket_id], HYPER, grad_divisor=torch.tensor(2.0))
                for worker in (local, remote):
                    header, received = worker.reply()
                    assert header.msg_type == MsgType.PARAMS and header.bucket_id == bucket_id and header.step == step + 1
                    assert received.dtype == dtype and torch.equal(received, values.to(dtype)), f"step {step}, bucket {bucket_id}, rank {worker.rank}"
        assert local.client.shared.board is not None and local.client.shared.board.read_bytes > 0, "the local worker read the board"
        metrics = scrape(node.metrics_url)
        assert metrics["netoptim_same_host_board_copied_bytes_total"] == copied_at_start, "every update was written onto the board in place"
        assert metrics["netoptim_same_host_board_written_bytes_total"] == copied_at_start * (1 + STEPS)
        # fp32: the board's slots are the master values themselves, each update writing beside the version it reads
        on_board = 4 * sum(values.numel() for values in params) if wire == "float32" and masters else 0
        assert metrics["netoptim_master_values_on_board_bytes"] == on_board
        header, read = local.request(Header(msg_type=MsgType.READ_STATE, rank=0, bucket_id=1, meta={"part": "param"}))
        assert header.msg_type == MsgType.STATE and torch.equal(read, params[1]), "the state read is the masters, wherever they live"

        # values loaded between steps go into memory of the bucket's own, not into a slot a worker may read
        loaded = torch.randn(params[0].numel(), generator=generator)
        load = tensor_header(MsgType.LOAD_STATE, loaded, rank=0, bucket_id=0, meta={"part": "param"})
        assert local.request(load, loaded).msg_type == MsgType.ACK
        assert scrape(node.metrics_url)["netoptim_master_values_on_board_bytes"] == on_board - (4 * params[0].numel() if on_board else 0)
        assert torch.equal(local.pull(0), loaded.to(dtype)) and torch.equal(remote.pull(0), loaded.to(dtype))
        params[0] = loaded
        grads = [torch.randn(loaded.numel(), generator=generator).to(dtype) for _ in range(2)]
        remote.push(0, STEPS, grads[1])
        local.push(0, STEPS, grads[0])
        adamw_update(loaded, grads[0].to(torch.float32) + grads[1].to(torch.float32), *moments[0], HYPER, grad_divisor=torch.tensor(2.0))
        for worker in (local, remote):
            header, received = worker.reply()
            assert header.msg_type == MsgType.PARAMS and header.step == STEPS + 1 and torch.equal(received, loaded.to(dtype))
        assert scrape(node.metrics_url)["netoptim_master_values_on_board_bytes"] == on_board, "the next update put them back on the board"
    finally:
        local.client.close()
        remote.client.close()
        transport.close()
