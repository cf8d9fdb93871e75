"""The stage service's parts (docs/architecture.md "The stage worker"): worker_svc/server.py is
the gRPC servicer over them.

- `work`: one micro-batch on its way through the stage, and the wire helpers the parts share;
- `compute`: the compute loop (decode, run in arrival order on one thread, report);
- `downstream`: the sender of hidden states and plans to the next stage;
- `feedback`: sampled-token feedback, the first stage's inbox and the last stage's outbox;
- `lora_admin`: loading and unloading LoRA adapters between steps;
- `statistics`: the counters, `StageStats` and the Prometheus samples;
- `loading`: the runner a stage serves (weights and KV pool, or an emulated device).
"""
