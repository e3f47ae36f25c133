"""A real HTTP server on 127.0.0.1 that answers as AWS, GCP and Azure instance metadata services do about preemption.

What each serves follows the providers' documentation (the same bodies, statuses and headers), including what the
client must send (a request without it is refused as the real service refuses it):

* AWS (IMDSv2): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` -> a token;
  ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token`` -> 404 (an HTML "404 - Not
  Found" page) without a notice, 200 ``{"action": "terminate", "time": "..."}`` with one; a missing or expired
  token -> 401. ``aws_v1_only``: the token request is refused with 403 and GETs need no token (IMDSv1).
* GCP: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` -> ``FALSE``/``TRUE``,
  answered with the same header; without the header -> 403.
* Azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true`` -> ``{"DocumentIncarnation":
  N, "Events": [...]}``; ``GET /metadata/instance/compute/name?...&format=text`` -> the VM's name; without the
  header -> 400.

A test changes what it serves by setting attributes (``aws_notice``, ``gcp_preempted``, ``azure_events``, or
``raw`` for a malformed answer on a path) while the server runs; ``requests`` records what clients sent (header
names in lower case).
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

AWS_404 = (b'<?xml version="1.0" encoding="iso-8859-1"?>\n'
           b'<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN"\n'
           b'\t"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">\n'
           b'<html xmlns="http://www.w3.org/1999/xhtml" xml:lang="en" lang="en">\n <head>\n'
           b'  <title>404 - Not Found</title>\n </head>\n <body>\n  <h1>404 - Not Found</h1>\n </body>\n</html>\n')
AWS_NOTICE = {"action": "terminate", "time": "2026-11-25T08:22:00Z"}
AZURE_PREEMPT = {"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": "Preempt",
                 "ResourceType": "VirtualMachine", "Resources": ["trainer-vm-3"], "EventStatus": "Scheduled",
                 "NotBefore": "Wed, 25 Nov 2026 08:22:00 GMT", "Description": "", "EventSource": "Platform",
                 "DurationInSeconds": -1}


def _lower(headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


class MetadataServer:
    def __init__(self) -> None:
        self.aws_notice: dict | None = None
        self.aws_v1_only = False
        self.aws_tokens: set[str] = set()
        self.gcp_preempted = "FALSE"
        self.azure_events: list[dict] = []
        self.azure_vm_name: str | None = "trainer-vm-3"
        self.raw: dict[str, tuple[int, dict, bytes]] = {}  # path -> (status, headers, body): a malformed answer
        self.requests: list[tuple[str, str, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                server.requests.append(("PUT", self.path, _lower(self.headers)))
                if self.path != "/latest/api/token":
                    return self._send(404, AWS_404)
                if server.aws_v1_only:
                    return self._send(403, b"")
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(400, b"")
                token = uuid.uuid4().hex
                server.aws_tokens.add(token)
                return self._send(200, token.encode(), {"X-aws-ec2-metadata-token-ttl-seconds":
                                                        self.headers["X-aws-ec2-metadata-token-ttl-seconds"]})

            def do_GET(self):
                server.requests.append(("GET", self.path, _lower(self.headers)))
                if self.path in server.raw:
                    status, headers, body = server.raw[self.path]
                    return self._send(status, body, headers)
                if self.path.startswith("/latest/"):
                    return self._aws()
                if self.path.startswith("/computeMetadata/"):
                    return self._gcp()
                if self.path.startswith("/metadata/"):
                    return self._azure()
                return self._send(404, b"")

            def _aws(self):
                if not server.aws_v1_only and self.headers.get("X-aws-ec2-metadata-token") not in server.aws_tokens:
                    return self._send(401, b"")
                if self.path == "/latest/meta-data/spot/instance-action" and server.aws_notice is not None:
                    return self._send(200, json.dumps(server.aws_notice).encode(), {"Content-Type": "text/plain"})
                return self._send(404, AWS_404, {"Content-Type": "text/html"})

            def _gcp(self):
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, b"Missing Metadata-Flavor:Google header.\n")
                if self.path == "/computeMetadata/v1/instance/preempted":
                    return self._send(200, server.gcp_preempted.encode(),
                                      {"Metadata-Flavor": "Google", "Content-Type": "application/text"})
                return self._send(404, b"", {"Metadata-Flavor": "Google"})

            def _azure(self):
                if self.headers.get("Metadata") != "true":
                    return self._send(400, json.dumps({"error": "Bad request. Required metadata header not "
                                                                "specified"}).encode())
                if self.path == "/metadata/scheduledevents?api-version=2020-07-01":
                    body = {"DocumentIncarnation": len(server.azure_events), "Events": server.azure_events}
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                if self.path.startswith("/metadata/instance/compute/name?") and server.azure_vm_name:
                    return self._send(200, server.azure_vm_name.encode(), {"Content-Type": "text/plain"})
                return self._send(404, b"")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> MetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
