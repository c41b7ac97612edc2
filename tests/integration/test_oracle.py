"""The mesh's greedy tokens equal transformers' LlavaForConditionalGeneration.generate."""

from __future__ import annotations

import grpc
import pytest

from tests.helpers import check_against_transformers
from vlmesh.v1 import gateway_pb2_grpc


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def test_greedy_tokens_match_transformers(mesh, tiny_model, stub):
    check_against_transformers(stub, tiny_model)
