"""The peer: vLLM's own OpenAI-compatible server on the same LLaVA checkpoint (`--target vllm`).

vLLM serves the checkpoint natively (its own image processing, batching and scheduling), on
loopback, driven by the same workloads and arrivals as the mesh. Two adjustments make it
load the checkpoints transformers 5 writes, in a copy under `.cache/vllm-peer/`:
- vision keys `vision_tower.embeddings.*` / `vision_tower.encoder.*` are renamed to the
  `vision_tower.vision_model.*` that vLLM expects;
- the chat template must start with `{{ bos_token }}` (the chat endpoint adds no BOS).
And `services/bench/vllm_shim` goes on the server's PYTHONPATH (see its docstring). Prefix
caching and the multimodal processor cache are off, as in the mesh, which has neither.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from services.launcher import free_port

SHIM = Path(__file__).resolve().parent / "vllm_shim"
START_TIMEOUT_S = 300.0


def prepare_checkpoint(model_dir: str, root: Path = Path(".cache/vllm-peer")) -> Path:
    """A copy of the checkpoint that vLLM's LLaVA loader reads; made once per checkpoint."""
    from safetensors.torch import load_file, save_file

    src = Path(model_dir).resolve()
    out = root / hashlib.sha256(str(src).encode()).hexdigest()[:16]
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    if len(shards) != 1:
        raise ValueError(f"{src}: the peer copy handles one safetensors file, found {len(shards)}")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    state = load_file(shards[0])
    renamed = {}
    for key, value in state.items():
        if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
            key = "vision_tower.vision_model." + key[len("vision_tower.") :]
        renamed[key] = value
    template = out / "chat_template.jinja"
    if template.is_file() and not template.read_text().lstrip().startswith("{{ bos_token }}"):
        template.write_text("{{ bos_token }}" + template.read_text())
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class VllmServer:
    """`vllm serve` on loopback in its own process group; stopped by its PID."""

    def __init__(self, model_dir: str, max_model_len: int, dtype: str = "float32") -> None:
        self.checkpoint = prepare_checkpoint(model_dir)
        self.port = free_port("127.0.0.1")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SHIM), os.environ.get("PYTHONPATH", "")])),
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "VLLM_CACHE_ROOT": str(Path(".cache/vllm").resolve()),
        }
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.checkpoint), "--served-model-name", "peer",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(max_model_len), "--dtype", dtype, "--enforce-eager",
            "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, progress=print) -> None:
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with code {self.proc.returncode} (its log is above)")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as resp:
                    if resp.status == 200:
                        progress(f"vLLM peer ready on {self.base} after {time.monotonic() - start:.0f}s")
                        return
            except OSError:
                pass
            if time.monotonic() - start > START_TIMEOUT_S:
                raise RuntimeError(f"the vLLM server was not ready after {START_TIMEOUT_S:.0f}s")
            time.sleep(1.0)

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
