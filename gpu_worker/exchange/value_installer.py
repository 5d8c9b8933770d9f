"""Received bucket values into a full-model worker's parameters.

On the CPU each bucket is copied in place as it comes. On a GPU the copies go up on a side stream
(:class:`~gpu_worker.layerwise.device_copy.HostToDevice`: page-locked windows and parameter boards read in
place, other values through pinned staging buffers), and each bucket's copy is ordered before the
compute stream's next kernels by an event: the host never waits for a copy to land, so the values of
bucket i go up while the worker waits for bucket i+1. Values read from a node's parameter board are
checked (:func:`~gpu_worker.layout.finish_board_read`) once their copy is done, at :meth:`settle`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_worker.layerwise.device_copy import HostToDevice, lock_source_window, wait_on_host
from gpu_worker.layout import InstallTargets, finish_board_read
from protos.job.placement import BucketSpec
from transport.interface import Message


class ValueInstaller:
    """Copies bucket values into the parameters (views made once per bucket), on the CPU or to a GPU."""

    def __init__(self, *, cuda: bool, staging_numel: int) -> None:
        """``staging_numel``: elements of the largest bucket (the GPU's staging buffers hold one)."""
        self._targets = InstallTargets()
        self._cuda = cuda
        self._staging_numel = staging_numel
        self._device_copies: HostToDevice | None = None  # made at the first install on a GPU
        self._board_reads: list[tuple[Message, str]] = []  # read from a board, checked at settle()

    def install(self, bucket: BucketSpec, message: Message, params: Sequence[torch.Tensor], *, node: str) -> None:
        """``message``'s values of ``bucket`` into ``params`` (sent by ``node``)."""
        if not self._cuda:
            self._targets.install(bucket, message.tensors, params)
            finish_board_read(message, node)
            return
        copies = self._device_copies
        if copies is None:
            device = next(p.device for p in params if p.device.type == "cuda")
            copies = self._device_copies = HostToDevice(device, staging_numel=self._staging_numel)
        lock_source_window(message.tensors)  # values in a same-host window: page-lock it (once), so the copies run at the bus's speed
        self._targets.install(bucket, message.tensors, params, copies.copy)
        copied = copies.record()
        assert copied is not None
        torch.cuda.current_stream(copies.device).wait_event(copied)  # the next forward reads them after the copy
        if message.still_current is not None:
            self._board_reads.append((message, node))

    @property
    def device_copy_bytes(self) -> dict[str, int]:
        """Bytes copied up to the GPU: ``direct`` from page-locked windows and boards, ``staged``
        through pinned buffers (zeros on CPU)."""
        return self._device_copies.copied_bytes if self._device_copies is not None else {"direct": 0, "staged": 0}

    def settle(self) -> None:
        """Once every value is in (the end of a step): wait for the last copies (most landed while
        later buckets were awaited), let go of the windows' extents they read, and check that no node
        rewrote board values meanwhile (the protocol rules it out)."""
        if self._device_copies is None:
            return
        last = self._device_copies.record()
        if last is not None:
            wait_on_host(last)
        self._device_copies.drop_finished()
        reads, self._board_reads = self._board_reads, []
        for message, node in reads:
            finish_board_read(message, node)
