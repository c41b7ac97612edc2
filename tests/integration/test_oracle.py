"""The mesh's greedy tokens equal transformers' LlavaForConditionalGeneration.generate, for one
picture and for several in one request, and for a checkpoint stored in fp8 (compressed-tensors)."""

from __future__ import annotations

import shutil

import grpc
import pytest

from services.launcher import Mesh
from services.model.stored_fp8 import store_fp8
from tests.helpers import (
    check_against_transformers,
    check_pictures_against_transformers,
    mesh_options,
    multiplied_out,
)
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


def test_a_checkpoint_stored_in_fp8_matches_transformers_on_its_codes_multiplied_out(tiny_model, tmp_path):
    """--quantize none on a CPU: the llm multiplies the stored codes out; transformers runs the same
    weights written back in fp32 (its own compressed-tensors loader needs a package vlmesh does not use)."""
    stored = tmp_path / "fp8"
    shutil.copytree(tiny_model, stored)
    store_fp8(stored)
    with Mesh(mesh_options(stored)) as mesh:
        mesh.start(progress=lambda m: None)
        with grpc.insecure_channel(mesh.target("gateway")) as channel:
            check_against_transformers(
                gateway_pb2_grpc.GatewayStub(channel), multiplied_out(stored, tmp_path / "plain")
            )
