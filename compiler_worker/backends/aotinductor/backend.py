"""AOTInductor backend: compiles a ``torch.export`` program into an AOTInductor package
(``torch._inductor.aoti_compile_and_package``), which the executor twin loads with
``aoti_load_package``.

Input. The model is a ``torch.export`` archive (``torch.export.save``, ``.pt2``), loaded here —
in the build step, never in the API — with ``torch.export.load``, after the pipeline checked
its structure and made the profiles' dynamic axes (``compiler_worker.torch_program``). The
pipeline hands this backend torch programs only (``model_formats``): the API refuses a job for
an ONNX model on an AOTInductor key, and ``compile_model`` refuses one with ``InvalidOptions``.
ONNX models would need a converter to a torch program; ``onnx2torch``, the obvious one, needs
torchvision, which cannot be installed beside this torch, so there is none. A file that
reaches ``build`` anyway fails the candidate with that reason. For a model of either format,
a backend that takes its format builds (``backend_for(model_format=...)``); onnxruntime takes
torch programs too (through the ONNX exporter), and the control plane builds both for a
program and gives an agent the faster (``services/api/engine_choice.py``).

A failure Inductor attributes to an operator (a missing lowering or decomposition, a lowering
that raised: ``target: <op>`` in its message) fails the candidate with the op named
(``details["op"]``); the tuner records it and goes on with the other candidates.

Target ISA (CPU). Inductor compiles its C++ kernels for the vector ISA it picks
(``cpp.simdlen``: 512 → AVX-512, 256 → AVX2, 0 → scalar) and the whole library with
``-march=native`` unless ``cpp.march`` names a target. Kiln sets both from the x86-64 level of
the build fingerprint's ISA class — the level of the key — not from the host:

====================  ============================  ========================================
level                 ``cpp.march``                 ``cpp.simdlen``
====================  ============================  ========================================
``x86-64``            ``x86-64``                    0 (scalar kernels)
``x86-64-v2``         ``x86-64-v2``                 0 (Inductor has no SSE kernels)
``x86-64-v3``         ``x86-64-v3``                 256 (AVX2, FMA, F16C)
``x86-64-v4``         ``x86-64-v4``                 512 where the host has no AVX-512
                                                    extension beyond the level (VNNI, BF16,
                                                    FP16, AMX: Inductor would add them), else
                                                    256
====================  ============================  ========================================

After the build, every shared library in the package is disassembled (binutils' ``objdump``,
which every host with Inductor's C++ compiler has) and checked for instructions the level
lacks (``forbidden_instructions``): AVX-512 registers, masks and AVX-512-only mnemonics below
v4, any VEX instruction or BMI below v3, SSSE3/SSE4/POPCNT below v2, and VNNI/BF16/FP16/AMX at
v4. A build whose library holds one fails with the instructions named. A worker whose CPU is
above the declared fingerprint's level (a declared older variant) therefore builds, verifies
and benchmarks engines for that lower level: ``runtime_config["cross_built"]`` says so, and
the benchmark was measured on the build host. A fingerprint above the host's level is refused.

CUDA (a fingerprint with a CUDA target, see the executor twin): the program is moved to the
GPU and compiled by Inductor's Triton path for the build GPU, whose compute capability must be
the fingerprint's; the host wrapper is compiled for the architecture's baseline. Written
against torch's documented API, but NOT run: no machine this was written on had a GPU.

Candidates (fp32 only), the default first: ``default``; ``freezing`` (weights folded into the
graph as constants, prepacked for oneDNN on CPU); and, when the tuning budget is at least
``AUTOTUNE_BUDGET_S``, ``max-autotune`` (Inductor benchmarks GEMM/convolution templates on the
build host). A pinned ``optimization_level`` below 3 keeps the default only. Reduced precision
is recorded as skipped: Kiln builds AOTInductor engines from the program as exported.
``portability: portable`` is refused (no AOTInductor engine is portable; see the executor's
compatibility keys for what does run elsewhere).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from compiler_worker.backends.base import Backend, BuiltEngine, Candidate, toolchain_string
from runtime_agent.executors.aotinductor.executor import ENGINE_MEDIA_TYPE, AOTInductorExecutor
from runtime_agent.executors.base import CustomOpAdapter
from runtime_agent.fingerprint import detect_cpu, isa_class, major_minor
from schemas.errors import BackendUnavailable, CompileError, FingerprintMismatch
from schemas.fingerprint import HardwareFingerprint
from schemas.options import CompileOptions, Portability, Precision
from schemas.technologies.aotinductor import X86_LEVEL_ORDER, cuda_target, level_index

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

#: Tuning budget (seconds) from which ``max-autotune`` is a candidate.
AUTOTUNE_BUDGET_S = 300
#: CPU features beyond x86-64-v4 for which Inductor adds instructions at ``simdlen`` 512.
V4_EXTENSIONS = frozenset({"avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                           "amx_bf16", "amx_int8"})
#: ``-march`` of the host wrapper of a CUDA package, by architecture.
BASELINE_MARCH = {"x86_64": "x86-64", "aarch64": "armv8-a"}
#: Largest share of the package the shared libraries may take uncompressed (sanity bound for
#: the instruction check, which unpacks them).
MAX_LIBRARY_BYTES = 4 << 30


def _has_march_setting() -> bool:
    """Whether this torch's Inductor takes ``cpp.march`` (older releases compile with their
    own ``-march``)."""
    from torch._inductor import config

    return hasattr(config.cpp, "march")


def vector_settings(level: str, host_features: set[str] | frozenset[str]) -> tuple[str, int]:
    """(``cpp.march``, ``cpp.simdlen``) that keep Inductor's code within x86-64 ``level``
    on a host with ``host_features``."""
    if level_index(level) < 0:
        raise BackendUnavailable(f"the aotinductor CPU backend targets the x86-64 levels "
                                 f"{list(X86_LEVEL_ORDER)}; got {level!r}")
    if level == "x86-64-v4":
        return level, 256 if set(host_features) & V4_EXTENSIONS else 512
    return level, 256 if level == "x86-64-v3" else 0


# -- the instruction check ------------------------------------------------------------------

_SSSE3 = {"pabsb", "pabsw", "pabsd", "palignr", "phaddw", "phaddd", "phaddsw", "phsubw",
          "phsubd", "phsubsw", "pmaddubsw", "pmulhrsw", "pshufb", "psignb", "psignw", "psignd"}
_SSE41 = {"blendpd", "blendps", "blendvpd", "blendvps", "dppd", "dpps", "extractps", "insertps",
          "movntdqa", "mpsadbw", "packusdw", "pblendvb", "pblendw", "pcmpeqq", "pextrb",
          "pextrd", "pextrq", "pinsrb", "pinsrd", "pinsrq", "pmaxsb", "pmaxsd", "pmaxud",
          "pmaxuw", "pminsb", "pminsd", "pminud", "pminuw", "pmuldq", "pmulld", "ptest",
          "roundpd", "roundps", "roundsd", "roundss", "phminposuw", "pmovsxbw", "pmovsxbd",
          "pmovsxbq", "pmovsxwd", "pmovsxwq", "pmovsxdq", "pmovzxbw", "pmovzxbd", "pmovzxbq",
          "pmovzxwd", "pmovzxwq", "pmovzxdq"}
_SSE42 = {"crc32", "pcmpestri", "pcmpestrm", "pcmpistri", "pcmpistrm", "pcmpgtq", "popcnt"}
_BMI_ABM = {"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "mulx", "pdep", "pext", "rorx",
            "sarx", "shlx", "shrx", "tzcnt", "lzcnt", "movbe"}
#: Legacy (non-VEX) mnemonics that start with "v".
_LEGACY_V = {"verr", "verw", "vmcall", "vmlaunch", "vmresume", "vmxoff", "vmxon", "vmread",
             "vmwrite", "vmptrld", "vmptrst", "vmclear", "vmfunc", "vmrun", "vmload", "vmsave",
             "vmmcall"}
_AVX512_ONLY = re.compile(
    r"^(k[a-z]+|vpternlog[dq]|vperm[it]2\w+|vp?compress\w+|vp?expand\w+|vrndscale\w+|"
    r"vgetexp\w+|vgetmant\w+|vfixupimm\w+|vscalef\w+|vrange\w+|vreduce\w+|vpro[lr]v?[dq]|"
    r"vpmovu?s?[qdw][bwd]|vpmov[bwdq]2m|vpmovm2[bwdq]|vpabsq|vp(max|min)[su]q|vpsra[v]?q|"
    r"vcvt\w*(qq|udq|uqq|usi)\w*|vpmullq|vextract[if](32x4|64x2|32x8|64x4)|"
    r"vinsert[if](32x4|64x2|32x8|64x4)|vbroadcast[if](32x2|32x4|64x2|32x8|64x4)|"
    r"vshuf[if](32x4|64x2)|valign[dq]|vpconflict[dq]|vplzcnt[dq]|vrcp14\w+|vrsqrt14\w+|"
    r"vp?blendm\w+|vpcmpu?[bwdq]|vptestn?m\w+|vmovdq[au](8|16|32|64)|vpbroadcastm\w+|"
    r"vdbpsadbw|vpermw|vpsllvw|vpsrlvw|vpsravw)$")
_V4_EXTENSION_MNEMONIC = re.compile(
    r"^(vpdpbu[sw]ds?|vpdpws[sw]ds?|vdpbf16ps|vcvtne2?ps2bf16|tile\w+|ldtilecfg|sttilecfg|"
    r"tdp\w+|v\w+ph|v\w+sh|vmovw)$")
#: F16C conversions (x86-64-v3) that the FP16 pattern above would catch.
_F16C = {"vcvtps2ph", "vcvtph2ps"}
_ZMM_OR_MASK = re.compile(r"\b(zmm\d+|k[0-7]|[xy]mm(1[6-9]|2\d|3[01]))\b")
_YMM = re.compile(r"\bymm\d+\b")


def forbidden_instructions(disassembly: str, level: str) -> dict[str, int]:
    """Instructions (mnemonic, or ``<mnemonic> (<register>)``) in ``objdump -d -M intel``
    output that x86-64 ``level`` lacks, with their counts.

    It checks the instruction families each level adds — not a full decoder: VEX and BMI
    for v3, SSSE3/SSE4/POPCNT for v2, AVX-512 registers, masks and AVX-512-only mnemonics for
    v4, and VNNI, BF16, FP16 and AMX, which no level includes.
    """
    rank = level_index(level)
    found: dict[str, int] = {}
    for line in disassembly.splitlines():
        parts = line.split("\t")
        if len(parts) < 2 or not parts[0].strip().endswith(":"):
            continue
        text = re.sub(r"<[^>]*>", "", parts[-1]).strip()
        if not text:
            continue
        words = text.split()
        while words and words[0] in ("lock", "rep", "repz", "repnz", "repe", "repne",
                                     "notrack", "bnd", "data16", "addr32"):
            words = words[1:]
        if not words:
            continue
        mnemonic, operands = words[0], " ".join(words[1:])
        register = _ZMM_OR_MASK.search(operands)
        below_v4 = rank < 3 and (_AVX512_ONLY.match(mnemonic) or register)
        below_v3 = rank < 2 and ((mnemonic.startswith("v") and mnemonic not in _LEGACY_V)
                                 or mnemonic in _BMI_ABM or _YMM.search(operands))
        below_v2 = rank < 1 and (mnemonic in _SSSE3 or mnemonic in _SSE41
                                 or mnemonic.rstrip("bwlq") in _SSE42)
        bad = ""
        if _V4_EXTENSION_MNEMONIC.match(mnemonic) and mnemonic not in _F16C:
            bad = mnemonic
        elif below_v4:
            bad = f"{mnemonic} ({register.group(0)})" if register else mnemonic
        elif below_v3 or below_v2:
            bad = mnemonic
        if bad:
            found[bad] = found.get(bad, 0) + 1
    return found


def check_package_isa(package: Path, level: str) -> int:
    """Disassemble every shared library in the AOTInductor ``package`` and raise
    ``CompileError`` naming the instructions above ``level``; returns the number of libraries
    checked (at least one)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise BackendUnavailable(
            "the aotinductor CPU backend checks each package's instructions with binutils' "
            "objdump, which is not on this worker's PATH (install binutils)")
    checked = 0
    with zipfile.ZipFile(package) as archive, tempfile.TemporaryDirectory() as scratch:
        libraries = [m for m in archive.infolist() if m.filename.endswith(".so")]
        if sum(m.file_size for m in libraries) > MAX_LIBRARY_BYTES:
            raise CompileError(f"the package's shared libraries exceed "
                               f"{MAX_LIBRARY_BYTES >> 30} GiB")
        for index, member in enumerate(libraries):
            target = Path(scratch) / f"{index}.so"
            with archive.open(member) as source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink)
            result = subprocess.run(
                [objdump, "-d", "--no-show-raw-insn", "-M", "intel", str(target)],
                capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise CompileError(f"objdump could not disassemble {member.filename} of the "
                                   f"package: {result.stderr.strip()[:500]}")
            found = forbidden_instructions(result.stdout, level)
            if found:
                listing = ", ".join(f"{name} x{count}" for name, count in
                                    sorted(found.items(), key=lambda kv: -kv[1])[:12])
                raise CompileError(
                    f"the AOTInductor package targets {level}, but {member.filename} holds "
                    f"instructions that level lacks: {listing}", level=level,
                    instructions=sorted(found))
            checked += 1
    if not checked:
        raise CompileError("the AOTInductor package holds no shared library to check")
    return checked


# -- the backend ----------------------------------------------------------------------------

_TARGET = re.compile(r"^\s*target:\s*(\S+)", re.MULTILINE)


def failing_op(exc: BaseException) -> str | None:
    """The operator an Inductor failure is about (``mylib.op.default``,
    ``aten.foo.default``): Inductor's ``OperatorIssue`` errors (a missing lowering or
    decomposition, a lowering that raised) say ``target: <op>``; the cause chain is searched.
    ``None`` when the failure names no operator (a C++ compiler error, say)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        match = _TARGET.search(str(current))
        if match:
            return match.group(1)
        current = current.__cause__ or current.__context__
    return None


def _is_zip(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(4) == b"PK\x03\x04"


class AOTInductorBackend(Backend):
    """PyTorch AOTInductor packages from ``torch.export`` programs; keyed by ISA class (CPU)
    or compute capability (CUDA), and torch ``major.minor``."""

    name = "aotinductor"
    executor = AOTInductorExecutor
    #: Below onnxruntime: picked only when a job's options name it.
    priority = 5
    device = "cpu"
    #: ``torch.export`` archives (workers advertise it per key: ``WorkerInfo.model_formats``).
    model_formats = frozenset({"torch-export"})

    def toolchain(self) -> str:
        version = AOTInductorExecutor.probe_version()
        if version is None:
            raise BackendUnavailable("torch is not installed on this worker")
        return toolchain_string("torch", version)

    def check_options(self, options: CompileOptions) -> None:
        if options.precision not in (Precision.FP32, Precision.AUTO):
            raise BackendUnavailable(
                f"the {self.name} backend builds fp32 engines (precision fp32 or auto); got "
                f"{options.precision.value}", precision=options.precision.value,
                supported=[Precision.FP32.value, Precision.AUTO.value])
        if options.portability is Portability.PORTABLE:
            raise BackendUnavailable(
                f"the {self.name} backend builds no portable engines (AOTInductor packages are "
                f"tied to the torch version and the CPU level or GPU that built them); use "
                f"portability: exact")

    def candidates(self, fingerprint: HardwareFingerprint,
                   options: CompileOptions) -> list[Candidate]:
        found = [Candidate(name=f"{self.name}/default", config={})]
        pinned_low = options.optimization_level is not None and options.optimization_level < 3
        if not pinned_low:
            found.append(Candidate(name=f"{self.name}/freezing", config={"freezing": True}))
            if options.tuning_budget_s >= AUTOTUNE_BUDGET_S:
                found.append(Candidate(name=f"{self.name}/max-autotune",
                                       config={"max_autotune": True}))
        if options.precision is Precision.AUTO:
            for precision in ("bf16", "fp16"):
                found.append(Candidate(
                    name=f"{self.name}/{precision}", precision=precision,
                    skip=f"Kiln builds AOTInductor engines from the program as exported "
                         f"(fp32); a {precision} engine needs the program converted before "
                         f"export"))
        return found

    def _build(
        self,
        model_path: Path,
        options: CompileOptions,
        workdir: Path,
        *,
        fingerprint: HardwareFingerprint | None,
        candidate: Candidate,
        custom_ops: CustomOpAdapter | None,
        calibration: list[Mapping[str, np.ndarray]],
    ) -> BuiltEngine:
        if not _is_zip(model_path):
            raise CompileError(
                f"the {self.name} backend builds torch.export programs (.pt2 archives from "
                f"torch.export.save); {model_path.name} is not one (an ONNX model needs a "
                f"converter to a torch program, which Kiln does not have yet)",
                candidate=candidate.name)
        try:
            import torch
            from torch._inductor import aoti_compile_and_package
        except ImportError as exc:
            raise BackendUnavailable(f"torch is not installed on this worker: {exc}") from exc
        installed = AOTInductorExecutor.probe_version() or torch.__version__
        if fingerprint is not None:
            declared = fingerprint.runtimes.get(self.executor.runtime)
            if major_minor(declared) != major_minor(torch.__version__):
                raise FingerprintMismatch(
                    f"the build fingerprint declares torch {declared}, but this worker runs "
                    f"torch {torch.__version__}; an engine built here would carry the wrong key")
        if custom_ops is not None:  # torch.export.load needs the program's custom ops
            custom_ops.apply(None)
        try:
            program = torch.export.load(str(model_path))
        except Exception as exc:  # torch raises its own untyped errors
            raise CompileError(
                f"{model_path.name} is not a torch.export archive torch {torch.__version__} "
                f"can load: {type(exc).__name__}: {exc}"[:2000]) from exc
        signature = program.graph_signature
        input_names = list(signature.user_inputs)
        non_tensor = [spec.arg.name for spec in signature.input_specs
                      if spec.kind.name == "USER_INPUT"
                      and type(spec.arg).__name__ != "TensorArgument"]
        if non_tensor:
            raise CompileError(f"the program's inputs {non_tensor} are not tensors; Kiln feeds "
                               f"tensors only")

        target = cuda_target(fingerprint) if fingerprint is not None else None
        configs: dict[str, object] = {}
        runtime_config: dict[str, object] = {"precision": candidate.precision,
                                             "input_names": input_names}
        if custom_ops is not None:
            runtime_config["custom_ops"] = custom_ops.runtime_config()
        if target is not None:
            device, cc, _, _ = target
            if not torch.cuda.is_available():
                raise FingerprintMismatch(
                    f"the build fingerprint names GPU {device.name} ({device.compute_capability}) "
                    f"but torch {torch.__version__} sees no CUDA device here")
            here = "{}.{}".format(*torch.cuda.get_device_capability())
            if here != f"{cc[0]}.{cc[1]}":
                raise FingerprintMismatch(
                    f"the build fingerprint names compute capability {cc[0]}.{cc[1]}; this "
                    f"worker's GPU has {here}")
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, "cuda")
            if _has_march_setting():
                configs["cpp.march"] = BASELINE_MARCH.get(fingerprint.cpu.arch, "")  # type: ignore[union-attr]
            else:  # an older torch: the host wrapper gets Inductor's own flags
                logger.warning("torch %s has no inductor setting cpp.march: the host wrapper "
                               "of this CUDA package is compiled with Inductor's default "
                               "flags", torch.__version__)
            runtime_config.update(device="cuda", compute_capability=f"{cc[0]}.{cc[1]}")
        else:
            host = detect_cpu()
            host_level = isa_class(host)
            level = isa_class(fingerprint.cpu) if fingerprint is not None else host_level
            if host.arch != "x86_64" or level_index(host_level) < level_index(level) \
                    or level_index(level) < 0:
                raise FingerprintMismatch(
                    f"the {self.name} CPU backend builds for an x86-64 level this host can "
                    f"execute; the fingerprint declares {level}, this host is {host_level}")
            if not _has_march_setting():
                raise BackendUnavailable(
                    f"torch {torch.__version__} has no inductor setting cpp.march, which the "
                    f"{self.name} CPU backend needs to hold a package to an x86-64 level; "
                    f"build CPU packages with a torch that has it", backend=self.name)
            march, simdlen = vector_settings(level, set(host.features))
            configs.update({"cpp.march": march, "cpp.simdlen": simdlen})
            runtime_config.update(device="cpu", isa_class=level, march=march, simdlen=simdlen,
                                  cross_built=level != host_level)
        configs.update(candidate.config)
        runtime_config["inductor_configs"] = dict(configs)
        package = workdir / "engine.pt2"
        try:
            aoti_compile_and_package(program, package_path=str(package),
                                     inductor_configs=configs)
        except Exception as exc:  # Inductor raises its own untyped errors (lowering, C++)
            op = failing_op(exc)
            if op is not None:
                raise CompileError(
                    f"AOTInductor (torch {torch.__version__}) cannot lower op {op} in "
                    f"{candidate.name}: {type(exc).__name__}: {exc}"[:2000],
                    candidate=candidate.name, op=op) from exc
            raise CompileError(
                f"AOTInductor (torch {torch.__version__}) could not compile {candidate.name}: "
                f"{type(exc).__name__}: {exc}"[:2000], candidate=candidate.name) from exc
        if runtime_config["device"] == "cpu":
            runtime_config["isa_checked_libraries"] = check_package_isa(
                package, str(runtime_config["isa_class"]))
        logger.info("AOTInductor built %s (%s)", candidate.name, configs)
        return BuiltEngine(blobs=[("engine", package, ENGINE_MEDIA_TYPE)],
                           runtime_config=runtime_config,
                           toolchain=toolchain_string("torch", installed))
