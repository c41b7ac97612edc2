"""The committed stubs are what grpcio-tools makes of protos/, and import on the GPU machine."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT


def test_committed_stubs_match_protos(tmp_path):
    pytest.importorskip("grpc_tools")
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = ROOT / rel
        assert committed.is_file(), f"{rel} is not committed: run `make protos`"
        assert committed.read_bytes() == path.read_bytes(), f"{rel} drifted from protos/: run `make protos`"
    committed = {p.relative_to(ROOT) for p in (ROOT / "vlmesh").rglob("*_pb2*.py*")}
    assert committed == {p.relative_to(tmp_path) for p in fresh}, "stale stubs without a proto"


def test_stubs_import_on_grpcio_184_and_protobuf_736():
    """The GPU machine has grpcio 1.84 and protobuf 7.36: the stubs' version gates must admit them."""
    for path in (ROOT / "vlmesh" / "v1").glob("*_pb2_grpc.py"):
        version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", path.read_text()).group(1)
        assert tuple(map(int, version.split("."))) <= (1, 84, 0), f"{path.name} needs grpcio {version}"
    for path in (ROOT / "vlmesh" / "v1").glob("*_pb2.py"):
        major, minor, patch = map(int, re.search(r"PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", path.read_text()).groups())
        assert (7, 0, 0) <= (major, minor, patch) <= (7, 36, 0), f"{path.name} gencode {major}.{minor}.{patch}"
