"""Cheap checks of a checkpoint directory's files, before anything loads them.

A file that is missing, cut short or not what its name says becomes one InvalidArgument that
names the file and what is wrong with it, instead of an error from deep inside transformers or
safetensors. `vlmesh serve`, `vlmesh bench` and the loaders (checkpoint.py, prompt.py) use these.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from services.common.errors import InvalidArgument

# A safetensors file: an 8-byte little-endian header length, the JSON header, then the data,
# whose size the header's data_offsets give.
_MAX_HEADER_BYTES = 100_000_000
# Files a tokenizer loads from: the fast tokenizer's own file, or a sentencepiece model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def check_safetensors(path: Path) -> None:
    """InvalidArgument naming `path` unless its header is readable and the file holds all its data."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > min(size - 8, _MAX_HEADER_BYTES):
                raise InvalidArgument(f"{path} is not a whole safetensors file: {size} bytes, no complete header")
            header = json.loads(f.read(n))
    except OSError as err:
        raise InvalidArgument(f"{path}: cannot read it: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidArgument(f"{path} is not a safetensors file: its header is not JSON") from None
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        raise InvalidArgument(f"{path} is not a safetensors file: its header lists no tensor offsets") from None
    if size < 8 + n + end:
        raise InvalidArgument(
            f"{path} is truncated: {size} bytes, but its header describes {8 + n + end} (copy or download it again)"
        )


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors shards (from the index when there is one); InvalidArgument if none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InvalidArgument(f"{index} is not a safetensors index (no weight_map)") from None
        shards = [model_dir / n for n in names]
        if missing := [p.name for p in shards if not p.is_file()]:
            raise InvalidArgument(f"{model_dir}: {index.name} lists shards that are missing: {', '.join(missing)}")
        return shards
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise InvalidArgument(f"{model_dir}: no *.safetensors weights")
    return shards


def check_tokenizer_files(model_dir: Path) -> None:
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise InvalidArgument(f"{model_dir}: tokenizer.json is missing (the checkpoint's tokenizer)")


def check_checkpoint(model_dir: str | Path, weights: bool = True, tokenizer: bool = True) -> None:
    """A local checkpoint's files, before loading: config.json, the tokenizer's file, every weight
    shard whole. A random-weight preset (presets.py) has no weights to check."""
    path = Path(model_dir)
    if not path.is_dir():
        raise InvalidArgument(f"{path}: no such checkpoint directory")
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{path}: no config.json; --model must be a local LLaVA checkpoint directory")
    if tokenizer:
        check_tokenizer_files(path)
    if weights:
        from services.model.presets import is_random

        if not is_random(path):
            for shard in weight_files(path):
                if shard.is_file():  # a pipe or a device is read once, by the service: not here
                    check_safetensors(shard)
