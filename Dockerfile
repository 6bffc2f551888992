# syntax=docker/dockerfile:1
# The gpuplace image: `gpuplace serve` (webhook + scheduler extender) and `gpuplace certs`.
#   docker build -t gpuplace:0.1.0 .
# Stage `build` makes wheels: gpuplace's own (with its C helpers, gpuplace/extender/_node_names.c and
# gpuplace/extender/_priorities.c, so it has a C compiler), then every dependency at the version constraints.txt pins. Stage
# `runtime` is the same slim Python with one virtualenv that holds only what those wheels
# install: no compiler, no pip, no source tree.
# Nor the development tools: .dockerignore keeps gpuplace/dev (the local API, the demo) and
# gpuplace/commands/demo.py out of the build context, so gpuplace's wheel has neither (the
# build fails if it does) and `gpuplace --help` lists no `demo`; the wheel's dependencies
# leave out the `demo` extra, so matplotlib is not installed either.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY gpuplace/ gpuplace/
# The C helpers are optional in setup.py (installs without a compiler); the image
# must have them, so the build fails here if the wheel lacks one.
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -c "import sys, zipfile, glob; names = zipfile.ZipFile(glob.glob('/wheels/gpuplace-*.whl')[0]).namelist(); sys.exit(not all(any(n.startswith(m) and n.endswith('.so') for n in names) for m in ('gpuplace/extender/_node_names.', 'gpuplace/extender/_priorities.')))" \
 && python -c "import sys, zipfile, glob; names = zipfile.ZipFile(glob.glob('/wheels/gpuplace-*.whl')[0]).namelist(); sys.exit(any(n.startswith('gpuplace/dev/') or n == 'gpuplace/commands/demo.py' for n in names))" \
 && python -m pip wheel --only-binary=:all: --wheel-dir /wheels \
        --constraint constraints.txt /wheels/gpuplace-*.whl

FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The base image's pip installs into a venv that has none (--without-pip), from the wheels
# of the build stage only (--no-index), mounted for this step and never copied in. The
# venv goes first on PATH only after this step: before it, the `python` of `python -m pip`
# would be the venv's own, which has no pip.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv --without-pip /opt/gpuplace \
 && python -m pip --python /opt/gpuplace/bin/python install --no-cache-dir --no-index \
        --find-links=/wheels gpuplace \
 && groupadd --system --gid 65532 gpuplace \
 && useradd --system --uid 65532 --gid 65532 --home-dir /home/gpuplace --create-home \
        --shell /usr/sbin/nologin gpuplace
ENV PATH=/opt/gpuplace/bin:${PATH}
WORKDIR /home/gpuplace
# Numeric, so the kubelet can check runAsNonRoot without reading /etc/passwd.
USER 65532:65532
EXPOSE 8443 9090
ENTRYPOINT ["gpuplace"]
CMD ["--help"]
