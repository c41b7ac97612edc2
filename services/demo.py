"""`vlmesh demo`: start the mesh on the demo model, ask about one picture, print the answer
with its per-stage timings, and stop.

The demo model (models/demo, see its README) is trained to name the color and shape in
pictures like those of services/model/shapes.py; the demo renders one and prints the
generator's ground truth beside the model's answer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from services.client import build_request, format_timings, generate, image_file
from services.common.logs import LOG_LEVELS
from services.common.validation import CliParser, int_in, prompt_text
from services.launcher import Mesh, MeshError, MeshOptions
from services.model.shapes import PROMPTS, Picture, render

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "models" / "demo"
CACHE = ROOT / ".cache"


def sample_picture(path: Path, seed: int) -> Picture:
    """A picture from the demo model's generator (services/model/shapes.py), saved as PNG."""
    picture = render(np.random.default_rng(seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.image.save(path)
    return picture


def main(argv: list[str] | None = None) -> int:
    p = CliParser(prog="vlmesh demo", description=__doc__)
    p.add_argument("--image", type=image_file, default=None, help="picture to send (default: a rendered sample)")
    p.add_argument("--seed", type=int_in(0), default=7, help="which sample picture to render (default %(default)s)")
    p.add_argument("--prompt", type=prompt_text, default="What is in the image?", help="default: %(default)s")
    p.add_argument(
        "--log-level", default="warning", choices=LOG_LEVELS, help="services' log level (default %(default)s)"
    )
    args = p.parse_args(argv)

    def say(msg: str) -> None:
        print(f"demo: {msg}", flush=True)

    if not (DEMO_MODEL / "config.json").is_file():
        say(f"error: the demo model is missing from {DEMO_MODEL} (it ships with the repository)")
        return 1
    model = DEMO_MODEL
    truth = None
    image = args.image
    if image is None:
        image = CACHE / f"demo-sample-{args.seed}.png"
        picture = sample_picture(image, args.seed)
        if args.prompt in PROMPTS:
            truth = picture.answer(args.prompt)
    opts = MeshOptions.from_flags(
        metrics_ports=(0, 0, 0),
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
            if truth is not None:
                say(f"the picture shows {truth!r} (the generator's ground truth)")
            u = final.usage
            say(f"{u.output_tokens} tokens; prompt {u.prompt_tokens} text + {u.image_tokens} image tokens")
            print("per-stage timings (from the gateway's final message):")
            print(format_timings(final.timings))
            say("stopping the mesh")
    except MeshError as err:
        say(f"error: {err}")
        return 1
    return 0
