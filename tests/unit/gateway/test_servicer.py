"""The gateway servicer in this process: a real grpc.aio server in front of a fake vision and a fake llm.

The fakes record what the gateway sends them (requests and their metadata) and answer from a
script, so each test checks one thing the gateway owes its peers or its client: the
Encode and Generate requests, qos-level propagation, the relay, the merged timings, and
the lease release when the llm never read the features.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from services.common.qos import QosLevel
from services.common.validation import check_sampling
from services.gateway.config import AdmissionConfig
from services.gateway.servicer import GatewayServicer
from tests.helpers import FakeVision, eventually, local_server
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc, llm_pb2, llm_pb2_grpc, vision_pb2, vision_pb2_grpc

SHM, INLINE = pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE
HANG = "hang"  # in a script: wait until cancelled
INFO = pb.ServiceInfo(
    service="llm",
    model_id="tiny-llava",
    host_id="host-a/0000",
    gpu_uuid="GPU-1234",
    transports=[SHM, INLINE],
    max_context=512,
    image_tokens=16,
    default_max_tokens=32,
)
REFS = [
    pb.TensorRef(transport=SHM, arena_id="arena-1", shape=[16, 32], dtype=pb.DTYPE_FLOAT32, lease=pb.Lease(id=11)),
    pb.TensorRef(transport=INLINE, shape=[16, 32], dtype=pb.DTYPE_FLOAT32, inline_data=b"\0" * 2048),
    pb.TensorRef(transport=SHM, arena_id="arena-1", shape=[16, 32], dtype=pb.DTYPE_FLOAT32, lease=pb.Lease(id=12)),
]
LEASES = [11, 12]  # the inline reference holds none
VISION_TIMINGS = pb.StageTimings(preprocess_ms=5, vision_queue_ms=2, vision_ms=7, handoff_ms=1)
LLM_TIMINGS = pb.StageTimings(handoff_ms=3, llm_queue_ms=4, prefill_ms=6, decode_ms=8)
USAGE = pb.Usage(prompt_tokens=7, image_tokens=48, output_tokens=4)
STREAM = [
    llm_pb2.LlmGenerateResponse(text="he", token_ids=[1, 2]),
    llm_pb2.LlmGenerateResponse(text="llo", token_ids=[3]),
    llm_pb2.LlmGenerateResponse(
        text="!", token_ids=[4], finish_reason=pb.FINISH_REASON_LENGTH, usage=USAGE, timings=LLM_TIMINGS
    ),
]
SAMPLING = pb.SamplingParams(max_tokens=4, top_p=0.9)  # temperature unset: the gateway fills it in
PICTURES = [pb.Image(data=b"picture-1", mime_type="image/png"), pb.Image(data=b"picture-2")]
REALTIME = (("qos-level", "realtime"),)


class FakeLlm(llm_pb2_grpc.LlmServicer):
    """Info answers INFO; Generate records the request and its metadata, then plays `script`.

    A (code, details) step aborts the call there; HANG waits until the call is cancelled.
    """

    def __init__(self, script=STREAM) -> None:
        self.script = list(script)
        self.info_calls = 0
        self.generates: list[tuple[llm_pb2.LlmGenerateRequest, dict[str, str]]] = []
        self.cancelled = False

    async def Info(self, request, context):
        self.info_calls += 1
        return INFO

    async def Generate(self, request, context):
        self.generates.append((request, dict(context.invocation_metadata())))
        try:
            for step in self.script:
                if step == HANG:
                    await asyncio.Event().wait()
                if isinstance(step, tuple):
                    await context.abort(*step)
                yield step
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def fake_vision(**options) -> FakeVision:
    return FakeVision(vision_pb2.EncodeResponse(features=REFS, timings=VISION_TIMINGS), **options)


@contextlib.asynccontextmanager
async def gateway_service(vision: FakeVision, llm: FakeLlm, admission: AdmissionConfig | None = None, tenants=None):
    """(stub, servicer): the real GatewayServicer on a local port, in front of the two fakes."""
    async with (
        local_server(vision_pb2_grpc.add_VisionServicer_to_server, vision) as vision_target,
        local_server(llm_pb2_grpc.add_LlmServicer_to_server, llm) as llm_target,
    ):
        servicer = GatewayServicer(vision_target, llm_target, max_images=2, tenants=tenants, admission=admission)
        async with local_server(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer) as target:
            async with grpc.aio.insecure_channel(target) as channel:
                yield gateway_pb2_grpc.GatewayStub(channel), servicer


def request(**fields) -> gateway_pb2.GenerateRequest:
    values = {"request_id": "g-1", "images": PICTURES, "prompt": "What is in the image?", "sampling": SAMPLING}
    values.update(fields)
    return gateway_pb2.GenerateRequest(**values)


def in_flight(servicer: GatewayServicer) -> int:
    return sum(servicer.admission.in_flight.values())


def check_final_timings(t: pb.StageTimings) -> None:
    """The vision's stages, the llm's, the hand-off's two halves summed, and the gateway's own."""
    assert (t.preprocess_ms, t.vision_queue_ms, t.vision_ms) == (5, 2, 7)
    assert t.handoff_ms == pytest.approx(1 + 3)
    assert (t.llm_queue_ms, t.prefill_ms, t.decode_ms) == (4, 6, 8)
    assert t.admission_ms > 0 and t.ttft_ms > t.admission_ms and t.total_ms >= t.ttft_ms


def test_generate_encodes_then_relays_the_llm_stream_with_merged_timings():
    vision, llm = fake_vision(), FakeLlm()

    async def main():
        async with gateway_service(vision, llm) as (stub, servicer):
            msgs = [m async for m in stub.Generate(request(), metadata=REALTIME, timeout=10)]
            assert in_flight(servicer) == 0
            return msgs, dict(servicer.admission.stage_s)

    msgs, averages = asyncio.run(main())
    # What the vision got: the pictures, the request id, the llm as consumer (from its Info), the QoS.
    ((encode, encode_md),) = vision.encodes
    assert encode.request_id == "g-1"
    assert list(encode.images) == PICTURES
    assert encode.consumer == pb.ConsumerInfo(host_id=INFO.host_id, gpu_uuid=INFO.gpu_uuid, accept=INFO.transports)
    assert encode_md["qos-level"] == "realtime"
    # What the llm got: the vision's references as they came, the sampling normalised once.
    ((gen, gen_md),) = llm.generates
    assert (gen.request_id, gen.prompt) == ("g-1", "What is in the image?")
    assert list(gen.image_features) == REFS
    assert gen.sampling == check_sampling(SAMPLING, INFO.max_context).to_pb()
    assert gen.sampling.HasField("temperature") and gen.sampling.temperature == 0
    assert gen_md["qos-level"] == "realtime"
    # What the client got.
    assert [(m.request_id, m.text, list(m.token_ids)) for m in msgs] == [
        ("g-1", "he", [1, 2]),
        ("g-1", "llo", [3]),
        ("g-1", "!", [4]),
    ]
    assert [m.finish_reason for m in msgs] == [pb.FINISH_REASON_UNSPECIFIED] * 2 + [pb.FINISH_REASON_LENGTH]
    assert not msgs[0].HasField("timings") and not msgs[1].HasField("usage")
    assert msgs[-1].usage == USAGE
    check_final_timings(msgs[-1].timings)
    assert vision.releases == []  # the llm read the features: it releases them, not the gateway
    assert averages["prefill"] == pytest.approx(0.006) and averages["decode"] == pytest.approx(0.008 / 3)


def test_generate_unary_joins_the_stream_and_asks_the_llm_info_once():
    vision, llm = fake_vision(), FakeLlm()

    async def main():
        async with gateway_service(vision, llm) as (stub, _):
            first = await stub.GenerateUnary(request(request_id=""), timeout=10)
            second = await stub.GenerateUnary(request(request_id="u-2"), timeout=10)
            return first, second

    first, second = asyncio.run(main())
    assert llm.info_calls == 1
    assert (first.text, list(first.token_ids), first.finish_reason) == ("hello!", [1, 2, 3, 4], pb.FINISH_REASON_LENGTH)
    assert first.usage == USAGE
    check_final_timings(first.timings)
    # No request id given: one is made up, and the same one goes to both peers and back.
    assert len(first.request_id) == 32
    assert [r.request_id for r, _ in vision.encodes] == [r.request_id for r, _ in llm.generates]
    assert (
        [r.request_id for r, _ in llm.generates] == [first.request_id, "u-2"] == [first.request_id, second.request_id]
    )
    assert [md["qos-level"] for _, md in vision.encodes + llm.generates] == ["standard"] * 4


@pytest.mark.parametrize("after", [0, 1], ids=["before-any-message", "after-a-message"])
def test_an_llm_failure_releases_the_leases_only_if_it_never_answered(after):
    """Before its first message the llm may never have opened the features: the gateway hands them back."""
    failure = (grpc.StatusCode.UNAVAILABLE, "the llm is draining")
    vision, llm = fake_vision(release_delay_s=0.2), FakeLlm([*STREAM[:after], failure])

    async def main():
        async with gateway_service(vision, llm) as (stub, servicer):
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for msg in stub.Generate(request(), timeout=10):
                    got.append(msg)
            releases = list(vision.releases)  # the slow release was awaited before the status came
            await asyncio.sleep(0.3)
            assert in_flight(servicer) == 0
            return got, err.value, releases

    got, err, releases = asyncio.run(main())
    assert len(got) == after
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "llm" in err.details() and "draining" in err.details()
    assert releases == ([LEASES] if after == 0 else [])
    assert vision.releases == releases


@pytest.mark.parametrize("answered", [False, True], ids=["llm-silent", "llm-answered"])
def test_a_client_cancel_cancels_the_llm_call(answered):
    """The llm call ends with the client's; features it never answered for are handed back."""
    vision, llm = fake_vision(), FakeLlm([*STREAM[: int(answered)], HANG])

    async def main():
        async with gateway_service(vision, llm) as (stub, servicer):
            call = stub.Generate(request(), timeout=10)
            if answered:
                assert (await call.read()).token_ids == [1, 2]
            else:
                assert await eventually(lambda: llm.generates)
            call.cancel()
            assert await eventually(lambda: llm.cancelled), "the llm call outlived the client's"
            assert await eventually(lambda: in_flight(servicer) == 0)
            if not answered:
                assert await eventually(lambda: vision.releases)
            await asyncio.sleep(0.1)

    asyncio.run(main())
    assert vision.releases == ([] if answered else [LEASES])


def test_a_vision_refusal_passes_through_and_skips_the_llm():
    vision = fake_vision(encode_error=(grpc.StatusCode.RESOURCE_EXHAUSTED, "arena full (retry after 0.5s)"))
    llm = FakeLlm()

    async def main():
        async with gateway_service(vision, llm) as (stub, servicer):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GenerateUnary(request(), timeout=10)
            assert in_flight(servicer) == 0
            return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "arena full" in err.details()
    assert len(vision.encodes) == 1 and llm.generates == []


@pytest.mark.parametrize(
    "fields,metadata,code,details",
    [
        ({"model": "other-model"}, (), grpc.StatusCode.NOT_FOUND, "does not exist; this mesh serves 'tiny-llava'"),
        ({}, (("qos-level", "urgent"),), grpc.StatusCode.INVALID_ARGUMENT, "unknown qos-level 'urgent'"),
        ({"images": PICTURES + PICTURES[:1]}, (), grpc.StatusCode.INVALID_ARGUMENT, "at most 2"),
        ({"prompt": "  "}, (), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (
            {"sampling": pb.SamplingParams(max_tokens=512)},
            (),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.max_tokens=512 is out of range",
        ),
    ],
    ids=["model", "qos", "images", "prompt", "max-tokens"],
)
def test_bad_requests_are_refused_before_any_downstream_work(fields, metadata, code, details):
    vision, llm = fake_vision(), FakeLlm()

    async def main():
        async with gateway_service(vision, llm) as (stub, servicer):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GenerateUnary(request(**fields), metadata=metadata, timeout=10)
            assert in_flight(servicer) == 0
            return err.value

    err = asyncio.run(main())
    assert err.code() == code
    assert details in err.details()
    assert vision.encodes == [] and llm.generates == []


def test_a_full_class_is_refused_while_a_higher_one_is_admitted():
    """Limits of one in flight for standard and best-effort: the second standard request is refused."""
    limits = AdmissionConfig(max_in_flight={QosLevel.REALTIME: 2, QosLevel.STANDARD: 1, QosLevel.BEST_EFFORT: 1})
    vision, llm = fake_vision(), FakeLlm([STREAM[0], HANG])

    async def main():
        async with gateway_service(vision, llm, limits) as (stub, servicer):
            hanging = stub.Generate(request(), timeout=10)
            await hanging.read()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GenerateUnary(request(request_id="g-2"), timeout=10)
            urgent = stub.Generate(request(request_id="g-3"), metadata=REALTIME, timeout=10)
            await urgent.read()
            assert servicer.admission.in_flight == {QosLevel.REALTIME: 1, QosLevel.STANDARD: 1, QosLevel.BEST_EFFORT: 0}
            hanging.cancel()
            urgent.cancel()
            assert await eventually(lambda: in_flight(servicer) == 0)
            return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "full for standard" in err.details()
    assert [r.request_id for r, _ in llm.generates] == ["g-1", "g-3"]


def test_info_is_the_llm_s_under_the_gateway_s_name():
    llm = FakeLlm()

    async def main():
        async with gateway_service(fake_vision(), llm) as (stub, _):
            return [await stub.Info(pb.InfoRequest(), timeout=5) for _ in range(2)]

    first, second = asyncio.run(main())
    want = pb.ServiceInfo()
    want.CopyFrom(INFO)
    want.service = "gateway"
    assert first == second == want
    assert llm.info_calls == 1


def test_a_tenant_s_max_streams_holds_while_its_requests_run_and_frees_as_they_end(tmp_path):
    """Counted from admission to the end of the answer, however it ends; a request refused after
    the tenant check (a bad prompt) is not counted."""
    import json

    from services.gateway.tenants import TenantRegistry

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"id": "t", "api_keys": ["k"], "max_streams": 1, "burst": 10}]}))
    tenants = TenantRegistry.load(path)
    auth = (("authorization", "Bearer k"),)
    vision, llm = fake_vision(), FakeLlm([STREAM[0], HANG])

    async def main():
        async with gateway_service(vision, llm, tenants=tenants) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.GenerateUnary(request(prompt=" "), metadata=auth, timeout=10)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            hanging = stub.Generate(request(), metadata=auth, timeout=10)
            await hanging.read()
            with pytest.raises(grpc.aio.AioRpcError) as over:
                await stub.GenerateUnary(request(request_id="g-2"), metadata=auth, timeout=10)
            hanging.cancel()
            tenant = tenants.authenticate(auth)
            assert await eventually(lambda: tenant.in_flight == 0)
            llm.script = STREAM
            done = await stub.GenerateUnary(request(request_id="g-3"), metadata=auth, timeout=10)
            return over.value, done, tenant.in_flight

    over, done, left = asyncio.run(main())
    assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams" in over.details()
    assert done.usage.output_tokens == 4 and left == 0


def test_a_worker_that_fails_every_call_is_cut_off_probed_and_readmitted():
    """Two workers; the second's llm fails every call (INTERNAL): after 3 failures in a row it gets
    no requests, the first serves them all; healed, it is probed after its cool-down and takes
    requests again."""
    from services.gateway.workers import CLOSED, OPEN

    good, bad = FakeLlm(), FakeLlm([(grpc.StatusCode.INTERNAL, "broken")])

    async def main():
        async with (
            local_server(vision_pb2_grpc.add_VisionServicer_to_server, fake_vision()) as v1,
            local_server(vision_pb2_grpc.add_VisionServicer_to_server, fake_vision()) as v2,
            local_server(llm_pb2_grpc.add_LlmServicer_to_server, good) as l1,
            local_server(llm_pb2_grpc.add_LlmServicer_to_server, bad) as l2,
        ):
            servicer = GatewayServicer(f"{v1},{v2}", f"{l1},{l2}", max_images=2, breaker=(3, 0.3))
            async with local_server(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer) as target:
                async with grpc.aio.insecure_channel(target) as channel:
                    stub = gateway_pb2_grpc.GatewayStub(channel)
                    codes = []
                    for i in range(12):
                        try:
                            await stub.GenerateUnary(request(request_id=f"r{i}"), timeout=10)
                            codes.append("OK")
                        except grpc.aio.AioRpcError as err:
                            codes.append(err.code().name)
                    broken = servicer.workers.all[1].breaker
                    cut_off = (broken.state, len(bad.generates), len(good.generates))
                    bad.script = STREAM  # healed
                    await asyncio.sleep(0.35)
                    for i in range(4):
                        await stub.GenerateUnary(request(request_id=f"h{i}"), timeout=10)
                    return codes, cut_off, broken.state, len(bad.generates)

    codes, (state, bad_calls, good_calls), healed_state, bad_after = asyncio.run(main())
    assert state == OPEN and bad_calls == 3 and good_calls == 9, (state, bad_calls, good_calls)
    assert codes.count("OK") == 9 and len(codes) - codes.count("OK") == 3  # only the 3 that cut it off failed
    assert healed_state == CLOSED and bad_after > 3  # probed, answered, readmitted


def test_the_breaker_opens_after_failures_in_a_row_and_backs_off_after_a_failed_probe():
    from services.gateway.workers import CLOSED, HALF_OPEN, OPEN, Breaker

    now = [0.0]
    b = Breaker("w", failures=2, cooldown_s=1.0, clock=lambda: now[0])
    b.record(False)
    b.record(True)  # not in a row
    b.record(False)
    assert b.state == CLOSED and b.allows()
    b.record(False)
    assert b.state == OPEN and not b.allows() and b.wait_s() == 1.0
    now[0] = 1.0
    assert b.allows() and b.state == HALF_OPEN
    b.started()
    assert not b.allows()  # one probe at a time
    b.record(False)  # the probe failed: twice the cool-down
    assert b.state == OPEN and b.wait_s() == 2.0
    now[0] = 3.0
    assert b.allows()
    b.started()
    b.record(True)
    assert b.state == CLOSED and b.allows()


def test_overloaded_best_effort_work_of_a_tenant_that_allows_it_is_served_with_fewer_tokens(tmp_path):
    """degrade_max_tokens (services/gateway/degrade.py): over its budget with 100 tokens, within it
    with 2; the llm gets the cap and the tenant's max_prompt_tokens, and the answer says so."""
    import json

    from services.gateway.tenants import TenantRegistry

    path = tmp_path / "tenants.json"
    entry = {"id": "t", "api_keys": ["k"], "max_qos": "realtime", "burst": 10, "degrade_max_tokens": 2}
    path.write_text(json.dumps({"tenants": [{**entry, "max_prompt_tokens": 900}]}))
    tenants = TenantRegistry.load(path)
    auth = (("authorization", "Bearer k"),)
    long = pb.SamplingParams(max_tokens=100, ignore_eos=True)
    vision, llm = fake_vision(), FakeLlm([STREAM[0], HANG])

    async def main():
        async with gateway_service(vision, llm, AdmissionConfig(parallelism=1), tenants) as (stub, servicer):
            hanging = stub.Generate(request(), metadata=auth, timeout=10)
            await hanging.read()  # one batch ahead of the next request
            servicer.admission.stage_s.update(preprocess=0.0, vision=0.0, prefill=0.0, decode=1.0)  # 1 s a token
            llm.script = STREAM
            call = stub.GenerateUnary(
                request(request_id="g-2", sampling=long), metadata=(*auth, ("qos-level", "best-effort")), timeout=10
            )
            answer, metadata = await call, dict(await call.initial_metadata())
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # standard has no such cap: refused
                await stub.GenerateUnary(request(request_id="g-3", sampling=long), metadata=auth, timeout=10)
            hanging.cancel()
            return answer, metadata, refused.value

    answer, metadata, refused = asyncio.run(main())
    assert metadata["x-vlmesh-degraded"] == "max_tokens=2" and answer.usage.output_tokens == 4
    sent, _ = llm.generates[1]
    assert sent.request_id == "g-2" and sent.sampling.max_tokens == 2 and sent.max_prompt_tokens == 900
    assert llm.generates[0][0].max_prompt_tokens == 900
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "budget" in refused.details()


class CachingLlm(FakeLlm):
    """An llm that reads cached images: it serves content keys alone while `holds`, else refuses them."""

    def __init__(self, holds: bool = True) -> None:
        super().__init__()
        self.holds = holds

    async def Info(self, request, context):
        info = pb.ServiceInfo()
        info.CopyFrom(INFO)
        info.reads_cached_images = True
        return info

    async def Generate(self, request, context):
        if request.cached_image_keys and not self.holds:
            self.generates.append((request, dict(context.invocation_metadata())))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "send their features")
        async for msg in super().Generate(request, context):
            yield msg


def keyed_refs() -> list[pb.TensorRef]:
    refs = [pb.TensorRef(), pb.TensorRef()]
    for i, ref in enumerate(refs):
        ref.CopyFrom(REFS[i])
        ref.content_key = bytes([i + 1]) * 16
    return refs


def test_pictures_the_llm_has_read_go_as_content_keys_alone_and_come_back_with_features_when_evicted():
    """services/gateway/image_keys.py: the second request sends no Encode and no features; once the
    llm no longer holds them, it refuses the keys before any answer, the gateway encodes and sends
    the features, and the client sees one whole answer each time."""
    refs = keyed_refs()
    vision, llm = FakeVision(vision_pb2.EncodeResponse(features=refs, timings=VISION_TIMINGS)), CachingLlm()

    async def main():
        async with gateway_service(vision, llm) as (stub, _):
            answers = [await stub.GenerateUnary(request(request_id=f"g-{i}"), timeout=10) for i in range(2)]
            llm.holds = False
            answers.append(await stub.GenerateUnary(request(request_id="g-2"), timeout=10))
            other = request(request_id="g-3", images=[PICTURES[0], pb.Image(data=b"picture-3")])
            answers.append(await stub.GenerateUnary(other, timeout=10))  # one picture it never read: encoded
            return answers

    answers = asyncio.run(main())
    assert [a.text for a in answers] == ["hello!"] * 4
    assert [e.request_id for e, _ in vision.encodes] == ["g-0", "g-2", "g-3"]
    sent = [(g.request_id, list(g.cached_image_keys), len(g.image_features)) for g, _ in llm.generates]
    keys = [r.content_key for r in refs]
    assert sent == [("g-0", [], 2), ("g-1", keys, 0), ("g-2", keys, 0), ("g-2", [], 2), ("g-3", [], 2)]
    skipped = answers[1].timings
    assert skipped.preprocess_ms == skipped.vision_ms == 0 and skipped.prefill_ms == 6  # no vision stage ran


def test_an_llm_that_does_not_read_cached_images_always_gets_features():
    vision = FakeVision(vision_pb2.EncodeResponse(features=keyed_refs(), timings=VISION_TIMINGS))
    llm = FakeLlm()

    async def main():
        async with gateway_service(vision, llm) as (stub, _):
            for i in range(2):
                await stub.GenerateUnary(request(request_id=f"g-{i}"), timeout=10)

    asyncio.run(main())
    assert len(vision.encodes) == 2 and all(not g.cached_image_keys for g, _ in llm.generates)
