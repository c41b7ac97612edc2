"""Fuzzing the public API: a fixed corpus of known-bad pictures, then `hypothesis` over the
GenerateRequest proto, image bytes, sampling values, metadata and raw wire bytes.

Every case must end with a clear status: OK, or one of the statuses the API documents for bad
input and load (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND, UNAUTHENTICATED,
FAILED_PRECONDITION, OUT_OF_RANGE). Never UNKNOWN or INTERNAL (an unhandled error), never
UNAVAILABLE (a crash) or DEADLINE_EXCEEDED (a hang). Afterwards every server is SERVING and a
good request is answered.
"""

from __future__ import annotations

import io
import math
from collections import Counter

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.helpers import image_bytes
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

GOOD_IMAGE = image_bytes(7)
CLEAR = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}
CASES = {"n": 0}
SEEN: Counter = Counter()  # final statuses of the generated cases, printed at the end (-s)


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def bad_pictures() -> dict[str, bytes]:
    """Pictures that have broken image servers: bombs, odd modes, odd containers, cut files."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90
    frames = [Image.new("P", (20, 20), i) for i in range(3)]
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return {
        "bomb 20000x20000 png": encoded(Image.new("1", (20000, 20000)), "PNG"),  # 50 KB, 400 M pixels
        "bomb 1x3000000 png": encoded(Image.new("L", (1, 3_000_000)), "PNG"),
        "1x1": encoded(Image.new("RGB", (1, 1)), "PNG"),
        "16-bit gray png": encoded(Image.fromarray(rng.integers(0, 65535, (30, 30), dtype=np.uint16)), "PNG"),
        "32-bit int tiff": encoded(Image.fromarray(rng.integers(0, 2**31, (30, 30), dtype=np.int32)), "TIFF"),
        "float tiff": encoded(Image.fromarray(rng.random((30, 30), dtype=np.float32)), "TIFF"),
        "cmyk jpeg": encoded(rgb.convert("CMYK"), "JPEG"),
        "palette png": encoded(rgb.convert("P"), "PNG"),
        "palette with transparency": encoded(rgb.convert("P"), "PNG", transparency=0),
        "la png": encoded(rgb.convert("LA"), "PNG"),
        "rgba webp": encoded(rgb.convert("RGBA"), "WEBP"),
        "1-bit bmp": encoded(rgb.convert("1"), "BMP"),
        "animated gif": gif.getvalue(),
        "exif-rotated jpeg": encoded(rgb, "JPEG", exif=exif.tobytes()),
        "truncated jpeg": encoded(rgb, "JPEG")[:300],
        "truncated png": GOOD_IMAGE[: len(GOOD_IMAGE) // 2],
        "png header only": GOOD_IMAGE[:8],
        "jpeg magic then noise": b"\xff\xd8\xff\xe0" + rng.bytes(500),
        "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
        "html": b"<html><body>not a picture</body></html>",
        "zeros": bytes(4096),
        "ico": encoded(rgb, "ICO"),
    }


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as ch:
        yield gateway_pb2_grpc.GatewayStub(ch), ch


def status_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        code = err.code()
        assert code in CLEAR, f"{code}: {err.details()}"
        assert err.details(), f"{code} without a message"
    else:
        code = grpc.StatusCode.OK
    SEEN[code.name] += 1
    return code


def assert_all_serving(mesh, stub) -> None:
    for name in ("gateway", "vision", "llm"):
        with grpc.insecure_channel(mesh.target(name)) as ch:
            got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, name
    ok = stub.GenerateUnary(
        gateway_pb2.GenerateRequest(
            images=[pb.Image(data=GOOD_IMAGE)], prompt="What?", sampling=pb.SamplingParams(max_tokens=2)
        ),
        timeout=30,
    )
    assert ok.usage.output_tokens >= 1


@pytest.mark.parametrize("name", sorted(bad_pictures()))
def test_known_bad_pictures_get_a_clear_status(stub, name):
    gateway, _ = stub
    data = bad_pictures()[name]
    req = gateway_pb2.GenerateRequest(
        images=[pb.Image(data=data)], prompt="What?", sampling=pb.SamplingParams(max_tokens=2)
    )
    code = status_of(lambda: gateway.GenerateUnary(req, timeout=30))
    if name.startswith(("bomb", "truncated", "png header", "jpeg magic", "svg", "html", "zeros")):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, name


def small_pictures():
    modes = st.sampled_from(["RGB", "L", "P", "RGBA", "CMYK", "1", "I;16", "LA"])
    formats = st.sampled_from(["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])

    @st.composite
    def picture(draw):
        w, h = draw(st.integers(1, 64)), draw(st.integers(1, 64))
        mode, fmt = draw(modes), draw(formats)
        seed = draw(st.integers(0, 2**16))
        arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
        try:
            data = encoded(Image.fromarray(arr).convert(mode), fmt)
        except (OSError, ValueError, KeyError):  # this format cannot hold this mode
            data = encoded(Image.fromarray(arr), "PNG")
        cut = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, len(data))))
        return data if cut is None else data[:cut]

    return picture()


FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 3.4e38]),
)
TEXT = st.text(max_size=80)
wild_sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1)),
    temperature=FLOATS,
    top_p=FLOATS,
    seed=st.integers(0, 2**64 - 1),
    stop=st.lists(TEXT, max_size=3),
    min_tokens=st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)),
    ignore_eos=st.booleans(),
)
# Half the cases sample sanely, so that odd pictures, prompts and metadata reach the model too.
sampling = st.one_of(
    st.builds(pb.SamplingParams, max_tokens=st.integers(1, 3), temperature=st.floats(0, 2)), wild_sampling
)
images = st.lists(
    st.builds(
        pb.Image,
        data=st.one_of(small_pictures(), st.binary(max_size=200), st.just(GOOD_IMAGE)),
        mime_type=st.sampled_from(["", "", "image/png", "image/jpeg", "text/plain", "image/", "x"]),
    ),
    min_size=1,
    max_size=1,
) | st.lists(
    st.builds(
        pb.Image,
        data=st.one_of(small_pictures(), st.binary(max_size=200), st.just(GOOD_IMAGE)),
        mime_type=st.sampled_from(["", "image/png", "image/jpeg", "text/plain", "image/", "x"]),
    ),
    max_size=2,
)
messages = st.lists(
    st.builds(
        pb.ChatMessage,
        role=st.sampled_from(["user", "system", "assistant", "", "root"]),
        content=st.lists(
            st.one_of(st.builds(pb.ContentPart, text=TEXT), st.builds(pb.ContentPart, image=st.booleans())),
            max_size=3,
        ),
    ),
    max_size=3,
)
requests = st.builds(
    gateway_pb2.GenerateRequest,
    images=images,
    prompt=st.one_of(TEXT, st.just("What is in the image?"), st.just("Why?"), st.just("<image> look")),
    sampling=sampling,
    model=st.sampled_from(["", "", "", "x", "gpt-17"]),
    messages=st.one_of(st.just([]), st.just([]), st.just([]), messages),
)
printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
metadata = st.lists(
    st.tuples(
        st.sampled_from(["qos-level", "x-model-variant", "authorization", "x-tenant", "grpc-timeout-ish"]),
        st.one_of(printable, st.sampled_from(["realtime", "standard", "best-effort", "Bearer ", "Bearer x"])),
    ),
    max_size=3,
)


@settings(
    max_examples=1000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(req=requests, md=metadata, streamed=st.booleans())
def test_generated_requests_get_a_clear_status(stub, req, md, streamed):
    gateway, _ = stub
    CASES["n"] += 1
    if streamed:
        status_of(lambda: list(gateway.Generate(req, metadata=md, timeout=30)))
    else:
        status_of(lambda: gateway.GenerateUnary(req, metadata=md, timeout=30))


def with_invalid_utf8(prompt_bytes: bytes) -> bytes:
    """A GenerateRequest whose prompt (field 3) holds bytes that are not UTF-8, written by hand
    (protobuf refuses to serialise such a string)."""
    head = gateway_pb2.GenerateRequest(images=[pb.Image(data=GOOD_IMAGE)]).SerializeToString()
    return head + b"\x1a" + bytes([len(prompt_bytes)]) + prompt_bytes


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=st.one_of(
        st.binary(max_size=300), st.binary(min_size=1, max_size=100).map(lambda b: with_invalid_utf8(b"\xff" + b[:99]))
    )
)
def test_raw_wire_bytes_get_a_clear_status(stub, raw):
    _, channel = stub
    CASES["n"] += 1
    call = channel.unary_unary(
        "/vlmesh.v1.Gateway/GenerateUnary",
        request_serializer=None,
        response_deserializer=gateway_pb2.GenerateResult.FromString,
    )
    status_of(lambda: call(raw, timeout=30))


def test_an_oversized_message_is_refused_with_resource_exhausted(stub):
    gateway, _ = stub
    huge = gateway_pb2.GenerateRequest(images=[pb.Image(data=bytes(70 * 2**20))], prompt="What?")
    assert status_of(lambda: gateway.GenerateUnary(huge, timeout=30)) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_every_server_serves_after_the_fuzzing(mesh, stub):
    assert CASES["n"] >= 1100, f"only {CASES['n']} generated cases ran"
    print(f"fuzzing: {CASES['n']} generated cases, statuses of every case run {dict(SEEN)}")
    assert_all_serving(mesh, stub[0])
