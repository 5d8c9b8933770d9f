"""Backend-neutral transport interface: a server endpoint (the optimizer node) and client endpoints
(one per worker-to-node connection) that exchange :mod:`transport.wire` messages.

Backends implement bind/connect/send/receive only; validation of what arrives is shared and lives in
:mod:`transport.wire`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from transport.wire import Header, Payload


def no_shared_memory() -> dict[str, int]:
    """:meth:`ServerEndpoint.shared_memory` of an endpoint without shared memory."""
    return dict.fromkeys(
        ("connections", "written_bytes", "read_bytes", "board_bytes", "board_written_bytes", "board_copied_bytes", "board_referenced_bytes"), 0
    )


@dataclass(slots=True)
class Message:
    """One received message. ``peer`` identifies the sender on a server endpoint (``b""`` on a client);
    ``chunks`` are the payload frames, already validated against the header; ``tensors`` are
    ``(element_offset, view)`` pairs over those frames (zero-copy)."""

    peer: bytes
    header: Header
    tensors: list[tuple[int, torch.Tensor]]
    still_current: Callable[[], bool] | None = None
    """For a payload read in place from memory its sender may rewrite (a node's parameter board):
    whether the sender still holds these values there, to be asked once they were copied out (a
    ``False`` means the copy may be torn). ``None``: the payload is the receiver's own."""
    release: Callable[[], None] | None = None
    """For such a payload: called once its views are no longer read, lets the receiver's resident
    memory stop counting the sender's pages (they stay the sender's)."""
    user_id: str | None = None
    """The sender's authenticated identity, where the backend has one: with CURVE on a ZeroMQ server
    endpoint, the client's public key (z85) as the node's authenticator vouched for it. ``None``
    without authentication; ``peer`` is chosen by the client and proves nothing."""


class SendHandle(ABC):
    """Completion of a zero-copy send: the payload buffer must stay unchanged until ``done()``."""

    @abstractmethod
    def done(self) -> bool:
        """True once the transport no longer reads the payload buffer."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until done; ``TimeoutError`` after ``timeout_s``. A backend may complete sends only
        on calls into the endpoint (the mooncake one does); a sender that stops calling its endpoint
        waits on its last send's handle so the message is on its way."""


class ServerEndpoint(ABC):
    """The node side: many peers, replies routed by peer identity."""

    address: str
    """The bound address, with the port the OS chose when asked for port 0."""

    @abstractmethod
    def recv(self, timeout_s: float) -> Message | None:
        """The next message, or ``None`` after ``timeout_s``. Raises ``WireError`` (with ``peer`` set)
        for a message that violates the protocol; the endpoint stays usable."""

    @abstractmethod
    def send(self, peer: bytes, header: Header, payload: Payload | None = None, *, track: bool = False) -> SendHandle:
        """Queue a message for ``peer``; the payload is sent without a copy. With ``track`` the handle
        is done only once every frame of the message, small ones too, has left this process: what the
        node uses to bound its answers to peers that do not read them. A backend whose handles are done
        once the message is handed to its socket (Mooncake, which answers only peers that completed
        its engine handshake) may ignore it."""

    @abstractmethod
    def close(self) -> None:
        """Release the endpoint; idempotent."""

    def wake_on(self, fd: int) -> bool:
        """Let :meth:`recv` return ``None`` early once ``fd`` is readable (the caller drains it): how
        another thread of the caller wakes its wait for messages. Whether this backend does; by default
        it does not (the caller waits in short steps instead)."""
        return False

    def publish_board(self, nbytes: int, *, slots_per_key: int = 1) -> bool:
        """Make a parameter board of ``nbytes`` (replacing any) that same-host peers may read sent
        values from (:meth:`send_published`); whether this backend has one. By default: none. With
        two slots a key, each version written in place goes into the key's other slot, so the one
        before stays readable (:meth:`board_held`)."""
        return False

    def drop_board(self) -> None:
        """Close the parameter board, if any; what it held goes to peers as copies again."""
        return None

    def size_inboxes(self, nbytes: int) -> None:
        """Same-host peers that connect from now on may have ``nbytes`` of payload in flight to this
        endpoint in shared memory (where the backend has such a path; by default it has none)."""
        return None

    def board_slot(self, key: Hashable, nbytes: int) -> torch.Tensor | None:
        """Writable bytes where the next version of ``key`` (``nbytes`` of payload) goes on the board, for
        the caller to compute it there in place and then call :meth:`board_written`, so that
        :meth:`send_published` of that version copies nothing. ``None`` where no peer reads the
        board (or there is none, or no room): by default."""
        return None

    def board_written(self, key: Hashable, version: Hashable) -> None:
        """The bytes :meth:`board_slot` gave for ``key`` now hold ``version``."""
        return None

    def board_held(self, key: Hashable, version: Hashable) -> torch.Tensor | None:
        """On a board of two slots a key: the payload bytes of the slot of ``key`` that holds
        ``version`` (the current one or the one before), until :meth:`board_slot` of the key opens that
        slot again; ``None`` otherwise (and by default)."""
        return None

    def send_published(self, peer: bytes, header: Header, payload: Payload, key: Hashable, version: Hashable) -> SendHandle:
        """:meth:`send` of values that several peers are sent: the ``version`` of ``key`` (a bucket's
        values of a step). Where the peer mapped this endpoint's board, the values are copied onto it
        once per version and the peer reads them there. The caller promises that once it publishes a
        newer version of a key, no peer still reads an older one. By default: :meth:`send`."""
        return self.send(peer, header, payload)

    def limit_payload(self, max_bytes: int, why: str) -> None:
        """Refuse from now on, with ``WireError(TOO_LARGE)`` saying ``why``, messages that declare a
        payload over ``max_bytes`` (a limit only ever lowered), before their payload is viewed. A
        backend without this check leaves it to its caller: by default it does nothing."""
        return None

    def unlimit_payload(self) -> None:
        """Back to the endpoint's own limit (max_message_bytes): the job that lowered it is over."""
        return None

    def bind_same_host(self) -> str | None:
        """Also listen on a same-host fast path (for workers on this host) and return its address,
        served exactly like the main one; ``None`` where the backend has none or already is one."""
        return None

    def shared_memory(self) -> dict[str, int]:
        """Same-host connections whose payloads go through shared memory, the bytes that did each way,
        and the parameter board's size and traffic (the keys of :func:`no_shared_memory`); zeros where
        the backend has none. Safe to call from another thread."""
        return no_shared_memory()


class ClientEndpoint(ABC):
    """The worker side of one connection to one node."""

    address: str

    @abstractmethod
    def send(self, header: Header, payload: Payload | None = None) -> SendHandle:
        """Queue a message to the node; the payload is sent without a copy."""

    @abstractmethod
    def recv(self, timeout_s: float) -> Message | None:
        """The next message from the node, or ``None`` after ``timeout_s``."""

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        """Bytes the caller may fill with a payload and then :meth:`send` without a copy (the node's
        shared window on this host), or ``None``: where the backend has no such place, or no room."""
        return None

    def cancel(self, reserved: torch.Tensor) -> None:
        """Bytes :meth:`reserve` gave that will not be sent."""
        return None

    def connection_dropped(self) -> bool:
        """Whether the link to the node dropped since the last call (a reset, or the node gone), so
        that messages in flight either way may be lost; a backend that cannot tell says ``False``
        and the worker's heartbeats find the loss instead."""
        return False

    def link_state(self) -> str | None:
        """The connection's state in words, as the backend sees it, for an error that says the node did
        not answer (:meth:`link_problem`, else e.g. connected but silent), or ``None`` where it cannot tell."""
        return None

    def link_problem(self) -> str | None:
        """What keeps the connection from carrying messages, where the backend knows for certain
        (nothing listens at the address, a failed handshake); else ``None``."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the connection; idempotent."""


class Transport(ABC):
    """A backend: creates endpoints and waits on several client endpoints at once."""

    @abstractmethod
    def bind(self, url: str) -> ServerEndpoint:
        """A server endpoint listening on ``url`` (port 0: the OS picks)."""

    @abstractmethod
    def connect(self, url: str) -> ClientEndpoint:
        """A client endpoint connected to the server at ``url``."""

    @abstractmethod
    def wait_readable(self, clients: Sequence[ClientEndpoint], timeout_s: float) -> list[int]:
        """Indices of ``clients`` with a message ready, waiting at most ``timeout_s``."""

    @abstractmethod
    def close(self) -> None:
        """Release backend-wide resources, after every endpoint is closed."""
