"""The gateway's access log and its warm-up key, on the real servicer in this process.

A real grpc.aio GatewayServicer in front of a fake vision and a fake llm (as in test_servicer.py):
each request, however it ends (answered, refused at admission or auth, invalid, a failed peer,
cancelled, past its deadline), writes exactly one access-log line with its final status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import grpc
import pytest

from services.common.config import WARMUP_KEY_ENV
from services.common.logs import JsonFormatter
from services.common.qos import QosLevel
from services.gateway import access_log
from services.gateway.config import AdmissionConfig, GatewayConfig
from services.gateway.server import load_tenants
from services.gateway.servicer import GatewayServicer
from services.gateway.tenants import WARMUP_TENANT_ID, TenantRegistry
from tests.helpers import FakeVision, eventually, local_server
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc, llm_pb2, llm_pb2_grpc, vision_pb2, vision_pb2_grpc

HANG = "hang"
INFO = pb.ServiceInfo(service="llm", model_id="tiny", max_context=512, image_tokens=16, default_max_tokens=32)
REF = pb.TensorRef(transport=pb.TRANSPORT_INLINE, shape=[16, 32], dtype=pb.DTYPE_FLOAT32, inline_data=b"\0" * 2048)
USAGE = pb.Usage(prompt_tokens=7, image_tokens=16, output_tokens=3)
STREAM = [
    llm_pb2.LlmGenerateResponse(text="he", token_ids=[1, 2]),
    llm_pb2.LlmGenerateResponse(text="y", token_ids=[3], finish_reason=pb.FINISH_REASON_LENGTH, usage=USAGE),
]
TENANTS = {
    "tenants": [
        {"id": "acme", "api_keys": ["sk-acme"], "max_qos": "standard", "requests_per_second": 0.001, "burst": 1}
    ]
}
WARM_KEY = "warm-3f9a"
ACCESS_LOGGER = access_log.__name__


class FakeLlm(llm_pb2_grpc.LlmServicer):
    """Info answers INFO; Generate plays `script` ((code, details) aborts there; HANG waits for the cancel)."""

    def __init__(self, script=STREAM) -> None:
        self.script = list(script)
        self.generates = 0

    async def Info(self, request, context):
        return INFO

    async def Generate(self, request, context):
        self.generates += 1
        for step in self.script:
            if step == HANG:
                await asyncio.Event().wait()
            if isinstance(step, tuple):
                await context.abort(*step)
            yield step


@contextlib.asynccontextmanager
async def gateway(llm=None, vision=None, **options):
    """A stub of the real GatewayServicer (given `options`) in front of the fakes; yields (stub, servicer)."""
    vision = vision or FakeVision(vision_pb2.EncodeResponse(features=[REF]))
    async with (
        local_server(vision_pb2_grpc.add_VisionServicer_to_server, vision) as vision_target,
        local_server(llm_pb2_grpc.add_LlmServicer_to_server, llm or FakeLlm()) as llm_target,
    ):
        servicer = GatewayServicer(vision_target, llm_target, max_images=1, **options)
        async with local_server(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer) as target:
            async with grpc.aio.insecure_channel(target) as channel:
                yield gateway_pb2_grpc.GatewayStub(channel), servicer


def request(**fields) -> gateway_pb2.GenerateRequest:
    values = {"request_id": "r-1", "images": [pb.Image(data=b"pic")], "prompt": "What is it?"}
    return gateway_pb2.GenerateRequest(**{**values, **fields})


def registry(tmp_path, internal_key: str | None = WARM_KEY) -> TenantRegistry:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    return TenantRegistry.load(path, internal_key=internal_key)


def bearer(key: str, qos: str = "standard"):
    return (("authorization", f"Bearer {key}"), ("qos-level", qos))


@pytest.fixture
def lines(caplog):
    """The access-log lines written so far, as the JSON the services print."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    formatter = JsonFormatter("gateway")
    return lambda: [json.loads(formatter.format(r)) for r in caplog.records if r.name == ACCESS_LOGGER]


async def status_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


def test_an_answered_request_writes_one_line_with_its_fields(lines):
    async def main():
        async with gateway() as (stub, _):
            msgs = [m async for m in stub.Generate(request(), metadata=(("qos-level", "realtime"),), timeout=10)]
            assert await eventually(lambda: len(lines()) == 1)
            await stub.GenerateUnary(request(request_id="r-2"), timeout=10)
            assert await eventually(lambda: len(lines()) == 2)
            await asyncio.sleep(0.1)  # nothing more comes
            return msgs

    msgs = asyncio.run(main())
    assert msgs[-1].usage.output_tokens == 3
    streamed, unary = lines()
    assert streamed["msg"].startswith("Generate OK request=r-1 tenant=anonymous qos=realtime output_tokens=3 ms=")
    fields = {k: streamed[k] for k in ("request.id", "tenant.id", "qos.level", "status", "output_tokens", "method")}
    assert fields == {
        "request.id": "r-1",
        "tenant.id": "anonymous",
        "qos.level": "realtime",
        "status": "OK",
        "output_tokens": 3,
        "method": "Generate",
    }
    assert streamed["level"] == "info" and streamed["logger"] == ACCESS_LOGGER and 0 < streamed["ms"] < 10_000
    assert (unary["method"], unary["request.id"], unary["status"], unary["qos.level"]) == (
        "GenerateUnary",
        "r-2",
        "OK",
        "standard",
    )
    assert unary["output_tokens"] == 3


@pytest.mark.parametrize("method", ["Generate", "GenerateUnary"])
@pytest.mark.parametrize(
    "case",
    ["admission", "unauthenticated", "invalid", "llm-down", "llm-down-after-a-message", "vision-down"],
)
def test_a_refused_or_failed_request_writes_one_line_with_its_status(lines, tmp_path, method, case):
    llm, vision, options, fields, metadata = FakeLlm(), None, {}, {}, bearer("sk-acme")
    if case == "admission":  # no room for standard at all
        limits = {QosLevel.REALTIME: 1, QosLevel.STANDARD: 0, QosLevel.BEST_EFFORT: 0}
        options["admission"] = AdmissionConfig(max_in_flight=limits)
        want = ("RESOURCE_EXHAUSTED", "anonymous", "standard", 0)
    elif case == "unauthenticated":
        options["tenants"] = registry(tmp_path)
        metadata = (("qos-level", "standard"),)
        want = ("UNAUTHENTICATED", None, None, 0)
    elif case == "invalid":
        fields["prompt"] = "  "
        want = ("INVALID_ARGUMENT", "anonymous", "standard", 0)
    elif case == "vision-down":
        vision = FakeVision(encode_error=(grpc.StatusCode.UNAVAILABLE, "vision is draining"))
        want = ("UNAVAILABLE", "anonymous", "standard", 0)
    else:
        before = STREAM[:1] if case.endswith("after-a-message") else []
        llm = FakeLlm([*before, (grpc.StatusCode.UNAVAILABLE, "llm is draining")])
        want = ("UNAVAILABLE", "anonymous", "standard", 2 if before else 0)

    async def main():
        async with gateway(llm, vision, **options) as (stub, _):
            if method == "Generate":
                code = await status_of(_drain(stub.Generate(request(**fields), metadata=metadata, timeout=10)))
            else:
                code = await status_of(stub.GenerateUnary(request(**fields), metadata=metadata, timeout=10))
            assert await eventually(lambda: len(lines()) >= 1)
            await asyncio.sleep(0.1)
            return code

    code = asyncio.run(main())
    assert code.name == want[0]
    (line,) = lines()
    got = (line["status"], line["tenant.id"], line["qos.level"], line["output_tokens"])
    assert got == want
    assert (line["method"], line["request.id"]) == (method, "r-1")


async def _drain(call) -> None:
    async for _ in call:
        pass


@pytest.mark.parametrize("ending", ["cancel", "deadline"])
def test_a_cancelled_or_expired_request_writes_one_line(lines, ending):
    llm = FakeLlm([STREAM[0], HANG])

    async def main():
        async with gateway(llm) as (stub, _):
            call = stub.Generate(request(), timeout=10 if ending == "cancel" else 0.5)
            assert (await call.read()).token_ids == [1, 2]
            if ending == "cancel":
                call.cancel()
            else:
                assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await eventually(lambda: len(lines()) >= 1)
            await asyncio.sleep(0.1)

    asyncio.run(main())
    (line,) = lines()
    want = "CANCELLED" if ending == "cancel" else "DEADLINE_EXCEEDED"
    assert (line["status"], line["output_tokens"], line["method"]) == (want, 2, "Generate")


def test_no_access_log_writes_none(lines):
    async def main():
        async with gateway(access_log=False) as (stub, _):
            await stub.GenerateUnary(request(), timeout=10)
            assert (
                await status_of(stub.GenerateUnary(request(prompt=" "), timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
            )

    asyncio.run(main())
    assert lines() == []


def test_the_flag_is_on_by_default_and_off_with_no_access_log():
    from services.common.flags import to_argv
    from services.gateway.config import parse

    assert GatewayConfig().access_log is True and parse([]).access_log is True
    off = parse(["--no-access-log"])
    assert off.access_log is False and parse(to_argv(off)) == off
    assert parse(["--access-log"]).access_log is True


def test_the_warmup_key_is_an_internal_tenant_without_limits(lines, tmp_path):
    """acme's burst is 1 and its max class standard; the warm-up key gets realtime, again and again,
    and leaves acme's bucket as it was."""
    tenants = registry(tmp_path)

    async def main():
        async with gateway(tenants=tenants) as (stub, _):
            for i in range(3):
                await stub.GenerateUnary(
                    request(request_id=f"w-{i}"), metadata=bearer(WARM_KEY, "realtime"), timeout=10
                )
            await stub.GenerateUnary(request(request_id="a-1"), metadata=bearer("sk-acme"), timeout=10)  # its one
            limited = stub.GenerateUnary(request(request_id="a-2"), metadata=bearer("sk-acme"), timeout=10)
            assert await status_of(limited) == grpc.StatusCode.RESOURCE_EXHAUSTED
            for near in (WARM_KEY + "x", WARM_KEY[:-1], WARM_KEY.upper()):
                assert await status_of(stub.GenerateUnary(request(), metadata=bearer(near), timeout=10)) == (
                    grpc.StatusCode.UNAUTHENTICATED
                )
            assert await eventually(lambda: len(lines()) == 8)

    asyncio.run(main())
    got = [(line["request.id"], line["tenant.id"], line["qos.level"], line["status"]) for line in lines()[:5]]
    assert got == [
        ("w-0", WARMUP_TENANT_ID, "realtime", "OK"),
        ("w-1", WARMUP_TENANT_ID, "realtime", "OK"),
        ("w-2", WARMUP_TENANT_ID, "realtime", "OK"),
        ("a-1", "acme", "standard", "OK"),
        ("a-2", "acme", "standard", "RESOURCE_EXHAUSTED"),
    ]


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_without_a_warmup_key_in_the_environment_no_internal_key_is_accepted(tmp_path, value):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    cfg = GatewayConfig(tenants=str(path))
    environ = {} if value is None else {WARMUP_KEY_ENV: value}
    tenants = load_tenants(cfg, environ)
    for header in ("Bearer ", "Bearer", "Bearer  ", f"Bearer {WARM_KEY}"):
        with pytest.raises(Exception, match="API key") as err:
            tenants.authenticate([("authorization", header)])
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert load_tenants(cfg, {WARMUP_KEY_ENV: WARM_KEY}).authenticate(bearer(WARM_KEY)).id == WARMUP_TENANT_ID
    assert load_tenants(GatewayConfig(), {WARMUP_KEY_ENV: WARM_KEY}) is None  # auth off: nothing to authenticate
