"""Build tiny random-weight LLaVA checkpoints with transformers, for tests and the demo.

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

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]

_CORPUS = [
    "USER: ASSISTANT: What is in the image? Describe the picture in detail.",
    "a red circle, a green square, a blue triangle, a yellow star, purple and orange shapes",
    "The quick brown fox jumps over the lazy dog. 0123456789 !?.,;:'\"()[]{}",
    "What color is the shape? What shape is it? How many objects are there?",
    "Écrire en français, ünïcödé text and emoji 🙂 are bytes too.",
]


def build_tokenizer(out_dir: Path, vocab_size: int, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or _CORPUS) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    fast.chat_template = CHAT_TEMPLATE
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
    checking the engine against it on the GPU."""
    from services.model.presets import PRESETS

    vision = {**PRESETS[preset]["vision"], "num_hidden_layers": vision_layers}
    text = {**PRESETS[preset]["text"], "num_hidden_layers": text_layers}
    vocab = text.pop("vocab_size")
    return build_llava(out_dir, vision, text, 1000, seed, center_crop=True, text_vocab=vocab)


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
    # Larger-than-default init so that random logits are not near-ties: greedy tokens
    # then differ between images, which is what the oracle test needs to see.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embedding" not in name:
                p.normal_(0.0, 0.2 / p.shape[-1] ** 0.5 * 4)
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
