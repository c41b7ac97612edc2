"""What the vision tests share: the tiny model's encoder and a consumer in this process."""

from __future__ import annotations

import pytest

from services.handoff.consumer import Consumer


@pytest.fixture(scope="module")
def encoder(tiny_model):
    from services.model.spec import load_spec
    from services.vision.encoder import VisionEncoder

    return VisionEncoder(load_spec(tiny_model), "cpu", "float32")


@pytest.fixture
def consumer():
    c = Consumer()
    yield c
    c.close()
