"""The generated gRPC code under protos/ is what protos/admin.proto gives: regenerate and compare."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ["admin_pb2.py", "admin_pb2_grpc.py", "admin_pb2.pyi"]


def test_generated_code_has_not_drifted(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    (tmp_path / "protos").mkdir()
    shutil.copy(ROOT / "protos" / "admin.proto", tmp_path / "protos" / "admin.proto")
    status = protoc.main(
        [
            "protoc",
            f"-I{tmp_path}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            str(tmp_path / "protos" / "admin.proto"),
        ]
    )
    assert status == 0
    for name in GENERATED:
        assert (tmp_path / "protos" / name).read_text() == (ROOT / "protos" / name).read_text(), (
            f"protos/{name} is stale: run python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/admin.proto"
        )
