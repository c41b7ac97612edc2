"""The gateway: the public vlmesh.v1.Gateway API in front of a vision and an llm service."""
