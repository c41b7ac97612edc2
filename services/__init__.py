"""vlmesh services: gateway, vision and llm gRPC servers, and what they share."""
