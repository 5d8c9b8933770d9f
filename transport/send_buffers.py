"""Buffers for outgoing payloads (a worker's gradient buckets, a node's batches of new values), reused
once the zero-copy send that reads them is done."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import torch

from transport.interface import SendHandle


class SendBuffers:
    """A pool of wire-dtype buffers by size. A buffer handed out is lent to one send; it comes back
    when that send is done. Sends on one connection finish in order (over several lanes nearly so: a
    buffer behind a slower lane's comes back a little later), so each connection's sends wait in a
    queue and only its head is looked at: taking a buffer costs O(1) amortized, whatever the number
    of buckets (a scan of every send in flight made a step O(buckets^2))."""

    def __init__(self, dtype: torch.dtype, pin_memory: bool = False) -> None:
        self.dtype = dtype
        # pinned when gradients come from a GPU, so the device-to-host copies can be asynchronous
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = {}  # numel -> buffers no send reads
        self._sending: dict[Hashable, deque[tuple[SendHandle, torch.Tensor]]] = {}  # connection -> sends in order
        self.allocated = 0  # buffers made so far (after warm-up, a step makes none)

    def take(self, numel: int) -> torch.Tensor:
        """A buffer of ``numel`` elements that no send reads."""
        free = self._free.get(numel)
        if not free:
            self._reclaim()
            free = self._free.get(numel)
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(numel, dtype=self.dtype, pin_memory=self.pin_memory)

    def lend(self, connection: Hashable, handle: SendHandle, buffer: torch.Tensor) -> None:
        """``buffer`` is read by the send ``handle`` on ``connection`` until that send is done."""
        self._sending.setdefault(connection, deque()).append((handle, buffer))

    def give_back(self, buffer: torch.Tensor) -> None:
        """A buffer taken and then not sent: free for the next taker."""
        self._free.setdefault(buffer.numel(), []).append(buffer)

    def forget(self, connection: Hashable) -> None:
        """The connection was closed: its sends will not finish; their buffers are not reused."""
        self._sending.pop(connection, None)

    def clear(self) -> None:
        """Drop the free buffers (layer-wise workers keep no gradient memory between steps)."""
        self._free.clear()

    def _reclaim(self) -> None:
        for sends in self._sending.values():
            while sends and sends[0][0].done():
                buffer = sends.popleft()[1]
                self._free.setdefault(buffer.numel(), []).append(buffer)
