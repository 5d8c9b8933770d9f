"""ZeroMQ CURVE security for the data plane: encryption plus an allow-list of worker public keys.

Keys are ZeroMQ certificate files (``netoptim keygen``): ``NAME.key`` holds the public key and goes to
peers; ``NAME.key_secret`` holds both keys and stays with its owner. A node lists the workers it
accepts as a directory of their ``.key`` files; a worker names its own secret file and the node's
public file. Off by default: on loopback and trusted networks it only costs throughput.

A worker's key can be bound to the ranks it may register as (``netoptim keygen --ranks 0-3``): the
ranks are written into the metadata section of both certificate files, and the node reads them from
the ``.key`` files of its allow-list (:class:`AllowList`), so only the node operator's copy counts.
The ZAP handler tags every message with the sender's public key (its ``User-Id``), which the node
checks against the ranks on HELLO.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import zmq
import zmq.auth

from transport.secret_files import check_private


@dataclass(frozen=True, slots=True)
class CurveServerConfig:
    """The node's side."""

    secret_key_file: str
    """The node's ``.key_secret`` certificate."""

    allowed_keys_dir: str
    """A directory of the ``.key`` certificates of the workers that may connect."""

    def validate(self) -> None:
        load_keypair(self.secret_key_file, need_secret=True)
        allowed = Path(self.allowed_keys_dir)
        if not allowed.is_dir() or not any(allowed.glob("*.key")):
            raise ValueError(f"{self.allowed_keys_dir} must be a directory holding the workers' .key files (from netoptim keygen)")
        AllowList.load(allowed)  # bad rank metadata stops the node at start, naming the file


@dataclass(frozen=True, slots=True)
class CurveClientConfig:
    """A worker's side."""

    secret_key_file: str
    """The worker's ``.key_secret`` certificate."""

    server_key_file: str
    """The node's public ``.key`` certificate."""

    def validate(self) -> None:
        load_keypair(self.secret_key_file, need_secret=True)
        load_keypair(self.server_key_file, need_secret=False)


class AllowedKeys:
    """The ZAP handler's check of a connecting worker's CURVE key (a credentials provider for
    ``configure_curve_callback``): allowed if it is one of ``keys`` (z85, :attr:`AllowList.public_keys`).
    ``on_refused`` hears of each key refused (z85, on the handler's thread), so that the node can say
    so: ZeroMQ itself tells the node nothing of a handshake it refused."""

    def __init__(self, keys: AbstractSet[str], on_refused: Callable[[str], None] | None = None) -> None:
        self._keys = keys
        self._on_refused = on_refused

    def callback(self, domain: str, key: bytes) -> bool:
        text = key.decode("ascii", "replace")
        if text in self._keys:
            return True
        if self._on_refused is not None:
            self._on_refused(text)
        return False


def load_keypair(path: str, *, need_secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) from a certificate file; ``ValueError`` saying what is wrong."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the CURVE key file {path}: {exc}") from None
    if need_secret and not secret:
        raise ValueError(f"{path} holds no secret key: give the .key_secret file made by netoptim keygen")
    if secret:
        check_private(path, "the CURVE secret key file")
    return public, secret


RANKS_METADATA = "ranks"
"""The certificate metadata field holding the ranks a worker key may register as (``0-3,8``)."""

MAX_RANK = (1 << 31) - 1
"""Largest rank a key can be bound to (far above any world size; keeps a typo from meaning 'all')."""


def parse_ranks(text: str) -> tuple[tuple[int, int], ...]:
    """``"0,1"``, ``"0-3"`` or ``"0-3,8"`` as sorted, merged, inclusive ``(first, last)`` ranges;
    ``ValueError`` saying what is wrong."""
    ranges = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise ValueError(f"ranks {text!r}: {part.strip()!r} is not a rank or a range like 0-3")
        first = int(match[1])
        last = first if match[2] is None else int(match[2])
        if first > last:
            raise ValueError(f"ranks {text!r}: the range {first}-{last} is empty")
        if last > MAX_RANK:
            raise ValueError(f"ranks {text!r}: {last} is above the largest rank {MAX_RANK}")
        ranges.append((first, last))
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return tuple(merged)


def format_ranks(ranges: Iterable[tuple[int, int]]) -> str:
    """The inverse of :func:`parse_ranks`: ``((0, 3), (8, 8))`` -> ``"0-3,8"``."""
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)


def read_metadata(path: str | Path) -> dict[str, str]:
    """The ``metadata`` section of a ZeroMQ certificate file (ZPL: a section name at the start of a
    line, its ``name = value`` properties indented under it); ``ValueError`` for a property line
    without ``=``."""
    metadata: dict[str, str] = {}
    section = None
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not line[0].isspace():
            section = stripped
            continue
        if section != "metadata":
            continue
        name, sep, value = stripped.partition("=")
        if not sep:
            raise ValueError(f"{path}, line {number}: a metadata property is 'name = value', got {stripped!r}")
        metadata[name.strip()] = value.strip().strip("'\"")
    return metadata


def _write_certificate(path: Path, banner: str, public: str, secret: str | None, metadata: Mapping[str, str], mode: int) -> None:
    lines = [f"#   {line}" for line in banner.splitlines()] + ["", "metadata"]
    lines += [f'    {name} = "{value}"' for name, value in metadata.items()]
    lines += ["curve", f'    public-key = "{public}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret}"')
    # Created with its final mode: a secret key is never readable by others, not even for a moment.
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    path.chmod(mode)  # an existing file keeps its old mode through O_CREAT


def generate_keypair(directory: str, name: str, ranks: str | None = None) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` into ``directory``; returns their paths. ``ranks``
    (``"0,1"``, ``"0-3"``) binds the key to the ranks it may register as, in both files' metadata;
    without it the key may register as any rank. ``ValueError`` for a bad ``ranks`` or ``name``."""
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"key name {name!r} must be a plain file name, like worker0")
    metadata = {RANKS_METADATA: format_ranks(parse_ranks(ranks))} if ranks is not None else {}
    Path(directory).mkdir(parents=True, exist_ok=True)
    public_key, secret_key = (key.decode("ascii") for key in zmq.curve_keypair())
    made = f"Generated on {datetime.now():%Y-%m-%d %H:%M:%S} by netoptim keygen"
    public = Path(directory) / f"{name}.key"
    secret = Path(directory) / f"{name}.key_secret"
    _write_certificate(public, f"{made}\nZeroMQ CURVE Public Certificate: give it to peers", public_key, None, metadata, 0o644)
    _write_certificate(secret, f"{made}\nZeroMQ CURVE **Secret** Certificate: keep it private", public_key, secret_key, metadata, 0o600)
    return public, secret


@dataclass(frozen=True, slots=True)
class KeyGrant:
    """What one allowed worker key may do, as its ``.key`` file in the allow-list says."""

    public_key: str
    """The key, z85 (as the ZAP handler gives it in a message's ``User-Id``)."""

    file: str
    """The name of its file in the allow-list directory."""

    ranks: tuple[tuple[int, int], ...] | None
    """Inclusive rank ranges it may register as; ``None``: any rank (no ranks in its metadata)."""

    @property
    def fingerprint(self) -> str:
        """A short id of the key for messages and logs: its first 8 z85 characters (the key is public)."""
        return self.public_key[:8]

    def allows(self, rank: int) -> bool:
        return self.ranks is None or any(first <= rank <= last for first, last in self.ranks)

    def __str__(self) -> str:
        return f"key {self.fingerprint} ({self.file})"


class AllowList:
    """The node's allow-list directory, read once at start: each allowed public key and its ranks."""

    def __init__(self, grants: Mapping[str, KeyGrant]) -> None:
        self._grants = dict(grants)

    @classmethod
    def load(cls, directory: str | Path) -> AllowList:
        """Read every ``*.key`` file of ``directory``; ``ValueError`` naming the file for one that cannot
        be read, bad ranks, or one key listed twice with different ranks."""
        grants: dict[str, KeyGrant] = {}
        for path in sorted(Path(directory).glob("*.key")):
            public, _ = load_keypair(str(path), need_secret=False)
            try:
                raw = read_metadata(path).get(RANKS_METADATA)
                ranks = None if raw is None else parse_ranks(raw)
            except (OSError, ValueError) as exc:
                raise ValueError(f"allow-list file {path}: {exc}") from None
            grant = KeyGrant(public.decode("ascii"), path.name, ranks)
            earlier = grants.get(grant.public_key)
            if earlier is not None and earlier.ranks != grant.ranks:
                raise ValueError(f"allow-list files {earlier.file} and {path.name} hold the same key with different ranks: keep one")
            grants.setdefault(grant.public_key, grant)
        return cls(grants)

    def __len__(self) -> int:
        return len(self._grants)

    @property
    def public_keys(self) -> frozenset[str]:
        """The allowed public keys (z85): what the handshake lets in."""
        return frozenset(self._grants)

    def grant(self, user_id: str | None) -> KeyGrant | None:
        """The grant of the key a message came with (its ``User-Id``); ``None`` for a key not listed."""
        return None if user_id is None else self._grants.get(user_id)

    def refusal(self, user_id: str | None, rank: int) -> str | None:
        """Why the key ``user_id`` may not register as ``rank``, or ``None`` when it may. One dict
        lookup plus the key's few rank ranges: cheap enough for every HELLO."""
        grant = self.grant(user_id)
        if grant is None:  # the ZAP handler let it in, so the directory changed since the node read it
            fingerprint = "none" if user_id is None else user_id[:8]
            return f"key {fingerprint} is not in the allow-list the node read at start; restart the node after changing --curve-allow"
        if grant.allows(rank):
            return None
        return f"{grant} may register as rank(s) {format_ranks(grant.ranks or ())} only, not as rank {rank}; use the key made for rank {rank}"

    @property
    def unbound(self) -> list[KeyGrant]:
        """The keys bound to no rank: any of their holders may register as any rank."""
        return [grant for grant in self._grants.values() if grant.ranks is None]


def secure_server_socket(socket: zmq.Socket, config: CurveServerConfig) -> None:
    public, secret = load_keypair(config.secret_key_file, need_secret=True)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True


def secure_client_socket(socket: zmq.Socket, config: CurveClientConfig) -> None:
    public, secret = load_keypair(config.secret_key_file, need_secret=True)
    server_public, _ = load_keypair(config.server_key_file, need_secret=False)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = server_public
