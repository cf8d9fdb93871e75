"""Weight formats the layers compute with: packed GGUF blocks and bfloat16, quantization, K-quant reference quantizers, LoRA adapters."""
