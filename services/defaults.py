"""Settings and names more than one part of Pagoda uses, declared once.

Each service's config takes its default from here, and so do the command line, `pagoda serve`,
the launcher and the Kubernetes renderer; a value written anywhere else is a copy that can drift.
"""

from __future__ import annotations

# KV slots per block: the KV service, the scheduler and every stage must agree on it
BLOCK_SIZE = 16
# the gateway's policies for placing a request among replicas (gateway/routing.py)
ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")
