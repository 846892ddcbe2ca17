# shopping-agent images (docs/deploy.md). Two targets from one build:
#
#   serve    the gRPC server: onnxruntime, no torch. RUNTIME=cpu (default) or gpu picks the
#            onnxruntime extra (never both: the two packages overwrite each other's files).
#   trainer  the `shopping-agent cycle` CronJob: the train extra (torch 2.13.0, onnx) plus CPU
#            onnxruntime for the offline gate. TORCH_INDEX_URL picks the torch build: the CPU
#            wheels by default, a CUDA index (e.g. https://download.pytorch.org/whl/cu128) for GPU nodes.
#
#   docker build --target serve -t shopping-agent:0.1.0 .
#   docker build --target serve --build-arg RUNTIME=gpu -t shopping-agent:0.1.0-gpu .
#   docker build --target trainer -t shopping-agent-trainer:0.1.0 .
#   docker build --target trainer --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     -t shopping-agent-trainer:0.1.0-cuda .
#
# Both run as uid/gid 10001 (the manifests' runAsUser) and need nothing writable but /tmp and
# the mounted volumes (readOnlyRootFilesystem). A plain `docker build .` gives the serving image.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN groupadd --system --gid 10001 app \
    && useradd --system --no-log-init --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin app

# The source, once, for both installs. .dockerignore lets in only what is copied here.
FROM base AS source
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md ./
COPY requirements ./requirements
COPY core ./core
COPY guard ./guard
COPY policy ./policy
COPY weights ./weights
COPY experience ./experience
COPY simulator ./simulator
COPY trainer ./trainer
COPY server ./server

FROM source AS build-serve
ARG RUNTIME=cpu
# Dependencies and the build backend from the hash-pinned locks (scripts/lock.sh), then the project itself without
# resolving or fetching anything (no build isolation: pip would fetch an unpinned setuptools to build it).
RUN case "${RUNTIME}" in cpu|gpu) ;; *) echo "RUNTIME must be cpu or gpu, got ${RUNTIME}" >&2; exit 2;; esac \
    && pip install --no-cache-dir --require-hashes -r "/src/requirements/serve-${RUNTIME}.txt" \
    && pip install --no-cache-dir --require-hashes -r /src/requirements/build.txt \
    && pip install --no-cache-dir --no-deps --no-build-isolation "/src[${RUNTIME}]"

FROM source AS build-trainer
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Everything but torch from the hash-pinned lock; torch (pinned by version) from its own index
# only (--index-url, not --extra-index-url: no other index can offer a higher "torch").
RUN pip install --no-cache-dir --require-hashes -r /src/requirements/trainer.txt \
    && pip install --no-cache-dir --require-hashes -r /src/requirements/build.txt \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0 \
    && pip install --no-cache-dir --no-deps --no-build-isolation "/src[cpu,train]"

FROM base AS trainer
COPY --from=build-trainer /opt/venv /opt/venv
# An empty working directory: nothing relative resolves to a real file (see SECURITY.md).
WORKDIR /var/empty
USER 10001:10001
ENTRYPOINT ["shopping-agent"]
# The CronJob's mounts (k8s/base/cronjob.yaml), which gives its own command line.
CMD ["cycle", "--logs=/logs", "--weights-dir=/weights"]

# Last, so that a build without --target gives the serving image.
FROM base AS serve
COPY --from=build-serve /opt/venv /opt/venv
# An empty working directory: onnxruntime would resolve a graph's relative external-data path
# here (bundles with any are refused before that; see SECURITY.md).
WORKDIR /var/empty
USER 10001:10001
EXPOSE 50051 9095
ENTRYPOINT ["shopping-agent"]
CMD ["serve", "--port=50051", "--metrics-port=9095"]
