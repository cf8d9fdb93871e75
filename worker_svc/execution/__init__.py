"""Running a stage's steps: the runner, the persistent batch, KV pools and memory sizing, sampling, pooling, drafting, tensor parallelism and devices."""
