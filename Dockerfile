# lanegate: one image for every process (gateway, realtime worker, batch worker).
# The pocketsphinx wheel ships its English model and PyAV its codecs, so the runtime
# image needs no system packages and downloads nothing at run time.
# Build: docker build -t lanegate .   (docker-compose.yml builds it for you)

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/lanegate
COPY pyproject.toml README.md ./
COPY lanegate ./lanegate
COPY gateway ./gateway
COPY lanes ./lanes
COPY vad ./vad
COPY workers ./workers
# Only the runtime dependencies: no [dev], [bench] or [torch] extras.
RUN /opt/lanegate/bin/pip install --upgrade pip \
    && /opt/lanegate/bin/pip install .

FROM python:3.11-slim
ENV PATH=/opt/lanegate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LANEGATE_DATA_DIR=/data \
    LANEGATE_BLOB_DIR=/data/blobs
RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home lanegate \
    && mkdir -p /data/blobs \
    && chown -R lanegate:lanegate /data
COPY --from=build /opt/lanegate /opt/lanegate
USER lanegate
WORKDIR /data
# gateway: 8080; worker internal server and /metrics: 9000 (LANEGATE_WORKER_PORT)
EXPOSE 8080 9000
CMD ["lanegate", "gateway", "--host", "0.0.0.0", "--port", "8080"]
