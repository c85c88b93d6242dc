"""A real S3-API server (moto_server) on 127.0.0.1 and a free port, for the whole session; no other network."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path_factory, extra_env: dict[str, str]):
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(exe):
        exe = shutil.which("moto_server")
    if exe is None:
        pytest.fail("moto_server is not installed: pip install 'moto[server]' (it is in the test extra)")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w+")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **extra_env, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto_server did not start on port {port}")
            time.sleep(0.2)
    return proc, port, log


class S3:
    """The server's address and the environment that points clients at it."""

    def __init__(self, port: int, log):
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}
        self.log = log

    def bucket(self) -> str:
        import fsspec

        name = f"b-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=self.endpoint, key="testing", secret="testing").mkdir(name)
        return name

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    proc, port, log = _start(tmp_path_factory, {})
    server = S3(port, log)
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture(scope="session")
def s3_server_with_auth(tmp_path_factory):
    """A second server that checks credentials (moto: INITIAL_NO_AUTH_ACTION_COUNT=0)."""
    proc, port, log = _start(tmp_path_factory, {"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    yield S3(port, log)
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture
def bucket(s3_server):
    return s3_server.bucket()
