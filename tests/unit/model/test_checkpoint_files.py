"""A broken checkpoint or picture is reported in one line that names the file (or the field) and
what is wrong, never with a library's internals."""

from __future__ import annotations

import shutil

import pytest
import torch

from services.common.errors import InvalidArgument
from services.model.checkpoint import check_weights, load_decoder
from services.model.files import check_checkpoint, check_safetensors
from services.model.preprocess import decode_image
from services.model.prompt import load_tokenizer
from services.model.spec import load_spec
from tests.helpers import ROOT, image_bytes

DEMO = ROOT / "models" / "demo"


@pytest.fixture
def demo_copy(tmp_path):
    """models/demo without its weights (linked back in by each test as it needs)."""
    out = tmp_path / "demo"
    out.mkdir()
    for f in DEMO.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def truncated(demo_copy, keep: int):
    data = (DEMO / "model.safetensors").read_bytes()
    (demo_copy / "model.safetensors").write_bytes(data[:keep])
    return demo_copy / "model.safetensors", len(data)


def test_the_demo_checkpoint_passes():
    check_checkpoint(DEMO)


def test_a_truncated_shard_is_named_with_its_sizes(demo_copy):
    shard, whole = truncated(demo_copy, 7_000_000)
    with pytest.raises(InvalidArgument) as info:
        check_checkpoint(demo_copy)
    assert info.value.message == (
        f"{shard} is truncated: 7000000 bytes, but its header describes {whole} (copy or download it again)"
    )


@pytest.mark.parametrize("keep,needle", [(5, "no complete header"), (100, "no complete header")])
def test_a_shard_cut_inside_its_header(demo_copy, keep, needle):
    shard, _ = truncated(demo_copy, keep)
    with pytest.raises(InvalidArgument, match=needle):
        check_safetensors(shard)


def test_not_a_safetensors_file(demo_copy):
    (demo_copy / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0" + b"not json at all!")
    with pytest.raises(InvalidArgument, match="is not a safetensors file: its header is not JSON"):
        check_safetensors(demo_copy / "model.safetensors")


def test_the_loader_names_a_truncated_file_instead_of_a_safetensors_error(demo_copy):
    shard, _ = truncated(demo_copy, 7_000_000)
    with pytest.raises(InvalidArgument) as info:
        load_decoder(load_spec(demo_copy), torch.device("cpu"), torch.float32)
    assert info.value.message.startswith(f"{shard} is truncated")


def test_the_loader_reads_a_whole_file(demo_copy):
    (demo_copy / "model.safetensors").symlink_to(DEMO / "model.safetensors")
    spec = load_spec(demo_copy)
    check_weights(spec, "text")
    assert isinstance(load_decoder(spec, torch.device("cpu"), torch.float32).norm.weight, torch.Tensor)


def test_a_missing_tokenizer_is_named(demo_copy):
    (demo_copy / "tokenizer.json").unlink()
    for check in (lambda: check_checkpoint(demo_copy, weights=False), lambda: load_tokenizer(demo_copy)):
        with pytest.raises(InvalidArgument) as info:
            check()
        assert info.value.message.startswith(f"{demo_copy}: tokenizer.json is missing")
        assert "sentencepiece" not in info.value.message


def test_no_config_is_named(demo_copy):
    (demo_copy / "config.json").unlink()
    with pytest.raises(InvalidArgument, match=r"no config\.json"):
        check_checkpoint(demo_copy, weights=False)


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"this is not an image at all", "its format is not one Pillow recognises"),
        (image_bytes(7)[:60], "truncated"),
    ],
)
def test_an_unreadable_picture_is_named_without_python_internals(data, reason):
    with pytest.raises(InvalidArgument) as info:
        decode_image(data, name="images[0]")
    msg = info.value.message
    assert msg.startswith(f"images[0] ({len(data)} bytes) is not a readable image (JPEG, PNG, WebP, ...): ")
    assert reason in msg
    assert "0x" not in msg and "BytesIO" not in msg and "<" not in msg
