"""Host<->device copies for streamed parameters and gradients.

On CPU a copy is a copy. On CUDA, parameters that arrive in a same-host node's shared window
(:mod:`transport.shm.window`) are copied from there: the window is page-locked for the device once,
and each piece goes to the device with a non-blocking copy on a side stream, its view held until the
copy has read it (so the window's extent is not given back to the node before). Parameters that
arrive in pageable host memory (a socket's receive frames) are staged through a pinned buffer
first. An event per unit tells the compute stream when the unit is complete. Gradients go the other way on a second side stream into pinned send buffers, ordered after
the backward kernels that produced them by an event, and the sender waits for that copy only.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from transport.shm.window import SharedWindow, window_holding

log = logging.getLogger(__name__)


_HOST_REGISTER_READ_ONLY = 0x08


def page_locked(window: SharedWindow) -> bool:
    """Whether ``window`` is page-locked for CUDA copies, doing it the first time (once per window;
    undone before the window closes). False where CUDA refuses: copies are then staged."""
    if window.page_locked is None:
        cudart = torch.cuda.cudart()
        # A board is mapped read-only: CUDA must be told (cudaHostRegisterReadOnly), or it refuses.
        status = int(cudart.cudaHostRegister(window.address, window.nbytes, 0 if window.writable else _HOST_REGISTER_READ_ONLY))
        window.page_locked = status == 0
        if status == 0:

            def unlock() -> None:
                torch.cuda.synchronize()  # no copy may still read it
                cudart.cudaHostUnregister(window.address)

            window.before_close.append(unlock)
        else:
            log.warning("CUDA could not page-lock a shared window (error %d): copies to or from it are staged through pinned buffers", status)
    return window.page_locked


def in_page_locked_window(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in a shared window page-locked for CUDA copies (locking it the first time)."""
    window = window_holding(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    return window is not None and page_locked(window)


def lock_source_window(pieces: list[tuple[int, torch.Tensor]]) -> None:
    """Page-lock the shared window that received views lie in, if they do (a blocking copy from
    page-locked memory runs at the bus's speed, from pageable memory at a fraction of it)."""
    for _offset, view in pieces[:1]:
        window = window_holding(view.data_ptr(), view.numel() * view.element_size())
        if window is not None:
            page_locked(window)


def host_waitable_event() -> torch.cuda.Event:
    """A CUDA event a host thread waits for asleep (``cudaEventBlockingSync``). CUDA's default with
    one context on a many-core host is to spin while waiting: a worker thread that waits for a copy
    (the push courier through backward, the loop before each push) would hold a core that the node's
    update threads on the same host need, and one thread of a static parallel loop held up holds up
    the whole loop."""
    return torch.cuda.Event(blocking=True)


def wait_on_host(event: torch.cuda.Event) -> None:
    """Block this thread until ``event`` completed: asleep, if it has not already (most have)."""
    if not event.query():
        event.synchronize()


def wait_for_stream(stream: torch.cuda.Stream) -> None:
    """Block this thread, asleep, until the work queued on ``stream`` so far is done."""
    event = host_waitable_event()
    event.record(stream)
    event.synchronize()


class HostToDevice:
    """Copies received host views into device tensors, overlapped with compute on CUDA."""

    def __init__(self, device: torch.device, staging_numel: int, staging_buffers: int = 4) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # Bytes copied up straight from page-locked windows and boards, and through the staging buffers
        # (a CPU memcpy first, on the worker's thread): where the installs' time goes.
        self.direct_bytes = 0
        self.staged_bytes = 0
        if self.cuda:
            self._stream = torch.cuda.Stream(device=device)
            # Pinned staging buffers, each with the event of the copy that last read it.
            self._staging: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque(
                (torch.empty(staging_numel, dtype=torch.float32, pin_memory=True), None) for _ in range(staging_buffers)
            )
            self._held: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()  # sources read in place, until their copy is done

    @property
    def copied_bytes(self) -> dict[str, int]:
        """Bytes copied up so far: ``direct`` from page-locked windows and boards, ``staged`` through
        the pinned buffers."""
        return {"direct": self.direct_bytes, "staged": self.staged_bytes}

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
        self.drop_finished()
        window = window_holding(source.data_ptr(), source.numel() * source.element_size())
        if window is not None and page_locked(window):
            with torch.cuda.stream(self._stream):
                target.copy_(source, non_blocking=True)
                done = host_waitable_event()
                done.record(self._stream)
            self._held.append((source, done))
            self.direct_bytes += source.numel() * source.element_size()
            return
        staging, last_use = self._staging.popleft()
        if last_use is not None:
            wait_on_host(last_use)  # the copy that read this buffer before has finished
        piece = staging.view(torch.uint8)[: source.numel() * source.element_size()].view(source.dtype)
        piece.copy_(source)
        self.staged_bytes += source.numel() * source.element_size()
        with torch.cuda.stream(self._stream):
            target.copy_(piece, non_blocking=True)
            done = host_waitable_event()
            done.record(self._stream)
        self._staging.append((staging, done))

    def drop_finished(self) -> None:
        """Let go of the sources read in place whose copies are done (a window's extents go back to
        their sender as their last views go)."""
        if self.cuda:
            while self._held and self._held[0][1].query():
                self._held.popleft()

    def record(self) -> torch.cuda.Event | None:
        """An event after every copy queued so far (``None`` on CPU)."""
        if not self.cuda:
            return None
        event = host_waitable_event()
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
