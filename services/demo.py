"""`vlmesh demo`: start the mesh on the demo model, ask about one picture, print the answer
with its per-stage timings, and stop."""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image, ImageDraw

from services.client import build_request, format_timings, generate
from services.launcher import Mesh, MeshError, MeshOptions

ROOT = Path(__file__).resolve().parent.parent
TRAINED_DEMO = ROOT / "models" / "demo"
CACHE = ROOT / ".cache"


def demo_model(progress) -> tuple[Path, bool]:
    """The trained demo model when the repo ships one, else a tiny random model (and say so)."""
    if (TRAINED_DEMO / "config.json").is_file():
        return TRAINED_DEMO, True
    from services.model.tiny import build_tiny_llava

    path = CACHE / "tiny-random-llava"
    if not (path / "config.json").is_file():
        progress(f"building a tiny random-weight LLaVA checkpoint in {path}")
        build_tiny_llava(path, seed=0, image_size=64, center_crop=False)
    return path, False


def sample_picture(path: Path) -> Path:
    """A red circle on a light background, 256x192 PNG."""
    img = Image.new("RGB", (256, 192), (235, 232, 225))
    ImageDraw.Draw(img).ellipse((78, 46, 178, 146), fill=(220, 30, 30))
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vlmesh demo", description=__doc__)
    p.add_argument("--image", type=Path, default=None, help="picture to send (default: a rendered sample)")
    p.add_argument("--prompt", default="What is in the image?")
    p.add_argument("--log-level", default="warning", help="services' log level (default %(default)s)")
    args = p.parse_args(argv)

    def say(msg: str) -> None:
        print(f"demo: {msg}", flush=True)

    model, trained = demo_model(say)
    if not trained:
        say("NOTE: no trained demo model in this checkout, so the mesh runs a tiny model with RANDOM weights.")
        say("      The answer below is noise; it shows the path works, not that the model sees.")
    image = args.image or sample_picture(CACHE / "demo-sample.png")
    opts = MeshOptions(
        model=str(model),
        gateway_port=0,
        vision_port=0,
        llm_port=0,
        warmup_requests=2,
        log_level=args.log_level,
        device="cpu",
    )
    try:
        with Mesh(opts) as mesh:
            mesh.start(say)
            say(f"gateway ready on {mesh.target('gateway')}")
            width, height = Image.open(image).size
            say(f"sending {image} ({width}x{height}) with prompt {args.prompt!r}")
            print("answer: ", end="", flush=True)
            final = generate(
                mesh.target("gateway"),
                build_request(image, args.prompt, 16, None, None, []),
                "standard",
                60.0,
            )
            u = final.usage
            say(f"{u.output_tokens} tokens; prompt {u.prompt_tokens} text + {u.image_tokens} image tokens")
            print("per-stage timings (from the gateway's final message):")
            print(format_timings(final.timings))
            say("stopping the mesh")
    except MeshError as err:
        say(f"error: {err}")
        return 1
    return 0
