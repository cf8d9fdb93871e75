# Pagoda in one image; the `pagoda` command picks the service:
#
#   docker build -t pagoda:local .
#   docker run --rm pagoda:local --help
#   docker run --rm -v ./models/tiny:/models/tiny:ro pagoda:local worker --model /models/tiny ...
#
# docker-compose.yml runs the whole stack from it. The model is never baked in: mount it.
FROM python:3.11-slim

# The Makefile's TORCH_CPU_VERSION. The CPU build comes from PyTorch's CPU index: a torch
# from PyPI would pull a multi-GB CUDA build, as the Makefile warns.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

# A C compiler: the stage workers build their native CPU decode-attention kernel for the
# host they run on at first start (worker_svc/kernels/cpu_kernels.py; without it they use torch).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && useradd --create-home --uid 10001 --user-group pagoda

# Dependencies before the source, so that a code change does not reinstall them; the exact
# versions are the ones `make install` uses.
WORKDIR /tmp/pagoda
COPY pyproject.toml ./
COPY requirements/constraints.txt requirements/constraints.txt
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && pip install -c requirements/constraints.txt -r requirements.txt

COPY README.md ./
COPY services services
COPY wiring wiring
COPY gateway gateway
COPY scheduler_svc scheduler_svc
COPY kvcache_svc kvcache_svc
COPY worker_svc worker_svc
RUN pip install --no-deps . \
    && cd / && rm -rf /tmp/pagoda \
    && python -c "import wiring.cli, gateway, scheduler_svc, kvcache_svc, worker_svc"

USER pagoda
WORKDIR /home/pagoda

# REST (OpenAI-compatible) and gRPC of the gateway; the internal services take --port.
EXPOSE 8000 50051
ENTRYPOINT ["pagoda"]
CMD ["--help"]
