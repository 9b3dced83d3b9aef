"""A local S3 server for tests: moto's real HTTP server on 127.0.0.1, one per session.

Code under test reaches it exactly as it would reach AWS: through the environment (fake keys and
`AWS_ENDPOINT_URL_S3`, which s3fs, boto3 and the MLflow server honour; `MLFLOW_S3_ENDPOINT_URL`
too). The variables are set for the rest of the session once the server starts, because services
started later inherit them: the session stack depends on this fixture, so its worker (also when a
test restarts the stack) runs jobs that reach the same server. No test can then reach real AWS.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

BUCKET = "opentinker-test"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str
    env: dict[str, str]

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def objects(self, url: str) -> dict[str, str]:
        """Key → ETag of every object under `url` (s3://bucket/prefix): a snapshot to prove that a
        failure changed nothing."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


@contextmanager
def moto_server(address: str = "127.0.0.1") -> Iterator[S3Server]:
    """moto's ThreadedMotoServer on a free port of `address` (its default binds every interface) with one bucket."""
    from moto.server import ThreadedMotoServer

    from tests.stack_fixtures import free_ports

    (port,) = free_ports(1)
    server = ThreadedMotoServer(ip_address=address, port=port, verbose=False)
    server.start()
    endpoint = f"http://{address}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
        "MLFLOW_S3_ENDPOINT_URL": endpoint,
    }
    s3 = S3Server(endpoint, BUCKET, env)
    try:
        s3.client().create_bucket(Bucket=BUCKET)
        yield s3
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server():
    """A moto server on loopback; yields an S3Server, with its `env` set in os.environ until the session ends."""
    with moto_server() as s3, pytest.MonkeyPatch.context() as session_env:
        for key, value in s3.env.items():
            session_env.setenv(key, value)
        yield s3


@pytest.fixture
def s3_url(s3_server, monkeypatch, request) -> str:
    """A fresh `s3://bucket/<test name>-<random>`; the server's variables are set again for this
    test (a test that removed one with monkeypatch gets it back afterwards either way)."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40]
    return f"s3://{s3_server.bucket}/{name}-{uuid.uuid4().hex[:8]}"
