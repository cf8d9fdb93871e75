"""The building blocks every architecture composes (worker_svc/models/): RMSNorm
(`norm.py`), rotary embeddings (`rotary.py`), the attention block with its options
(`attention.py`), the gated MLP (`mlp.py`), the decoder layers (`decoder.py`) and the fusing
of linears that read one input (`linear.py`). They live once; an architecture names its
options (worker_svc/model_config.ModelConfig's fields) and which layer it builds.
"""
