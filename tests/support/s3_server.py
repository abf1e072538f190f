"""A real S3 HTTP endpoint for the tests: moto's standalone server
in a subprocess, with IAM authentication enforced, and a small fault-injecting
HTTP proxy in front of it (test-only code, stdlib only).

``start_moto()`` starts ``python -m moto.server`` on a free port of 127.0.0.1,
waits until it answers, creates an IAM user whose access key is the only one
the server accepts (moto's ``INITIAL_NO_AUTH_ACTION_COUNT``: the first few
requests, which create that user and the bucket, are not checked; every later
one is), and creates the test bucket. The clients under test (s3fs, boto3) talk
to it over HTTP exactly as they talk to S3.

``FaultProxy`` forwards every HTTP request to moto unchanged (the request's
bytes and headers, so SigV4 signatures still match) and can, for chosen
requests (the Nth matching one, the next K, or a fraction of them), answer 500
InternalError, stall (read the request and never answer), cut the
connection (TCP reset), or forward the request and then cut the connection
instead of passing the answer on ("drop_reply": the server did the work, the
client never hears of it). It also counts requests and the most upload
requests in progress at once.
"""

import http.client
import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, List, Optional

from dist_launch import free_port

REGION = "us-east-1"
BUCKET = "fastckpt-test"
# moto: the requests before authentication is enforced (create_user,
# create_access_key, put_user_policy, create_bucket) and then some slack for
# the requests boto3 may make on the way; counted by the server.
_NO_AUTH_ACTIONS = 4


class MotoServer:
    """``python -m moto.server`` in a subprocess, with one authenticated user and a bucket."""

    def __init__(self, log_path: str):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_NO_AUTH_ACTIONS),
                   AWS_ACCESS_KEY_ID="bootstrap", AWS_SECRET_ACCESS_KEY="bootstrap")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_up()
            self.key, self.secret = self._bootstrap()
        except BaseException:
            self.stop()
            raise

    def _wait_up(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode} (log: {self._log.name})")
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2) as r:
                    r.read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not answer on {self.endpoint} in {timeout} s")
                time.sleep(0.2)

    def _bootstrap(self):
        import boto3
        kw = dict(endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id="bootstrap",
                  aws_secret_access_key="bootstrap")
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="fastckpt")
        ak = iam.create_access_key(UserName="fastckpt")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="fastckpt", PolicyName="all", PolicyDocument=json.dumps(policy))
        boto3.client("s3", **kw).create_bucket(Bucket=BUCKET)
        return ak["AccessKeyId"], ak["SecretAccessKey"]

    def storage_options(self, endpoint: Optional[str] = None, **extra) -> Dict:
        """s3fs options for this server (or for a proxy in front of it): the
        user's key, the endpoint, the region; ``extra`` merged in."""
        opts = {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": REGION}}
        opts.update(extra)
        return opts

    def boto3_client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.key,
                            aws_secret_access_key=self.secret)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


# ---------------------------------------------------------------- the fault proxy

class Fault:
    """What to do with matching requests: ``kind`` is "500", "stall", "reset"
    or "drop_reply" (forwarded, then the connection is reset instead of answering);
    requests number ``nth`` .. ``nth + count - 1`` among those ``match``
    accepts (count=None: every one from nth on), each hit with probability
    ``fraction``."""

    def __init__(self, kind: str, nth: int = 1, count: Optional[int] = 1, fraction: float = 1.0,
                 match: Optional[Callable[[str, str], bool]] = None, seed: int = 0):
        assert kind in ("500", "stall", "reset", "drop_reply"), kind
        self.kind, self.nth, self.count, self.fraction = kind, nth, count, fraction
        self.match = match or (lambda method, path: True)
        self.seen = 0
        self.fired = 0
        self._rng = random.Random(seed)

    def hit(self, method: str, path: str) -> bool:
        if not self.match(method, path):
            return False
        self.seen += 1
        if self.seen < self.nth or (self.count is not None and self.seen >= self.nth + self.count):
            return False
        if self.fraction < 1.0 and self._rng.random() >= self.fraction:
            return False
        self.fired += 1
        return True


def is_part_upload(method: str, path: str) -> bool:
    """An S3 UploadPart request (PUT ...?partNumber=..&uploadId=..)."""
    return method == "PUT" and "uploadId=" in path and "partNumber=" in path


def is_complete_upload(method: str, path: str) -> bool:
    """An S3 CompleteMultipartUpload request (POST ...?uploadId=..)."""
    return method == "POST" and "uploadId=" in path


_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *a):  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = []
            while True:
                line = self.rfile.readline()
                n = int(line.split(b";")[0].strip(), 16)
                if n == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(out)
                out.append(self.rfile.read(n))
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self):
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _proxy(self):
        proxy = self.server.owner
        part = is_part_upload(self.command, self.path)
        fault = proxy._pick(self.command, self.path)
        if part:
            with proxy._lock:
                proxy.parts_in_progress += 1
                proxy.max_parts_in_progress = max(proxy.max_parts_in_progress, proxy.parts_in_progress)
        try:
            body = self._body()
            if fault == "reset":
                self._reset()
                return
            if fault == "stall":
                proxy._stop.wait(proxy.stall_s)
                self.close_connection = True
                return
            if fault == "500":
                msg = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                       b'<Message>injected by the test proxy</Message><RequestId>0</RequestId></Error>')
                self.send_response(500)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return
            with proxy._lock:
                proxy.requests.append((self.command, self.path, len(body)))
            conn = getattr(self, "_up", None)
            if conn is None:
                conn = self._up = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=120)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            if self.command in ("PUT", "POST") or body:
                headers["Content-Length"] = str(len(body))
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
            data = resp.read()
            if fault == "drop_reply":  # the server did it; the client is told nothing
                self._reset()
                return
            self.send_response_only(resp.status, resp.reason)
            head = self.command == "HEAD"  # its Content-Length is the object's: passed on as it is
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                    self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            if part:
                with proxy._lock:
                    proxy.parts_in_progress -= 1

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _proxy


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: "FaultProxy"


class FaultProxy:
    """A threaded HTTP proxy on 127.0.0.1 in front of ``upstream_port`` that
    injects the faults added with :meth:`add`; ``endpoint`` is its URL."""

    def __init__(self, upstream_port: int, stall_s: float = 60.0):
        self.upstream_port = upstream_port
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.faults: List[Fault] = []
        self.requests: List = []
        self.parts_in_progress = 0
        self.max_parts_in_progress = 0
        self._srv = _Server(("127.0.0.1", 0), _Handler)
        self._srv.owner = self
        self.endpoint = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()

    def add(self, *a, **kw) -> Fault:
        f = Fault(*a, **kw)
        with self._lock:
            self.faults.append(f)
        return f

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def _pick(self, method: str, path: str) -> Optional[str]:
        with self._lock:
            for f in self.faults:
                if f.hit(method, path):
                    return f.kind
        return None

    def close(self) -> None:
        self._stop.set()
        self._srv.shutdown()
        self._srv.server_close()
