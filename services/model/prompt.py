"""Prompt text -> token ids: the checkpoint's tokenizer and chat template, with the family's
image placeholder (`ModelSpec.placeholder`) expanded to one position per image feature."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument
from services.model.files import check_tokenizer_files
from services.model.spec import ModelSpec


def _find_chat_template(model_dir: Path, tokenizer) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = model_dir / "chat_template.json"
    if js.is_file():
        return json.loads(js.read_text())["chat_template"]
    raise InvalidArgument(f"{model_dir}: the checkpoint has no chat template")


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer; InvalidArgument naming the directory and the missing file.

    Without tokenizer.json transformers tries to rebuild the tokenizer from other files and
    fails with a message about sentencepiece or tiktoken, which hides the real cause.
    """
    from transformers import AutoTokenizer

    check_tokenizer_files(model_dir)
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as err:  # transformers raises ValueError, OSError, ImportError, ... here
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        reason = lines[-1] if lines[0].endswith(":") else lines[0]  # "Couldn't ... from one of:" says nothing
        if not (model_dir / "tokenizer.json").is_file():
            raise InvalidArgument(
                f"{model_dir}: tokenizer.json is missing, and transformers cannot build the tokenizer from the "
                f"other files: {reason}"
            ) from err
        raise InvalidArgument(f"{model_dir}: cannot load the tokenizer: {reason}") from err


@dataclass
class PromptIds:
    ids: list[int]  # the whole prompt, image positions included
    image_positions: list[int]  # first position of each image's block of features
    text_tokens: int


class PromptBuilder:
    """Applies the chat template and expands each image placeholder to its picture's positions."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.tokenizer = load_tokenizer(spec.model_dir)
        self.template = _find_chat_template(spec.model_dir, self.tokenizer)
        image_id = self.tokenizer.convert_tokens_to_ids(spec.placeholder)
        if image_id != spec.image_token_id:
            raise InvalidArgument(
                f"{spec.model_dir}: tokenizer maps {spec.placeholder!r} to {image_id}, "
                f"but config.json says the image token is {spec.image_token_id}"
            )

    def render(self, prompt: str | Sequence[dict], n_images: int) -> str:
        """The templated text: a prompt is one user turn, its images first; a conversation (as
        check_conversation returns it) is rendered as it is."""
        if isinstance(prompt, str):
            content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": prompt}]
            messages: Sequence[dict] = [{"role": "user", "content": content}]
        else:
            messages = prompt
        return self.tokenizer.apply_chat_template(
            list(messages), chat_template=self.template, add_generation_prompt=True, tokenize=False
        )

    def build(self, prompt: str | Sequence[dict], images: int | Sequence[int]) -> PromptIds:
        """`images`: how many pictures, each `spec.image_tokens` positions; or each one's positions."""
        per_image = [self.spec.image_tokens] * images if isinstance(images, int) else list(images)
        n_images = len(per_image)
        text = self.render(prompt, n_images)
        # As transformers' processors do: the tokenizer adds its special tokens (BOS) unless the
        # template already wrote BOS (LLaVA's writes it, DeepSeek's leaves it to the tokenizer).
        bos = self.tokenizer.bos_token
        raw = self.tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]
        image_id = self.spec.image_token_id
        found = raw.count(image_id)
        if found != n_images:
            raise InvalidArgument(
                f"the prompt yields {found} image placeholders for {n_images} images; "
                f"do not write {self.spec.placeholder!r} in the prompt text"
            )
        ids: list[int] = []
        positions: list[int] = []
        for tok in raw:
            if tok == image_id:
                positions.append(len(ids))
                ids.extend([image_id] * per_image[len(positions) - 1])
            else:
                ids.append(tok)
        return PromptIds(ids=ids, image_positions=positions, text_tokens=len(raw) - found)
