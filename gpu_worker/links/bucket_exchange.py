"""Request and answer, one bucket at a time, with the node that owns it, outside the steps: a
bucket's initial values (rank 0, at registration), and a part of its optimizer state read or
replaced (the optimizer's state dicts). Each call waits for the node's answer."""

from __future__ import annotations

import torch

from gpu_worker.links.connections import NodeConnections
from protos.job.placement import BucketSpec
from transport.wire import Header, MsgType, tensor_header


class BucketExchange:
    """A worker's requests about single buckets, over its node connections."""

    def __init__(self, connections: NodeConnections) -> None:
        self._connections = connections

    def send_initial(self, bucket: BucketSpec, rank: int, values: torch.Tensor) -> None:
        """Rank 0: give a bucket its initial fp32 values (flat, ``numel`` of the bucket); waits for the ACK."""
        self._connections.send(bucket.node, tensor_header(MsgType.INIT, values, rank=rank, bucket_id=bucket.bucket_id), values)
        try:
            self._connections.expect(bucket.node, MsgType.ACK, f"initial values of bucket {bucket.bucket_id}", fail_on_drop=True)
        except (ConnectionError, TimeoutError) as exc:
            raise RuntimeError(
                f"{exc}. A node that restarts before the job's first checkpoint (which it writes once every bucket has its initial "
                f"values) comes back without them: restart the worker (the job starts over from its initial values)"
            ) from exc

    def read_state(self, bucket: BucketSpec, rank: int, part: str) -> tuple[torch.Tensor, list[float]]:
        """One part of a bucket's optimizer state (``param``, ``exp_avg``, ``exp_avg_sq``; fp32, flat)
        and its segments' AdamW step counts, as the node holds them now (call between steps)."""
        self._connections.send(bucket.node, Header(msg_type=MsgType.READ_STATE, rank=rank, bucket_id=bucket.bucket_id, meta={"part": part}))
        reply = self._connections.expect(bucket.node, MsgType.STATE, f"the {part} of bucket {bucket.bucket_id}")
        values = torch.empty(bucket.numel, dtype=torch.float32)
        for offset, view in reply.tensors:
            values[offset : offset + view.numel()].copy_(view)
        return values, [float(s) for s in reply.header.meta["segment_steps"]]

    def load_state(self, bucket: BucketSpec, rank: int, step: int, part: str, values: torch.Tensor, segment_steps: list[float] | None = None) -> None:
        """Rank 0: replace one part of a bucket's optimizer state (fp32, flat) and, when given, its
        segments' step counts; waits for the ACK."""
        meta: dict = {"part": part}
        if segment_steps is not None:
            meta["segment_steps"] = segment_steps
        header = tensor_header(MsgType.LOAD_STATE, values, rank=rank, step=step, bucket_id=bucket.bucket_id, meta=meta)
        self._connections.send(bucket.node, header, values)
        self._connections.expect(bucket.node, MsgType.ACK, f"the {part} of bucket {bucket.bucket_id} to load")
