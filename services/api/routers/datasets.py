"""``/v1/datasets``: sample inputs (``.npz``) uploaded once; the same bytes are the same dataset.

A compile request names a dataset by id in ``options.samples`` (verification, accuracy,
benchmarking) or ``options.calibration`` (static int8). Each array is a stack of samples
along its first axis; see ``schemas.datasets``.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, File, Request, Response, UploadFile, status

from schemas.datasets import NPZ_MEDIA_TYPE, DatasetInfo
from services.api.deps import (
    AdminPrincipal,
    DatasetId,
    Limit,
    ReaderPrincipal,
    Route,
    SessionDep,
    SettingsDep,
    StoreDep,
)
from services.api.gate import BODY_LIMIT
from services.api.inspection import inspect_dataset
from services.api.threads import committed, run_slow
from services.api.transfers import received_upload, scratch_of
from services.db import repo

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/datasets", tags=["datasets"], route_class=Route)


@router.post("", response_model=DatasetInfo, status_code=status.HTTP_201_CREATED,
             responses={200: {"model": DatasetInfo,
                              "description": "the same bytes were uploaded before"}},
             openapi_extra={BODY_LIMIT: "max_dataset_bytes"})
async def upload_dataset(
    response: Response, session: SessionDep, store: StoreDep, settings: SettingsDep,
    _: AdminPrincipal, http: Request,
    file: Annotated[UploadFile, File(description="the .npz file")],
) -> DatasetInfo:
    """Store an ``.npz`` of sample inputs: one array per model input, first axis = sample.
    Validated from its headers first (no pickles, no absurd shapes, within the size limit), in
    a bounded child."""
    limit = min(settings.max_dataset_bytes, settings.max_upload_bytes)
    async with received_upload(file, scratch=scratch_of(http), max_bytes=limit,
                               what="an .npz dataset",
                               limit_name="KILN_MAX_DATASET_BYTES") as (path, size):
        tensors = await run_slow(http, inspect_dataset, path, settings=settings,
                                 max_bytes=limit)
        ref = await run_slow(http, store.put_blob, path, name="dataset",
                             media_type=NPZ_MEDIA_TYPE)
    dataset, created = await committed(session, repo.record_dataset, sha256=ref.sha256,
                                       size_bytes=size, tensors=tensors,
                                       blob_key=store.blob_key(ref.sha256))
    if not created:
        response.status_code = status.HTTP_200_OK
    logger.info("dataset %s (%d bytes) %s", dataset.id, size, "stored" if created else "exists")
    return dataset


@router.get("", response_model=list[DatasetInfo])
def list_datasets(session: SessionDep, _: ReaderPrincipal, limit: Limit = 100
                  ) -> list[DatasetInfo]:
    return repo.list_datasets(session, limit=limit)


@router.get("/{dataset_id}", response_model=DatasetInfo)
def get_dataset(dataset_id: DatasetId, session: SessionDep) -> DatasetInfo:
    return repo.require_dataset(session, dataset_id=dataset_id)
