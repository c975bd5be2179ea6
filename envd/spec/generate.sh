#!/bin/sh
# Regenerate the Go code for envd's Connect services from spec/*.proto.
# Needs protoc, protoc-gen-go and protoc-gen-connect-go on PATH
# (go install google.golang.org/protobuf/cmd/protoc-gen-go@latest
#  go install connectrpc.com/connect/cmd/protoc-gen-connect-go@latest).
# The generated code is committed, so a normal build never runs this.
set -eu
cd "$(dirname "$0")"
PATH="$PATH:$(go env GOPATH)/bin"
protoc -I. \
  --go_out=.. --go_opt=module=forkyard/envd \
  --connect-go_out=.. --connect-go_opt=module=forkyard/envd \
  process/process.proto filesystem/filesystem.proto
