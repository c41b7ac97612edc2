"""Train the demo model: a 3.7M-parameter LLaVA that names the color and shape in a picture.

The data is generated on the fly by `services.model.shapes` (seeded per sample index, so
any number of data workers gives the same stream) and goes through the same Pillow
preprocessing the vision service uses, after a random JPEG/WebP round trip for a third of
the pictures. A training-only auxiliary head (a linear layer on the mean of the projected
image features, predicting shape and color) speeds learning up; it is thrown away, and the
shipped weights are a plain transformers LLaVA checkpoint.

Resumable: checkpoints go to --work every --ckpt-every steps and when --max-minutes runs
out, and a rerun with the same flags continues from there. At the end it evaluates greedy
answers on pictures from --eval-seed, writes the model to --out and a card (README.md)
with the accuracy per prompt.

    python training/train_demo_model.py --device cuda --max-minutes 9      # on the H200
    python training/train_demo_model.py --device cpu --steps 40 --batch 16 # a CPU smoke run
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.model.preprocess import ImageProcessorConfig, preprocess  # noqa: E402
from services.model.shapes import COLORS, PROMPTS, SHAPES, encode, render  # noqa: E402
from services.model.tiny import build_tokenizer  # noqa: E402

IMAGE_SIZE, PATCH = 96, 8
PROMPT_LIST = list(PROMPTS)
CORPUS = [
    *PROMPT_LIST,
    *[PROMPTS[p].format(color=c, shape=s) for p in PROMPT_LIST for c in COLORS for s in SHAPES],
    "USER: ASSISTANT:",
]


def build_checkpoint_skeleton(work: Path, seed: int):
    """Tokenizer, processor config and a freshly initialised transformers LLaVA."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tok = build_tokenizer(work, vocab_size=320, corpus=CORPUS)
    (work / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "CLIPImageProcessor",
                "do_resize": True,
                "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                "resample": 3,
                "do_center_crop": False,
                "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "do_convert_rgb": True,
            },
            indent=2,
        )
    )
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=192,
            intermediate_size=768,
            num_hidden_layers=6,
            num_attention_heads=6,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
            projection_dim=192,
        ),
        text_config=LlamaConfig(
            hidden_size=192,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=6,
            vocab_size=len(tok),
            max_position_embeddings=256,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=False,
        ),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    return tok, LlavaForConditionalGeneration(config)


class ShapesData(torch.utils.data.Dataset):
    """Sample i is fixed by (seed, i): pixels, prompt ids, labels, aux targets."""

    def __init__(self, seed: int, prompt_ids: list[list[int]], answer_ids: dict, proc: ImageProcessorConfig):
        self.seed, self.prompt_ids, self.answer_ids, self.proc = seed, prompt_ids, answer_ids, proc

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, i: int):
        rng = np.random.default_rng([self.seed, i])
        pic = render(rng)
        img = pic.image
        u = rng.random()
        if u < 0.25:  # JPEG artefacts, as from users' photos
            img = Image.open(io.BytesIO(encode(img, "JPEG", int(rng.integers(50, 96)))))
        elif u < 0.35:
            img = Image.open(io.BytesIO(encode(img, "WEBP", int(rng.integers(60, 96)))))
        k = int(rng.integers(len(PROMPT_LIST)))
        prompt = self.prompt_ids[k]
        answer = self.answer_ids[(k, pic.color, pic.shape)]
        ids = prompt + answer
        labels = [-100] * len(prompt) + answer
        return (
            preprocess(img, self.proc),
            torch.tensor(ids),
            torch.tensor(labels),
            SHAPES.index(pic.shape),
            list(COLORS).index(pic.color),
        )


def collate(batch, pad_id: int):
    pixels = torch.stack([b[0] for b in batch])
    n = max(len(b[1]) for b in batch)
    ids = torch.full((len(batch), n), pad_id)
    labels = torch.full((len(batch), n), -100)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for j, b in enumerate(batch):
        ids[j, : len(b[1])], labels[j, : len(b[2])], mask[j, : len(b[1])] = b[1], b[2], 1
    return pixels, ids, labels, mask, torch.tensor([b[3] for b in batch]), torch.tensor([b[4] for b in batch])


def prompt_token_ids(tok, image_token_id: int, n_image: int) -> tuple[list[list[int]], dict]:
    """The serving path's prompt (chat template, <image> expanded) and each answer + EOS."""
    prompts = []
    for p in PROMPT_LIST:
        text = tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        raw = tok(text, add_special_tokens=False)["input_ids"]
        ids = []
        for t in raw:
            ids.extend([image_token_id] * n_image if t == image_token_id else [t])
        prompts.append(ids)
    answers = {
        (k, c, s): tok(PROMPTS[p].format(color=c, shape=s), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        for k, p in enumerate(PROMPT_LIST)
        for c in COLORS
        for s in SHAPES
    }
    return prompts, answers


@torch.no_grad()
def evaluate(model, tok, prompts, proc, seed: int, n: int, device) -> dict[str, float]:
    """Greedy answers for n pictures per prompt, exact match, as transformers generates them."""
    model.eval()
    pics = [render(np.random.default_rng([seed, i])) for i in range(n)]
    pixels = torch.stack([preprocess(p.image, proc) for p in pics])
    out = {}
    for k, prompt in enumerate(PROMPT_LIST):
        right = 0
        for start in range(0, n, 100):
            chunk = pics[start : start + 100]
            ids = torch.tensor([prompts[k]] * len(chunk), device=device)
            gen = model.generate(
                input_ids=ids,
                pixel_values=pixels[start : start + 100].to(device),
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            texts = tok.batch_decode(gen[:, ids.shape[1] :], skip_special_tokens=True)
            right += sum(t == p.answer(prompt) for t, p in zip(texts, chunk, strict=True))
        out[prompt] = right / n
    model.train()
    return out


def write_card(out: Path, acc: dict[str, float], args, step: int, images: int, minutes: float, params: int) -> None:
    rows = "\n".join(f"| {p} | `{PROMPTS[p]}` | {acc[p] * 100:.1f}% |" for p in PROMPT_LIST)
    (out / "README.md").write_text(f"""# vlmesh demo model

A {params / 1e6:.1f}M-parameter LLaVA (CLIP ViT {IMAGE_SIZE} px, patch {PATCH}, 192 wide, 6 layers; MLP projector;
Llama decoder 192 wide, 2 layers) trained from scratch to describe one filled shape on a light background
(the generator is `services/model/shapes.py`). Weights are random-initialised with seed {args.seed} and
trained on generated pictures only.

Training: {step} steps of batch {args.batch} ({images:,} pictures), AdamW lr {args.lr} with cosine decay,
{minutes:.1f} minutes of device time in total, plus a training-only auxiliary head on the pooled image
features (not shipped). Command: `{" ".join(["python", "training/train_demo_model.py", *sys.argv[1:]])}`.

Greedy exact-match accuracy on {args.eval_images} fresh pictures per prompt (eval seed {args.eval_seed},
never used in training), answered by transformers' `LlavaForConditionalGeneration.generate`:

| prompt | answer | accuracy |
| --- | --- | --- |
{rows}
""")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "models" / "demo", help="where the trained model goes")
    p.add_argument("--work", type=Path, default=ROOT / ".cache" / "train-demo", help="checkpoints (resume from here)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3500, help="optimizer steps in total (default %(default)s)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--aux-weight", type=float, default=1.0, help="weight of the auxiliary shape/color loss")
    p.add_argument("--seed", type=int, default=0, help="data and init seed")
    p.add_argument("--eval-seed", type=int, default=1_000_003, help="held-out pictures for the card")
    p.add_argument("--eval-images", type=int, default=600)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="data workers")
    p.add_argument("--max-minutes", type=float, default=None, help="checkpoint and stop after this long")
    p.add_argument("--ckpt-every", type=int, default=500)
    args = p.parse_args()

    started = time.monotonic()
    device = torch.device(args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    tok, model = build_checkpoint_skeleton(args.work, args.seed)
    proc = ImageProcessorConfig.load(args.work, IMAGE_SIZE)
    n_image = (IMAGE_SIZE // PATCH) ** 2
    prompts, answers = prompt_token_ids(tok, model.config.image_token_index, n_image)
    model.to(device).train()
    aux = torch.nn.Linear(model.config.text_config.hidden_size, len(SHAPES) + len(COLORS)).to(device)
    params = [*model.parameters(), *aux.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    warmup = min(200, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
    )
    step, used_minutes = 0, 0.0
    ckpt = args.work / "ckpt.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        aux.load_state_dict(state["aux"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, used_minutes = state["step"], state["minutes"]
        print(f"resumed at step {step} ({used_minutes:.1f} min used so far)", flush=True)

    def save() -> None:
        torch.save(
            {
                "model": model.state_dict(),
                "aux": aux.state_dict(),
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "step": step,
                "minutes": used_minutes + (time.monotonic() - started) / 60,
            },
            ckpt,
        )

    data = ShapesData(args.seed, prompts, answers, proc)
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=args.batch,
        sampler=range(step * args.batch, args.steps * args.batch),
        num_workers=args.workers,
        collate_fn=lambda b: collate(b, tok.pad_token_id),
        persistent_workers=args.workers > 0,
        prefetch_factor=4 if args.workers > 0 else None,
        pin_memory=device.type == "cuda",
    )
    # The projector's output [B, image_tokens, H] feeds the auxiliary head; a hook reads it
    # without depending on what each transformers version returns from forward().
    captured: dict[str, torch.Tensor] = {}
    projector = next(m for name, m in model.named_modules() if name.endswith("multi_modal_projector"))
    projector.register_forward_hook(lambda mod, inp, out: captured.__setitem__("feats", out))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    t_log, seen = time.monotonic(), 0
    print(
        f"training {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {device}, "
        f"steps {step}..{args.steps}, batch {args.batch}, {args.workers} data workers",
        flush=True,
    )
    stopped_early = False
    for pixels, ids, labels, mask, shape_t, color_t in loader:
        pixels, ids, labels, mask = (t.to(device, non_blocking=True) for t in (pixels, ids, labels, mask))
        with autocast:
            out = model(input_ids=ids, pixel_values=pixels, attention_mask=mask, labels=labels)
            feats = captured["feats"].reshape(ids.shape[0], n_image, -1).float().mean(1)
            logits = aux(feats)
        shape_t, color_t = shape_t.to(device), color_t.to(device)
        aux_loss = torch.nn.functional.cross_entropy(
            logits[:, : len(SHAPES)], shape_t
        ) + torch.nn.functional.cross_entropy(logits[:, len(SHAPES) :], color_t)
        loss = out.loss + args.aux_weight * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        seen += ids.shape[0]
        if step % 50 == 0 or step == args.steps:
            now = time.monotonic()
            shape_acc = (logits[:, : len(SHAPES)].argmax(-1) == shape_t).float().mean().item()
            print(
                f"step {step}/{args.steps} lm {out.loss.item():.4f} aux {aux_loss.item():.4f} "
                f"aux-shape-acc {shape_acc:.3f} lr {sched.get_last_lr()[0]:.2e} "
                f"{seen / (now - t_log):.0f} img/s",
                flush=True,
            )
            t_log, seen = now, 0
        if step % args.ckpt_every == 0:
            save()
        if args.max_minutes and (time.monotonic() - started) / 60 > args.max_minutes:
            stopped_early = step < args.steps
            break
    save()
    if stopped_early:
        print(
            f"stopped at step {step} after --max-minutes {args.max_minutes}; rerun the same command to resume",
            flush=True,
        )
        return 0
    minutes = used_minutes + (time.monotonic() - started) / 60
    acc = evaluate(model, tok, prompts, proc, args.eval_seed, args.eval_images, device)
    print("accuracy:", json.dumps(acc), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.to("cpu", torch.float32).save_pretrained(args.out)
    tok.save_pretrained(args.out)
    (args.out / "preprocessor_config.json").write_text((args.work / "preprocessor_config.json").read_text())
    write_card(args.out, acc, args, step, step * args.batch, minutes, sum(p.numel() for p in model.parameters()))
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
