"""Reading checkpoints into a stage: folders of safetensors, GGUF files, and the conversions between them."""
