"""The soak's memory figures: GPU memory read from a service's /metrics, and growth after warm-up."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from bench.soak import gpu_memory, growth_of


def test_gpu_memory_is_read_from_the_services_metrics():
    registry = CollectorRegistry()
    gauge = Gauge("vlmesh_gpu_memory_bytes", "GPU memory", ["service", "kind"], registry=registry)
    gauge.labels("llm", "reserved").set(3 * 2**30)
    gauge.labels("llm", "allocated").set(2**29)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        got = gpu_memory(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
        thread.join()
    assert got == {"gpu_reserved_mib": 3072.0, "gpu_allocated_mib": 512.0}


def test_growth_compares_the_peaks_of_the_last_and_first_thirds_and_counts_gpu_memory_where_sampled():
    def row(private: float, gpu: float | None = None) -> dict:
        r = {"rss_mib": private + 100, "private_mib": private, "fds": 10}
        return r if gpu is None else r | {"gpu_reserved_mib": gpu}

    flat = [row(100 + (i % 2), 1000) for i in range(9)]  # swings, but its peaks do not climb
    assert growth_of(flat) == {"rss": 0.0, "private": 0.0, "fds": 0, "gpu_reserved": 0.0}
    leaking = [row(100, 1000 + 10 * i) for i in range(9)]
    assert growth_of(leaking)["gpu_reserved"] == round(1080 / 1020 - 1, 4)
    assert "gpu_reserved" not in growth_of([row(100) for _ in range(3)])  # the CPU: none sampled
