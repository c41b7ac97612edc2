"""Sampling, qos-level and checkpoint-key handling."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.qos import QosLevel, parse_qos, qos_from_metadata
from services.common.validation import MAX_PROMPT_CHARS, check_conversation, check_sampling
from services.model.checkpoint import canonical_key
from vlmesh.v1 import common_pb2 as pb


def test_defaults_are_greedy_and_unbounded():
    s = check_sampling(pb.SamplingParams(), 512)
    assert s.greedy and s.max_tokens is None and s.top_p == 1.0 and s.seed is None


@pytest.mark.parametrize(
    "params,needle",
    [
        (pb.SamplingParams(max_tokens=0), "max_tokens=0"),
        (pb.SamplingParams(max_tokens=512), "max_tokens=512"),
        (pb.SamplingParams(temperature=float("nan")), "temperature"),
        (pb.SamplingParams(top_p=1.5), "top_p"),
        (pb.SamplingParams(stop=[""]), "stop[0]"),
        (pb.SamplingParams(stop=["x"] * 17), "at most 16"),
    ],
)
def test_bad_sampling(params, needle):
    with pytest.raises(InvalidArgument, match=None) as info:
        check_sampling(params, 512)
    assert needle in info.value.message


def test_qos_levels():
    assert parse_qos(None) is QosLevel.STANDARD
    assert parse_qos("best-effort") is QosLevel.BEST_EFFORT
    assert qos_from_metadata([("other", "x"), ("qos-level", "realtime")]) is QosLevel.REALTIME
    assert QosLevel.REALTIME < QosLevel.STANDARD < QosLevel.BEST_EFFORT
    with pytest.raises(InvalidArgument, match="unknown qos-level"):
        parse_qos("gold")


@pytest.mark.parametrize(
    "key,expected",
    [
        ("vision_tower.encoder.layers.0.mlp.fc1.weight", ("vision", "encoder.layers.0.mlp.fc1.weight")),
        ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", ("vision", "encoder.layers.0.mlp.fc1.weight")),
        ("model.vision_tower.vision_model.embeddings.class_embedding", ("vision", "embeddings.class_embedding")),
        ("multi_modal_projector.linear_1.weight", ("vision", "multi_modal_projector.linear_1.weight")),
        ("model.multi_modal_projector.linear_2.bias", ("vision", "multi_modal_projector.linear_2.bias")),
        ("language_model.model.layers.1.self_attn.q_proj.weight", ("text", "layers.1.self_attn.q_proj.weight")),
        ("model.language_model.embed_tokens.weight", ("text", "embed_tokens.weight")),
        ("language_model.lm_head.weight", ("text", "lm_head.weight")),
        ("lm_head.weight", ("text", "lm_head.weight")),
    ],
)
def test_checkpoint_key_layouts(key, expected):
    assert canonical_key(key) == expected


@pytest.mark.parametrize(
    "params",
    [
        pb.SamplingParams(),
        pb.SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, seed=3, stop=["\n", "END"], min_tokens=2),
        pb.SamplingParams(max_tokens=5, min_tokens=5, ignore_eos=True),
    ],
)
def test_normalised_sampling_survives_forwarding(params):
    """The gateway forwards `Sampling.to_pb()`: the llm must read back exactly what the gateway checked."""
    s = check_sampling(params, 512)
    assert check_sampling(s.to_pb(), 512) == s


IMAGE = object()  # an image part, in _msg


def _msg(role: str, *parts) -> pb.ChatMessage:
    content = [pb.ContentPart(image=True) if p is IMAGE else pb.ContentPart(text=p) for p in parts]
    return pb.ChatMessage(role=role, content=content)


def test_a_conversation_becomes_the_chat_templates_messages():
    messages = [
        _msg("system", "Answer briefly."),
        _msg("user", IMAGE, "What is it?"),
        _msg("assistant", "A circle."),
        _msg("user", "Which color?"),
    ]
    assert check_conversation("", messages, 1) == [
        {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A circle."}]},
        {"role": "user", "content": [{"type": "text", "text": "Which color?"}]},
    ]
    assert check_conversation("What is it?", [], 1) == "What is it?"  # a prompt stays a prompt


@pytest.mark.parametrize(
    ("prompt", "messages", "n_images", "match"),
    [
        ("hi", [_msg("user", IMAGE, "hi")], 1, "not both"),
        ("", [_msg("robot", IMAGE, "hi")], 1, "role 'robot' is not one of system, user, assistant"),
        ("", [_msg("user", IMAGE, "hi"), _msg("assistant", "ok")], 1, "end with a user message"),
        ("", [_msg("assistant", IMAGE, "x"), _msg("user", "hi")], 1, "images go in user messages only"),
        ("", [_msg("user", "hi")], 1, "0 image parts for 1 images"),
        ("", [_msg("user", IMAGE, IMAGE, "hi")], 1, "2 image parts for 1 images"),
        ("", [_msg("user", IMAGE, "  ")], 1, "no text"),
        ("", [_msg("user"), _msg("user", IMAGE, "hi")], 1, r"messages\[0\] \(user\) has no content"),
        ("", [pb.ChatMessage(role="user", content=[pb.ContentPart()])], 1, r"content\[0\] is empty"),
        ("", [_msg("user", IMAGE, "x" * (MAX_PROMPT_CHARS + 1))], 1, "characters of text"),
    ],
)
def test_a_bad_conversation_is_refused_naming_what_is_wrong(prompt, messages, n_images, match):
    with pytest.raises(InvalidArgument, match=match):
        check_conversation(prompt, messages, n_images)
