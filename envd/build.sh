#!/bin/sh
# Build envd/bin/envd: static (CGO_ENABLED=0), stripped, reproducible paths.
set -eu
cd "$(dirname "$0")"
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o bin/envd .
