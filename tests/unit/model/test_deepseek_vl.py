"""DeepSeek-VL as a family: its preprocessing equals transformers' PIL image processors to the
bit, its towers equal transformers' image features, the registry names what it serves, and a
tiny checkpoint from the CLI is one transformers loads."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from services.common.errors import InvalidArgument
from services.model.checkpoint import load_vision_tower
from services.model.family import FAMILY_NAMES, family_for, family_named, family_of, model_types
from services.model.spec import load_spec
from tests.helpers import ROOT, hf_model

MODELS = ["tiny_deepseek_hybrid", "tiny_deepseek"]
# (height, width, mode): wide, tall, a sliver below min_size, square, grey, with alpha, bigger than SAM's side
PICTURES = [(37, 90, "RGB"), (90, 37, "RGB"), (5, 200, "RGB"), (64, 64, "RGB"), (31, 31, "L"), (50, 70, "RGBA"),
            (300, 120, "RGB")]  # fmt: skip


def picture(seed: int, h: int, w: int, mode: str) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def transformers_processor(model_dir):
    from tests.helpers import hf_processor

    return hf_processor(model_dir).image_processor


@pytest.mark.parametrize("resize_on", [None, torch.device("cpu")], ids=["pillow", "resample"])
@pytest.mark.parametrize("model", MODELS)
def test_pixels_equal_transformers_pil_processor(model, resize_on, request):
    """Resized by Pillow on the preprocessing threads, or by resample.py where the tower runs."""
    model_dir = request.getfixturevalue(model)
    spec = load_spec(model_dir)
    ours = family_of(spec).image_processor(spec, resize_on)
    theirs = transformers_processor(model_dir)
    for i, (h, w, mode) in enumerate(PICTURES):
        img = picture(i, h, w, mode)
        got = ours.tower_inputs([ours.pixels(img, "images[0]")], torch.device("cpu"))
        want = theirs(images=img.convert("RGB"), return_tensors="pt")
        names = ["pixel_values", "high_res_pixel_values"][: len(got)]
        assert sorted(want.keys()) == sorted(names)
        for name, px in zip(names, got, strict=True):
            assert px.shape == want[name].shape, (name, h, w)
            torch.testing.assert_close(px, want[name], atol=1e-6, rtol=0, msg=f"{name} of a {w}x{h} {mode} picture")


@pytest.mark.parametrize("model", MODELS)
def test_the_towers_give_transformers_image_features(model, request):
    model_dir = request.getfixturevalue(model)
    spec = load_spec(model_dir)
    tower = load_vision_tower(spec, torch.device("cpu"), torch.float32)
    proc = family_of(spec).image_processor(spec)
    reference = hf_model(model_dir).model
    theirs = transformers_processor(model_dir)
    imgs = [picture(10 + i, h, w, "RGB") for i, (h, w, _) in enumerate(PICTURES[:3])]
    with torch.no_grad():
        got = tower(*proc.tower_inputs([proc.pixels(img, "x") for img in imgs], torch.device("cpu")))
        inputs = theirs(images=imgs, return_tensors="pt")
        want = reference.get_image_features(**inputs).pooler_output
    assert got.shape == (3, spec.image_tokens, spec.text.hidden) == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert (got[0] - got[1]).abs().mean() > 0.05 * got.abs().mean()  # the pictures matter


def test_the_spec_of_each_type(tiny_deepseek_hybrid, tiny_deepseek):
    hybrid, plain = load_spec(tiny_deepseek_hybrid), load_spec(tiny_deepseek)
    assert (hybrid.family, plain.family) == ("deepseek_vl_hybrid", "deepseek_vl")
    assert hybrid.placeholder == plain.placeholder == "<image_placeholder>"
    assert hybrid.image_tokens == plain.image_tokens == (32 // 8) ** 2
    assert hybrid.vision.hybrid and not plain.vision.hybrid


def test_the_registry_names_what_it_serves(tmp_path):
    assert sorted(model_types()) == sorted(FAMILY_NAMES)
    for name in FAMILY_NAMES:
        assert family_for(name).name == name == family_named(name.replace("_", "-")).name
    with pytest.raises(InvalidArgument) as err:
        family_for("qwen2_vl", tmp_path / "config.json")
    assert err.value.message == (
        f"{tmp_path}/config.json: model_type 'qwen2_vl' is not one vlmesh serves "
        "(it serves llava, deepseek_vl, deepseek_vl_hybrid, qwen2_5_vl)"
    )


def test_make_tiny_model_writes_a_checkpoint_transformers_loads(tmp_path):
    out = tmp_path / "ds"
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "make-tiny-model", "--family", "deepseek-vl-hybrid", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(model).__name__ == "DeepseekVLHybridForConditionalGeneration"
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text.endswith("User: <image_placeholder>What is it?\n\nAssistant:")
    assert load_spec(out).family == "deepseek_vl_hybrid"


def test_a_picture_is_refused_by_name_when_unreadable(tiny_deepseek_hybrid):
    from services.vision.encoder import VisionEncoder

    enc = VisionEncoder(load_spec(tiny_deepseek_hybrid), "cpu", "float32")
    with pytest.raises(InvalidArgument, match=r"images\[2\] \(5 bytes\) is not a readable image"):
        enc.pixels(b"nope!", "images[2]")
    buf = io.BytesIO()
    picture(0, 10, 3000, "RGB").save(buf, "PNG")  # 300:1, fine here: the long side is what is resized
    assert [tuple(p.shape) for p in enc.pixels(buf.getvalue())] == [(32, 32, 3), (64, 64, 3)]
