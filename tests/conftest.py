"""Shared fixtures and hooks: a tiny random LLaVA checkpoint and a real three-process mesh on it.

Fixtures and hooks only; helpers that test modules import live in tests/helpers.py.
"""

from __future__ import annotations

import pytest

from services.launcher import Mesh
from tests.helpers import mesh_options


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random LLaVA written by transformers' save_pretrained (center crop on, 32 px, 16 image tokens)."""
    from services.model.tiny import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), seed=0)


@pytest.fixture(scope="session")
def tiny_deepseek_hybrid(tmp_path_factory):
    """A random DeepSeek-VL hybrid (SigLIP 32 px and SAM 64 px, 16 image tokens), saved by transformers."""
    from services.model.tiny import build_tiny_deepseek

    return build_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek-hybrid"), hybrid=True, seed=3)


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory):
    """A random DeepSeek-VL of the SigLIP-only kind (`deepseek_vl`, 16 image tokens)."""
    from services.model.tiny import build_tiny_deepseek

    return build_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"), hybrid=False, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    """A random Qwen2.5-VL (14-px patches, 4 to 64 tokens a picture, M-RoPE), saved by transformers."""
    from services.model.tiny import build_tiny_qwen2_5_vl

    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), seed=2)


@pytest.fixture(scope="session")
def mesh(tiny_model):
    """gateway, vision and llm as three real processes on ephemeral ports."""
    with Mesh(mesh_options(tiny_model)) as running:
        running.start(progress=lambda msg: None)
        yield running
