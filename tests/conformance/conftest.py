"""The ``conformance`` marker: ONNX's own test models through Kiln (``-m conformance``)."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "conformance: ONNX's backend test models compiled by Kiln and checked "
                   "against their shipped outputs (about 2 minutes on 2 cores)")
