"""Build tiny random-weight LLaVA checkpoints with transformers, for tests and the demo; the
tokenizer every family's tiny checkpoint and preset use.

The checkpoint is a real Hugging Face LLaVA directory (config.json, safetensors,
tokenizer with chat template, preprocessor_config.json) written by transformers'
own `save_pretrained`, so it also serves as the oracle's input.
"""

from __future__ import annotations

from pathlib import Path

# LLaVA-1.5's conversation format, with BOS written by the template itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} {% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

_CORPUS = [
    "USER: ASSISTANT: What is in the image? Describe the picture in detail.",
    "a red circle, a green square, a blue triangle, a yellow star, purple and orange shapes",
    "The quick brown fox jumps over the lazy dog. 0123456789 !?.,;:'\"()[]{}",
    "What color is the shape? What shape is it? How many objects are there?",
    "Écrire en français, ünïcödé text and emoji 🙂 are bytes too.",
]


def build_tokenizer(
    out_dir: Path,
    vocab_size: int,
    corpus: list[str] | None = None,
    template: str = CHAT_TEMPLATE,
    bos: str = "<s>",
    eos: str = "</s>",
    pad: str = "<pad>",
    image: str = "<image>",
    add_bos: bool = False,
    extra: tuple[str, ...] = (),
):
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic).

    `add_bos`: the tokenizer writes BOS itself (as Llama's does), for chat templates that do not.
    `extra`: more special tokens (a chat template's markers).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys(["<unk>", bos, eos, pad, image, *extra])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or _CORPUS) * 4, trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        extra_special_tokens={"image_token": image},
    )
    fast.chat_template = template
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_llava(
    out_dir: str | Path,
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 8,
    vision_width: int = 32,
    text_width: int = 64,
    vocab_size: int = 384,
    center_crop: bool = True,
    context: int = 512,
) -> Path:
    """Write a random tiny LLaVA checkpoint to `out_dir` and return its path; `context`: its positions."""
    vision = {
        "hidden_size": vision_width,
        "intermediate_size": vision_width * 2,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "image_size": image_size,
        "patch_size": patch_size,
        "projection_dim": vision_width,
    }
    text = {
        "hidden_size": text_width,
        "intermediate_size": text_width * 2,
        "num_hidden_layers": 2,
        # head_dim 32: vLLM's CPU attention has no kernel for 16 (the vLLM engine tests use this model).
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": context,
    }
    return build_llava(out_dir, vision, text, vocab_size, seed, center_crop)


def build_preset_checkpoint(out_dir: str | Path, preset: str, text_layers: int, vision_layers: int, seed: int = 0):
    """A named preset's shapes (services/model/presets.py) cut to a few layers, with random weights
    saved by transformers: production-sized matrices that transformers itself can load, for
    checking the engine against it on the GPU. DeepSeek-VL's SAM tower keeps `vision_layers` too,
    its last one global."""
    from services.model.presets import PRESETS

    entry = PRESETS[preset]
    if entry["family"] == "qwen2_5_vl":  # the last vision layer a full-attention one
        vision = {**entry["vision"], "depth": vision_layers, "fullatt_block_indexes": [vision_layers - 1]}
        text = {k: v for k, v in entry["text"].items() if k != "vocab_size"}
        text["num_hidden_layers"] = text_layers
        return build_qwen(out_dir, vision, text, seed, entry["max_pixels"], text_vocab=entry["text"]["vocab_size"])
    vision = {**entry["vision"], "num_hidden_layers": vision_layers}
    text = {**entry["text"], "num_hidden_layers": text_layers}
    vocab = text.pop("vocab_size")
    if entry["family"] == "llava":
        return build_llava(out_dir, vision, text, 1000, seed, center_crop=True, text_vocab=vocab)
    vision.pop("projection_dim")
    high = None
    if entry["family"] == "deepseek_vl_hybrid":
        high = {**entry["high_res"], "num_hidden_layers": vision_layers, "global_attn_indexes": [vision_layers - 1]}
    return build_deepseek(out_dir, vision, high, text, 1000, seed, text_vocab=vocab)


def build_llava(
    out_dir: str | Path,
    vision: dict,
    text: dict,
    vocab_size: int,
    seed: int,
    center_crop: bool,
    text_vocab: int | None = None,
) -> Path:
    """Write a random LLaVA checkpoint (CLIP `vision`, Llama `text` config fields) and return its path.

    `vocab_size` is the tokenizer's; the decoder's vocabulary is `text_vocab` (default: the
    tokenizer's size), so a production-sized head can sit over a small tokenizer.
    """
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size)
    vision_cfg = CLIPVisionConfig(**vision)
    text_cfg = LlamaConfig(
        **text,
        vocab_size=text_vocab or len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    image_size, patch_size = vision_cfg.image_size, vision_cfg.patch_size
    config = LlavaConfig(
        vision_config=vision_cfg,
        text_config=text_cfg,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    widen_init(model)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    crop = {"height": image_size, "width": image_size}
    processor = CLIPImageProcessor(
        size={"shortest_edge": image_size} if center_crop else crop,
        crop_size=crop,
        do_center_crop=center_crop,
    )
    processor.save_pretrained(out)
    return out


def widen_init(model) -> None:
    """Larger-than-default random weights, so that random logits are not near-ties: greedy tokens
    then differ between images, which is what the oracle tests need to see."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embedding" not in name:
                p.normal_(0.0, 0.2 / p.shape[-1] ** 0.5 * 4)


# DeepSeek-VL's conversation format (its own repository's conversation.py, as transformers'
# converted checkpoints carry it): a system line, "User: ...\n\n", "Assistant: ...<eos>"; within a
# message, text after text is joined by a space and the message's ends are stripped.
DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DEEPSEEK_TEMPLATE = (
    "You are a helpful language and vision assistant. You are able to understand the visual content that the "
    "user provides, and assist the user with a variety of tasks using natural language.\n\n"
    "{% for message in messages %}"
    "{% set role = message['role']|lower %}"
    "{% if role == 'user' %}User: {% elif role == 'assistant' %}Assistant: {% else %}"
    "{{ message['role'].capitalize() }}: {% endif %}"
    "{% set parts = message['content'] if message['content'] is not string "
    "else [{'type': 'text', 'text': message['content']}] %}"
    "{% for part in parts %}"
    "{% if part['type'] == 'image' %}<image_placeholder>"
    "{% elif part['type'] == 'text' %}{% set text = part['text'] %}"
    "{% if loop.first %}{% set text = text.lstrip() %}{% endif %}"
    "{% if loop.last %}{% set text = text.rstrip() %}{% endif %}"
    "{% if not loop.first and parts[loop.index0 - 1]['type'] == 'text' %} {% endif %}{{ text }}"
    "{% endif %}{% endfor %}"
    "{% if not loop.last or add_generation_prompt %}"
    "{% if role == 'user' %}{{ '\n\n' }}{% else %}" + DEEPSEEK_EOS + "{% endif %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def build_tiny_deepseek(out_dir: str | Path, hybrid: bool, seed: int = 0, context: int = 512) -> Path:
    """A random tiny DeepSeek-VL (SigLIP 32 px / 8 = 16 tokens; hybrid: SAM 64 px, window 3, so
    windows are padded) with its tokenizer, chat template and image processor."""
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 32,
        "patch_size": 8,
    }
    high = {
        "hidden_size": 32,
        "output_channels": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "image_size": 64,
        "patch_size": 8,
        "window_size": 3,
        "global_attn_indexes": [1],
        "mlp_dim": 64,
    }
    text = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": context,
    }
    return build_deepseek(out_dir, vision, high if hybrid else None, text, 384, seed)


def _deepseek_config(tok, vision: dict, high: dict | None, text: dict, tie: bool):
    from transformers import DeepseekVLConfig, DeepseekVLHybridConfig

    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    common = {
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_act": "gelu",
            "vision_use_head": False,
            **vision,
        },
        "text_config": {"model_type": "llama", "vocab_size": len(tok), **text, **ids},
        "image_token_id": tok.convert_tokens_to_ids("<image_placeholder>"),
        "tie_word_embeddings": tie,
    }
    if high is None:
        return DeepseekVLConfig(**common)
    return DeepseekVLHybridConfig(**common, high_res_vision_config={"model_type": "sam_vision_model", **high})


def _deepseek_processor(out: Path, tok, config, hybrid: bool) -> None:
    """The image processor (and, for transformers' AutoProcessor, the processor) of the checkpoint."""
    from transformers import DeepseekVLHybridProcessor, DeepseekVLProcessor
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling
    from transformers.models.deepseek_vl.image_processing_pil_deepseek_vl import DeepseekVLImageProcessorPil
    from transformers.models.deepseek_vl_hybrid.image_processing_pil_deepseek_vl_hybrid import (
        DeepseekVLHybridImageProcessorPil,
    )

    vc = config.vision_config
    side = {"height": vc.image_size, "width": vc.image_size}
    norm = {"image_mean": IMAGENET_STANDARD_MEAN, "image_std": IMAGENET_STANDARD_STD}
    tokens = (vc.image_size // vc.patch_size) ** 2
    if hybrid:
        hs = config.high_res_vision_config.image_size
        images = DeepseekVLHybridImageProcessorPil(
            size=side, high_res_size={"height": hs, "width": hs}, resample=PILImageResampling.BILINEAR, **norm
        )
        processor = DeepseekVLHybridProcessor(images, tok, chat_template=DEEPSEEK_TEMPLATE, num_image_tokens=tokens)
    else:
        images = DeepseekVLImageProcessorPil(size=side, **norm)
        processor = DeepseekVLProcessor(images, tok, chat_template=DEEPSEEK_TEMPLATE, num_image_tokens=tokens)
    processor.save_pretrained(out)


def _deepseek_tokenizer(out: Path, vocab_size: int):
    return build_tokenizer(
        out,
        vocab_size,
        template=DEEPSEEK_TEMPLATE,
        bos=DEEPSEEK_BOS,
        eos=DEEPSEEK_EOS,
        pad=DEEPSEEK_EOS,
        image="<image_placeholder>",
        add_bos=True,
    )


def build_deepseek(
    out_dir: str | Path,
    vision: dict,
    high: dict | None,
    text: dict,
    vocab_size: int,
    seed: int,
    text_vocab: int | None = None,
) -> Path:
    """Write a random DeepSeek-VL checkpoint (SigLIP `vision`, SAM `high` or None, Llama `text`);
    `text_vocab` as in build_llava."""
    import torch
    from transformers import DeepseekVLForConditionalGeneration, DeepseekVLHybridForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _deepseek_tokenizer(out, vocab_size)
    config = _deepseek_config(tok, vision, high, text, tie=False)  # tied, random logits repeat the last token
    if text_vocab:
        config.text_config.vocab_size = text_vocab
    torch.manual_seed(seed)
    cls = DeepseekVLForConditionalGeneration if high is None else DeepseekVLHybridForConditionalGeneration
    model = cls(config)
    widen_init(model)
    if high is not None:
        with torch.no_grad():
            model.model.high_res_vision_alpha.fill_(0.5)  # zero at init: the global branch would not count
            # SAM's neck ends in a layer norm, so the fused features come out some 20x the text
            # embeddings' size and swamp them: greedy tokens then barely depend on the picture.
            model.model.aligner.proj.weight.mul_(0.05)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    _deepseek_processor(out, tok, config, hybrid=high is not None)
    return out


def write_deepseek_preset(out_dir: Path, name: str, hybrid: bool) -> None:
    """A preset's config, tokenizer and processors (presets.py writes no weights)."""
    from services.model.presets import PRESETS

    preset = PRESETS[name]
    tok = _deepseek_tokenizer(out_dir, 1000)
    vision = {k: v for k, v in preset["vision"].items() if k != "projection_dim"}
    text = {k: v for k, v in preset["text"].items() if k != "vocab_size"}
    config = _deepseek_config(tok, vision, preset.get("high_res") if hybrid else None, text, tie=False)
    config.text_config.vocab_size = preset["text"]["vocab_size"]
    config.save_pretrained(out_dir)
    _deepseek_processor(out_dir, tok, config, hybrid)


# Qwen2.5-VL's chat template (its checkpoints' own, without video): a default system turn, each
# picture as <|vision_start|><|image_pad|><|vision_end|>, turns between <|im_start|> and <|im_end|>.
QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIALS = ("<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")


def build_tiny_qwen2_5_vl(out_dir: str | Path, seed: int = 0, context: int = 1024) -> Path:
    """A random tiny Qwen2.5-VL: a 4-layer ViT (14-px patches, windows of 56 px so that small
    pictures span several, full attention in layers 1 and 3), pictures of 56x56 to 28*28*64 px
    (4 to 64 tokens), a 2-layer Qwen2 decoder with M-RoPE sections (2, 3, 3)."""
    text = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": context,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    vision = {
        "depth": 4,
        "hidden_size": 32,
        "intermediate_size": 60,  # not a multiple of 8, as the 7B's 3,420: the tower pads it (qwen_vit.ALIGN)
        "num_heads": 2,
        "patch_size": 14,
        "window_size": 56,
        "fullatt_block_indexes": [1, 3],
        "out_hidden_size": 64,
    }
    return build_qwen(out_dir, vision, text, seed, max_pixels=28 * 28 * 64)


def _qwen_tokenizer(out: Path, vocab_size: int):
    return build_tokenizer(
        out, vocab_size, template=QWEN_TEMPLATE, bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>",
        image="<|image_pad|>", extra=QWEN_SPECIALS,
    )  # fmt: skip


def _qwen_config(tok, vision: dict, text: dict):
    from transformers import Qwen2_5_VLConfig

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
    ]}  # fmt: skip
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tok), **text, **special},
        vision_config=vision,
        tie_word_embeddings=False,
        **ids,
    )


def _qwen_processor(out: Path, max_pixels: int) -> None:
    """The image processor alone: transformers' Qwen2_5_VLProcessor also wants a video processor,
    which needs torchvision (tests/helpers.py builds the processor's work from these parts)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels).save_pretrained(out)


def build_qwen(
    out_dir: str | Path, vision: dict, text: dict, seed: int, max_pixels: int, text_vocab: int | None = None
) -> Path:
    """Write a random Qwen2.5-VL checkpoint (`vision`: its ViT's config, `text`: Qwen2's); pictures
    up to `max_pixels`; `text_vocab` as in build_llava."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _qwen_tokenizer(out, 384)
    config = _qwen_config(tok, vision, text)
    if text_vocab:
        config.text_config.vocab_size = text_vocab
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    widen_init(model)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    _qwen_processor(out, max_pixels)
    return out


def write_qwen_preset(out_dir: Path, name: str) -> None:
    """A preset's config, tokenizer and image processor (presets.py writes no weights)."""
    from services.model.presets import PRESETS

    preset = PRESETS[name]
    tok = _qwen_tokenizer(out_dir, 1000)
    text = {k: v for k, v in preset["text"].items() if k != "vocab_size"}
    config = _qwen_config(tok, preset["vision"], text)
    config.text_config.vocab_size = preset["text"]["vocab_size"]
    config.save_pretrained(out_dir)
    _qwen_processor(out_dir, preset["max_pixels"])
