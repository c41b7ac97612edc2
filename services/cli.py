"""The `vlmesh` command.

A bad argument exits 2 with one line on stderr, `vlmesh COMMAND: error: ...`; so does an error
the command knows (a bad checkpoint, a refused request), never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("up", "route", "demo", "generate", "bench", "serve", "make-tiny-model")
SERVICES = {
    "gateway": "the public API (vlmesh.v1.Gateway): checks each request, calls vision, streams the llm's answer",
    "vision": "the vision encoder: decodes images, runs the ViT and projector, leases the features to the llm",
    "llm": "the decoder: applies the chat template and decodes with continuous batching in QoS order",
}

USAGE = """usage: vlmesh COMMAND [options]

commands:
  up          start gateway, vision and llm, warm up, and serve until Ctrl-C
  route       change the weights between the variants of `vlmesh up --variants` while it runs
  demo        start the mesh on the demo model, answer one picture, and stop
  generate    send one image and prompt to a gateway and stream the answer
  bench       open-loop load with the write-ups' workloads, against the mesh and baselines
  serve NAME  run one service: gateway, vision or llm
  make-tiny-model [--family F] [--stored fp8] DIR
              write a tiny random-weight checkpoint of a model family (for tests and trials)

`vlmesh COMMAND --help` explains each command's options; `vlmesh --version` prints the version.
"""

SERVE_USAGE = (
    "usage: vlmesh serve NAME [options]\n\n"
    "Run one service of the mesh in the foreground (`vlmesh up` starts all three):\n"
    + "".join(f"  {name:<8} {line}\n" for name, line in SERVICES.items())
    + "\n`vlmesh serve NAME --help` lists NAME's flags.\n"
)


def version() -> str:
    """The installed package's version, else the one pyproject.toml declares."""
    from importlib import metadata

    try:
        return metadata.version("vlmesh")
    except metadata.PackageNotFoundError:
        import tomllib

        try:
            return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def _flag_value(argv: list[str], name: str) -> str | None:
    """The value of `name` in argv (`--model X` or `--model=X`), the last one winning, as argparse does."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg.partition("=")[2]
    return found


def _check_model(argv: list[str], service: str) -> None:
    """Before a service loads anything: a local --model's files, config and weights' shapes."""
    model = _flag_value(argv, "--model")
    if model is None or model.startswith("preset:") or not Path(model).is_dir():
        return  # the service's own parser or loader reports what is wrong
    from services.model.checkpoint import preflight

    spec = preflight(model, ("vision",) if service == "vision" else ("text",), tokenizer=service == "llm")
    if service == "llm":
        from services.llm.engines import check_engine
        from services.model.stored_fp8 import check_quantize

        check_engine(_flag_value(argv, "--llm-engine") or "native", spec)
        check_quantize(spec, _flag_value(argv, "--quantize") or "none")


def serve(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        if rest:
            print(SERVE_USAGE, end="")
            return 0
        print("vlmesh serve: error: name a service: gateway, vision or llm (vlmesh serve --help)", file=sys.stderr)
        return 2
    name, argv = rest[0], rest[1:]
    if name not in SERVICES:
        print(
            f"vlmesh serve: error: unknown service {name!r}: use gateway, vision or llm "
            "(vlmesh serve --help describes them)",
            file=sys.stderr,
        )
        return 2
    if name != "gateway" and not {"-h", "--help"} & set(argv):
        _check_model(argv, name)
    module = __import__(f"services.{name}.server", fromlist=["main"])
    return module.main(argv)


def dispatch(cmd: str, rest: list[str]) -> int:
    if cmd == "up":
        from services.launcher import up

        if not {"-h", "--help"} & set(rest):
            _check_model(rest, "llm")  # a broken checkpoint: one line now, not two dead children later
        return up(rest)
    if cmd == "route":
        from services.launcher.variants import route_main

        return route_main(rest)
    if cmd == "demo":
        from services.demo import main as demo

        return demo(rest)
    if cmd == "generate":
        from services.client import main as generate

        return generate(rest)
    if cmd == "bench":
        from services.bench.cli import main as bench

        return bench(rest)
    if cmd == "serve":
        return serve(rest)
    return make_tiny_model(rest)


def make_tiny_model(argv: list[str]) -> int:
    """`vlmesh make-tiny-model [--family F] [--seed N] [--stored fp8] DIR`: a tiny random checkpoint of a family."""
    from services.common.validation import CliParser
    from services.model.family import FAMILY_NAMES

    p = CliParser(
        prog="vlmesh make-tiny-model",
        description="Write a tiny random-weight checkpoint (config, safetensors, tokenizer with the family's chat "
        "template, image processor) that transformers itself loads: for tests and trials, not for answers.",
    )
    p.add_argument("dir", metavar="DIR", help="the directory to write (created if missing)")
    p.add_argument(
        "--family",
        default="llava",
        choices=FAMILY_NAMES,
        help="the checkpoint layout (config.json model_type; '-' and '_' are alike): %(choices)s (default %(default)s)",
        type=lambda v: v.replace("-", "_"),
    )
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed (default %(default)s)")
    p.add_argument(
        "--stored",
        default="none",
        choices=("none", "fp8"),
        help="how the decoder's projections are stored: none (full precision) or fp8 (compressed-tensors e4m3 "
        "codes with per-channel scales, as llm-compressor's FP8_DYNAMIC writes; serve with --quantize fp8 on a "
        "GPU, or none to multiply them out) (default %(default)s)",
    )
    args = p.parse_args(argv)
    from services.model.family import family_named

    out = family_named(args.family).write_tiny(Path(args.dir), args.seed)
    if args.stored == "fp8":
        from services.model.stored_fp8 import store_fp8

        store_fp8(out)
    print(out)
    return 0


def _one_line(err: BaseException) -> str:
    """The error's message on one line: a mesh error's text, an OSError's `file: reason`."""
    if isinstance(err, OSError) and err.strerror:
        text = f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    else:
        text = getattr(err, "message", None) or str(err) or type(err).__name__
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        print(f"vlmesh {version()}")
        return 0
    cmd, rest = args[0], args[1:]
    if cmd not in COMMANDS:
        print(f"vlmesh: error: unknown command {cmd!r}: use {', '.join(COMMANDS)} (vlmesh --help)", file=sys.stderr)
        return 2
    prog = f"vlmesh {cmd}" + (f" {rest[0]}" if cmd == "serve" and rest and rest[0] in SERVICES else "")
    import grpc

    from services.common.errors import InvalidArgument, MeshError

    try:
        return dispatch(cmd, rest)
    except grpc.RpcError as err:  # generate: the gateway refused or failed
        code = err.code() if hasattr(err, "code") else None
        details = err.details() if hasattr(err, "details") else str(err)
        details = " ".join(str(details).split())
        print(f"{prog}: error: {getattr(code, 'name', 'UNKNOWN')}: {details}", file=sys.stderr)
        return 2 if code == grpc.StatusCode.INVALID_ARGUMENT else 1
    except (InvalidArgument, ValueError) as err:
        print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except (MeshError, OSError) as err:
        print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
