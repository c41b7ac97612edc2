"""Every preset materialises (config, tokenizer, processor, no weights) and reads as its family."""

from __future__ import annotations

import pytest

from services.model.presets import PRESETS, is_random, resolve_model
from services.model.spec import load_spec


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_reads_as_its_family(tmp_path, name):
    model_dir = resolve_model(f"preset:{name}", cache=tmp_path)
    spec = load_spec(model_dir)
    assert spec.family == PRESETS[name]["family"] and is_random(spec.model_dir)
    assert spec.text.vocab == PRESETS[name]["text"]["vocab_size"]
    assert spec.text.layers == PRESETS[name]["text"]["num_hidden_layers"]


def test_the_qwen_preset_is_7b_shaped(tmp_path):
    spec = load_spec(resolve_model("preset:qwen2.5-vl-7b-shaped", cache=tmp_path))
    assert spec.image_grid and spec.image_tokens == 1280  # max_pixels 28 * 28 * 1280
    assert (spec.text.hidden, spec.text.heads, spec.text.kv_heads, spec.text.head_dim) == (3584, 28, 4, 128)
    assert spec.text.qkv_bias and spec.text.mrope_section == (16, 24, 24)
