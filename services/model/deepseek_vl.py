"""DeepSeek-VL (`deepseek_vl`: SigLIP alone; `deepseek_vl_hybrid`: SigLIP beside SAM).

The picture is resized so that its long side fits, and padded to a square with the mean colour
(for the hybrid: to the SAM tower's 1024 px, then that square down to SigLIP's 384 px). SigLIP's
last hidden state, after its post layer norm, gives one token per patch. The hybrid also runs
SAM ViT-B: its neck output and the neck'd output of its first global-attention layer (scaled by a
learned alpha) are downsampled to SigLIP's grid and the aligner fuses both per token.

SigLIP's layers are clip.py's (the same layer, q/k/v fused); SAM's layers are transformers' own
SamVisionLayer (window partition, MLP) around our SamAttention (relative positions without a
mask), run layer by layer here so that the global layer's output is kept without recording
every hidden state.
Shapes: B pictures, T = (384/16)^2 tokens, D = SigLIP width, C = SAM neck channels, H = text width.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from services.common.errors import InvalidArgument
from services.model import resample
from services.model.clip import VisionEncoder as VitLayers
from services.model.family import LayerFn, rename_key, run_layer
from services.model.preprocess import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    image_processor_json,
    normalize,
    rgb_tensor,
)
from services.model.spec import ModelSpec, VisionSpec, text_spec

PLACEHOLDER = "<image_placeholder>"


@dataclass(frozen=True)
class DeepseekVision:
    low: VisionSpec  # SigLIP
    high: object | None  # the hybrid's SamVisionConfig (transformers'), None for deepseek_vl
    text_hidden: int

    @property
    def hybrid(self) -> bool:
        return self.high is not None


# --- preprocessing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolution:
    """One tower input: resize the long side to `side`, pad to a square of `background`, normalise."""

    side: int
    resample: int
    background: tuple[int, int, int]
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def _side(size: object, where: str) -> int:
    if isinstance(size, int):
        return size
    if isinstance(size, dict) and size.get("height") == size.get("width") and isinstance(size.get("height"), int):
        return size["height"]
    raise InvalidArgument(f"{where}: the size must be a square (height == width), not {size!r}")


class DeepseekProcessor:
    """DeepseekVL(Hybrid)ImageProcessor: resize the long side, pad to a square (uint8, Pillow's
    arithmetic, on the preprocessing threads or on `resize_on`), then rescale and normalise where
    the tower runs."""

    def __init__(
        self,
        model_dir: Path,
        hybrid: bool,
        low_side: int,
        high_side: int | None,
        resize_on: torch.device | None = None,
    ) -> None:
        path, raw = image_processor_json(model_dir)
        if not raw.get("do_resize", True) or not raw.get("do_pad", True):
            raise InvalidArgument(f"{path}: do_resize and do_pad must be true (the towers take fixed squares)")
        self.min_size = int(raw.get("min_size", 14))
        # transformers' rule for the pad colour: the hybrid's from a configured mean, else grey;
        # the SigLIP-only one's from its mean, whose default is CLIP's.
        mean = tuple(raw.get("image_mean", OPENAI_CLIP_MEAN))
        grey = (127, 127, 127)
        self.low = Resolution(
            side=_side(raw.get("size", {"height": low_side, "width": low_side}), str(path)),
            resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
            background=grey if hybrid and "image_mean" not in raw else tuple(int(x * 255) for x in mean),
            do_rescale=raw.get("do_rescale", True),
            rescale_factor=raw.get("rescale_factor", 1 / 255),
            do_normalize=raw.get("do_normalize", True),
            mean=mean,
            std=tuple(raw.get("image_std", OPENAI_CLIP_STD)),
        )
        if self.low.side != low_side:
            raise InvalidArgument(f"{path}: size {self.low.side} differs from the SigLIP tower's image_size {low_side}")
        self.high: Resolution | None = None
        if hybrid:
            high_mean = tuple(raw.get("high_res_image_mean", OPENAI_CLIP_MEAN))
            self.high = Resolution(
                side=_side(raw.get("high_res_size", {"height": high_side, "width": high_side}), str(path)),
                resample=int(raw.get("high_res_resample", Image.Resampling.BICUBIC)),
                background=tuple(int(x * 255) for x in high_mean) if "high_res_image_mean" in raw else grey,
                do_rescale=self.low.do_rescale,
                rescale_factor=self.low.rescale_factor,
                do_normalize=self.low.do_normalize,
                mean=high_mean,
                std=tuple(raw.get("high_res_image_std", OPENAI_CLIP_STD)),
            )
            if self.high.side != high_side:
                raise InvalidArgument(
                    f"{path}: high_res_size {self.high.side} differs from the SAM tower's image_size {high_side}"
                )

        filters = [self.low.resample] + ([self.high.resample] if self.high is not None else [])
        self.resize_on = resize_on if resize_on is not None and all(map(resample.supported, filters)) else None

    def _size(self, width: int, height: int, res: Resolution) -> tuple[int, int]:
        """The long side to `res.side`, the short one at least min_size."""
        scale = res.side / max(width, height)
        return max(round(width * scale), self.min_size), max(round(height * scale), self.min_size)

    def _square(self, img: Image.Image, res: Resolution) -> Image.Image:
        """Resized (`_size`) and centred on a square of the pad colour, by Pillow."""
        w, h = self._size(img.width, img.height, res)
        img = img.resize((w, h), resample=res.resample)
        if w == h:
            return img
        side = max(w, h)
        square = Image.new("RGB", (side, side), res.background)
        square.paste(img, ((side - w) // 2, (side - h) // 2))
        return square

    def _square_on_device(self, px: torch.Tensor, res: Resolution) -> torch.Tensor:
        """`_square` of uint8 [h, w, 3] on its device, with Pillow's arithmetic (resample.py)."""
        w, h = self._size(px.shape[1], px.shape[0], res)
        px = resample.resize(px, w, h, res.resample)
        if w == h:
            return px
        side = max(w, h)
        square = px.new_empty(side, side, 3)
        for c, value in enumerate(res.background):  # fills, not a copy of the colour from the host
            square[..., c].fill_(value)
        top, left = (side - h) // 2, (side - w) // 2
        square[top : top + h, left : left + w] = px
        return square

    def pixels(self, img: Image.Image, name: str) -> tuple[torch.Tensor, ...]:
        """-> (SigLIP's [S, S, 3] uint8,) and, for the hybrid, SAM's [S', S', 3] after it; with
        `resize_on`, the decoded picture alone."""
        if img.mode != "RGB":
            img = img.convert("RGB")
        if self.resize_on is not None:
            return (rgb_tensor(img),)
        if self.high is None:
            return (rgb_tensor(self._square(img, self.low)),)
        high = self._square(img, self.high)
        low = self._square(high, self.low)  # transformers resizes the padded high-res square
        return rgb_tensor(low), rgb_tensor(high)

    def _on_device(self, picture: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.high is None:
            return (self._square_on_device(picture, self.low),)
        high = self._square_on_device(picture, self.high)
        return self._square_on_device(high, self.low), high

    def tower_inputs(self, batch: Sequence[tuple[torch.Tensor, ...]], device: torch.device) -> tuple[torch.Tensor, ...]:
        if self.resize_on is None:
            stacked = [torch.stack(px).to(device, non_blocking=True) for px in zip(*batch, strict=True)]
        else:
            squares = [self._on_device(p[0].to(device, non_blocking=True)) for p in batch]
            stacked = [torch.stack(px) for px in zip(*squares, strict=True)]
        resolutions = [self.low] if self.high is None else [self.low, self.high]
        return tuple(normalize(px, res) for px, res in zip(stacked, resolutions, strict=True))

    def salt(self) -> tuple:
        return (self.min_size, self.low, self.high)


# --- towers ----------------------------------------------------------------------------------


class SiglipEmbeddings(nn.Module):
    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, s.hidden, s.patch_size, s.patch_size)
        self.position_embedding = nn.Embedding(s.patches, s.hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels [B, 3, S, S] -> [B, T, D]
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipTower(nn.Module):
    """SigLIP's ViT up to its post layer norm (the pooling head is not used)."""

    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(s)
        self.encoder = VitLayers(s)
        self.post_layernorm = nn.LayerNorm(s.hidden, eps=s.eps)

    def forward(self, pixels: torch.Tensor, run_layer: LayerFn) -> torch.Tensor:
        x = self.embeddings(pixels)  # [B, T, D]
        for layer in self.encoder.layers:
            x = run_layer(layer, x)
        return self.post_layernorm(x)


class SamAttention(nn.Module):
    """SAM's attention with decomposed relative positions, without an attention mask.

    The bias of query (qh, qw) for key (kh, kw) is q·Rh[qh, kh] + q·Rw[qw, kw]. transformers
    writes it out as a dense [heads, N, N] mask (400 MB a picture for a 64x64 global layer) that
    SDPA then reads. Here it rides in the dot product instead: q gains the rows q·Rh[qh] and
    q·Rw[qw] (over the softmax scale), k the one-hot of its row and column, so a flash kernel
    computes scale * q·k + bias with no mask. v is zero-padded to q's width (flash kernels want
    equal widths) and the padding dropped after. Parameters as transformers' (qkv, proj, rel_pos_h/w).
    """

    def __init__(self, config, window_size: int) -> None:
        super().__init__()
        side = window_size or config.image_size // config.patch_size
        self.heads = config.num_attention_heads
        head_dim = config.hidden_size // self.heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, config.hidden_size * 3, bias=config.qkv_bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * side - 1, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * side - 1, head_dim))

    @staticmethod
    def _table(rel_pos: torch.Tensor, side: int) -> torch.Tensor:
        """[2*side - 1, C] -> R[q, k, C] = rel_pos[q - k + side - 1] (the table is made for this side)."""
        idx = torch.arange(side, device=rel_pos.device)
        return rel_pos[idx[:, None] - idx[None, :] + side - 1]

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        x = hidden_states  # [B, H, W, D]: windows, or the whole grid for a global layer
        b, h, w, _ = x.shape
        q, k, v = self.qkv(x).view(b, h, w, 3, self.heads, -1).permute(3, 0, 4, 1, 2, 5).unbind(0)  # [B, nh, H, W, C]
        rel_h = torch.einsum("bnhwc,hkc->bnhwk", q, self._table(self.rel_pos_h, h))  # [B, nh, H, W, H]
        rel_w = torch.einsum("bnhwc,wkc->bnhwk", q, self._table(self.rel_pos_w, w))  # [B, nh, H, W, W]
        rows = torch.eye(h, dtype=k.dtype, device=k.device)[:, None, :].expand(h, w, h)  # key (kh, kw) -> one-hot kh
        cols = torch.eye(w, dtype=k.dtype, device=k.device)[None, :, :].expand(h, w, w)  # -> one-hot kw
        q = torch.cat([q, rel_h / self.scale, rel_w / self.scale], dim=-1).flatten(2, 3)  # [B, nh, N, C + H + W]
        k = torch.cat([k, rows.expand(b, self.heads, h, w, h), cols.expand(b, self.heads, h, w, w)], dim=-1)
        width = q.shape[-1]
        pad = (-width) % 8  # kernels want widths that are multiples of 8
        q, k = F.pad(q, (0, pad)), F.pad(k.flatten(2, 3), (0, pad))
        v = F.pad(v.flatten(2, 3), (0, width + pad - v.shape[-1]))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)[..., : x.shape[-1] // self.heads]
        out = out.view(b, self.heads, h, w, -1).permute(0, 2, 3, 1, 4).reshape(b, h, w, -1)
        return self.proj(out), None


class SamTower(nn.Module):
    """SAM's image encoder: patches, absolute positions, windowed and global layers, neck.

    transformers' SamVisionLayer (window partition, MLP, norms) with our SamAttention in it."""

    def __init__(self, config) -> None:
        from transformers.models.sam.modeling_sam import SamPatchEmbeddings, SamVisionLayer, SamVisionNeck

        super().__init__()
        grid = config.image_size // config.patch_size
        self.patch_embed = SamPatchEmbeddings(config)
        self.pos_embed = nn.Parameter(torch.zeros(1, grid, grid, config.hidden_size))
        self.layers = nn.ModuleList()
        for i in range(config.num_hidden_layers):
            window = 0 if i in config.global_attn_indexes else config.window_size
            layer = SamVisionLayer(config, window_size=window)
            layer.attn = SamAttention(config, window)
            self.layers.append(layer)
        self.neck = SamVisionNeck(config)


class SamDownsample(nn.Module):
    """Neck output [B, C, G, G] -> [B, 4C, o, o]: bilinear to 4o, then two stride-2 convolutions."""

    def __init__(self, channels: int, out_side: int) -> None:
        super().__init__()
        self.out_side = out_side
        self.conv1 = nn.Conv2d(channels, channels * 2, 3, stride=2, padding=1, bias=False)
        self.conv2 = nn.Conv2d(channels * 2, channels * 4, 3, stride=2, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = 4 * self.out_side
        x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
        return self.conv2(self.conv1(x))


class Aligner(nn.Module):
    """deepseek_vl: SigLIP tokens [B, T, D] -> [B, T, H] by a 2-layer MLP (exact GELU)."""

    def __init__(self, vision: DeepseekVision) -> None:
        super().__init__()
        self.linear1 = nn.Linear(vision.low.hidden, vision.text_hidden)
        self.linear2 = nn.Linear(vision.text_hidden, vision.text_hidden)

    def forward(self, low: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(low)))


class HybridAligner(nn.Module):
    """deepseek_vl_hybrid: each tower to H/2, concatenated (SAM's first), GELU, then H -> H."""

    def __init__(self, vision: DeepseekVision) -> None:
        super().__init__()
        half = vision.text_hidden // 2
        self.vision_proj = nn.Linear(vision.low.hidden, half)
        self.high_res_vision_proj = nn.Linear(vision.high.output_channels * 4, half)  # type: ignore[union-attr]
        self.proj = nn.Linear(vision.text_hidden, vision.text_hidden)

    def forward(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.high_res_vision_proj(high), self.vision_proj(low)], dim=-1)  # [B, T, H]
        return self.proj(F.gelu(x))


class DeepseekTower(nn.Module):
    """pixels (SigLIP's [B, 3, 384, 384] and, hybrid, SAM's [B, 3, 1024, 1024]) -> [B, T, H]."""

    def __init__(self, vision: DeepseekVision) -> None:
        from transformers.models.sam.modeling_sam import SamVisionNeck

        super().__init__()
        self.sides = [vision.low.image_size]
        self.vision_model = SiglipTower(vision.low)
        if vision.hybrid:
            high = vision.high
            self.sides.append(high.image_size)  # type: ignore[union-attr]
            self.global_index = high.global_attn_indexes[0]  # type: ignore[union-attr]
            self.high_res_vision_model = SamTower(high)
            self.high_res_vision_neck = SamVisionNeck(high)
            out_side = vision.low.image_size // vision.low.patch_size
            self.high_res_vision_proj = SamDownsample(high.output_channels, out_side)  # type: ignore[union-attr]
            self.high_res_vision_alpha = nn.Parameter(torch.zeros(1))
            self.aligner: nn.Module = HybridAligner(vision)
        else:
            self.aligner = Aligner(vision)

    def input_shapes(self) -> list[tuple[int, ...]]:
        return [(3, side, side) for side in self.sides]

    def _high_res(self, pixels: torch.Tensor, run_layer: LayerFn) -> torch.Tensor:
        sam = self.high_res_vision_model
        x = sam.patch_embed(pixels) + sam.pos_embed  # [B, G, G, Dsam]
        kept = x
        for i, layer in enumerate(sam.layers):
            x = run_layer(layer, x)
            if i == self.global_index:
                kept = x
        out = self.high_res_vision_proj(sam.neck(x))  # [B, 4C, o, o]
        out = out + self.high_res_vision_proj(self.high_res_vision_neck(kept)) * self.high_res_vision_alpha
        return out.flatten(2).transpose(1, 2)  # [B, T, 4C]

    def forward(self, *pixels: torch.Tensor, run_layer: LayerFn = run_layer) -> torch.Tensor:
        low = self.vision_model(pixels[0], run_layer)  # [B, T, D]
        if len(self.sides) == 1:
            return self.aligner(low)
        return self.aligner(low, self._high_res(pixels[1], run_layer))

    @torch.no_grad()
    def fuse_projections(self) -> None:
        for layer in self.vision_model.encoder.layers:
            layer.self_attn.fuse()


# --- the family ------------------------------------------------------------------------------

# transformers 5.x saves `model.vision_model.*` and `model.high_res_vision_model.vision_encoder.*`;
# the hub's converted checkpoints nest SigLIP once more (`model.vision_model.vision_model.*`).
_VISION_KEYS = [
    (re.compile(r"^(?:model\.)?vision_model\.(?:vision_model\.)?(.*)$"), r"vision_model.\1"),
    (re.compile(r"^(?:model\.)?high_res_vision_model\.(?:vision_encoder\.)?(.*)$"), r"high_res_vision_model.\1"),
    (re.compile(r"^(?:model\.)?((?:high_res_vision_neck|high_res_vision_proj|aligner)\..*)$"), r"\1"),
    (re.compile(r"^(?:model\.)?(high_res_vision_alpha)$"), r"\1"),
]


def _siglip_spec(vc, where: str) -> VisionSpec:
    if vc.model_type != "siglip_vision_model":
        raise InvalidArgument(f"{where}: vision_config.model_type {vc.model_type!r} is not supported (SigLIP)")
    if vc.image_size % vc.patch_size:
        raise InvalidArgument(f"{where}: vision_config.image_size {vc.image_size} is not a multiple of its patch_size")
    return VisionSpec.from_hf(vc, layers_used=vc.num_hidden_layers, keep_cls=False)


def _check_sam(hc, where: str) -> None:
    if hc.model_type != "sam_vision_model":
        raise InvalidArgument(f"{where}: high_res_vision_config.model_type {hc.model_type!r} is not supported (SAM)")
    if not hc.global_attn_indexes or not 0 <= hc.global_attn_indexes[0] < hc.num_hidden_layers:
        raise InvalidArgument(f"{where}: high_res_vision_config.global_attn_indexes {hc.global_attn_indexes!r}")
    if not (hc.use_abs_pos and hc.use_rel_pos):
        raise InvalidArgument(f"{where}: high_res_vision_config: use_abs_pos and use_rel_pos must both be true")
    hc._attn_implementation = "sdpa"  # SamVisionLayer builds an attention by this name (SamAttention replaces it)


class DeepseekVL:
    def __init__(self, name: str) -> None:
        self.name = name
        self.model_types = (name,)
        self.hybrid = name == "deepseek_vl_hybrid"

    def read_spec(self, path: Path, cfg: object, model_id: str) -> ModelSpec:
        where = f"{path}/config.json"
        low = _siglip_spec(cfg.vision_config, where)  # type: ignore[attr-defined]
        high = None
        if self.hybrid:
            high = cfg.high_res_vision_config  # type: ignore[attr-defined]
            _check_sam(high, where)
        text = text_spec(path, cfg)
        if self.hybrid and text.hidden % 2:
            raise InvalidArgument(f"{where}: text_config.hidden_size {text.hidden} must be even (the hybrid aligner)")
        return ModelSpec(
            model_dir=path,
            model_id=model_id,
            family=self.name,
            text=text,
            image_token_id=cfg.image_token_id,  # type: ignore[attr-defined]
            placeholder=PLACEHOLDER,
            image_tokens=low.patches,
            vision=DeepseekVision(low=low, high=high, text_hidden=text.hidden),
            hf_config=cfg,
        )

    def vision_key(self, key: str) -> str | None:
        return rename_key(_VISION_KEYS, key)

    def build_tower(self, spec: ModelSpec) -> nn.Module:
        return DeepseekTower(spec.vision)  # type: ignore[arg-type]

    def prepare_tower(self, tower: nn.Module) -> None:
        tower.fuse_projections()  # type: ignore[operator]

    def image_processor(self, spec: ModelSpec, resize_on: torch.device | None = None) -> DeepseekProcessor:
        v: DeepseekVision = spec.vision  # type: ignore[assignment]
        high = v.high.image_size if v.high is not None else None  # type: ignore[attr-defined]
        return DeepseekProcessor(spec.model_dir, self.hybrid, v.low.image_size, high, resize_on)

    def write_tiny(self, out_dir: Path, seed: int) -> Path:
        from services.model.tiny import build_tiny_deepseek

        return build_tiny_deepseek(out_dir, hybrid=self.hybrid, seed=seed)

    def write_preset(self, out_dir: Path, name: str) -> None:
        from services.model.tiny import write_deepseek_preset

        write_deepseek_preset(out_dir, name, hybrid=self.hybrid)


DEEPSEEK_VL = DeepseekVL("deepseek_vl")
DEEPSEEK_VL_HYBRID = DeepseekVL("deepseek_vl_hybrid")
