"""vlmesh public API: generated gRPC stubs of protos/vlmesh/v1."""
