"""The `vlmesh` command."""

from __future__ import annotations

import sys

USAGE = """usage: vlmesh COMMAND [options]

commands:
  up          start gateway, vision and llm, warm up, and serve until Ctrl-C
  demo        start the mesh on the demo model, answer one picture, and stop
  generate    send one image and prompt to a gateway and stream the answer
  bench       open-loop load with the write-ups' workloads, against the mesh and baselines
  serve NAME  run one service: gateway, vision or llm
  make-tiny-model DIR
              write a tiny random-weight LLaVA checkpoint (for tests and trials)

`vlmesh COMMAND --help` explains each command's options.
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "up":
        from services.launcher import up

        return up(rest)
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
        services = {"gateway", "vision", "llm"}
        if not rest or rest[0] not in services:
            print("usage: vlmesh serve {gateway,vision,llm} [options]", file=sys.stderr)
            return 2
        module = __import__(f"services.{rest[0]}.server", fromlist=["main"])
        return module.main(rest[1:])
    if cmd == "make-tiny-model":
        if len(rest) != 1 or rest[0].startswith("-"):
            print("usage: vlmesh make-tiny-model DIR", file=sys.stderr)
            return 2
        from services.model.tiny import build_tiny_llava

        print(build_tiny_llava(rest[0]))
        return 0
    print(f"vlmesh: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
