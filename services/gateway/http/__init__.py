"""The gateway's OpenAI-compatible HTTP door (FastAPI on uvicorn), beside its gRPC one."""
