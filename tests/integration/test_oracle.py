"""The mesh's greedy tokens equal transformers' LlavaForConditionalGeneration.generate, for one
picture and for several in one request."""

from __future__ import annotations

import grpc
import pytest

from services.launcher import Mesh
from tests.helpers import check_against_transformers, check_pictures_against_transformers, mesh_options
from vlmesh.v1 import gateway_pb2_grpc


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def test_greedy_tokens_match_transformers(mesh, tiny_model, stub):
    check_against_transformers(stub, tiny_model)


def test_several_pictures_in_one_request_match_transformers(tiny_model):
    with Mesh(mesh_options(tiny_model, max_images=3)) as mesh:
        mesh.start(progress=lambda m: None)
        with grpc.insecure_channel(mesh.target("gateway")) as channel:
            check_pictures_against_transformers(gateway_pb2_grpc.GatewayStub(channel), tiny_model)
