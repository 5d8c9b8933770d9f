"""Bad wire messages for the fuzzer (:mod:`tests.security.wire_fuzz`): msgpack encoded by hand (keys
twice, nesting deeper than msgpack's encoder goes, integers past 64 bits), odd values, and
structure-aware mutations of valid messages' headers, metadata and payload frames.
"""

from __future__ import annotations

import copy
import math
import random
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from transport.wire import MAX_HEADER_BYTES, PROTOCOL_VERSION, Header, MsgType, encode_message

# ---------------------------------------------------------------------------- encoding by hand


@dataclass(frozen=True, slots=True)
class Raw:
    """Bytes spliced into an encoded message as they are: nesting deeper than msgpack's own encoder
    allows, or encodings it never produces."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Pairs:
    """A map given as key-value pairs, so that a key can appear twice."""

    items: tuple[tuple[Any, Any], ...]


def _container_head(kind: str, length: int) -> bytes:
    small, medium, large = {"map": (0x80, 0xDE, 0xDF), "array": (0x90, 0xDC, 0xDD)}[kind]
    if length < 16:
        return bytes([small | length])
    if length < 1 << 16:
        return bytes([medium]) + struct.pack(">H", length)
    return bytes([large]) + struct.pack(">I", length)


def pack(value: Any) -> bytes:
    """msgpack of ``value``, where :class:`Raw` and :class:`Pairs` may appear anywhere."""
    try:
        return msgpack.packb(value, use_bin_type=True)  # the common case, at C speed
    except (TypeError, ValueError, OverflowError):  # a Raw or Pairs inside, nesting msgpack's encoder refuses, an integer beyond 64 bits
        pass
    if isinstance(value, int) and not isinstance(value, bool):
        return msgpack.packb(max(min(value, 2**64 - 1), -(2**63)))  # msgpack integers have 64 bits
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, Pairs):
        return _container_head("map", len(value.items)) + b"".join(pack(k) + pack(v) for k, v in value.items)
    if isinstance(value, dict):
        return _container_head("map", len(value)) + b"".join(pack(k) + pack(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return _container_head("array", len(value)) + b"".join(pack(v) for v in value)
    return msgpack.packb(value, use_bin_type=True)


# ---------------------------------------------------------------------------- values


SMALL_INTS = (0, 1, 2, 3, -1, -2, 7, 63, 64, 65, 127, 128, 255, 256, 65535)
HUGE_INTS = (2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), 2**64 - 1)
FLOATS = (math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-300, 1e-8, 0.5, 0.999, 1.0, 1.5, -1.0, 1e30, 1e300)


def long_text(rng: random.Random) -> str:
    size = rng.choice((256, 4096, 65536, 1 << 20))
    return rng.choice(("x", "é", "\x00", "🙂", "ab")) * (size // 2)


def deep(rng: random.Random) -> Raw:
    """Arrays or maps nested ``depth`` deep, as raw bytes (msgpack's encoder stops at 512)."""
    depth = rng.choice((8, 31, 32, 33, 100, 1000, 1023, 1100, 5000))
    level = b"\x91" if rng.random() < 0.5 else b"\x81\xa1k"
    return Raw(level * depth + b"\xc0")


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(13 if depth < 2 else 9)
    if kind == 0:
        return rng.choice(SMALL_INTS)
    if kind == 1:
        return rng.choice(HUGE_INTS)
    if kind == 2:
        return rng.choice(FLOATS)
    if kind == 3:
        return rng.choice((True, False, None))
    if kind == 4:
        return rng.choice(("", "0", "1", "float32", "bfloat16", "int8", "full", "layerwise", "hyper", "x" * rng.randrange(40)))
    if kind == 5:
        return rng.randbytes(rng.randrange(12))
    if kind == 6:
        if rng.random() < 0.5:  # extension types, and timestamps (type -1) of valid and invalid lengths
            return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.choice((0, 1, 4, 8, 12, 16))))
        prefix, size = rng.choice(((b"\xd6\xff", 4), (b"\xd7\xff", 8), (b"\xd5\xff", 2), (b"\xd4\x80", 1)))
        return Raw(prefix + rng.randbytes(size))
    if kind == 7:
        return long_text(rng)
    if kind == 8:
        return deep(rng)
    if kind == 9:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    if kind == 10:
        return {rng.choice(("job", "hyper", "at_step", "code", "x", "")): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if kind == 11:
        return list(range(rng.choice((1000, 100_000))))
    return [rng.choice(FLOATS) for _ in range(5)]


# ---------------------------------------------------------------------------- templates and mutations


@dataclass(slots=True)
class Template:
    """A valid message to start from: its header as (key, value) pairs and its payload frames."""

    name: str
    fields: list[tuple[Any, Any]]
    frames: list[bytes]

    @classmethod
    def of(cls, name: str, frames: Sequence[bytes | memoryview]) -> Template:
        raw = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=False)
        return cls(name, list(raw.items()), [bytes(f) for f in frames[1:]])

    @classmethod
    def from_header(cls, name: str, header: Header, payload: torch.Tensor | None = None) -> Template:
        return cls.of(name, [bytes(f) for f in encode_message(header, payload)])


@dataclass(slots=True)
class Draft:
    """A message being mutated: header fields (or raw header bytes, once an operation broke the
    encoding itself) and payload frames, with notes of what was done, for failure messages."""

    fields: list[tuple[Any, Any]]
    frames: list[bytes]
    header_bytes: bytes | None = None
    notes: list[str] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        for name, value in reversed(self.fields):
            if name == key:
                return value
        return default

    def set(self, key: str, value: Any) -> None:
        for index, (name, _) in enumerate(self.fields):
            if name == key:
                self.fields[index] = (key, value)
                return
        self.fields.append((key, value))

    def drop(self, key: str) -> None:
        self.fields = [(name, value) for name, value in self.fields if name != key]

    def encoded(self) -> list[bytes]:
        header = self.header_bytes if self.header_bytes is not None else pack(Pairs(tuple(self.fields)))
        return [header, *self.frames]


HEADER_KEYS = ("v", "t", "r", "s", "b", "d", "n", "c", "m")
DTYPES = ("float32", "bfloat16", "float16", "float64", "int8", "", "FLOAT32", "float32 ", "x" * 300)


def _field_value(rng: random.Random, key: str, current: Any) -> Any:
    """A value for header field ``key``: of its type but odd, or of another type."""
    if rng.random() < 0.3:
        return random_value(rng)
    if key == "t":
        return rng.choice([*(int(t) for t in MsgType), 0, 16, 99, 255, -1, 2**63 - 1])
    if key == "d":
        return rng.choice(DTYPES)
    if key == "m":
        return random_value(rng)
    if key == "v":
        return rng.choice((0, 2, -1, 1.0, True, "1", None, 2**64 - 1, PROTOCOL_VERSION))
    if isinstance(current, int) and not isinstance(current, bool) and rng.random() < 0.5:
        return current + rng.choice((-2, -1, 1, 2, 64, 1 << 20))
    return rng.choice(SMALL_INTS + HUGE_INTS)


def _paths(value: Any, prefix: tuple = ()) -> Iterable[tuple]:
    """Every path into the maps and arrays of ``value`` (itself included)."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value[:64]):
            yield from _paths(child, (*prefix, index))


def _mutate_at(root: Any, path: tuple, rng: random.Random) -> tuple[Any, str]:
    """``root`` with the value at ``path`` changed: replaced, removed, grown or cut."""
    if not path:
        return random_value(rng), "replaced"
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    child = parent[last]
    action = rng.randrange(6)
    if action == 0 and isinstance(parent, dict):
        del parent[last]
        return root, "removed"
    if action == 1 and isinstance(child, list):
        if child and rng.random() < 0.5:
            del child[rng.randrange(len(child)) :]
            return root, "cut"
        child.append(random_value(rng, 2))
        return root, "grown"
    if action == 2 and isinstance(child, list) and child:
        child.append(copy.deepcopy(child[-1]))  # a repeated entry: a duplicate parameter, unit start, ...
        return root, "repeated"
    if action == 3 and isinstance(child, int | float) and not isinstance(child, bool):
        parent[last] = rng.choice((-child, child + 1, child - 1, child * 2**20, *HUGE_INTS, *FLOATS))
        return root, "number"
    parent[last] = random_value(rng, 1)
    return root, "replaced"


def _payload_numel(draft: Draft) -> int:
    return sum(len(f) for f in draft.frames)


def mutate(template: Template, rng: random.Random, operations: int) -> Draft:
    """``template`` with ``operations`` random changes of its header, meta or payload frames."""
    draft = Draft([(k, copy.deepcopy(v)) for k, v in template.fields], list(template.frames), notes=[template.name])
    for _ in range(operations):
        op = rng.randrange(20)
        if draft.header_bytes is not None and op < 14:
            op = 14 + op % 6  # the header is bytes now: frame operations only
        if op <= 2:
            key = rng.choice(HEADER_KEYS)
            value = _field_value(rng, key, draft.get(key))
            draft.set(key, value)
            draft.notes.append(f"{key}={short(value)}")
        elif op == 3:
            key = rng.choice(HEADER_KEYS)
            draft.drop(key)
            draft.notes.append(f"no {key}")
        elif op == 4:
            key = rng.choice(("x", "", "vv", "T", 7, -1, b"m", None, 1.5, True, "y" * 1000))
            draft.fields.append((key, random_value(rng)))
            draft.notes.append(f"extra key {short(key)}")
        elif op == 5 and draft.fields:
            key, _ = rng.choice(draft.fields)
            value = _field_value(rng, str(key), draft.get(key))
            draft.fields.append((key, value))  # the same key twice: the last one wins in msgpack's map
            draft.notes.append(f"twice {key}={short(value)}")
        elif op <= 9:
            meta = copy.deepcopy(draft.get("m", {}))
            paths = list(_paths(meta))
            path = rng.choice(paths[1:] if len(paths) > 1 and rng.random() < 0.9 else paths)
            meta, what = _mutate_at(meta, path, rng)
            draft.set("m", meta)
            draft.notes.append(f"meta{list(path)} {what}")
        elif op == 10:
            numel = draft.get("n", 0) if is_int(draft.get("n", 0)) else 0
            value = rng.choice((0, 1, -1, numel + 1, numel - 1, numel * 2, 1 << 20, 1 << 40, 2**63 - 1))
            draft.set("n", value)
            draft.notes.append(f"n={value}")
        elif op == 11:
            value = rng.choice(DTYPES)
            draft.set("d", value)
            draft.notes.append(f"d={short(value)}")
        elif op == 12:
            chunks = draft.get("c", 0) if is_int(draft.get("c", 0)) else 0
            value = rng.choice((0, 1, -1, chunks + 1, chunks - 1, 1 << 20, 2**63 - 1))
            draft.set("c", value)
            draft.notes.append(f"c={value}")
        elif op == 13 and any(draft.frames):
            # new payload contents of the same size: NaN/inf, huge, tiny, random bits
            frames = bytearray(b"".join(draft.frames))
            values = torch.frombuffer(frames, dtype=torch.uint8)
            kind = rng.randrange(4)
            if kind == 0 and len(frames) >= 4:
                at = rng.randrange(len(frames) // 4) * 4
                frames[at : at + 4] = struct.pack("<f", rng.choice((math.nan, math.inf, -math.inf)))
            elif kind == 1:
                values.copy_(torch.randint(0, 256, (len(frames),), dtype=torch.uint8, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))))
            elif kind == 2 and len(frames) % 4 == 0:
                values.view(torch.float32).fill_(rng.choice((3e38, -3e38, 1e-40, 0.0, -0.0)))
            draft.frames = _rechunk(bytes(frames), [len(f) for f in draft.frames])
            draft.notes.append(f"payload values {kind}")
        elif op == 14 and draft.frames:
            del draft.frames[rng.randrange(len(draft.frames))]
            draft.notes.append("frame dropped")
        elif op == 15:
            extra = rng.choice((b"", b"\x00" * 4, rng.randbytes(rng.randrange(1, 9000)), draft.frames[0] if draft.frames else b"x"))
            draft.frames.insert(rng.randrange(len(draft.frames) + 1), extra)
            draft.notes.append(f"extra frame of {len(extra)} bytes")
        elif op == 16 and draft.frames:
            index = rng.randrange(len(draft.frames))
            frame = draft.frames[index]
            cut = rng.randrange(len(frame) + 1)
            draft.frames[index : index + 1] = [frame[:cut], frame[cut:]]
            draft.notes.append(f"frame {index} split at {cut}")
        elif op == 17 and draft.frames:
            index = rng.randrange(len(draft.frames))
            frame = draft.frames[index]
            draft.frames[index] = frame[: rng.randrange(len(frame) + 1)] if rng.random() < 0.6 else frame + rng.randbytes(rng.randrange(1, 7))
            draft.notes.append(f"frame {index} of {len(draft.frames[index])} bytes")
        elif op == 18:
            header = draft.encoded()[0]
            cut = header[: rng.randrange(len(header) + 1)]
            draft.header_bytes = cut if rng.random() < 0.5 else cut + rng.randbytes(4)
            draft.notes.append("header truncated")
        else:
            header = bytearray(draft.encoded()[0]) or bytearray(b"\x80")
            for _ in range(rng.randrange(1, 4)):
                header[rng.randrange(len(header))] ^= 1 << rng.randrange(8)
            draft.header_bytes = bytes(header)
            draft.notes.append("header bits flipped")
    return draft


def _rechunk(data: bytes, sizes: Sequence[int]) -> list[bytes]:
    frames, at = [], 0
    for size in sizes:
        frames.append(data[at : at + size])
        at += size
    return frames


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def random_frames(rng: random.Random) -> list[bytes]:
    """1 to 4 frames of random bytes (a random first byte reads as any msgpack type)."""
    return [rng.randbytes(rng.choice((0, 1, 2, 7, 64, 1000, 65536))) for _ in range(rng.randrange(1, 5))]


def header_bomb(rng: random.Random) -> tuple[bytes, str]:
    """A header of ``MAX_HEADER_BYTES`` that decodes to millions of small objects (before the bound on
    decoded values, 16 MiB of empty arrays took a node 1.2 GB and 5 s)."""
    kind, element = rng.choice((("empty arrays", b"\x90"), ("empty maps", b"\x80"), ("2-char strings", b"\xa2ab"), ("uint16", b"\xcd\x01\x02")))
    per_array = (1 << 18) - 1
    inner = b"\xdd" + struct.pack(">I", per_array) + element * per_array
    count = (MAX_HEADER_BYTES - 64) // len(inner)
    body = pack(Pairs((("v", PROTOCOL_VERSION), ("t", int(MsgType.QUERY)))))[1:]
    data = bytes([0x83]) + body + pack("m") + b"\xdd" + struct.pack(">I", count) + inner * count
    return data[:MAX_HEADER_BYTES], f"header bomb of {kind}"


def answerable(chosen: bytes) -> bool:
    """Whether every answer of the node reaches a socket with routing id ``chosen``: a laned client's
    id (see transport.zeromq.backend) is answered on the id of the lane of the bucket a message is about,
    which is this socket's own only for lane 0 of one lane."""
    return not (len(chosen) == 10 and chosen[:1] == b"\x01") or chosen[8:] == b"\x00\x01"


def routing_id(rng: random.Random) -> bytes:
    """A client-chosen ZeroMQ routing id: random, or shaped like a laned or single client's (any lane count, 0 included)."""
    kind = rng.randrange(3)
    if kind == 0:
        return b"\x01" + rng.randbytes(7) + bytes([rng.randrange(256), rng.choice((0, 1, 2, 255, rng.randrange(256)))])
    if kind == 1:
        return b"\x02" + rng.randbytes(7)
    return bytes([rng.randrange(1, 256)]) + rng.randbytes(rng.randrange(0, 255))


def is_int(value: Any) -> bool:
    """An integer, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)
