"""NVIDIA MPS for the mesh's GPU processes: `vlmesh up --cuda-mps`.

Without MPS, the vision and llm processes on one GPU time-slice it: the llm's steps wait while
the ViT holds the GPU, and the other way round. Under an MPS server their kernels run side by
side, which lowers both the vision stage and the end-to-end tail under load (docs/PERF.md).

The launcher starts a control daemon of its own, with its pipe and log directories in the run
directory, so it neither needs nor touches a system-wide one; the children find it through
CUDA_MPS_PIPE_DIRECTORY, and it is told to quit once they have stopped. A launcher killed with
SIGKILL leaves its daemon running: `echo quit | CUDA_MPS_PIPE_DIRECTORY=DIR nvidia-cuda-mps-control`
with the pipe directory it printed at start. The trade-off is
isolation: an MPS server's clients share the GPU's fault domain, so a fatal GPU fault in one
(an illegal address) ends the other's work on that GPU too, where without MPS only the faulting
process fails. In Kubernetes, NVIDIA's device plugin shares a GPU through MPS itself
(deploy/README.md); this flag is for `vlmesh up` on a host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from services.launcher.ports import MeshError

CONTROL = "nvidia-cuda-mps-control"  # ships with the NVIDIA driver


class CudaMps:
    """One MPS control daemon for the lifetime of a mesh: `start`, then `env` for each GPU child, then `stop`."""

    def __init__(self, where: Path) -> None:
        self.pipe, self.logs = where / "pipe", where / "log"
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}
        self._started = False

    def _control(self, *args: str, text: str | None = None) -> subprocess.CompletedProcess:
        binary = shutil.which(CONTROL)
        if binary is None:
            raise MeshError(f"--cuda-mps: {CONTROL} is not on PATH (it ships with the NVIDIA driver)")
        env = {**os.environ, **self.env}
        return subprocess.run([binary, *args], input=text, env=env, capture_output=True, text=True, timeout=30)

    def start(self, progress: Callable[[str], None] = print) -> None:
        """Start the daemon (MeshError if it cannot); the MPS server itself starts with the first client."""
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        done = self._control("-d")
        if done.returncode != 0:
            raise MeshError(f"--cuda-mps: {CONTROL} -d failed ({done.returncode}): {self._why(done)}")
        self._started = True
        progress(f"NVIDIA MPS control daemon started (pipe {self.pipe})")

    def stop(self) -> None:
        """Tell the daemon to quit (after the children have stopped); a no-op if it was not started."""
        if not self._started:
            return
        self._started = False
        try:
            self._control(text="quit\n")
        except (OSError, subprocess.TimeoutExpired, MeshError):
            pass  # best effort: the mesh is stopping, its children are gone

    def _why(self, done: subprocess.CompletedProcess) -> str:
        said = (done.stderr or done.stdout or "").strip()
        log = self.logs / "control.log"
        if not said and log.is_file():
            said = " / ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        return said or "no message"
