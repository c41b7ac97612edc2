"""A do-nothing OTLP/gRPC trace receiver, to measure tracing's cost in the mesh itself.

It accepts and counts spans and throws them away, so a benchmark with
OTEL_EXPORTER_OTLP_ENDPOINT pointing here charges the mesh with span creation and export,
not with a trace backend's ingestion on the same cores.

    python -m bench.otlp_sink --port 4319
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    async def Export(self, request, context):
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        print(f"received {self.spans} spans", flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()


async def serve(port: int) -> None:
    server = grpc.aio.server()
    sink = Sink()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"OTLP sink on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=4319)
    asyncio.run(serve(p.parse_args().port))


if __name__ == "__main__":
    main()
