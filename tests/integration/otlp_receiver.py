"""A real OTLP/HTTP endpoint on loopback that decodes with the opentelemetry-proto classes."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)


class OtlpReceiver:
    def __init__(self) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.raw: list[bytes] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportMetricsServiceRequest()
                req.ParseFromString(body)
                receiver.requests.append(req)
                receiver.raw.append(body)
                out = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def metric_names_by_rank(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for req in self.requests:
            for rm in req.resource_metrics:
                attrs = {a.key: a.value for a in rm.resource.attributes}
                rank = attrs["trainspec.rank"]
                rank_value = str(
                    rank.int_value if rank.HasField("int_value") else rank.string_value
                )
                names = out.setdefault(rank_value, set())
                for sm in rm.scope_metrics:
                    names.update(m.name for m in sm.metrics)
        return out
