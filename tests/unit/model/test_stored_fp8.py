"""Checkpoints stored in compressed-tensors fp8: which configs are served and which are refused
(naming the field), the codes kept as stored (`--quantize fp8`) or multiplied out (`none`), and a
broken fp8 checkpoint named in one line before anything loads."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.errors import InvalidArgument
from services.model.checkpoint import load_decoder, preflight
from services.model.fuse import fuse_linears
from services.model.qlinear import FP8, FP8_KERNEL_ROWS, Fp8Linear
from services.model.stored_fp8 import check_quantize, store_fp8, stored_quantization
from services.model.tiny import build_tiny_llava
from tests.helpers import multiplied_out

CPU = torch.device("cpu")
SHARD = "model.safetensors"


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("full"), seed=0)


@pytest.fixture(scope="module")
def stored(full, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "model"
    shutil.copytree(full, out)
    store_fp8(out)
    return out


@pytest.fixture
def stored_copy(stored, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(stored, out)
    return out


def _config(model_dir):
    return json.loads((model_dir / "config.json").read_text())


def test_store_fp8_writes_e4m3_codes_and_per_channel_scales_for_the_decoder_only(stored):
    tensors = load_file(stored / SHARD)
    codes = {k: t for k, t in tensors.items() if t.dtype == FP8}
    assert codes and all(".layers." in k and k.endswith("_proj.weight") for k in codes)
    assert not any("vision" in k or "projector" in k or "lm_head" in k or "embed" in k for k in codes)
    assert len(codes) == 7 * _config(stored)["text_config"]["num_hidden_layers"]
    for key, q in codes.items():
        scale = tensors[key + "_scale"]
        assert scale.shape == (q.shape[0], 1) and scale.dtype == torch.float32
        assert q.float().abs().amax(dim=1).eq(448).all()  # each channel's largest at e4m3's largest
    assert stored_quantization(_config(stored), stored / "config.json") == "fp8"


def _text_key(module_key: str) -> str:
    """The tiny LLaVA's checkpoint key of a decoder module key."""
    return f"language_model.{module_key}" if module_key.startswith("lm_head") else f"language_model.model.{module_key}"


def test_quantize_none_multiplies_the_codes_out_exactly(full, stored, tmp_path):
    spec = preflight(stored)
    assert spec.stored_quantization == "fp8"
    decoder = load_decoder(spec, CPU, torch.float32, fuse=False)
    reference = load_decoder(preflight(multiplied_out(stored, tmp_path / "plain")), CPU, torch.float32, fuse=False)
    assert decoder.state_dict().keys() == reference.state_dict().keys()
    for name, param in decoder.state_dict().items():
        assert torch.equal(param, reference.state_dict()[name]), name
    # and the full-precision checkpoint it came from is close, not equal: the codes are real
    original = load_decoder(preflight(full), CPU, torch.float32, fuse=False)
    w0, w1 = original.layers[0].mlp.up_proj.weight, decoder.layers[0].mlp.up_proj.weight
    err = ((w1 - w0).norm() / w0.norm()).item()
    assert 0 < err < 0.05


def test_the_codes_multiplied_out_equal_compressed_tensors_own_decompression(stored):
    """The format's own library (through transformers) reads the checkpoint as vlmesh does."""
    from transformers import CompressedTensorsConfig, LlavaForConditionalGeneration

    theirs = LlavaForConditionalGeneration.from_pretrained(
        stored, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    ).model.language_model
    ours = load_decoder(preflight(stored), CPU, torch.float32, fuse=False)
    compared = 0
    for name, param in ours.named_parameters():
        if name.endswith("_proj.weight"):
            assert torch.equal(param, theirs.get_parameter(name)), name
            compared += 1
    assert compared == 7 * len(ours.layers)


def test_quantize_fp8_keeps_the_stored_codes_fused_and_their_scales(stored):
    spec = preflight(stored)
    tensors = load_file(stored / SHARD)
    decoder = load_decoder(spec, CPU, torch.float32, keep_fp8=True)
    qkv = decoder.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear)
    names = [_text_key(f"layers.1.self_attn.{p}_proj.weight") for p in "qkv"]
    assert torch.equal(qkv.qdata.view(torch.uint8), torch.cat([tensors[n] for n in names]).view(torch.uint8))
    assert torch.equal(qkv.scale, torch.cat([tensors[n + "_scale"].reshape(-1) for n in names]))
    assert isinstance(decoder.layers[0].mlp.gate_up_proj, Fp8Linear)
    assert isinstance(decoder.lm_head, torch.nn.Linear) and decoder.lm_head.weight.dtype == torch.float32
    # decode rows read the weight as stored (W8A16): the multiplied-out weights' product
    plain = load_decoder(spec, CPU, torch.float32)
    x = torch.randn(FP8_KERNEL_ROWS, spec.text.hidden)
    got, want = decoder.layers[0].mlp(x), plain.layers[0].mlp(x)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fusing_fp8_layers_concatenates_codes_scales_and_biases():
    torch.manual_seed(0)
    layers = [Fp8Linear.of(torch.nn.Linear(32, n, bias=True)) for n in (16, 8)]
    fused = fuse_linears(*layers)
    x = torch.randn(4, 32)
    assert torch.allclose(fused(x), torch.cat([lay(x) for lay in layers], dim=-1))
    with pytest.raises(ValueError, match="some of these layers are stored in fp8"):
        fuse_linears(layers[0], torch.nn.Linear(32, 8, bias=True))


SCHEME = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
}


def _with(path: str, value):
    scheme = copy.deepcopy(SCHEME)
    *parents, last = path.split(".")
    block = scheme
    for part in parents:
        block = block[part]
    block[last] = value
    return scheme


@pytest.mark.parametrize(
    "field, value",
    [
        ("quant_method", "awq"),
        ("quant_method", "fp8"),  # transformers' block-wise FineGrainedFP8
        ("format", "pack-quantized"),
        ("kv_cache_scheme", {"num_bits": 8, "type": "float"}),
        ("config_groups.group_0.weights.num_bits", 4),
        ("config_groups.group_0.weights.type", "int"),
        ("config_groups.group_0.weights.strategy", "block"),
        ("config_groups.group_0.input_activations", {"num_bits": 8, "type": "int"}),
    ],
)
@pytest.mark.parametrize("where", ["", "text_config."])
def test_other_stored_forms_are_refused_naming_the_field(tmp_path, field, value, where):
    config = tmp_path / "config.json"
    raw = {"model_type": "llava", "text_config": {}}
    (raw if not where else raw["text_config"])["quantization_config"] = _with(field, value)
    with pytest.raises(InvalidArgument) as err:
        stored_quantization(raw, config)
    msg = err.value.message
    assert msg.startswith(f"{config}: {where}quantization_config.{field} is {value!r}: vlmesh loads only ")
    assert "compressed-tensors fp8" in msg


def test_the_served_scheme_per_tensor_and_without_activations_is_fp8(tmp_path):
    scheme = _with("config_groups.group_0.weights.strategy", "tensor")
    del scheme["config_groups"]["group_0"]["input_activations"]
    assert stored_quantization({"quantization_config": scheme}, tmp_path / "config.json") == "fp8"
    assert stored_quantization({"model_type": "llava"}, tmp_path / "config.json") == "none"


def test_per_tensor_scales_load_as_one_scale_a_channel(stored_copy):
    tensors = load_file(stored_copy / SHARD)
    key = _text_key("layers.0.mlp.down_proj.weight")
    tensors[key + "_scale"] = torch.tensor([0.01])
    save_file(tensors, stored_copy / SHARD)
    decoder = load_decoder(preflight(stored_copy), CPU, torch.float32, keep_fp8=True)
    assert torch.equal(decoder.layers[0].mlp.down_proj.scale, torch.full((tensors[key].shape[0],), 0.01))


def test_a_missing_or_block_scale_is_named_before_loading(stored_copy):
    tensors = load_file(stored_copy / SHARD)
    key = _text_key("layers.0.self_attn.o_proj.weight")
    scale = tensors.pop(key + "_scale")
    save_file(tensors, stored_copy / SHARD)
    with pytest.raises(InvalidArgument) as err:
        preflight(stored_copy)
    assert err.value.message == (f"{stored_copy / SHARD}: {key} is stored in fp8 but the checkpoint has no {key}_scale")
    tensors[key + "_scale"] = scale.reshape(-1)[:2].reshape(1, 2)  # a block's scales
    save_file(tensors, stored_copy / SHARD)
    with pytest.raises(InvalidArgument, match=r"o_proj.weight_scale is \(1, 2\): vlmesh reads one scale per output"):
        preflight(stored_copy)


def test_fp8_outside_the_decoders_projections_is_refused(stored_copy):
    tensors = load_file(stored_copy / SHARD)
    key = next(k for k in tensors if "vision" in k and k.endswith("fc1.weight"))
    tensors[key] = tensors[key].to(FP8)
    save_file(tensors, stored_copy / SHARD)
    with pytest.raises(InvalidArgument, match=f"{key} is stored in fp8; vlmesh reads fp8 codes only for the decoder"):
        preflight(stored_copy)


def test_fp8_codes_without_a_quantization_config_are_refused(stored_copy):
    raw = _config(stored_copy)
    del raw["quantization_config"]
    (stored_copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(InvalidArgument, match="is stored in fp8; vlmesh reads fp8 codes only"):
        preflight(stored_copy)


@pytest.mark.parametrize("quantize, ok", [("none", True), ("fp8", True), ("int8", False), ("int4", False)])
def test_int8_or_int4_would_round_the_codes_twice(stored, quantize, ok):
    spec = preflight(stored)
    if ok:
        check_quantize(spec, quantize)
        return
    with pytest.raises(InvalidArgument) as err:
        check_quantize(spec, quantize)
    assert f"--quantize {quantize} would round those codes again: serve it with --quantize fp8" in err.value.message


@pytest.mark.parametrize("family", ["tiny_qwen", "tiny_deepseek_hybrid"])
def test_other_families_load_their_stored_codes_too(family, request, tmp_path):
    """Qwen2.5-VL (q/k/v biases, the fused Fp8Linear carries them) and DeepSeek-VL (two towers left
    in full precision): the codes multiplied out, and kept as stored, against the reference weights."""
    model = tmp_path / "fp8"
    shutil.copytree(request.getfixturevalue(family), model)
    store_fp8(model)
    spec = preflight(model)
    plain = load_decoder(preflight(multiplied_out(model, tmp_path / "plain")), CPU, torch.float32)
    ours = load_decoder(spec, CPU, torch.float32)
    for name, param in plain.state_dict().items():
        assert torch.equal(ours.state_dict()[name], param), name
    kept = load_decoder(spec, CPU, torch.float32, keep_fp8=True)
    qkv = kept.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear)
    assert (qkv.bias is not None) == spec.text.qkv_bias
    x = torch.randn(3, spec.text.hidden)
    want = plain.layers[0].self_attn.qkv_proj(x)
    assert torch.allclose(qkv(x), want, rtol=1e-4, atol=1e-5)


def test_a_fused_group_stored_half_in_fp8_is_named_before_loading(stored_copy):
    tensors = load_file(stored_copy / SHARD)
    key = _text_key("layers.1.self_attn.k_proj.weight")
    tensors[key] = tensors[key].float() * tensors.pop(key + "_scale")  # k in full precision, q and v in fp8
    save_file(tensors, stored_copy / SHARD)
    with pytest.raises(InvalidArgument) as err:
        preflight(stored_copy)
    q = _text_key("layers.1.self_attn.q_proj.weight")
    assert err.value.message == (
        f"{stored_copy / SHARD}: {q} is stored in fp8 but {key} is not; vlmesh runs q/k/v as one projection, "
        "stored one way"
    )


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_the_language_model_handed_to_vllm_is_dense(stored_copy, tmp_path, where):
    """--llm-engine vllm: the decoder vLLM loads holds the codes multiplied out, and its config
    says nothing of a stored quantization (vLLM would look for e4m3 codes and scales)."""
    from services.llm.vllm_engine import export_text_model

    if where == "text_config":
        raw = _config(stored_copy)
        raw["text_config"]["quantization_config"] = raw.pop("quantization_config")
        (stored_copy / "config.json").write_text(json.dumps(raw))
    out = export_text_model(preflight(stored_copy), torch.float32, root=tmp_path / "export")
    assert "quantization_config" not in _config(out)
    weights = load_file(out / SHARD)
    assert weights and all(t.dtype == torch.float32 for t in weights.values())
    assert not any(k.endswith("_scale") for k in weights)
