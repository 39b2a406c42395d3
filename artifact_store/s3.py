"""A store in an S3 bucket (AWS, MinIO, any S3-compatible server) through boto3.

boto3 is imported when a store is created, never at module import, so the rest of Kiln
imports without it (install the ``s3`` extra to use this store).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from artifact_store.base import ArtifactStore, check_key
from artifact_store.digest import CHUNK_SIZE
from schemas.errors import ConfigError, NotFound, StoreError

logger = logging.getLogger(__name__)

_ABSENT = {"404", "NoSuchKey", "NotFound"}


class S3Store(ArtifactStore):
    """Objects live at ``<prefix>/<key>`` in ``bucket``.

    S3 makes an object visible only once its upload (multipart included) completes, which
    gives the atomic writes the store promises. The bucket must exist: a missing bucket is
    a ``ConfigError``; an unreachable endpoint is a (transient) ``StoreError``.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        public_endpoint_url: str | None = None,
        create: bool = False,
    ) -> None:
        try:
            import boto3
            import botocore.exceptions
            from botocore.config import Config
        except ImportError as exc:
            raise ConfigError(
                "the s3 artifact store needs boto3; install the 's3' extra (pip install 'kiln[s3]')"
            ) from exc
        if not bucket:
            raise ConfigError("an S3 store needs a bucket name: s3://<bucket>/<prefix>")
        self.bucket = bucket
        self.prefix = check_key(prefix.strip("/")) if prefix.strip("/") else ""
        self.uri = f"s3://{bucket}/{self.prefix}"
        self._exc = botocore.exceptions
        config = Config(
            connect_timeout=10,
            read_timeout=60,
            retries={"max_attempts": 3, "mode": "standard"},
        )
        self._client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region,
                                    config=config)
        self.endpoint_url = self._client.meta.endpoint_url
        self.region = region
        # Presigned URLs go to agents, which may reach the server under another name than the
        # control plane does (compose's http://minio:9000 is not resolvable outside it): they
        # are signed for the public endpoint, whose host is part of what the signature covers.
        self._presigner = self._client if not public_endpoint_url else boto3.client(
            "s3", endpoint_url=public_endpoint_url, region_name=region, config=config)
        self.public_endpoint_url = self._presigner.meta.endpoint_url
        if create:
            self._create_bucket()
        self._check_bucket()

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextlib.contextmanager
    def _errors(self, action: str, key: str | None = None) -> Iterator[None]:
        """Translate botocore failures into Kiln errors that name endpoint and bucket."""
        where = f"bucket {self.bucket!r} at {self.endpoint_url}"
        what = f"{action} {key!r}" if key is not None else action
        try:
            yield
        except self._exc.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _ABSENT:
                raise NotFound(f"no object {key!r} in {self.uri}", key=key) from exc
            if code == "NoSuchBucket":
                raise ConfigError(f"S3 {where} does not exist ({what} failed); `kiln store "
                                  f"init` creates it") from exc
            raise StoreError(f"S3 {what} failed on {where}: {exc}") from exc
        except self._exc.NoCredentialsError as exc:
            raise ConfigError(
                f"no AWS credentials to reach {where}; set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or another boto3 credential source)"
            ) from exc
        except self._exc.BotoCoreError as exc:
            raise StoreError(f"S3 {what} failed on {where}: {exc}") from exc

    def _check_bucket(self) -> None:
        try:
            with self._errors("checking the bucket"):
                self._client.head_bucket(Bucket=self.bucket)
        except NotFound as exc:  # HEAD has no error body: a bare 404 means "no such bucket"
            raise ConfigError(
                f"S3 bucket {self.bucket!r} does not exist at {self.endpoint_url}; create it "
                f"(`kiln store init` does, and checks write access) or fix the store URI "
                f"{self.uri}"
            ) from exc

    def _create_bucket(self) -> None:
        """Create the bucket unless it exists (``kiln store init``)."""
        try:
            with self._errors("checking the bucket"):
                self._client.head_bucket(Bucket=self.bucket)
            return
        except NotFound:
            pass
        args: dict[str, Any] = {"Bucket": self.bucket}
        if self.region != "us-east-1":  # S3 refuses the default region named explicitly
            args["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        with self._errors("creating the bucket"):
            self._client.create_bucket(**args)
        logger.info("created S3 bucket %r at %s", self.bucket, self.endpoint_url)

    def _put_file(self, key: str, src: Path) -> None:
        from boto3.exceptions import S3UploadFailedError

        try:
            with self._errors("upload", key):
                self._client.upload_file(str(src), self.bucket, self._full(key))
        except S3UploadFailedError as exc:
            raise StoreError(
                f"S3 upload {key!r} failed on bucket {self.bucket!r} at {self.endpoint_url}: {exc}"
            ) from exc

    def _get_range(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key)}
        if start > 0 or end is not None:
            args["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        with self._errors("download", key):
            body = self._client.get_object(**args)["Body"]
            try:
                yield from body.iter_chunks(CHUNK_SIZE)
            finally:
                body.close()

    def _size(self, key: str) -> int | None:
        try:
            with self._errors("head", key):
                return self._client.head_object(Bucket=self.bucket, Key=self._full(key))[
                    "ContentLength"
                ]
        except NotFound:
            return None

    def _delete(self, key: str) -> None:
        with self._errors("delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=self._full(key))

    def _list(self, prefix: str) -> Iterator[str]:
        strip = len(self._full(""))
        paginator = self._client.get_paginator("list_objects_v2")
        with self._errors("list", prefix):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._full(prefix)):
                for obj in page.get("Contents", []):
                    yield obj["Key"][strip:]

    def _presigned_url(self, key: str, ttl_s: int) -> str | None:
        with self._errors("presign", key):
            return self._presigner.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self._full(key)},
                ExpiresIn=ttl_s,
            )
