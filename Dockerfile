# netoptim-train: an optimizer node by default; workers from the same image with another command.
#
#   docker build -t netoptim-train:0.2.0 .
#   docker run --rm netoptim-train:0.2.0 --version
#   docker run --rm --user "$(id -u):$(id -g)" -p 5555:5555 -p 9400:9400 -v "$PWD/keys:/keys:ro" \
#       netoptim-train:0.2.0 node --listen tcp://0.0.0.0:5555 --curve-secret-key /keys/node.key_secret \
#       --curve-allow /keys/allowed --admin 127.0.0.1:7000 --metrics-port 9400 --metrics-host 0.0.0.0
#   docker run --rm --no-healthcheck --entrypoint torchrun netoptim-train:0.2.0 --standalone \
#       --nproc-per-node 2 -m netoptim.recipes.train_gpt --nodes tcp://NODE_HOST:5555 ...
#
# (--user: the keys are 0400 files of yours, which the image's own user, uid 10001, cannot read.)
#
# The torch in the image is PyTorch's CPU build (the nodes need no GPU, and no CUDA build of several
# GB is pulled). For workers whose model runs on GPUs, build another tag with the index of a CUDA build:
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ. Operations guide:
# docs/operations.md, "Container image".

# The build stage: the wheel, from the five packages and the project's metadata only.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY gpu_worker/ gpu_worker/
COPY optimizer_node/ optimizer_node/
COPY transport/ transport/
COPY protos/ protos/
COPY netoptim/ netoptim/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# The runtime stage.
FROM python:3.11-slim-bookworm

# PyPI's torch for Linux is a CUDA build; PyTorch's own CPU index serves torch and its dependencies.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

LABEL org.opencontainers.image.title="netoptim-train" \
      org.opencontainers.image.description="Train models larger than their GPUs: the optimizer runs on CPU nodes in the network" \
      org.opencontainers.image.version="0.2.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/netoptim/netoptim" \
      org.opencontainers.image.documentation="https://github.com/netoptim/netoptim/tree/main/docs"

# The Mooncake transport ([rdma] extra) links libibverbs, librdmacm, libnuma and libcurl even for its
# tcp protocol; ibverbs-providers holds the drivers of the RDMA NICs (mooncake+rdma://). Not pinned
# (DL3008): Debian drops superseded versions from its archive, so a pin would break the build at the
# next security update; the base image's tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libnuma1 libcurl4 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/*

# torch first, from its CPU index, so that the wheel's "torch>=2.4" is already satisfied.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0

COPY --from=build /dist/ /tmp/dist/
# The wheel file built above, with its extra (DL3013 takes the path for an unpinned name).
# hadolint ignore=DL3013
RUN set -- /tmp/dist/netoptim_train-*.whl \
    && pip install --no-cache-dir "$1[rdma]" \
    && rm -rf /tmp/dist \
    && pip check \
    && netoptim --version

# A fixed numeric uid, so Kubernetes can check runAsNonRoot and the manifests' fsGroup matches.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/netoptim netoptim

# numba's compiled update kernels go to a directory any uid can write (docker run --user, Slurm's
# containers run as the caller), not next to the installed code.
ENV NUMBA_CACHE_DIR=/tmp/numba-cache \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /home/netoptim

# 5555: the data plane (--listen), 7000: the gRPC admin service and grpc.health.v1 (--admin),
# 9400: Prometheus /metrics (--metrics-port); the ports docs/operations.md and the manifests use.
EXPOSE 5555 7000 9400

# SERVING once the node accepts work. It asks the admin service at 127.0.0.1:7000 (health checks need
# no token); containers that run workers have none: start them with --no-healthcheck.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["netoptim", "admin", "--target", "127.0.0.1:7000", "--timeout", "5", "health"]

ENTRYPOINT ["netoptim"]
# A node reachable from the network needs CURVE keys (or --insecure on an isolated network): without
# them this default refuses to start and says so. Pass the node's full command line instead.
CMD ["node", "--listen", "tcp://0.0.0.0:5555", "--admin", "127.0.0.1:7000", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"]
