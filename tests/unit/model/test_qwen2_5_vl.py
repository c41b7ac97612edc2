"""Qwen2.5-VL's vision side against transformers (fp32, CPU): the processor's patches and grids,
and the tower's tokens, for pictures of several sizes and aspect ratios packed together."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from services.common.errors import InvalidArgument
from services.model.qwen2_5_vl import QwenImageConfig, QwenProcessor, QwenVisionTower, smart_resize

# (height, width): under min_pixels (grown), ordinary, over max_pixels (shrunk), long and thin.
SIZES = [(20, 30), (60, 90), (224, 224), (300, 120), (512, 512), (37, 400)]


def picture(seed: int, h: int, w: int, mode: str = "RGB") -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def theirs(model_dir):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(model_dir)


@pytest.mark.parametrize("resize_on", [None, torch.device("cpu")], ids=["pillow", "resample"])
def test_patches_and_grids_equal_transformers(tiny_qwen, resize_on):
    ours = QwenProcessor(QwenImageConfig.load(tiny_qwen), resize_on)
    imgs = [picture(i, h, w, "RGBA" if i == 3 else "RGB") for i, (h, w) in enumerate(SIZES)]
    patches, grid = ours.tower_inputs(
        [ours.pixels(img, f"images[{i}]") for i, img in enumerate(imgs)], torch.device("cpu")
    )
    want = theirs(tiny_qwen)(images=[img.convert("RGB") for img in imgs], return_tensors="pt")
    assert grid.tolist() == want["image_grid_thw"].tolist()
    assert patches.shape == want["pixel_values"].shape
    torch.testing.assert_close(patches, want["pixel_values"], atol=1e-6, rtol=0)


def test_smart_resize_keeps_the_area_inside_the_limits(tiny_qwen):
    cfg = QwenImageConfig.load(tiny_qwen)
    for h, w in [*SIZES, (1000, 7), (7, 1000)]:
        rh, rw = smart_resize(h, w, cfg)
        assert rh % 28 == rw % 28 == 0 and rh * rw <= cfg.max_pixels, (h, w, rh, rw)
    with pytest.raises(InvalidArgument, match=r"images\[1\] is 2000x5: an aspect ratio over 200"):
        smart_resize(5, 2000, cfg, "images[1]")


def test_the_tower_gives_transformers_image_features(tiny_qwen):
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen, dtype=torch.float32).eval()
    tower = QwenVisionTower(hf.config.vision_config)
    tower.load_state_dict(hf.model.visual.state_dict())
    tower.fuse_projections()
    width = hf.config.vision_config.intermediate_size
    assert width % 8 and tower.blocks[0].mlp.width == -(-width // 64) * 64  # padded with zero weights
    proc = QwenProcessor(QwenImageConfig.load(tiny_qwen))
    imgs = [picture(10 + i, h, w) for i, (h, w) in enumerate(SIZES)]
    patches, grid = proc.tower_inputs([proc.pixels(img, "x") for img in imgs], torch.device("cpu"))
    with torch.no_grad():
        got = tower(patches, grid)
        want = torch.cat(hf.model.get_image_features(pixel_values=patches, image_grid_thw=grid).pooler_output)
    tokens = [t * h * w // 4 for t, h, w in grid.tolist()]
    assert got.shape == (sum(tokens), hf.config.text_config.hidden_size) == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    first, second = got[: tokens[0]], got[tokens[0] : tokens[0] + tokens[1]]
    assert (first.mean(0) - second.mean(0)).abs().mean() > 0.05 * got.abs().mean()  # the pictures matter
    alone = tower(*proc.tower_inputs([proc.pixels(imgs[1], "x")], torch.device("cpu")))
    torch.testing.assert_close(alone, second, atol=2e-5, rtol=1e-5)  # packing does not mix pictures


def test_prompt_positions_equal_transformers_rope_index(tiny_qwen):
    """M-RoPE positions of a prompt with three pictures (services/model/mrope.py) equal
    transformers' get_rope_index, the delta after the prompt too."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from services.model.mrope import prompt_positions
    from tests.helpers import hf_inputs, image_bytes

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen, dtype=torch.float32).eval()
    pictures = [image_bytes(1, (60, 40)), image_bytes(2, (300, 90)), image_bytes(3, (90, 300))]
    inputs = hf_inputs(tiny_qwen, pictures, "Compare the pictures.")
    want, want_delta = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    ids = inputs["input_ids"][0].tolist()
    image = hf.config.image_token_id
    starts = [i for i, t in enumerate(ids) if t == image and (i == 0 or ids[i - 1] != image)]
    grids = [(h // 2, w // 2) for _, h, w in inputs["image_grid_thw"].tolist()]
    got, delta = prompt_positions(len(ids), starts, grids)
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert delta == int(want_delta) != 0


def test_the_vllm_engine_is_refused_with_its_reason(tiny_qwen):
    from services.llm.engines import check_engine
    from services.model.spec import load_spec

    spec = load_spec(tiny_qwen)
    assert spec.image_grid and spec.text.qkv_bias and spec.text.mrope_section == (2, 3, 3)
    check_engine("native", spec)
    with pytest.raises(InvalidArgument, match=r"--llm-engine vllm cannot serve qwen2_5_vl.*M-RoPE"):
        check_engine("vllm", spec)


@pytest.mark.parametrize("bounds", [(0, 5, 12), (0, 3, 6, 9, 12, 15, 19)], ids=["looped", "padded-batch"])
def test_segments_reach_sdpa_as_4d_tensors_and_attend_only_to_themselves(bounds, monkeypatch):
    """SDPA's flash and cuDNN kernels take [B, heads, L, d] only: 3-D inputs fall to its math
    backend, in fp32 (it cost a 1280x720 picture 25 of its 42 ms on an H200). Either way each
    segment's rows equal attention over that segment alone."""
    import torch.nn.functional as F

    from services.model import qwen_vit

    sdpa = F.scaled_dot_product_attention
    dims = []

    def four_d_only(q, k, v, **kw):
        dims.append((q.dim(), k.dim(), v.dim()))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(qwen_vit.F, "scaled_dot_product_attention", four_d_only)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(bounds[-1], 2, 8, generator=gen) for _ in range(3))
    got = qwen_vit.attend_segments(q, k, v, qwen_vit.Segments.of(bounds))
    assert dims and all(d == (4, 4, 4) for d in dims), dims
    for a, b in itertools.pairwise(bounds):
        want = sdpa(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
        torch.testing.assert_close(got[a:b], want)
