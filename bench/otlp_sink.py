"""A do-nothing OTLP/gRPC trace receiver, to measure tracing's cost in the mesh itself.

It accepts and counts spans and throws them away, so a benchmark with
OTEL_EXPORTER_OTLP_ENDPOINT pointing here charges the mesh with span creation and export,
not with a trace backend's ingestion on the same cores. With --out it also writes each
span as a JSON line (service, name, trace and span ids, start and end in ns) for
`python -m bench.span_timeline`.

    python -m bench.otlp_sink --port 4319 [--out spans.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import TextIO

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out: TextIO | None) -> None:
        self.spans = 0
        self.out = out

    async def Export(self, request, context):
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                self.spans += len(ss.spans)
                if self.out is None:
                    continue
                for s in ss.spans:
                    row = {
                        "service": service,
                        "name": s.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_id": s.parent_span_id.hex(),
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                    }
                    self.out.write(json.dumps(row) + "\n")
        if self.out is not None:
            self.out.flush()
        print(f"received {self.spans} spans", flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()


async def serve(port: int, out: TextIO | None) -> None:
    server = grpc.aio.server()
    sink = Sink(out)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"OTLP sink on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=4319)
    p.add_argument("--out", default=None, help="write every span as a JSON line to this file")
    args = p.parse_args()
    out = open(args.out, "w") if args.out else None
    try:
        asyncio.run(serve(args.port, out))
    finally:
        if out is not None:
            out.close()


if __name__ == "__main__":
    main()
