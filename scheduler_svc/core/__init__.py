"""The scheduler's pure core: requests and their states, the waiting queue, the planner.

Synchronous and deterministic: no grpc, no asyncio, no torch, no os.environ.
"""
