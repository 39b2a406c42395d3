"""Render a kustomization without a cluster or a kustomize binary: the fields Kiln's uses
(``resources`` files, ``namespace``, ``labels`` pairs on metadata only, ``images``), and a
refusal naming any other field, so that the manifests never rely on what this does not do."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass"}


class ManifestError(Exception):
    """A manifest or the kustomization is invalid; the message names the file and field."""


@dataclass
class Doc:
    file: Path
    body: dict[str, Any]

    @property
    def label(self) -> str:
        name = self.body.get("metadata", {}).get("name")
        return f"{self.file.name}: {self.body.get('kind')}/{name}"


def load_documents(path: Path) -> list[Doc]:
    """Every non-empty YAML document of ``path``; a parse error names the file."""
    try:
        bodies = [body for body in yaml.safe_load_all(path.read_text()) if body is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path.name}: not valid YAML: {exc}") from exc
    for index, body in enumerate(bodies):
        if not isinstance(body, dict) or "kind" not in body or "apiVersion" not in body:
            raise ManifestError(f"{path.name}: document {index} is not a Kubernetes object "
                                f"(expected a mapping with apiVersion and kind)")
    return [Doc(path, body) for body in bodies]


def _containers(body: dict[str, Any]) -> list[dict[str, Any]]:
    spec = body.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def render(folder: Path) -> list[Doc]:
    """The objects ``kubectl apply -k folder`` would apply."""
    kustomization = folder / "kustomization.yaml"
    config = yaml.safe_load(kustomization.read_text())
    unknown = sorted(set(config) - SUPPORTED)
    if unknown:
        raise ManifestError(f"{kustomization.name}: fields {unknown} are not rendered by the "
                            f"tests' helper (supported: {sorted(SUPPORTED)})")
    images = {}
    for index, entry in enumerate(config.get("images", [])):
        if set(entry) - {"name", "newName", "newTag"} or "name" not in entry:
            raise ManifestError(f"{kustomization.name}: images[{index}] takes name, newName "
                                f"and newTag, got {sorted(entry)}")
        images[entry["name"]] = entry
    pairs: dict[str, str] = {}
    for index, entry in enumerate(config.get("labels", [])):
        if set(entry) - {"pairs"} or entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise ManifestError(f"{kustomization.name}: labels[{index}]: only `pairs` (on "
                                f"metadata) is rendered by the tests' helper")
        pairs.update(entry["pairs"])
    namespace = config.get("namespace")
    docs: list[Doc] = []
    for name in config.get("resources", []):
        for doc in load_documents(folder / name):
            body = copy.deepcopy(doc.body)
            metadata = body.setdefault("metadata", {})
            metadata.setdefault("labels", {}).update(pairs)
            if namespace:
                if body["kind"] == "Namespace":
                    metadata["name"] = namespace
                elif body["kind"] not in CLUSTER_SCOPED:
                    metadata["namespace"] = namespace
            for container in _containers(body):
                image = container.get("image", "")
                base, _, tag = image.partition(":")
                entry = images.get(base)
                if entry is not None:
                    new_tag = entry.get("newTag", tag)
                    suffix = f":{new_tag}" if new_tag else ""
                    container["image"] = entry.get("newName", base) + suffix
            docs.append(Doc(doc.file, body))
    return docs


def containers(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The init containers and containers of a workload's pod template."""
    return _containers(body)
