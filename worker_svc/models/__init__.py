"""Architectures: one short module each (`llama.py`, `qwen3.py`, `gemma3.py`, ...) that
names its config fields, its weight names (Hugging Face and GGUF) and the decoder layer it
composes from worker_svc/layers/; `registry.py` maps `config.json`'s `architectures` and
GGUF's `general.architecture` to them. docs/architecture.md says how to add one.
"""
