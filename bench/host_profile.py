"""Sum up the servers' host profiles (`vlmesh up --profile-host DIR`, services/common/host_profile.py).

For each server's profile: its threads' CPU seconds, then the functions that spent the most of
it themselves (own, C calls they made included) and with their callees (total), as shares of
what its Python functions spent (a total passes 100% where calls nest: module calls, recursion).
Profiling slowed the Python it counted: read the shares, not the seconds.

    python -m bench.host_profile DIR|FILE.pstat... [--top 20]

A directory is searched whole: behind Envoy each worker's servers write DIR/<variant>[.<device>]/.
"""

from __future__ import annotations

import argparse
import pstats
from pathlib import Path


def profiles(paths: list[str]) -> list[tuple[str, Path]]:
    """(label, file) of the .pstat files named, or found under the directories named (a worker's
    behind Envoy in a directory of its own, labelled by it)."""
    out: list[tuple[str, Path]] = []
    for p in map(Path, paths):
        out += [(str(f.relative_to(p)), f) for f in sorted(p.rglob("*.pstat"))] if p.is_dir() else [(p.name, p)]
    if not out:
        raise SystemExit(f"no .pstat files in {' '.join(paths)} (vlmesh up --profile-host DIR writes them)")
    return out


def where(func: tuple[str, int, str]) -> str:
    """A function as `path:line name`, its path from the package down (services/..., grpc/...)."""
    path, line, name = func
    parts = Path(path).parts
    if "site-packages" in parts:
        parts = parts[len(parts) - parts[::-1].index("site-packages") :]
    elif roots := [i for i, part in enumerate(parts) if part in ("services", "bench", "tests")]:
        parts = parts[roots[0] :]
    else:
        parts = parts[-2:]
    return f"{'/'.join(parts)}:{line} {name}"


def summary(label: str, path: Path, top: int) -> list[str]:
    """One server's lines: its threads, then its `top` functions by their own CPU."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]  # {func: (cc, nc, own, total, callers)}
    cpu = sum(own for _, _, own, _, _ in stats.values()) or 1e-9
    lines = [f"{label}: {cpu:.2f} s of CPU in Python functions"]
    threads = Path(f"{path}.threads")
    if threads.is_file():
        rows = [line.split("\t") for line in threads.read_text().splitlines() if line]
        lines.append("  threads: " + ", ".join(f"{name} {float(s):.2f} s" for s, _, name in rows[:8]))
    lines.append(f"  {'own %':>6} {'total %':>7} {'calls':>9}  function")
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for func, (_, calls, own, total, _) in ranked:
        lines.append(f"  {100 * own / cpu:6.1f} {100 * total / cpu:7.1f} {calls:9d}  {where(func)}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.host_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="--profile-host directories, or .pstat files")
    p.add_argument("--top", type=int, default=20, help="functions shown per server (default %(default)s)")
    args = p.parse_args(argv)
    for label, path in profiles(args.paths):
        print("\n".join(summary(label, path, args.top)), end="\n\n")


if __name__ == "__main__":
    main()
