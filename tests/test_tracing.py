"""Optional OpenTelemetry tracing (``FORKYARD_TRACING=otlp``) through a real cluster
(Redis, scheduler, gateway, one node) exporting with the real OTLP/HTTP exporter to a
receiver in the test. Its own module: a cluster's node network prefixes are per test
process, so it must not overlap test_observability's module-wide cluster."""

from __future__ import annotations

import os
import time

from conftest import TEST_ROOT


class OtlpReceiver:
    """Collects what an OTLP/HTTP exporter POSTs to ``/v1/traces`` (protobuf
    ``ExportTraceServiceRequest``, decoded with ``opentelemetry-proto``): the stand-in for
    a collector, on a free port in a thread."""

    def __init__(self):
        import gzip
        import http.server
        import threading

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[dict] = []
        spans = self.spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 — http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            spans.append({"service": service, "name": sp.name, "trace": sp.trace_id.hex(),
                                          "id": sp.span_id.hex(), "parent": sp.parent_span_id.hex(),
                                          "ns": sp.end_time_unix_nano - sp.start_time_unix_nano,
                                          "attrs": {a.key: a.value.string_value or a.value.int_value
                                                    for a in sp.attributes}})
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_opentelemetry_spans_cross_gateway_to_node(base_template):
    """With ``FORKYARD_TRACING=otlp`` gateway and node export spans over OTLP/HTTP: the
    node's request span continues the gateway's trace (W3C traceparent), and the node's
    lifecycle span has the Server-Timing phases as children."""
    from _cluster import Cluster
    from e2b import Sandbox
    from test_cluster import assert_clean

    recv = OtlpReceiver()
    c = Cluster(TEST_ROOT / f"cluster-otel-{os.getpid()}", nodes=1)
    for p in [c.scheduler, c.gateway, *c.nodes]:
        p.env = dict(p.env, FORKYARD_TRACING="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=recv.url)
    try:
        c.start()
        sbx = Sandbox.create("base", timeout=120, **c.sdk)
        try:
            sbx.create_snapshot()
        finally:
            sbx.kill()

        def find(service, name):
            return [s for s in recv.spans if s["service"] == service and s["name"] == name]

        deadline = time.time() + 30
        while time.time() < deadline and not (find("forkyard-node", "snapshot.commit") and
                                              find("forkyard-gateway", "POST create")):
            time.sleep(0.5)
        gw = find("forkyard-gateway", "POST create")
        node = find("forkyard-node", "POST create")
        assert gw and node, sorted({(s["service"], s["name"]) for s in recv.spans})
        assert node[0]["trace"] == gw[0]["trace"] and node[0]["parent"] == gw[0]["id"]
        assert node[0]["attrs"]["forkyard.request_id"] == gw[0]["attrs"]["forkyard.request_id"]
        create = find("forkyard-node", "forkyard.create")
        assert create and create[0]["parent"] == node[0]["id"]
        snap = find("forkyard-node", "forkyard.snapshot")[0]
        phases = {s["name"]: s for s in recv.spans if s["parent"] == snap["id"]}
        assert {"snapshot.checkpoint", "snapshot.commit"} <= set(phases)
        assert all(0 < p["ns"] <= snap["ns"] for p in phases.values())
    finally:
        c.close()
        recv.close()
        assert_clean(c)
