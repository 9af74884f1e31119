"""Text encoding: Qwen3-VL on transformers, and the prompt presentation the DiT was trained on."""
