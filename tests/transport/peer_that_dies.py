"""A peer for the conformance suite that the test kills while its bytes are in transit: it sends
``MESSAGES`` messages of ``MESSAGE_NUMEL`` ones, through the project's own transport for the
address's backend, and says "sending" once the first is on its way."""

from __future__ import annotations

import sys

import torch

from transport import create_transport
from transport.wire import MsgType, tensor_header
from transport.zeromq.security import CurveClientConfig

MESSAGE_NUMEL = 2 << 20  # 8 MiB
MESSAGES = 64  # 512 MiB in all: a good fraction of a second on loopback, so the kill lands mid-stream


def main() -> None:
    address, secret, server_key, chunk_bytes, window_bytes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    options: dict = {"chunk_bytes": chunk_bytes}
    if secret != "-":
        options["curve_client"] = CurveClientConfig(secret, server_key)
    if address.startswith("mooncake"):
        options["window_bytes"] = window_bytes
    transport = create_transport(address, **options)
    client = transport.connect(address)
    payload = torch.ones(MESSAGE_NUMEL)
    for index in range(MESSAGES):
        client.send(tensor_header(MsgType.ECHO, payload, chunk_bytes=chunk_bytes, step=index), payload)
        if index == 0:
            print("sending", flush=True)
    sys.stdin.readline()  # the test kills this process before it would return


if __name__ == "__main__":
    main()
