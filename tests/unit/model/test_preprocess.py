"""Our Pillow/numpy preprocessing equals transformers' CLIPImageProcessor."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from services.common.errors import InvalidArgument
from services.model.preprocess import ImageProcessorConfig, crop, decode_image, normalize, preprocess
from tests.helpers import pil_clip_processor_class


def picture(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))
    return img.convert(mode)


CONFIGS = {
    "shortest-edge + crop": dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    "fixed size, no crop": dict(
        size={"height": 48, "width": 48}, crop_size={"height": 48, "width": 48}, do_center_crop=False
    ),
    "llava-336": dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("size", [(48, 40), (40, 97), (300, 120), (32, 32), (17, 500)])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_matches_transformers(tmp_path, name, size, mode):
    hf = pil_clip_processor_class()(**CONFIGS[name])
    hf.save_pretrained(tmp_path)
    side = CONFIGS[name]["crop_size"]["height"]
    cfg = ImageProcessorConfig.load(tmp_path, side)
    img = picture(*size, mode=mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    ours = preprocess(decode_image(buf.getvalue()), cfg)
    ref = hf(images=Image.open(io.BytesIO(buf.getvalue())), return_tensors="pt")["pixel_values"][0]
    assert ours.shape == ref.shape == (3, side, side)
    assert (ours - ref).abs().max().item() < 1e-5


def test_output_size_must_match_the_vit(tmp_path):
    pil_clip_processor_class()(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        tmp_path
    )
    with pytest.raises(InvalidArgument, match="image_size 64"):
        ImageProcessorConfig.load(tmp_path, 64)


@pytest.mark.parametrize("data", [b"", b"GIF89a broken", b"\x89PNG\r\n\x1a\n" + b"\0" * 20, b"hello"])
def test_undecodable_bytes(data):
    with pytest.raises(InvalidArgument):
        decode_image(data)


def test_pixel_limit():
    buf = io.BytesIO()
    Image.new("RGB", (300, 300)).save(buf, format="PNG")
    with pytest.raises(InvalidArgument, match="pixels"):
        decode_image(buf.getvalue(), max_pixels=10_000)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF"])
def test_formats_pillow_reads(fmt):
    buf = io.BytesIO()
    picture(40, 30).save(buf, format=fmt)
    assert decode_image(buf.getvalue()).size == (40, 30)


def test_normalizing_uint8_pixels_in_torch_is_the_processors_arithmetic(tmp_path):
    """`crop` then `normalize` (what the vision encoder runs, the second on its device) equals the
    whole preprocessing, and transformers', for a batch too."""
    hf = pil_clip_processor_class()(**CONFIGS["llava-336"])
    hf.save_pretrained(tmp_path)
    cfg = ImageProcessorConfig.load(tmp_path, 336)
    imgs = [picture(300, 120, seed=1), picture(40, 97, seed=2)]
    crops = torch.stack([crop(img, cfg) for img in imgs])
    assert crops.dtype == torch.uint8 and crops.shape == (2, 336, 336, 3)
    batch = normalize(crops, cfg)
    assert batch.shape == (2, 3, 336, 336) and batch.dtype == torch.float32
    for img, got in zip(imgs, batch, strict=True):
        ref = hf(images=img, return_tensors="pt")["pixel_values"][0]
        assert (got - ref).abs().max().item() < 1e-5
        assert torch.equal(got, preprocess(img, cfg))


def test_the_cpus_table_gives_the_bits_of_the_arithmetic_a_gpu_runs(tmp_path):
    """On the CPU `normalize` looks values up in a table; elsewhere it computes them. Both give the
    same bits, for every value of each channel, on a batch of strided (cropped) pixels."""
    from services.model import preprocess as pre

    hf = pil_clip_processor_class()(**CONFIGS["llava-336"])
    hf.save_pretrained(tmp_path)
    cfg = ImageProcessorConfig.load(tmp_path, 336)
    every = torch.arange(256, dtype=torch.uint8)
    px = torch.stack([every.roll(c) for c in range(3)], dim=-1).reshape(2, 8, 16, 3)  # each value in each channel
    px = torch.cat([px, torch.randint(0, 256, (2, 8, 16, 3), dtype=torch.uint8)], dim=2)[:, :, :26]  # strided
    assert not px.is_contiguous()
    got = normalize(px, cfg)
    assert got.shape == (2, 3, 8, 26) and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, pre._rescaled(px, cfg).movedim(-1, -3))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("size", [(48, 40), (40, 97), (300, 120), (32, 32), (17, 500)])
def test_resizing_where_the_tower_runs_gives_pillows_pixels(tmp_path, name, size):
    """ClipProcessor with `resize_on` (resample.py's arithmetic) equals it resizing with Pillow."""
    from services.model.llava import ClipProcessor

    pil_clip_processor_class()(**CONFIGS[name]).save_pretrained(tmp_path)
    cfg = ImageProcessorConfig.load(tmp_path, CONFIGS[name]["crop_size"]["height"])
    img, cpu = picture(*size, mode="RGBA", seed=1), torch.device("cpu")
    by_pillow, on_device = ClipProcessor(cfg), ClipProcessor(cfg, resize_on=cpu)
    assert on_device.pixels(img, "x")[0].shape == (size[1], size[0], 3)  # the resize is left to the device
    got = on_device.tower_inputs([on_device.pixels(img, "x")], cpu)[0]
    assert torch.equal(got, by_pillow.tower_inputs([by_pillow.pixels(img, "x")], cpu)[0])
