"""The LLaVA model in plain PyTorch: config, CLIP ViT, projector, Llama decoder, loading."""
