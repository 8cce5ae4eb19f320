"""A local S3-compatible server for the tests and benchmarks: moto's standalone server (the one
the Python S3 libraries' own test suites run), started and stopped by this script, talked to over
HTTP by the same client code that talks to AWS.

In front of it, optionally, a TCP relay (``gate=True``): the endpoint the client is given. The
fault tests kill the relay (the server's endpoint goes away mid-request, as when the server
dies) and start it again on the same port: moto keeps its objects in memory, so killing moto
itself would lose the previous checkpoint too, which no real store does; the relay is the part
that dies, the server's state survives like a real store's.

    python -m bench.s3_server [--port N]    # runs until interrupted, prints the variables

From Python: ``with S3Server() as s3: s3.env`` (the AWS variables that point at it).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

RELAY = r"""
import socket, sys, threading
listen, target = int(sys.argv[1]), int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", listen)); srv.listen(128)
def pump(a, b):
    try:
        while data := a.recv(1 << 20):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass
while True:
    c, _ = srv.accept()
    u = socket.create_connection(("127.0.0.1", target))
    for a, b in ((c, u), (u, c)):
        threading.Thread(target=pump, args=(a, b), daemon=True).start()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Any,
               timeout_s: float = 30.0) -> None:
    """Until ``url`` answers (bounded; fails with the server's output, ``log``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log.seek(0)
                out = log.read().decode(errors="replace")
                raise RuntimeError(f"the S3 server at {url} did not come up (exit "
                                   f"{proc.poll()}):\n{out[-3000:]}") from None
            time.sleep(0.05)


def _moto_command() -> list[str]:
    """This interpreter's moto (its environment's script, else the module)."""
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "moto.server"]


class S3Server:
    """moto_server on a free port (and the relay in front where ``gate``), a bucket made."""

    def __init__(self, bucket: str = "ckpt", gate: bool = False, auth: bool = False):
        """``auth``: the server checks every request's credentials (moto's IAM, where the
        access key ``testing`` is unknown: every request is refused, HTTP 403); no bucket."""
        self.bucket, self.gate, self.auth = bucket, gate, auth
        self.server_port = free_port()
        self.port = free_port() if gate else self.server_port
        self.server: subprocess.Popen[bytes] | None = None
        self.relay: subprocess.Popen[bytes] | None = None
        # the server logs every request: into a file, never a pipe nobody drains (a full pipe
        # blocks the server's next log line, and with it every request)
        self.log = tempfile.TemporaryFile()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}

    def start(self) -> S3Server:
        self.server = subprocess.Popen(
            [*_moto_command(), "-H", "127.0.0.1", "-p", str(self.server_port)],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if self.auth else {})})
        _wait_http(f"http://127.0.0.1:{self.server_port}/moto-api/", self.server, self.log)
        if self.gate:
            self.start_relay()
        if not self.auth:
            self.make_bucket(self.bucket)
        return self

    def make_bucket(self, name: str) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.server_port}/{name}", method="PUT")
        urllib.request.urlopen(req, timeout=10).close()

    def start_relay(self) -> None:
        assert self.gate
        self.relay = subprocess.Popen(
            [sys.executable, "-c", RELAY, str(self.port), str(self.server_port)],
            stdout=self.log, stderr=subprocess.STDOUT)
        _wait_http(f"{self.endpoint}/moto-api/", self.relay, self.log)

    def kill_relay(self) -> None:
        """The endpoint dies at once (SIGKILL): open connections are cut mid-request."""
        if self.relay is not None:
            self.relay.kill()
            self.relay.wait()
            self.relay = None

    def stop(self) -> None:
        self.kill_relay()
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
            self.server = None
        self.log.close()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bucket", default="ckpt")
    args = ap.parse_args()
    with S3Server(args.bucket) as s3:
        for k, v in s3.env.items():
            print(f"export {k}={v}")
        print(f"# bucket s3://{args.bucket} ready; Ctrl-C stops the server", flush=True)
        try:
            while s3.server is not None and s3.server.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
