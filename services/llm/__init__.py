"""The llm service: prompt and image features -> streamed tokens."""
