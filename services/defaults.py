"""Settings and names more than one part of Pagoda uses, declared once.

The settings' declarations (services/settings.py) and each service's config take their defaults
from here, and so do the launcher and the Kubernetes renderer; a value written anywhere else is a
copy that can drift.
"""

from __future__ import annotations

# KV slots per block: the KV service, the scheduler and every stage must agree on it
BLOCK_SIZE = 16
# the gateway's policies for placing a request among replicas (gateway/routing.py)
ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")
# KV blocks in a pool when it is neither given nor sized from memory
NUM_KV_BLOCKS = 1024
# the most tokens in one step: the scheduler's budget and what a stage takes in one plan (its
# message limit and memory profile); `pagoda serve` gives the stages the scheduler's value
MAX_NUM_BATCHED_TOKENS = 2048
# the most sequences running at once: the scheduler's budget, a stage's message limit
MAX_NUM_SEQS = 256
# n-gram drafts (speculative decoding): the longest and shortest n-gram of the recent tokens
# looked up in the context, as vLLM's `prompt_lookup_max` / `prompt_lookup_min`
PROMPT_LOOKUP_MAX = 4
PROMPT_LOOKUP_MIN = 2
# the longest context when neither --max-model-len nor the checkpoint's config.json says
MAX_MODEL_LEN = 4096
