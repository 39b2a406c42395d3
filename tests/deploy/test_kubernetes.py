"""deploy/kubernetes: every manifest parses and validates against the Kubernetes schemas of a
pinned version (offline, `kubernetes-validate`), and holds to what Kiln's trust model and
operations need: resources and probes, non-root containers, secrets only where they belong."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from compiler_worker.config import CONTROL_PLANE_SECRETS
from tests.deploy.kustomize import Doc, ManifestError, containers, load_documents, render

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "deploy" / "kubernetes"
#: The Kubernetes version the manifests are validated against.
KUBERNETES_VERSION = "1.32"
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "Job"}
#: Secrets only the control plane may reference.
CONTROL_PLANE_SECRET_OBJECTS = {"kiln-control-plane", "kiln-signing-key", "kiln-trust"}


def validate(doc: Doc) -> None:
    """The object against its apiVersion/kind's schema (strict: no unknown field); a failure
    names the file, the object and the field."""
    try:
        kubernetes_validate.validate(doc.body, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        field = ".".join(str(part) for part in exc.path) or "(top level)"
        raise ManifestError(f"{doc.label}: field {field}: {exc.message}") from exc
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise ManifestError(f"{doc.label}: {exc.message}") from exc


def pod_spec(body: dict[str, Any]) -> dict[str, Any]:
    return body["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def rendered() -> list[Doc]:
    return render(FOLDER)


@pytest.fixture(scope="module")
def workloads(rendered: list[Doc]) -> dict[str, Doc]:
    return {doc.body["metadata"]["name"]: doc for doc in rendered
            if doc.body["kind"] in WORKLOADS}


@pytest.fixture(scope="module")
def example_secrets() -> dict[str, set[str]]:
    return {doc.body["metadata"]["name"]: set(doc.body.get("stringData", {}))
            | set(doc.body.get("data", {}))
            for doc in load_documents(FOLDER / "secret.example.yaml")}


def test_every_manifest_validates_against_the_pinned_schema(rendered: list[Doc]) -> None:
    example = load_documents(FOLDER / "secret.example.yaml")
    files = {path.name for path in FOLDER.glob("*.yaml")} - {"kustomization.yaml"}
    assert {doc.file.name for doc in [*rendered, *example]} == files, \
        "every manifest file is listed in kustomization.yaml (or is the example Secret)"
    for doc in [*rendered, *example]:
        validate(doc)
    kinds = {(doc.body["kind"], doc.body["metadata"]["name"]) for doc in rendered}
    assert {("Deployment", "kiln-api"), ("Service", "kiln-api"), ("Service", "kiln-api-fleet"),
            ("Deployment", "kiln-worker-cpu"), ("Deployment", "kiln-worker-gpu"),
            ("DaemonSet", "kiln-agent")} <= kinds


def test_a_broken_manifest_fails_naming_its_file_and_field(tmp_path: Path) -> None:
    shutil.copy(FOLDER / "kustomization.yaml", tmp_path)
    for path in FOLDER.glob("*.yaml"):
        shutil.copy(path, tmp_path)
    text = (tmp_path / "worker-cpu.yaml").read_text()
    (tmp_path / "worker-cpu.yaml").write_text(
        text.replace("terminationGracePeriodSeconds: 60", "terminationGracePeriodSeconds: soon"))
    docs = render(tmp_path)
    with pytest.raises(ManifestError) as caught:
        for doc in docs:
            validate(doc)
    message = str(caught.value)
    assert "worker-cpu.yaml" in message and "kiln-worker-cpu" in message
    assert "spec.template.spec.terminationGracePeriodSeconds" in message

    # An unknown field (a typo) fails too: the schemas are strict.
    (tmp_path / "worker-cpu.yaml").write_text(text.replace("readinessProbe:", "readynessProbe:"))
    with pytest.raises(ManifestError, match=r"worker-cpu\.yaml.*readynessProbe"):
        for doc in render(tmp_path):
            validate(doc)

    (tmp_path / "agent.yaml").write_text("kind: [unclosed\n")
    with pytest.raises(ManifestError, match=r"agent\.yaml: not valid YAML"):
        render(tmp_path)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to compare with")
def test_kubectl_kustomize_renders_the_same_objects(rendered: list[Doc]) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(FOLDER)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    theirs = {(body["kind"], body["metadata"]["name"]): body
              for body in yaml.safe_load_all(out) if body}
    ours = {(doc.body["kind"], doc.body["metadata"]["name"]): doc.body for doc in rendered}
    assert theirs == ours


def test_every_container_has_requests_limits_and_probes(workloads: dict[str, Doc]) -> None:
    for name, doc in workloads.items():
        spec = pod_spec(doc.body)
        for container in containers(doc.body):
            where = f"{doc.label} container {container['name']}"
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), \
                    f"{where}: resources.{kind} needs cpu and memory"
        for container in spec["containers"]:
            if not container.get("ports"):
                continue  # serves no HTTP
            where = f"{name}/{container['name']}"
            assert container.get("livenessProbe", {}).get("httpGet", {}).get("path") \
                == "/healthz", f"{where}: liveness on /healthz"
            assert container.get("readinessProbe", {}).get("httpGet", {}).get("path") \
                == "/readyz", f"{where}: readiness on /readyz"
    # The worker's health server listens on loopback unless told otherwise: the kubelet
    # probes the pod's address.
    for name in ("kiln-worker-cpu", "kiln-worker-gpu"):
        env = _env(workloads[name])
        assert env["KILN_WORKER_HEALTH_HOST"]["value"] == "0.0.0.0"
        assert env["KILN_WORKER_HEALTH_PORT"]["value"] == "8001"


def test_containers_run_unprivileged(workloads: dict[str, Doc]) -> None:
    for doc in workloads.values():
        spec = pod_spec(doc.body)
        assert spec.get("enableServiceLinks") is False, \
            f"{doc.label}: service links would set KILN_API_PORT=tcp://..., a Kiln setting"
        assert spec.get("automountServiceAccountToken") is False, doc.label
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", doc.label
        for container in containers(doc.body):
            where = f"{doc.label} container {container['name']}"
            context = container.get("securityContext", {})
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("readOnlyRootFilesystem") is True, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not context.get("privileged"), where
            if (doc.body["metadata"]["name"], container["name"]) == ("kiln-agent", "cache-owner"):
                # The one root container: it chowns the agent's host cache, with CHOWN only.
                assert context["capabilities"].get("add") == ["CHOWN"], where
                assert container["command"][0] == "chown", where
                continue
            assert context.get("runAsNonRoot") is True, where
            assert context.get("runAsUser") == 10001, where
            assert not context.get("capabilities", {}).get("add"), where
            mounts = {mount["mountPath"] for mount in container.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{where}: a writable /tmp beside the read-only root"


def test_secret_references_name_keys_the_example_defines(
        workloads: dict[str, Doc], example_secrets: dict[str, set[str]]) -> None:
    seen = 0
    for doc in workloads.values():
        for container in containers(doc.body):
            assert not container.get("envFrom"), f"{doc.label}: name each variable"
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref is None:
                    continue
                seen += 1
                assert ref["name"] in example_secrets, \
                    f"{doc.label}: {var['name']} names Secret {ref['name']}, not in the example"
                assert ref["key"] in example_secrets[ref["name"]], \
                    f"{doc.label}: {var['name']} names key {ref['key']} of {ref['name']}, " \
                    f"which the example does not define"
        for volume in pod_spec(doc.body).get("volumes", []):
            secret = volume.get("secret")
            if secret is None:
                continue
            seen += 1
            assert secret["secretName"] in example_secrets, doc.label
            for item in secret.get("items", []):
                assert item["key"] in example_secrets[secret["secretName"]], \
                    f"{doc.label}: volume {volume['name']} names key {item['key']}"
    assert seen >= 10


def _env(doc: Doc, container: str | None = None) -> dict[str, dict[str, Any]]:
    found = {}
    for each in containers(doc.body):
        if container is None or each["name"] == container:
            found.update({var["name"]: var for var in each.get("env", [])})
    return found


def _secrets_mounted(doc: Doc) -> set[str]:
    spec = pod_spec(doc.body)
    return {volume["secret"]["secretName"] for volume in spec.get("volumes", [])
            if "secret" in volume}


def test_workers_and_agents_hold_no_control_plane_secret(workloads: dict[str, Doc]) -> None:
    for name in ("kiln-worker-cpu", "kiln-worker-gpu", "kiln-agent"):
        doc = workloads[name]
        env = _env(doc)
        held = set(env) & (set(CONTROL_PLANE_SECRETS) | {"KILN_TRUST_DIR"})
        assert not held, f"{name} holds {sorted(held)}"
        assert not [var for var in env if var.startswith("AWS_")], name
        referenced = {var["valueFrom"]["secretKeyRef"]["name"] for var in env.values()
                      if "secretKeyRef" in var.get("valueFrom", {})}
        assert not (referenced | _secrets_mounted(doc)) & CONTROL_PLANE_SECRET_OBJECTS, name
    # As in docker-compose.yml: workers get the broker, the API and a worker token; agents the
    # API's fleet port and an agent token (read from their node's key).
    for name in ("kiln-worker-cpu", "kiln-worker-gpu"):
        env = _env(workloads[name])
        assert {"KILN_BROKER_URL", "KILN_WORKER_API_URL", "KILN_WORKER_TOKEN"} <= set(env)
        assert env["KILN_WORKER_API_URL"]["value"] == "http://kiln-api:8000"
    agent = _env(workloads["kiln-agent"], "agent")
    assert agent["KILN_AGENT_API_URL"]["value"] == "http://kiln-api-fleet:8001"
    assert "KILN_BROKER_URL" not in agent
    assert "kiln-agent-tokens" in _secrets_mounted(workloads["kiln-agent"])
    api = _env(workloads["kiln-api"], "api")
    assert {"KILN_DATABASE_URL", "KILN_SECRET_KEY", "AWS_SECRET_ACCESS_KEY",
            "KILN_SIGNING_KEY_PATH"} <= set(api)


def test_agents_port_apart_and_hardware_classes(workloads: dict[str, Doc],
                                                rendered: list[Doc]) -> None:
    api = pod_spec(workloads["kiln-api"].body)["containers"][0]
    assert api["command"][api["command"].index("--agent-port") + 1] == "8001"
    services = {doc.body["metadata"]["name"]: doc.body for doc in rendered
                if doc.body["kind"] == "Service"}
    assert [port["port"] for port in services["kiln-api-fleet"]["spec"]["ports"]] == [8001]
    assert [port["port"] for port in services["kiln-api"]["spec"]["ports"]] == [8000]

    cpu = pod_spec(workloads["kiln-worker-cpu"].body)
    assert "kubernetes.io/arch" in cpu["nodeSelector"]
    gpu_doc = workloads["kiln-worker-gpu"]
    gpu = pod_spec(gpu_doc.body)
    assert gpu["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    worker = gpu["containers"][0]
    assert str(worker["resources"]["limits"].get("nvidia.com/gpu")) == "1", \
        "the GPU worker requests a GPU"
    assert "kiln-gpu:" in worker["image"], "the GPU worker runs the image with GPU engines"

    agent = workloads["kiln-agent"].body
    assert agent["kind"] == "DaemonSet"
    cache = {volume["name"]: volume for volume in pod_spec(agent)["volumes"]}["cache"]
    assert cache["hostPath"]["path"] == _env(workloads["kiln-agent"],
                                             "agent")["KILN_AGENT_CACHE_DIR"]["value"]


def test_images_are_set_by_the_kustomization(workloads: dict[str, Doc]) -> None:
    config = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())
    allowed = {f"{entry['newName']}:{entry['newTag']}" for entry in config["images"]}
    assert len({entry["newTag"] for entry in config["images"]}) == 1, "one tag for all"
    for doc in workloads.values():
        for container in containers(doc.body):
            assert container["image"] in allowed, f"{doc.label}: {container['image']}"
