"""The Mooncake transport's per-connection state: the engine, receive windows and their slots.

A :class:`Link` is one connection's pair of windows: ours, registered with the engine once and cut
into slots the peer writes into, and the peer's, whose free slots we track from its credits. A slot
handed to a reader as a view comes back (as a credit to send) when the last reference to it goes.
"""

from __future__ import annotations

import collections
import ctypes
import os
import socket as pysocket
import weakref

import msgpack
import torch

from transport.wire import ErrorCode, WireError

DEFAULT_WINDOW_BYTES = 64 << 20
"""Receive window per connection and direction; one message's payload must fit in it."""

CREDIT_TIMEOUT_S = 60.0
"""How long a sender waits for the peer to give window slots back before it gives up."""
INSTALL_HINT = (
    "the mooncake transport needs the Mooncake Transfer Engine: `pip install 'netoptim-train[rdma]'` "
    "(mooncake-transfer-engine-non-cuda) and the system libraries libibverbs1 librdmacm1 libnuma1 (and libcurl4 on minimal systems) "
    "(Debian/Ubuntu: `apt-get install libibverbs1 librdmacm1 libnuma1 libcurl4`), needed even for its tcp protocol"
)
_PROTOCOLS = {"mooncake": "tcp", "mooncake+rdma": "rdma"}


class TransportUnavailable(RuntimeError):
    """The backend's library is not installed here; the message says what to install."""


def engine_class() -> type:
    """Mooncake's ``TransferEngine``; :class:`TransportUnavailable` names what to install if it is missing."""
    # Read when the library loads: the engine logs every connection at INFO otherwise.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the package, or a system library it links (libibverbs.so.1, ...)
        raise TransportUnavailable(f"{INSTALL_HINT} ({exc})") from None
    return TransferEngine


def start_engine(host: str, protocol: str):  # -> mooncake.engine.TransferEngine
    engine = engine_class()()
    status = engine.initialize(f"{host}:0", "P2PHANDSHAKE", protocol, "")
    if status != 0:
        hint = "; is there an RDMA NIC and its driver? (mooncake:// uses TCP)" if protocol == "rdma" else ""
        raise ConnectionError(f"the Mooncake transfer engine did not start on {host} with protocol {protocol!r} (status {status}){hint}")
    return engine


def split_address(url: str) -> tuple[str, str, str]:
    """``(protocol, host, port)`` of a ``mooncake://`` or ``mooncake+rdma://`` address."""
    scheme, _, rest = url.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme not in _PROTOCOLS or not sep or not host or not port:
        raise ValueError(f"address {url!r}: expected mooncake://HOST:PORT or mooncake+rdma://HOST:PORT")
    return _PROTOCOLS[scheme], host, port


def local_ip_towards(host: str) -> str:
    """The address of this host's interface that routes to ``host`` (no packet is sent)."""
    with pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM) as probe:
        probe.connect((pysocket.gethostbyname(host), 9))
        return probe.getsockname()[0]


class Link:
    """One connection: our receive window (the peer writes into it), the peer's window (we write into
    it), a staging buffer for payloads outside registered memory, and the credits in both directions."""

    def __init__(self, engine, window_bytes: int, slot_bytes: int) -> None:
        self.engine = engine
        self.slot_bytes = slot_bytes
        self.window = torch.empty(window_bytes, dtype=torch.uint8)
        if engine.register_memory(self.window.data_ptr(), window_bytes) != 0:
            raise ConnectionError("the Mooncake engine could not register a receive window")
        self.staging: torch.Tensor | None = None  # registered on the first staged send
        self.remote_engine = ""
        self.remote_base = 0
        self.remote_free: collections.deque[int] = collections.deque()
        self.returned: collections.deque[int] = collections.deque()  # our slots released, credit not sent yet
        self.outstanding = 0  # our slots handed out in messages and not yet credited back

    @property
    def ready(self) -> bool:
        return bool(self.remote_engine)

    @property
    def slots(self) -> int:
        return self.window.numel() // self.slot_bytes

    def describe(self, engine_address: str) -> bytes:
        return msgpack.packb({"engine": engine_address, "base": self.window.data_ptr(), "slots": self.slots, "slot_bytes": self.slot_bytes})

    def accept(self, raw: bytes, peer: bytes = b"") -> None:
        try:
            info = msgpack.unpackb(raw)
            engine, base, slots, slot_bytes = info["engine"], int(info["base"]), int(info["slots"]), int(info["slot_bytes"])
        except Exception:
            raise WireError(ErrorCode.MALFORMED, "the mooncake handshake is not a window description", peer=peer) from None
        if slot_bytes != self.slot_bytes:
            raise WireError(
                ErrorCode.BAD_PAYLOAD,
                f"the peer cuts payloads in {slot_bytes}-byte chunks, this side in {self.slot_bytes}: give both the same chunk size",
                peer=peer,
            )
        self.remote_engine, self.remote_base = str(engine), base
        self.remote_free = collections.deque(range(slots))

    def staging_slot(self, slot: int) -> torch.Tensor:
        if self.staging is None:
            self.staging = torch.empty(self.window.numel(), dtype=torch.uint8)
            if self.engine.register_memory(self.staging.data_ptr(), self.staging.numel()) != 0:
                raise ConnectionError("the Mooncake engine could not register a staging buffer")
        return self.staging[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def view(self, slot: int, size: int, *, copy: bool) -> memoryview:
        """The first ``size`` bytes of our slot ``slot``: a view that gives the slot back when the last
        reference to it goes, or (``copy``) a copy, and the slot is given back at once."""
        address = self.window.data_ptr() + slot * self.slot_bytes
        self.outstanding += 1
        if copy:
            data = memoryview(bytearray(ctypes.string_at(address, size)))
            self.returned.append(slot)
            return data
        region = (ctypes.c_char * size).from_address(address)
        weakref.finalize(region, self.release, slot)  # runs in whichever thread drops the last view
        return memoryview(region)

    def release(self, slot: int) -> None:
        self.returned.append(slot)  # deque.append is atomic: safe from a finalizer in another thread

    def take_credits(self) -> list[int]:
        """Our slots released since the last call (the owner's thread only)."""
        credits = []
        while self.returned:
            credits.append(self.returned.popleft())
        self.outstanding -= len(credits)
        return credits

    def close(self) -> None:
        for buffer in (self.window, self.staging):
            if buffer is not None:
                self.engine.unregister_memory(buffer.data_ptr())
