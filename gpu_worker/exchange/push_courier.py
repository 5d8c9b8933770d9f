"""Pushes that leave during backward on a GPU, from a thread of their own.

On a GPU autograd runs the gradient hooks on its device thread, which must not block: it launches the
rest of backward, running far ahead of the GPU. There a bucket's copy out of the device is only
queued (:meth:`GradientSender.stage`); the copy lands while backward still computes. The courier
thread waits for each staged copy in turn and sends the push at once, so the node updates the last
layers while the GPU computes the first ones' gradients, rather than after ``step()`` sends them all.

The connections' sockets are used by one thread at a time, and with a lock between turns (the memory
barrier ZeroMQ asks of a socket that changes threads): the courier sends only between the first
gradient of a backward pass and the start of ``step()``, while the thread that owns the optimizer is
inside ``backward()`` (it must be the one that calls it, as documented for ``push_during_backward``).
``step()`` stops the courier first (:meth:`PushCourier.stop`): what it has not sent, ``step()``
sends, as before.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import weakref
from collections.abc import Callable

from transport.host_threads import name_os_thread

log = logging.getLogger(__name__)


class PushCourier:
    """Sends offered buckets once their copies landed, on its own thread, until :meth:`stop`."""

    def __init__(self, wait_copied: Callable[[int], None], send: Callable[[int], None]) -> None:
        """``wait_copied(bucket_id)``: block (without the GIL) until the bucket's staged copy landed;
        ``send(bucket_id)``: push it (the sockets are the courier's while it runs). Bound methods are
        held weakly: the courier's thread does not keep the optimizer alive (a user who never calls
        ``close()`` has its connections closed when it is collected, as before), and ends with it."""
        self._wait_copied = _weak(wait_copied)
        self._send = _weak(send)
        self._lock = threading.Lock()  # whoever sends holds it
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._generation = 0  # bumped by stop(): offers of a stopped backward are dropped
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.sent = 0  # pushes this courier sent (counted for tests and benchmarks)

    def offer(self, bucket_id: int) -> None:
        """A bucket's copy was staged (autograd's device thread, during backward): send it once landed."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="netoptim-push-courier", daemon=True)
            self._thread.start()
        self._queue.put((self._generation, bucket_id))

    def stop(self) -> None:
        """``step()`` takes the sockets back: the courier sends nothing more of this backward. A push
        the courier could not send is left to ``step()``, which sends it again (and fails there, with
        its own account, if it cannot either)."""
        with self._lock:
            self._generation += 1
            error, self._error = self._error, None
        if error is not None:
            log.warning("a push during backward failed (%s); step() sends it again", error)

    def close(self, *, wait: bool = True) -> None:
        """End the thread (the optimizer closes; ``wait=False`` when it is being collected)."""
        self.stop()
        if self._thread is not None:
            self._queue.put(None)
            if wait:
                self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        name_os_thread()
        while True:
            item = self._queue.get()
            if item is None:
                return
            generation, bucket_id = item
            if generation == self._generation and not self._deliver(generation, bucket_id):
                return

    def _deliver(self, generation: int, bucket_id: int) -> bool:
        """Wait for the bucket's copy and send it (a method of its own: the owner's methods are not
        held while the thread waits for the next offer); False once the owner was collected."""
        wait_copied, send = self._wait_copied(), self._send()
        if wait_copied is None or send is None:
            return False
        wait_copied(bucket_id)  # outside the lock: step() may take the sockets meanwhile
        with self._lock:
            if generation != self._generation or self._error is not None:
                return True
            try:
                send(bucket_id)
                self.sent += 1
            except Exception as exc:  # logged by stop(); step() pushes the bucket again
                self._error = exc
        return True


def _weak(function: Callable[[int], None]) -> Callable[[], Callable[[int], None] | None]:
    """A weak reference to a bound method (a plain function is held as it is)."""
    if inspect.ismethod(function):
        return weakref.WeakMethod(function)
    return lambda: function
