"""A misbehaving peer for the conformance suite: starts sending a 512 MiB message and is killed
(by the test) while the bytes are in transit."""

from __future__ import annotations

import sys

import torch
import zmq

from transport.security import CurveClientConfig, secure_client_socket
from transport.wire import MsgType, encode_message, tensor_header


def main() -> None:
    address, secret, server_key = sys.argv[1], sys.argv[2], sys.argv[3]
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.SNDHWM, 0)
    if secret != "-":
        secure_client_socket(socket, CurveClientConfig(secret, server_key))
    socket.connect(address)
    payload = torch.ones(128 << 20)  # 512 MiB: seconds on loopback, so the kill lands mid-message
    frames = encode_message(tensor_header(MsgType.ECHO, payload), payload)
    socket.send_multipart(frames, copy=False)
    print("sending", flush=True)
    sys.stdin.readline()  # the test kills this process before it would return


if __name__ == "__main__":
    main()
