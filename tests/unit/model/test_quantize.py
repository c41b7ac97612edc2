"""Weight-only quantization (torchao): int8 on the CPU, clear errors where a kind cannot run (fp8:
tests/unit/model/test_fp8.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from services.llm.config import NativeEngineConfig
from services.model import shapes
from services.model.quantize import quantize_decoder, weight_bytes
from tests.helpers import ROOT, Parts

CPU = torch.device("cpu")


def test_int8_keeps_the_layers_close_and_stores_a_quarter_of_the_bytes():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 128, bias=False))
    x = torch.randn(8, 256)
    want = layers(x)
    before = weight_bytes(layers)
    quantize_decoder(layers, "int8", CPU, torch.float32)
    got = layers(x)
    assert type(layers[0]).__name__ == "Int8Linear"  # torchao's data, as plain tensors
    assert layers[0].qdata.dtype == torch.int8 and type(layers[0].qdata) is nn.Parameter
    assert weight_bytes(layers) < before / 3  # int8 data and one fp32 scale per output channel
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert not torch.equal(got, want)  # it did quantize


def test_none_changes_nothing_and_bad_kinds_say_what_to_do():
    layer = nn.Linear(128, 128)
    weight = layer.weight
    quantize_decoder(layer, "none", CPU, torch.float32)
    assert layer.weight is weight
    with pytest.raises(ValueError, match=r"int4 needs a CUDA GPU and bf16.*use --quantize int8"):
        quantize_decoder(layer, "int4", CPU, torch.float32)
    with pytest.raises(ValueError, match="use one of none, int8, int4, fp8"):
        quantize_decoder(layer, "fp16", CPU, torch.float32)


def test_int4_takes_the_largest_group_that_divides_every_width():
    from services.model.quantize import int4_group

    assert int4_group({4096, 11008}) == 128  # Llama-7B
    assert int4_group({192, 512}) == 64  # the demo model
    assert int4_group({96, 4096}) == 32
    with pytest.raises(ValueError, match=r"groups 32, 64 or 128 input channels; this model has layers of \[200, 256\]"):
        int4_group({256, 200})


def test_the_demo_model_in_int8_still_sees():
    """The native engine with --quantize int8 on the CPU answers the demo task as fp32 does."""
    pics = [shapes.render(np.random.default_rng([5150, i])) for i in range(24)]
    prompts = list(shapes.PROMPTS)
    jobs = [(shapes.encode(p.image, "PNG"), prompts[i % len(prompts)]) for i, p in enumerate(pics)]
    parts = Parts(ROOT / "models" / "demo", max_batch=8, native=NativeEngineConfig(quantize="int8"))
    try:
        pairs = [parts.request(data, prompt, max_tokens=8) for data, prompt in jobs]
        parts.run(*pairs)
    finally:
        parts.engine.stop()
    assert type(parts.engine.runner.model.layers[0].mlp.down_proj).__name__ == "Int8Linear"
    right = sum(box["text"] == pic.answer(prompt) for (_, box), pic, (_, prompt) in zip(pairs, pics, jobs, strict=True))
    print(f"int8 demo model: {right} of {len(jobs)} right")
    assert right >= 22, f"{right} of {len(jobs)} right in int8"


def test_the_int8_kernel_op_compiles_into_one_graph():
    """Dynamo must see the registered op, not its registration: a graph break at every projection
    made each decode bucket five graphs to compile (20-90 s a bucket on the H200)."""
    from services.model import int8_mm

    def f(x, q, s):
        return int8_mm.linear(torch.relu(x), q, s).sin()

    x, q, s = torch.randn(4, 8), torch.randint(-8, 8, (6, 8), dtype=torch.int8), torch.rand(6)
    gm, _ = torch._dynamo.export(f)(x, q, s)  # raises on a graph break
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.vlmesh.byte_weight_linear.default in ops


def test_quantizing_leaves_inductor_settings_alone():
    """torchao's default turns on coordinate-descent tuning process-wide (minutes of warm-up).
    Both start off here, whatever an earlier quantization in this process left them at. (The
    config's own `patch`, not pytest's monkeypatch: that one deletes a config module's entries on
    undo, which broke every later compile in the process.)"""
    import torch._inductor.config as inductor

    with inductor.patch(coordinate_descent_tuning=False, coordinate_descent_check_all_directions=False):
        quantize_decoder(nn.Sequential(nn.Linear(128, 64, bias=False)), "int8", CPU, torch.float32)
        assert not inductor.coordinate_descent_tuning and not inductor.coordinate_descent_check_all_directions


def test_int4_codes_unpack_tinygemms_weight_and_dequantize_to_it():
    """The int4 prompt path's codes (Int4Linear.nibbles) come from tinygemm's dequantized weight;
    on the CPU the weight is made here by tinygemm's formula, w = (q - 8) * scale + zero."""
    from services.model.qlinear import int4_codes, int4_dequantize

    gen = torch.Generator().manual_seed(3)
    out, k, group = 6, 512, 128
    q = torch.randint(0, 16, (out, k), generator=gen)
    scale = (torch.rand(k // group, out, generator=gen) * 0.02).to(torch.bfloat16)
    scale[1, 2] = 0  # a constant group: every code reads as the zero point
    zero = (torch.randn(k // group, out, generator=gen) * 0.05).to(torch.bfloat16)
    sz = torch.stack((scale, zero), dim=-1)  # [groups, out, 2], as torchao packs it
    s, z = scale.float().t().repeat_interleave(group, 1), zero.float().t().repeat_interleave(group, 1)
    dense = ((q - 8) * s + z).to(torch.bfloat16)
    nibbles = int4_codes(dense, sz, group)
    assert nibbles.shape == (out, k // 2) and nibbles.dtype == torch.uint8
    got = torch.stack((nibbles >> 4, nibbles & 15), dim=-1).view(out, k).long()
    live = s != 0
    assert torch.equal(got[live], q[live])
    assert (got[~live] == 8).all()
    assert torch.equal(int4_dequantize(nibbles, sz, group), dense)
