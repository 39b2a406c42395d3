"""The worker's untrusted steps in real child processes: a hostile plugin gets nothing of the
worker's, a model that inflates past the memory limit fails ``resource_limit`` naming its
stage, and the same ``Sandbox`` then builds the next model."""

from __future__ import annotations

import json
import logging
import socket
import textwrap
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from artifact_store.sandbox import Limits
from compiler_worker.pipeline import CustomOpsFound, plan_build
from compiler_worker.sandbox import Sandbox
from kiln.examples import mlp
from schemas._canonical import sha256_hex
from schemas.errors import ResourceLimit
from schemas.fingerprint import HardwareFingerprint
from tests.compiler_worker.helpers import fast_options
from tests.plugins.helpers import SCALE_MODULE, pack, scale_model, scale_plugin, unique_domain

SECRET = "SECRET-SIGNING-KEY-5f1e"

#: A plugin module that, when the build imports it, tries every way to the worker's secrets
#: and writes what it got to ``probe.json`` in its working folder (the job's scratch folder).
HOSTILE = '''
import json, os, socket
from pathlib import Path

def _try(action):
    try:
        return "ok: " + str(action())
    except Exception as exc:
        return "refused: " + type(exc).__name__

_parent = os.getppid()
_probe = {
    "env": dict(os.environ),
    "signing_key": _try(lambda: Path(SIGNING_KEY).read_text()),
    "secret_file": _try(lambda: Path(SECRET_FILE).read_text()),
    "parent_environ": _try(lambda: Path(f"/proc/{_parent}/environ").read_bytes()),
    "write_outside": _try(lambda: Path(OUTSIDE).write_text("planted")),
    "connect": _try(lambda: socket.create_connection(("127.0.0.1", PORT), timeout=3).close()),
    "signal_parent": _try(lambda: os.kill(_parent, 0)),
}
Path("probe.json").write_text(json.dumps(_probe))
'''


def _plan(model: onnx.ModelProto, fingerprint: HardwareFingerprint, options, plugins=()):
    return plan_build(sha256_hex(model.SerializeToString()), options, fingerprint,
                      plugins=[ref for ref, _ in plugins])


def test_a_hostile_plugin_gets_nothing_of_the_worker(
        tmp_path: Path, fingerprint: HardwareFingerprint, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture):
    # The worker's secrets: a signing key file, a secret file, credentials in its environment.
    signing_key = tmp_path / "home" / "signing.key"
    signing_key.parent.mkdir()
    signing_key.write_text(SECRET)
    secret_file = tmp_path / "db-password"
    secret_file.write_text(SECRET)
    for name in ("KILN_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, SECRET)
    monkeypatch.setenv("KILN_DATABASE_URL", f"postgresql://kiln:{SECRET}@db/kiln")
    monkeypatch.setenv("KILN_SIGNING_KEY_PATH", str(signing_key))
    outside = tmp_path / "planted.txt"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)

    domain = unique_domain()
    module = SCALE_MODULE + textwrap.dedent(HOSTILE).replace(
        "SIGNING_KEY", repr(str(signing_key))).replace("SECRET_FILE", repr(str(secret_file))
    ).replace("OUTSIDE", repr(str(outside))).replace("PORT", str(listener.getsockname()[1]))
    bundle = pack(scale_plugin(tmp_path / "hostile", domain=domain, module=module),
                  tmp_path / "hostile.tar")
    workdir = tmp_path / "job"
    workdir.mkdir()
    archive = workdir / "plugin.tar"  # the runner fetches bundles into the job's folder
    archive.write_bytes(bundle.archive.read_bytes())
    plugins = [(bundle.ref, archive)]
    model, options = scale_model(domain), fast_options()

    caplog.set_level(logging.DEBUG)
    with listener:
        result = Sandbox(Limits(wall_s=300)).compile_model(
            model.SerializeToString(), options, fingerprint=fingerprint, workdir=workdir,
            plan=_plan(model, fingerprint, options, plugins), plugins=plugins)
        with pytest.raises(BlockingIOError):
            listener.accept()

    probe = json.loads((workdir / "probe.json").read_text())
    assert result.manifest.plugins == [bundle.ref]  # the build itself went through
    assert SECRET not in json.dumps(probe)
    assert not {"KILN_SECRET_KEY", "AWS_SECRET_ACCESS_KEY", "KILN_DATABASE_URL",
                "KILN_SIGNING_KEY_PATH"} & set(probe["env"])
    for attempt in ("signing_key", "secret_file", "parent_environ", "write_outside",
                    "connect", "signal_parent"):
        assert probe[attempt].startswith("refused"), (attempt, probe[attempt])
    assert not outside.exists()
    assert SECRET not in caplog.text


def test_a_build_given_no_plugins_answers_the_custom_ops_of_its_model_and_builds_nothing(
        tmp_path: Path, fingerprint: HardwareFingerprint):
    """The worker learns a model's custom ops from its build's child (which then builds
    nothing) and builds again with the plugins; a model without any builds at once."""
    domain = unique_domain()
    model, options = scale_model(domain), fast_options()
    sandbox = Sandbox(Limits(wall_s=300))
    with pytest.raises(CustomOpsFound) as found:
        sandbox.compile_model(model.SerializeToString(), options, fingerprint=fingerprint,
                              workdir=tmp_path / "job", plan=_plan(model, fingerprint, options))
    assert found.value.ops == {f"{domain}::Scale"}
    job = tmp_path / "job"
    # No engine and no result; the submitted model unpacked (``job/model``) is all it read.
    assert not [p for p in job.rglob("*") if p.parent != job / "model"
                and p.suffix in {".onnx", ".xml", ".bin", ".pt2", ".json"}]
    plain = mlp()
    result = sandbox.compile_model(plain.SerializeToString(), options, fingerprint=fingerprint,
                                   workdir=tmp_path / "plain",
                                   plan=_plan(plain, fingerprint, options))
    assert result.manifest.plugins == [] and result.manifest.verification.passed


def inflating_model(side: int = 1 << 15) -> onnx.ModelProto:
    """``y = Expand(x, [side, side])``: a 12-byte graph whose output is ``side²`` floats
    (4 GiB by default) as soon as anything runs it."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [side, side])
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["y"])], "inflate",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [side, side])],
        initializer=[shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_model_inflating_past_the_memory_limit_fails_and_the_next_one_builds(
        tmp_path: Path, fingerprint: HardwareFingerprint):
    sandbox = Sandbox(Limits(address_space_bytes=2 << 30, wall_s=300))
    options = fast_options()
    model = inflating_model()
    with pytest.raises(ResourceLimit) as err:
        sandbox.compile_model(model.SerializeToString(), options, fingerprint=fingerprint,
                              workdir=tmp_path / "a", plan=_plan(model, fingerprint, options))
    assert err.value.details["limit"] == "address_space"
    assert err.value.details["stage"] in {"building", "verifying"}, err.value.details

    good = mlp()
    result = sandbox.compile_model(good.SerializeToString(), options, fingerprint=fingerprint,
                                   workdir=tmp_path / "b", plan=_plan(good, fingerprint, options))
    assert result.manifest.verification.passed
    assert all(path.is_file() and path.is_relative_to((tmp_path / "b").resolve())
               for path in result.blob_paths.values())


#: A native custom-op library whose constructor runs when onnxruntime loads it (in the build):
#: it reads the secret, writes outside, reads the worker's environ, and records what it got
#: in ``probe_native.txt`` in its working folder. It registers no op, so the build then fails.
HOSTILE_LIBRARY = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void attempt(FILE *out, const char *what, int fd) {
    char buffer[256] = {0};
    if (fd < 0) { fprintf(out, "%s=refused:%d\n", what, errno); return; }
    ssize_t n = read(fd, buffer, sizeof buffer - 1);
    fprintf(out, "%s=ok:%.*s\n", what, (int)(n > 0 ? n : 0), buffer);
    close(fd);
}

__attribute__((constructor)) static void probe(void) {
    FILE *out = fopen("probe_native.txt", "w");
    if (!out) return;
    char environ_path[64];
    snprintf(environ_path, sizeof environ_path, "/proc/%d/environ", (int)getppid());
    attempt(out, "signing_key", open(SIGNING_KEY, O_RDONLY));
    attempt(out, "parent_environ", open(environ_path, O_RDONLY));
    int planted = open(OUTSIDE, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    fprintf(out, "write_outside=%s:%d\n", planted < 0 ? "refused" : "ok", errno);
    if (planted >= 0) close(planted);
    fprintf(out, "env_secret=%s\n", getenv("KILN_SECRET_KEY") ? getenv("KILN_SECRET_KEY")
                                                               : "refused:unset");
    fclose(out);
}

void *RegisterCustomOps(void *options, const void *api) { return 0; }
"""


def test_a_hostile_native_library_gets_nothing_of_the_worker(
        tmp_path: Path, fingerprint: HardwareFingerprint, monkeypatch: pytest.MonkeyPatch):
    import shutil
    import subprocess

    from runtime_agent.plugins.abi import runtime_abi
    from schemas.errors import KilnError
    from tests.plugins.helpers import write_folder

    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the hostile library")
    signing_key = tmp_path / "home" / "signing.key"
    signing_key.parent.mkdir()
    signing_key.write_text(SECRET)
    monkeypatch.setenv("KILN_SECRET_KEY", SECRET)
    outside = tmp_path / "planted-native.txt"
    domain = unique_domain()
    folder = tmp_path / "native"
    (folder / "lib").mkdir(parents=True)
    (tmp_path / "hostile.c").write_text(HOSTILE_LIBRARY)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "lib" / "libhostile.so"),
                    f"-DSIGNING_KEY=\"{signing_key}\"", f"-DOUTSIDE=\"{outside}\"",
                    str(tmp_path / "hostile.c")], check=True)
    manifest = {
        "name": "hostile-native", "version": "1.0.0",
        "ops": [{"domain": domain, "op_type": "Scale",
                 "inputs": [{"name": "x", "dtypes": ["float32"]}],
                 "outputs": [{"name": "y", "dtypes": ["float32"]}],
                 "attributes": [{"name": "factor", "type": "float", "default": 2.0}],
                 "shape_function": "scale:shape"}],
        "implementations": [{"ops": [f"{domain}::Scale"], "backend": "onnxruntime",
                             "device": "cpu", "kind": "native", "entry": "lib/libhostile.so",
                             "abi": runtime_abi("onnxruntime")}],
    }
    bundle = pack(write_folder(folder, manifest, {"scale.py": SCALE_MODULE}),
                  tmp_path / "native.tar")
    workdir = tmp_path / "job"
    workdir.mkdir()
    archive = workdir / "plugin.tar"
    archive.write_bytes(bundle.archive.read_bytes())
    plugins = [(bundle.ref, archive)]
    model, options = scale_model(domain), fast_options()
    with pytest.raises(KilnError):  # the library registers no op: no engine builds
        Sandbox(Limits(wall_s=300)).compile_model(
            model.SerializeToString(), options, fingerprint=fingerprint, workdir=workdir,
            plan=_plan(model, fingerprint, options, plugins), plugins=plugins)

    probe = dict(line.split("=", 1) for line in
                 (workdir / "probe_native.txt").read_text().splitlines())
    assert SECRET not in json.dumps(probe)
    assert set(probe) == {"signing_key", "parent_environ", "write_outside", "env_secret"}
    assert all(value.startswith("refused") for value in probe.values()), probe
    assert not outside.exists()


def test_a_build_child_loads_no_signing_stack():
    """Every compile job starts two sandboxed interpreters; what they import before their step
    runs is paid per job. The signing stack (securesystemslib, which imports boto3) is for the
    control plane and the agents: neither the child's entry nor the build pipeline loads it."""
    import subprocess
    import sys

    probe = ("import sys, compiler_worker.sandbox_child, compiler_worker.pipeline; "
             "print(sorted(m for m in ('boto3', 'botocore', 'securesystemslib', "
             "'artifact_store.signing') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "[]", f"a build child imports {loaded}"
