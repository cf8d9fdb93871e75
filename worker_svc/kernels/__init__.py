"""The CPU and GPU kernels: native C (csrc/) and Triton, the attention backends, the CPU's features and the start-up calibration."""
