# Support services for the simulated cluster (deploy/compose/docker-compose.yml), built on the
# same registry-free base image as forkyard's (deploy/docker/make-base-image.sh):
#   redis-server 7.0 (Debian bookworm) and moto_server (an S3 API server; moto is forkyard's
#   S3 test server too, pinned to the version the test suite uses).
# Production clusters use a real Redis and a real S3 (or MinIO); this image is for the demo.
ARG BASE_IMAGE=forkyard/bookworm:local
FROM ${BASE_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive
ARG MOTO_VERSION=5.2.5
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends redis-server python3-venv curl tini; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/moto; \
    /opt/moto/bin/pip install --no-cache-dir --disable-pip-version-check -q "moto[server]==${MOTO_VERSION}"
ENV PATH=/opt/moto/bin:$PATH
ENTRYPOINT ["/usr/bin/tini", "--"]
