"""A real S3 server for the tests: moto's server mode (the S3 protocol over HTTP) on 127.0.0.1, started
once per test session (``tests/conftest.py``: fixtures ``s3_server`` and ``s3_dump``).

``S3Server.env`` is what a client process needs (``AWS_ENDPOINT_URL``, test credentials, region):
both pyarrow's S3 file system and s3fs/boto3 read these standard variables, so a subprocess given
them reaches the same server. ``bucket()`` creates a new, empty bucket."""

from __future__ import annotations

import logging
import socket
import uuid


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer  # a test dependency (the `test` extra)

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"] for p in pages for o in p.get("Contents", [])]

    def stop(self) -> None:
        self._server.stop()
