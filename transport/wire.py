"""The netoptim wire format: one versioned header frame plus raw tensor chunk frames.

A message on the wire is a list of frames::

    [header, chunk_0, chunk_1, ..., chunk_{n-1}]

``header`` is a msgpack map (never pickle) decoded into :class:`Header`. The chunks are the raw,
little-endian bytes of one flat tensor split into pieces of at most ``chunk_bytes``; the header
declares the tensor's dtype, element count and number of chunks, and every receive checks the bytes
that arrived against that declaration. Small structured data (a layout, an error, a status) travels
in ``Header.meta``.

This module is the only place that knows the encoding. Anything that violates it raises
:class:`WireError`, whose ``code`` the receiver sends back in an ``ERROR`` message.
"""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; peers with another version are rejected."""

DEFAULT_CHUNK_BYTES = 4 << 20
"""Tensor payloads are split into frames of this size (ZeroMQ is fastest with 1-4 MB frames)."""

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31
"""Largest payload a receiver accepts unless configured otherwise."""

MAX_HEADER_BYTES = 16 << 20
"""Largest header frame accepted (a layout of a very large model still fits)."""

MAX_HEADER_ITEMS = 1 << 21
"""Values a header may decode to at most: every array and map counts one, plus one per element. A
msgpack byte can become a Python object of ~60 bytes, so without a bound one header of
``MAX_HEADER_BYTES`` took 1.2 GB and 5 s of a node (16 Mi empty arrays, measured); the layout of a
model of 250k parameter tensors takes less than 2 Mi."""

MAX_HEADER_LENGTH = 1 << 18
"""Elements of one array or map of a header at most (a layout of more parameters is over
``MAX_HEADER_BYTES`` anyway). Values are counted as each array completes, so this is how far a
header can go past ``MAX_HEADER_ITEMS`` before it is stopped: ~150 MB of a node at worst."""

MAX_HEADER_DEPTH = 32
"""How deeply arrays and maps may nest in a header (the protocol needs 5): a thousand levels cost a
few bytes on the wire and make every recursive function that meets them (``repr`` in an error
message) fail."""

MAX_ERROR_CHARS = 2000
"""An error message is cut to this many characters: it may quote what a peer sent, which can be
megabytes, and it goes back on the wire and into the log."""


class MsgType(enum.IntEnum):
    """Every message kind of the protocol. Requests come from workers, replies from nodes."""

    HELLO = 1  # worker -> node: layout and identity; reply HELLO_OK
    HELLO_OK = 2
    INIT = 3  # rank 0 -> node: initial fp32 values of one owned bucket; reply ACK
    ACK = 4
    PUSH = 5  # worker -> node: gradient of one bucket for one step; reply PARAMS when updated
    PULL = 6  # worker -> node: ask for the current parameters of one bucket; reply PARAMS
    PARAMS = 7
    NORM_PARTIAL = 8  # node -> rank 0: sum of squares of this node's averaged gradient
    CLIP = 9  # rank 0 -> node: the global gradient norm of the step
    QUERY = 10  # worker -> node: what is the node waiting for; reply STATUS
    STATUS = 11
    ERROR = 12  # either way: a request was rejected, with an ErrorCode and a message
    ECHO = 13  # transport benchmark and liveness: the payload comes straight back
    NOTICE = 14  # node -> workers: an operator paused or resumed updates (meta: paused, reason)
    CONSUMED = 15  # node -> worker (layer-wise): its gradient of this bucket and step is used up; flow control
    READ_STATE = 16  # worker -> node: one part of a bucket's optimizer state (meta: part); reply STATE
    STATE = 17
    LOAD_STATE = 18  # rank 0 -> node: replace one part of a bucket's state (meta: part, segment_steps); reply ACK
    BYE = 19  # worker -> node: this rank closed its optimizer (training over, or leaving); no reply


class ErrorCode(enum.IntEnum):
    """Why a message was rejected. Sent in ERROR replies as ``meta["code"]``."""

    MALFORMED = 1  # header not decodable, wrong field types
    VERSION = 2  # another protocol version
    BAD_PAYLOAD = 3  # bytes do not match the declared dtype/shape/chunks
    TOO_LARGE = 4  # declared payload over the receiver's limit
    UNKNOWN_BUCKET = 5
    WRONG_SHAPE = 6  # payload numel differs from the bucket's
    WRONG_DTYPE = 7  # payload dtype differs from the job's wire dtype
    STALE_STEP = 8
    FUTURE_STEP = 9
    DUPLICATE = 10
    LAYOUT_MISMATCH = 11
    NOT_REGISTERED = 12  # a request before HELLO, or before rank 0 registered
    BAD_REQUEST = 13  # a well-formed request that makes no sense in the node's state
    INTERNAL = 14
    DRAINING = 15  # the node finished its last step before a drain and takes no more gradients
    CANNOT_FIT = 16  # the node cannot hold its share of the job (RAM, disk or memory budget); the message says what to change
    NON_FINITE = 17  # a gradient holds NaN or inf: refused before it touches the state
    FORBIDDEN = 18  # the peer's key may not register as that rank (or job)
    LIMIT = 19  # a resource limit of the node (connections, peers waiting, declared sizes); the message names the flag


class WireError(Exception):
    """A message that violates the protocol or the receiver's state.

    ``peer`` is the transport's identity of the sender when known, so that a server can answer it.
    """

    def __init__(self, code: ErrorCode, message: str, *, peer: bytes | None = None) -> None:
        message = bounded_text(message)
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.peer = peer


def bounded_text(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text``, cut to ``limit`` characters with a note of how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60
_SHOW.maxlevel = 3


def shown(value: object) -> str:
    """A short ``repr`` of a value a peer sent, for an error message: bounded in length and depth."""
    return _SHOW.repr(value)


WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype, or ``TypeError`` for dtypes the wire does not carry."""
    for name, candidate in WIRE_DTYPES.items():
        if candidate == dtype:
            return name
    raise TypeError(f"dtype {dtype} cannot travel on the wire; use one of {sorted(WIRE_DTYPES)}")


@dataclass(frozen=True, slots=True)
class Header:
    """The first frame of every message.

    ``dtype``/``numel``/``num_chunks`` describe the tensor payload (``numel == 0`` means none);
    ``meta`` carries small per-message-type fields (kept out of the fixed fields on purpose: the
    fixed ones are those every receiver validates).
    """

    msg_type: MsgType
    version: int = PROTOCOL_VERSION
    rank: int = -1
    step: int = -1
    bucket_id: int = -1
    dtype: str = ""
    numel: int = 0
    num_chunks: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the tensor payload this header declares."""
        if self.numel == 0:
            return 0
        return self.numel * WIRE_DTYPES[self.dtype].itemsize


_FIELDS: dict[str, tuple[str, type]] = {
    "t": ("msg_type", int),
    "r": ("rank", int),
    "s": ("step", int),
    "b": ("bucket_id", int),
    "d": ("dtype", str),
    "n": ("numel", int),
    "c": ("num_chunks", int),
    "m": ("meta", dict),
}


def encode_header(header: Header) -> bytes:
    """Encode a header as a msgpack map with short keys."""
    return msgpack.packb(
        {
            "v": header.version,
            "t": int(header.msg_type),
            "r": header.rank,
            "s": header.step,
            "b": header.bucket_id,
            "d": header.dtype,
            "n": header.numel,
            "c": header.num_chunks,
            "m": header.meta,
        },
        use_bin_type=True,
    )


class _HeaderTooBig(Exception):
    """Raised from inside msgpack's decoding to stop it as soon as a header is over a bound."""


class _DecodeBudget:
    """msgpack hooks that count the arrays and maps of one header as they are decoded (each is
    handed over once complete) and stop the decoding once it is over ``MAX_HEADER_ITEMS``."""

    __slots__ = ("containers", "items")

    def __init__(self) -> None:
        self.containers = 0
        self.items = 0

    def _count(self, value: Any) -> Any:
        self.containers += 1
        self.items += len(value) + 1
        if self.items > MAX_HEADER_ITEMS:
            raise _HeaderTooBig(f"header decodes to more than {MAX_HEADER_ITEMS} values")
        return value


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and maps nest more than ``limit`` levels deep in ``value`` (iteratively: the
    value may be deeper than Python's recursion limit)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (list, dict)):
                stack.append((child, depth + 1))
    return False


def decode_header(data: bytes | memoryview, *, peer: bytes | None = None) -> Header:
    """Decode and validate a header frame; raises :class:`WireError` on any violation.

    What a header decodes to is bounded while it is built, not only its bytes: at most
    ``MAX_HEADER_ITEMS`` values, in arrays and maps of at most ``MAX_HEADER_LENGTH`` elements (msgpack
    reserves the length an array declares before it reads it), nested at most ``MAX_HEADER_DEPTH``
    deep."""
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(ErrorCode.TOO_LARGE, f"header of {len(data)} bytes is over the limit of {MAX_HEADER_BYTES}", peer=peer)
    budget = _DecodeBudget()
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            list_hook=budget._count,
            object_hook=budget._count,
            max_array_len=MAX_HEADER_LENGTH,
            max_map_len=MAX_HEADER_LENGTH,
        )
    except _HeaderTooBig as exc:
        raise WireError(ErrorCode.TOO_LARGE, str(exc), peer=peer) from None
    except msgpack.StackError:  # deeper than msgpack's own decoder goes (1024 levels)
        raise WireError(ErrorCode.MALFORMED, f"header nests arrays and maps more than {MAX_HEADER_DEPTH} levels deep", peer=peer) from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        # "N exceeds max_array_len(M)": an array or map longer than the header may hold
        code = ErrorCode.TOO_LARGE if isinstance(exc, ValueError) and "exceeds max_" in str(exc) else ErrorCode.MALFORMED
        raise WireError(code, f"header is not msgpack: {exc}" if code == ErrorCode.MALFORMED else f"header: {exc}", peer=peer) from exc
    if not isinstance(raw, dict):
        raise WireError(ErrorCode.MALFORMED, "header is not a map", peer=peer)
    # Nesting needs a container per level: only a header with more containers than levels allowed
    # (a layout, not the PUSH of every step) is walked.
    if budget.containers > MAX_HEADER_DEPTH and _nested_deeper_than(raw, MAX_HEADER_DEPTH):
        raise WireError(ErrorCode.MALFORMED, f"header nests arrays and maps more than {MAX_HEADER_DEPTH} levels deep", peer=peer)
    version = raw.get("v")
    if not isinstance(version, int) or isinstance(version, bool) or version != PROTOCOL_VERSION:  # 1.0 and True equal 1
        raise WireError(
            ErrorCode.VERSION,
            f"protocol version {shown(version)}, this side speaks {PROTOCOL_VERSION}; run the same netoptim release on workers and nodes",
            peer=peer,
        )
    kwargs: dict[str, Any] = {}
    for key, (name, kind) in _FIELDS.items():
        if key not in raw:
            continue
        value = raw[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise WireError(ErrorCode.MALFORMED, f"header field {name} has type {type(value).__name__}", peer=peer)
        kwargs[name] = value
    try:
        kwargs["msg_type"] = MsgType(kwargs.get("msg_type", 0))
    except ValueError:
        raise WireError(ErrorCode.MALFORMED, f"unknown message type {shown(raw.get('t'))}", peer=peer) from None
    header = Header(**kwargs)
    if header.numel < 0 or header.num_chunks < 0:
        raise WireError(ErrorCode.MALFORMED, "negative numel or chunk count", peer=peer)
    if header.numel > 0 and header.dtype not in WIRE_DTYPES:
        raise WireError(ErrorCode.WRONG_DTYPE, f"payload dtype {shown(header.dtype)} is not one of {sorted(WIRE_DTYPES)}", peer=peer)
    return header


def chunk_tensor(flat: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[memoryview]:
    """Zero-copy views of a contiguous 1-D CPU tensor, each at most ``chunk_bytes`` long."""
    if flat.dim() != 1 or not flat.is_contiguous() or flat.device.type != "cpu":
        raise ValueError("only contiguous 1-D CPU tensors can be sent")
    if flat.numel() == 0:
        return []
    # numpy has no bfloat16: view 2-byte types as int16, which has the same bytes.
    as_numpy = flat if flat.dtype in _NUMPY_NATIVE else flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(_INT_OF_SIZE[flat.element_size()])
    buffer = memoryview(as_numpy.numpy()).cast("B")
    if len(buffer) <= chunk_bytes:
        return [buffer]
    return [buffer[start : start + chunk_bytes] for start in range(0, len(buffer), chunk_bytes)]


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_NATIVE = frozenset({torch.float32, torch.float16, torch.float64, torch.int32, torch.int64, torch.uint8})


Payload = torch.Tensor | Sequence[torch.Tensor]
"""A flat tensor, or several flat tensors of one dtype sent back to back as one payload."""


def payload_chunks(payload: Payload | None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[memoryview]:
    """The frames of a payload: zero-copy views, at most ``chunk_bytes`` each."""
    if payload is None:
        return []
    pieces = [payload] if isinstance(payload, torch.Tensor) else list(payload)
    return [chunk for piece in pieces for chunk in chunk_tensor(piece, chunk_bytes)]


def tensor_header(msg_type: MsgType, payload: Payload, chunk_bytes: int = DEFAULT_CHUNK_BYTES, **fields: Any) -> Header:
    """A header describing ``payload``."""
    pieces = [payload] if isinstance(payload, torch.Tensor) else list(payload)
    if not pieces or len({piece.dtype for piece in pieces}) != 1:
        raise ValueError("a payload is one or more tensors of one dtype")
    return Header(
        msg_type=msg_type,
        dtype=dtype_name(pieces[0].dtype),
        numel=sum(piece.numel() for piece in pieces),
        num_chunks=sum(-(-piece.numel() * piece.element_size() // chunk_bytes) for piece in pieces),
        **fields,
    )


def encode_message(header: Header, payload: Payload | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[bytes | memoryview]:
    """Frames for one message; tensor chunks are zero-copy views of the payload."""
    chunks = payload_chunks(payload, chunk_bytes)
    if len(chunks) != header.num_chunks:
        raise ValueError(f"header declares {header.num_chunks} chunks, payload has {len(chunks)}")
    return [encode_header(header), *chunks]


def error_header(code: ErrorCode, message: str, *, bucket_id: int = -1, step: int = -1) -> Header:
    """An ERROR reply."""
    return Header(msg_type=MsgType.ERROR, bucket_id=bucket_id, step=step, meta={"code": int(code), "message": bounded_text(message)})
