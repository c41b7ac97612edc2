"""The llm servicer in this process: a real grpc.aio server around a scripted engine, a fake vision.

The engine is a FakeEngine (the Engine interface of services/llm/interface.py, no model): it
records the jobs and leases it is given and streams scripted Outputs. The features come
from a real Producer on the CPU (SHM slots) and as inline bytes; the fake vision hands the
released leases back to that producer, so a lease that is never released stays counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.qos import QosLevel
from services.common.validation import check_sampling
from services.handoff.producer import Producer
from services.handoff.wire import inline_ref
from services.llm.interface import EngineStats, Job
from services.llm.request import Finish, Output, Request
from services.llm.servicer import LlmServicer
from services.model.spec import load_spec
from tests.helpers import FakeVision, eventually, local_server
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import llm_pb2, llm_pb2_grpc, vision_pb2_grpc

SHM, INLINE = pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE
TEXT_TOKENS = 7
# The fake engine's stage clocks, relative to arrival: 10 ms queued, 20 ms prefill, 40 ms decode.
SCHEDULED, PREFILLED, FINISHED = 0.010, 0.030, 0.070
PAUSE = "pause"  # in a script: wait until the test opens the engine's gate
HANG = "hang"  # in a script: wait forever (until the stream is closed)
SAMPLING = pb.SamplingParams(max_tokens=6, temperature=0.5, seed=3)  # 4 tokens come: usage counts those
QOS = (("qos-level", "realtime"),)


class FakeSubmission:
    def __init__(self, engine: FakeEngine, req: Request) -> None:
        self.engine, self.req = engine, req
        self.closed = False  # the stream's `finally` ran
        self.finished = False  # it yielded its last Output
        self._stream = None

    def outputs(self):
        # Held here, so only an explicit aclose by the servicer (not garbage collection) runs its finally.
        self._stream = self._outputs()
        return self._stream

    async def _outputs(self):
        try:
            for step in self.engine.script:
                if step == PAUSE:
                    await self.engine.gate.wait()
                    continue
                if step == HANG:
                    await asyncio.Event().wait()
                self.req.output_ids.extend(step.token_ids)
                self.finished = step.finish is not None
                yield step
        finally:
            self.closed = True


class FakeEngine:
    """Records jobs and leases; every submission streams `script`; `submit_error` makes submit raise."""

    device = torch.device("cpu")
    reads_cached_images = False

    def __init__(self, reads_in_place: bool, script=(), submit_error: Exception | None = None) -> None:
        self._reads_in_place = reads_in_place
        self.script = list(script)
        self.submit_error = submit_error
        self.jobs: list[Job] = []
        self.leases: list[object] = []
        self.submissions: list[FakeSubmission] = []
        self.gate = asyncio.Event()

    @property
    def reads_in_place(self) -> bool:
        return self._reads_in_place

    def start(self) -> None:
        pass

    def submit(self, job: Job, leases=None) -> FakeSubmission:
        self.jobs.append(job)
        self.leases.append(leases)
        if self.submit_error is not None:
            raise self.submit_error
        image_tokens = sum(f.shape[0] for f in job.features)
        req = Request(
            id=f"{job.request_id}#0",
            prompt_ids=[0] * (TEXT_TOKENS + image_tokens),
            image_positions=[TEXT_TOKENS],
            image_features=job.features,
            text_tokens=TEXT_TOKENS,
            sampling=job.sampling,
            max_new=job.sampling.max_tokens or 16,
            qos=job.qos,
            detok=None,
            emit=lambda out: None,
        )
        req.leases = leases
        now = time.perf_counter()
        req.arrival, req.scheduled_at, req.prefill_done_at, req.finished_at = (
            now,
            now + SCHEDULED,
            now + PREFILLED,
            now + FINISHED,
        )
        sub = FakeSubmission(self, req)
        self.submissions.append(sub)
        return sub

    def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(running=0, waiting=0, free_slots=1)

    def stop(self) -> None:
        pass


@pytest.fixture(scope="module")
def spec(tiny_model):
    return load_spec(tiny_model)


@pytest.fixture
def producer(spec):
    p = Producer(
        page_bytes=spec.image_tokens * spec.text.hidden * 4,
        n_pages=4,
        ttl_s=30,
        device=torch.device("cpu"),
        ready="sync",
    )
    yield p
    p.close()


def features(spec, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(spec.image_tokens, spec.text.hidden, generator=g) for _ in range(n)]


def shm_refs(producer: Producer, feats: list[torch.Tensor]) -> list[pb.TensorRef]:
    refs = producer.export(feats, pb.ConsumerInfo(host_id=producer.host, accept=[SHM]))
    assert [r.transport for r in refs] == [SHM] * len(feats)
    return refs


@contextlib.asynccontextmanager
async def llm_service(spec, engine: FakeEngine, vision: FakeVision):
    """(stub, servicer): the real LlmServicer on a local port, releasing leases to `vision`."""
    async with local_server(vision_pb2_grpc.add_VisionServicer_to_server, vision) as vision_target:
        servicer = LlmServicer(engine, spec, default_max_tokens=32, vision_target=vision_target)
        try:
            async with local_server(llm_pb2_grpc.add_LlmServicer_to_server, servicer) as target:
                async with grpc.aio.insecure_channel(target) as channel:
                    yield llm_pb2_grpc.LlmStub(channel), servicer
        finally:
            servicer.close()


async def read_rest(call) -> list:
    """The remaining messages of a call already read with `read` (the two styles do not mix)."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


def generate_request(refs, request_id: str = "req-1") -> llm_pb2.LlmGenerateRequest:
    return llm_pb2.LlmGenerateRequest(
        request_id=request_id, prompt="What is in the image?", image_features=refs, sampling=SAMPLING
    )


@pytest.mark.parametrize("reads_in_place", [False, True], ids=["copying-engine", "in-place-engine"])
def test_stream_is_relayed_and_copied_features_are_released_after_submit(spec, producer, reads_in_place):
    """SHM and INLINE features are copies: whatever the engine, it gets no leases and they go back at submit."""
    feats = features(spec, 2)
    script = [
        Output("he", [11, 12]),
        PAUSE,
        Output("llo", [13]),
        Output("!", [14], Finish.LENGTH),
    ]
    engine = FakeEngine(reads_in_place, script)
    vision = FakeVision(producer=producer)

    async def main():
        refs = [*shm_refs(producer, feats[:1]), inline_ref(feats[1], producer.host)]
        assert producer.leased == 1
        async with llm_service(spec, engine, vision) as (stub, _):
            call = stub.Generate(generate_request(refs), metadata=QOS, timeout=10)
            first = await call.read()
            # The engine has not finished (it waits at its gate), yet the copied slot is back.
            assert await eventually(lambda: vision.releases), "no lease released while the engine ran"
            assert vision.releases == [[refs[0].lease.id]]  # inline bytes hold no lease
            assert producer.leased == 0
            engine.gate.set()
            rest = await read_rest(call)
            assert await call.code() == grpc.StatusCode.OK
        return first, rest

    first, rest = asyncio.run(main())
    assert engine.leases == [None]
    (job,) = engine.jobs
    assert job.request_id == "req-1" and job.prompt == "What is in the image?"
    assert job.qos is QosLevel.REALTIME
    assert job.sampling == check_sampling(SAMPLING, spec.text.max_context)
    assert len(job.features) == 2
    for got, want in zip(job.features, feats, strict=True):
        assert torch.equal(got, want)
    assert (first.text, list(first.token_ids), first.finish_reason) == ("he", [11, 12], pb.FINISH_REASON_UNSPECIFIED)
    assert not first.HasField("usage") and not first.HasField("timings")
    assert [(m.text, list(m.token_ids)) for m in rest] == [("llo", [13]), ("!", [14])]
    final = rest[-1]
    assert rest[0].finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage == pb.Usage(prompt_tokens=TEXT_TOKENS, image_tokens=2 * spec.image_tokens, output_tokens=4)
    t = final.timings
    assert t.llm_queue_ms == pytest.approx(SCHEDULED * 1000)
    assert t.prefill_ms == pytest.approx((PREFILLED - SCHEDULED) * 1000)
    assert t.decode_ms == pytest.approx((FINISHED - PREFILLED) * 1000)
    assert t.handoff_ms > 0
    assert t.preprocess_ms == t.vision_ms == t.vision_queue_ms == t.admission_ms == t.total_ms == 0
    assert engine.submissions[0].closed and engine.submissions[0].finished


def test_stop_finish_maps_to_stop(spec, producer):
    engine = FakeEngine(False, [Output("a", [3], Finish.STOP)])

    async def main():
        async with llm_service(spec, engine, FakeVision(producer=producer)) as (stub, _):
            return [m async for m in stub.Generate(generate_request(shm_refs(producer, features(spec, 1))))]

    (only,) = asyncio.run(main())
    assert only.finish_reason == pb.FINISH_REASON_STOP
    assert only.usage.output_tokens == 1 and only.usage.image_tokens == spec.image_tokens


def test_best_effort_is_refused_over_the_memory_watermark_and_the_rest_is_served(spec, producer):
    from services.common.memory import MemoryGuard, Watermarks

    engine = FakeEngine(False, [Output("a", [3], Finish.LENGTH)])

    async def main():
        async with llm_service(spec, engine, FakeVision(producer=producer)) as (stub, servicer):
            servicer.memory = MemoryGuard("llm", lambda: (97, 100), Watermarks())  # a GPU 97% full
            refs = shm_refs(producer, features(spec, 1))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(generate_request(refs), metadata=(("qos-level", "best-effort"),)).read()
            producer.release([r.lease.id for r in refs])  # as the gateway does for a refused request
            served = [m async for m in stub.Generate(generate_request(shm_refs(producer, features(spec, 1))))]
            return err.value, served, await eventually(lambda: producer.leased == 0)

    err, served, released = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "95% watermark" in err.details()
    assert served[-1].finish_reason == pb.FINISH_REASON_LENGTH  # standard work is not refused
    assert released


def test_a_refused_submit_is_invalid_argument_once_the_leases_are_back(spec, producer):
    """The status comes only after vision.Release answered (a slow one here): no slot outlives the RPC."""
    engine = FakeEngine(False, submit_error=InvalidArgument("sampling.max_tokens=4 does not fit"))
    vision = FakeVision(producer=producer, release_delay_s=0.3)

    async def main():
        refs = shm_refs(producer, features(spec, 2))
        async with llm_service(spec, engine, vision) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(generate_request(refs), timeout=10):
                    pass
            # Checked at once: the servicer answered only after the release did.
            assert vision.releases == [[r.lease.id for r in refs]]
            assert producer.leased == 0
        return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not fit" in err.details()
    assert len(engine.jobs) == 1 and engine.submissions == []


def test_features_of_the_wrong_shape_are_refused_and_released(spec, producer):
    """A reference that opens to another shape: INVALID_ARGUMENT, nothing submitted, the lease released."""
    engine = FakeEngine(False, [Output("x", [1], Finish.LENGTH)])
    vision = FakeVision(producer=producer)

    async def main():
        good = shm_refs(producer, features(spec, 1))
        bad = shm_refs(producer, [torch.zeros(spec.image_tokens - 1, spec.text.hidden)])
        async with llm_service(spec, engine, vision) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(generate_request([*good, *bad]), timeout=10):
                    pass
            assert vision.releases == [[good[0].lease.id, bad[0].lease.id]]
            assert producer.leased == 0
        return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image_features[1] has shape" in err.details()
    assert engine.jobs == []


@pytest.mark.parametrize(
    "final,code",
    [
        (Output("", [], Finish.ERROR, InvalidArgument("the prompt is too long")), grpc.StatusCode.INVALID_ARGUMENT),
        (Output("", [], Finish.ABORT, "the engine stopped"), grpc.StatusCode.UNAVAILABLE),
    ],
    ids=["error", "abort"],
)
def test_an_engine_failure_ends_the_stream_with_its_status(spec, producer, final, code):
    engine = FakeEngine(False, [Output("a", [5]), final])

    async def main():
        async with llm_service(spec, engine, FakeVision(producer=producer)) as (stub, _):
            call = stub.Generate(generate_request(shm_refs(producer, features(spec, 1))), timeout=10)
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for msg in call:
                    got.append(msg)
            return got, err.value

    got, err = asyncio.run(main())
    assert [(m.text, list(m.token_ids)) for m in got] == [("a", [5])]
    assert err.code() == code
    assert str(final.error) in err.details()


def test_a_client_cancel_closes_the_engine_stream(spec, producer):
    engine = FakeEngine(False, [Output("a", [5]), HANG])
    vision = FakeVision(producer=producer)

    async def main():
        async with llm_service(spec, engine, vision) as (stub, _):
            call = stub.Generate(generate_request(shm_refs(producer, features(spec, 1))), timeout=10)
            first = await call.read()
            assert first.token_ids == [5]
            (sub,) = engine.submissions
            assert not sub.closed
            call.cancel()
            assert await eventually(lambda: sub.closed), "the engine's stream was left open after the cancel"
            assert not sub.finished
            assert await call.code() == grpc.StatusCode.CANCELLED
            assert await eventually(lambda: producer.leased == 0)

    asyncio.run(main())


class FakeContext:
    """What the servicer reads from a grpc.aio context when its method is called directly."""

    def __init__(self, metadata=()) -> None:
        self._metadata = tuple(metadata)

    def invocation_metadata(self):
        return self._metadata


def test_closing_the_rpc_between_messages_closes_the_engine_stream(spec, producer):
    """grpc closes the servicer's generator while it waits at a `yield`: the engine's stream is closed with it.

    The servicer method is called directly here: with the server in between, a cancel usually lands
    while the servicer awaits the engine (the test above), not while it waits to send.
    """
    engine = FakeEngine(False, [Output("a", [5]), Output("b", [6]), Output("c", [7], Finish.LENGTH)])

    async def main():
        servicer = LlmServicer(engine, spec, default_max_tokens=32, vision_target=None)
        try:
            refs = shm_refs(producer, features(spec, 1))
            stream = servicer.Generate(generate_request(refs), FakeContext(QOS))
            first = await anext(stream)
            (sub,) = engine.submissions
            assert not sub.closed
            await stream.aclose()
            # Checked before asyncio.run's shutdown_asyncgens would close what was left open.
            assert sub.closed, "the engine's stream was left open"
            return first, sub
        finally:
            servicer.close()

    first, sub = asyncio.run(main())
    assert list(first.token_ids) == [5]
    assert not sub.finished


def test_info_names_the_model_and_what_it_opens(spec):
    async def main():
        async with llm_service(spec, FakeEngine(False), FakeVision()) as (stub, servicer):
            return await stub.Info(pb.InfoRequest(), timeout=5), servicer.consumer.host

    info, host = asyncio.run(main())
    assert info.service == "llm"
    assert info.model_id == spec.model_id
    assert info.host_id == host and info.gpu_uuid == ""
    assert list(info.transports) == [SHM, INLINE]
    assert info.max_context == spec.text.max_context
    assert info.image_tokens == spec.image_tokens
    assert info.default_max_tokens == 32


def test_content_keys_alone_are_checked_and_an_llm_without_the_cache_asks_for_features(spec, producer):
    """LlmGenerateRequest.cached_image_keys: keys and features together, or a key of the wrong size,
    are INVALID_ARGUMENT; an engine that reads no cached images answers FAILED_PRECONDITION (the
    gateway then sends the features), and reads nothing, submits nothing."""
    engine = FakeEngine(False)
    key = b"k" * 16

    async def main():
        async with llm_service(spec, engine, FakeVision()) as (stub, _):
            codes = []
            both = generate_request(shm_refs(producer, features(spec, 1)))
            both.cached_image_keys.append(key)
            for req in (
                both,
                llm_pb2.LlmGenerateRequest(request_id="r", prompt="Hi", cached_image_keys=[b"short"]),
                llm_pb2.LlmGenerateRequest(request_id="r", prompt="Hi", cached_image_keys=[key], sampling=SAMPLING),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await read_rest(stub.Generate(req, timeout=5))
                codes.append(err.value.code())
            return codes

    codes = asyncio.run(main())
    invalid, refused = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    assert codes == [invalid, invalid, refused]
    assert engine.jobs == []
