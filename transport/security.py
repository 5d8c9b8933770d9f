"""ZeroMQ CURVE security for the data plane: encryption plus an allow-list of worker public keys.

Keys are ZeroMQ certificate files (``netoptim keygen``): ``NAME.key`` holds the public key and goes to
peers; ``NAME.key_secret`` holds both keys and stays with its owner. A node lists the workers it
accepts as a directory of their ``.key`` files; a worker names its own secret file and the node's
public file. Off by default: on loopback and trusted networks it only costs throughput.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def generate_keypair(directory: str, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` into ``directory``; returns their paths."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


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
