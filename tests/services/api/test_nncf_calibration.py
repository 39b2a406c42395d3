"""A compile request whose int8 calibration would be NNCF's (the options name only the
openvino backend and allow int8) is refused at submit when the calibrating dataset holds fewer
samples than NNCF's method needs: a 422 naming the minimum, and no job written."""

from __future__ import annotations

from schemas.datasets import NNCF_MIN_CALIBRATION_SAMPLES
from tests.services.api.test_datasets import images, model, push

OV_KEY = "ov-cpu-x86-64-v4-amx-bf16-vnni-ov2026.4.1"


def submit(api, model_id: str, **options):
    return api.post("/v1/compile-jobs", json={
        "model_id": model_id, "targets": [{"fingerprint_key": OV_KEY}], "options": options})


def test_too_few_calibration_samples_for_nncf_is_422_naming_the_minimum(api) -> None:
    cnn = model(api, batch=1)
    few = push(api, images(NNCF_MIN_CALIBRATION_SAMPLES - 1, 1, 3, 32, 32)).json()["id"]
    enough = push(api, images(NNCF_MIN_CALIBRATION_SAMPLES, 1, 3, 32, 32)).json()["id"]
    refused = submit(api, cnn, backends=["openvino"], precision="auto", calibration=few)
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["code"] == "invalid_options"
    assert f"at least {NNCF_MIN_CALIBRATION_SAMPLES}" in body["message"]
    assert body["details"]["minimum"] == NNCF_MIN_CALIBRATION_SAMPLES
    # The samples calibrate when no calibration dataset is named.
    assert submit(api, cnn, backends=["openvino"], precision="int8",
                  samples=few).status_code == 422
    assert api.get("/v1/compile-jobs").json() == []
    # Enough samples, or options under which NNCF does not calibrate, are accepted.
    assert submit(api, cnn, backends=["openvino"], precision="auto",
                  calibration=enough, samples=few).status_code == 202
    assert submit(api, cnn, backends=["openvino"], precision="fp32",
                  samples=few).status_code == 202
    assert submit(api, cnn, precision="auto", calibration=few).status_code == 202
