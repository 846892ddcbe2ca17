# Serving image: the gRPC server on CPU onnxruntime, no torch. The multi-stage build with a
# GPU variant and the trainer image arrive with the deploy issue.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY policy ./policy
COPY guard ./guard
COPY weights ./weights
RUN pip install --no-cache-dir '.[cpu]' \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin app
USER 10001
EXPOSE 50051
ENTRYPOINT ["shopping-agent", "serve"]
CMD ["--port", "50051"]
