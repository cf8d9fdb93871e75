"""Mistral: Llama's layer with a sliding window on every layer (`sliding_window`)."""

from __future__ import annotations

from worker_svc.models.base import Architecture


class Mistral(Architecture):
    model_type = "mistral"
    hf_names = ("MistralForCausalLM",)
    gguf_names = ("mistral",)
    gguf_permuted_qk = True
