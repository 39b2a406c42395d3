"""Golden inputs and outputs written into every artifact the pipeline finishes: the first
verification samples and the reference outputs the engine was verified against. The agent
runs them on the device after loading the engine and before serving it (the rollout's
``golden`` gate); the format lives with the agent (``runtime_agent.golden``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from artifact_store.digest import sha256_file
from runtime_agent.executors import blob_filename
from runtime_agent.golden import GOLDEN_BLOB, GoldenSample, write_golden
from schemas.manifest import ArtifactManifest, BlobRef

logger = logging.getLogger(__name__)

#: How many verification samples travel with the artifact.
GOLDEN_SAMPLES = 2


def add_golden(manifest: ArtifactManifest, artifact_dir: Path,
               feeds: Sequence[Mapping[str, np.ndarray]],
               expected: Sequence[Mapping[str, np.ndarray]]) -> ArtifactManifest:
    """Write the golden blob into ``artifact_dir`` and return ``manifest`` listing it (once:
    a manifest that lists one already is returned as it is). Models with string tensors
    carry none: the golden file is plain npz without pickles, and the gate compares numbers;
    their rollouts say the golden gate had no samples."""
    if any(ref.name == GOLDEN_BLOB for ref in manifest.blobs) or not feeds:
        return manifest
    tensors = [a for sample in (*feeds, *expected) for a in sample.values()]
    if any(np.asarray(a).dtype.kind in "OSU" for a in tensors):
        logger.info("artifact %s: no golden samples (the model has string tensors)",
                    manifest.artifact_id)
        return manifest
    samples = [GoldenSample(dict(f), dict(e))
               for f, e in list(zip(feeds, expected, strict=False))[:GOLDEN_SAMPLES]]
    ref = BlobRef(name=GOLDEN_BLOB, sha256="0" * 64, size=0)
    path = write_golden(Path(artifact_dir) / blob_filename(ref), samples)
    digest, size = sha256_file(path)
    ref = ref.model_copy(update={"sha256": digest, "size": size})
    return manifest.model_copy(update={"blobs": [*manifest.blobs, ref]})
