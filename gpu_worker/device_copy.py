"""Host<->device copies for streamed parameters and gradients.

On CPU a copy is a copy. On CUDA, parameters arrive in pageable host memory (the transport's receive
frames), so each piece is staged through a pinned buffer and copied to the device with a
non-blocking copy on a side stream; an event per unit tells the compute stream when the unit is
complete. Gradients go the other way on a second side stream into pinned send buffers, ordered after
the backward kernels that produced them by an event, and the sender waits for that copy only.
"""

from __future__ import annotations

from collections import deque

import torch


class HostToDevice:
    """Copies received host views into device tensors, overlapped with compute on CUDA."""

    def __init__(self, device: torch.device, staging_numel: int, staging_buffers: int = 4) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._stream = torch.cuda.Stream(device=device)
            # Pinned staging buffers, each with the event of the copy that last read it.
            self._staging: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque(
                (torch.empty(staging_numel, dtype=torch.float32, pin_memory=True), None) for _ in range(staging_buffers)
            )

    def begin(self) -> None:
        """Before copies into freshly allocated device memory: that memory may have belonged to a
        tensor the compute stream still reads, so the side stream first waits for the compute stream."""
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)``; on CUDA queued on the side stream (see :meth:`record`)."""
        if not self.cuda:
            target.copy_(source)
            return
        staging, last_use = self._staging.popleft()
        if last_use is not None:
            last_use.synchronize()  # the copy that read this buffer before has finished
        piece = staging.view(torch.uint8)[: source.numel() * source.element_size()].view(source.dtype)
        piece.copy_(source)
        with torch.cuda.stream(self._stream):
            target.copy_(piece, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._staging.append((staging, done))

    def record(self) -> torch.cuda.Event | None:
        """An event after every copy queued so far (``None`` on CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """Make the current (compute) stream wait for ``event``."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


def canonical_device(device: torch.device | str) -> torch.device:
    """The device as the tensors on it name it, so that devices compare equal however they were
    spelled: ``cpu`` without an index (``cpu:0`` is the same memory), an accelerator with one
    (``cuda`` means the current CUDA device, ``cuda:0`` on most machines)."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None and device.type != "meta":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "current_device") and backend.is_available():
            return torch.device(device.type, backend.current_device())
    return device


def device_to_host_ready(device: torch.device) -> None:
    """Before a send buffer filled by non-blocking device-to-host copies is read by the transport."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
