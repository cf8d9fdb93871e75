"""The wiring floor: the code that starts services and puts them together.

The command line (`pagoda ...`), `pagoda serve`, the process launcher, the in-process engine,
the Kubernetes renderer, model sources (GGUF preparation, the default model) and the tiny-model
maker. The only code that imports several services; the services and the shared library
(`services/`) never import it. Tools and benchmarks (`bench/`) sit above it.
"""
