"""uvicorn inside the gateway's event loop, beside the gRPC server.

The socket is bound here (port 0 gives a free port, reported in --port-file) and handed to
uvicorn. uvicorn's own signal handling is off: the gateway's SIGTERM drains both doors.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket

import uvicorn

from services.common.server import PortInUse


class _Server(uvicorn.Server):
    def capture_signals(self):  # the gateway handles SIGINT/SIGTERM (services/common/server.py)
        return contextlib.nullcontext()


class HttpServer:
    """An ASGI app served on HOST:PORT until `stop`."""

    def __init__(self, app, host: str, port: int, grace_s: float, tls_cert: str = "", tls_key: str = "") -> None:
        """`tls_cert`, `tls_key`: serve HTTPS (the gateway's --tls-cert and --tls-key)."""
        self.host, self.port = host, port
        self.scheme = "https" if tls_cert else "http"
        config = uvicorn.Config(
            app,
            log_config=None,  # the gateway's logging stays as it is
            access_log=False,  # the gateway writes its own access log line per request
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(grace_s)),
            ssl_certfile=tls_cert or None,
            ssl_keyfile=tls_key or None,
        )
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and serve; return the bound port. PortInUse when it is taken."""
        family = socket.AF_INET6 if ":" in self.host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host.strip("[]"), self.port))
        except OSError as err:
            sock.close()
            if err.errno == errno.EADDRINUSE:
                raise PortInUse(f"{self.host}:{self.port}", "--http-port", what="the HTTP port ") from err
            raise
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {self.host}:{self.port} stopped at start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (up to the grace period), close."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
