"""`pagoda bench`: the benchmark harness (workloads, load generators, baselines, reports, plots).

Pure pieces (workloads, statistics, report rendering) import nothing of torch, grpc or
asyncio, so their unit tests run in milliseconds; the pieces that start services or load
models import them lazily.
"""
