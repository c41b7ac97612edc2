"""The feature hand-off: how image features made by the vision process reach the llm process.

Roles
    `producer.Producer` (the vision process) owns the arenas, negotiates a transport with
    each consumer, exports features into leased runs of arena pages and takes the leases back.
    `consumer.Consumer` (the llm process) opens references into tensors and hands the
    leases back (`release.release_leases`, the Vision.Release RPC; the gateway uses it too
    for features the llm never read).

Transports (one object per kind, interface in `transport.Transport`)
    CUDA_IPC (`cuda`): pages of one GPU allocation exported once; same host and same GPU;
        the consumer reads it in place, no copy.
    SHM (`shm`): pages of a POSIX shared-memory segment; same host; copied on open.
    INLINE (`inline`): the bytes ride in the TensorRef; works anywhere; copied on open.
    Negotiation (`wire.choose_transport`) picks the consumer's first choice that works
    between the two; every fallback is logged and counted.

Lease life cycle
    export: a free run of arena pages, as many as the tensor needs, is leased (id, TTL),
    written, then published in the arena's header (`arena`), so a reference is readable when
    it reaches the consumer. open: the consumer checks the reference against the header (page
    bounds, the lease id at the run's first and last page, expiry, the producer's heartbeat).
    A copy's lease is released at once; an in-place tensor's lease is held until its reader
    (the llm engine's prefill) has read it, verified again and released. A lease nobody
    releases expires after its TTL and the producer reaps the run. A released, expired,
    reused or forged reference is refused with FAILED_PRECONDITION; a dead producer's with
    UNAVAILABLE.

`peer` is a stand-in producer process for tests and benchmarks. This package imports
`services.common` and `vlmesh.v1` only, never a service.
"""
