"""The systems compared, one adapter each: prepare a workload once, then call it many times.

Every adapter turns ``(model, inputs)`` into a `Prepared` holding a zero-argument
callable that runs one inference on fixed inputs, and what preparing cost.
Systems:

- ``eager``: the module itself under ``torch.no_grad``;
- ``inductor`` / ``inductor-max-autotune``: ``torch.compile`` (default mode, and
  ``mode="max-autotune-no-cudagraphs"``) on a deep copy of the module;
- ``onnxruntime`` / ``openvino``: the same module exported once per workload
  with ``torch.onnx.export`` (the dynamo exporter, the default in torch 2.13;
  the TorchScript exporter if that fails), run on CPU with all graph
  optimisations, ``threads`` intra-op threads, f32 precision (OpenVINO would
  pick bf16 on AMX CPUs otherwise); ONNX Runtime's CPU memory arena is off in
  memory probes, on (its default) when timing;
- ``vtc-<variant>``: ``vtc.compile(model, inputs, **options)`` for each variant in
  ``VTC_VARIANTS`` (``vtc-torch``: the torch backend, ``vtc-none``: no movement
  op virtual, ``vtc-all``: every one, ``vtc-greedy`` (the default planner),
  ``vtc-measured`` (uncertain choices timed), ``vtc-memory`` (objective="memory");
  ``vtc-gemm-vtc`` / ``vtc-gemm-torch``: every GEMM generated / through torch,
  run only when named; ``vtc-onnx``: ``vtc.compile(<the ONNX file above>, inputs)``, the ONNX frontend on
  the file ONNX Runtime and OpenVINO run, run only when named, docs/onnx.md); a
  variant whose options vtc rejects (TypeError/ValueError on a trivial
  function) is "n/a".  The first compile of a workload runs against an empty
  kernel cache (``VTC_CACHE_DIR`` set to a directory of its own: a cold
  compile); a second ``vtc.compile`` in the same process is the warm one (the
  memory probe's compile, in a fresh process on the filled cache, is recorded
  too).

Failures raise `SystemFailure` with a status ("failed", "not installed", "n/a")
and a one-line reason; the harness records them instead of crashing.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

VTC_VARIANTS: dict[str, dict] = {
    "vtc-torch": {"plan": "all", "backend": "torch"},  # ablation: compute through torch, gathers for chains
    "vtc-none": {"plan": "none"},  # ablation: every movement op materialised (generated kernels)
    "vtc-all": {"plan": "all"},
    "vtc-greedy": {"plan": "greedy"},
    "vtc-measured": {"plan": "measured"},
    "vtc-gemm-vtc": {"plan": "all", "gemm": "vtc"},  # every float32 GEMM a generated kernel
    "vtc-gemm-torch": {"plan": "all", "gemm": "torch"},  # every GEMM through torch (non-strided operands copied)
    "vtc-memory": {"plan": "greedy", "objective": "memory"},  # lowest peak within 5% of greedy's estimate
    "vtc-onnx": {"plan": "greedy"},  # vtc-greedy on the ONNX file ONNX Runtime runs (the ONNX frontend)
}
FROM_ONNX = ("vtc-onnx",)  # vtc variants that compile the exported ONNX file, not the torch model
# The vtc variant that speaks for vtc in the summary: the most advanced one that ran (later wins).
VTC_HEADLINE_ORDER = ("vtc-all", "vtc-greedy", "vtc-measured")
OTHERS = ("eager", "inductor", "inductor-max-autotune", "onnxruntime", "openvino")
SYSTEMS = OTHERS + tuple(VTC_VARIANTS)
ALIASES = {"ort": "onnxruntime", "ov": "openvino", "torch": "eager", "torch.compile": "inductor",
           "max-autotune": "inductor-max-autotune", "vtc": ",".join(VTC_VARIANTS)}
QUICK_SKIP = ("inductor-max-autotune",)
NAMED_ONLY = ("vtc-gemm-vtc", "vtc-gemm-torch", "vtc-onnx")  # GEMM ablations, ONNX frontend: when named


class SystemFailure(Exception):
    """A system could not run a workload: status is "failed", "not installed" or "n/a"."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass
class Prepared:
    """A system ready to run one workload: ``fn()`` runs one inference."""

    fn: Callable[[], Any]
    prepare_s: float
    info: dict = field(default_factory=dict)


def one_line(e: BaseException, limit: int = 240) -> str:
    """`Type: first meaningful line` of an exception, cut to `limit` characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith("[torch.onnx]")]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_systems(spec: str | None, quick: bool) -> list[str]:
    """A comma list of system names/aliases -> system names in canonical order."""
    if not spec:
        return [s for s in SYSTEMS if not (quick and s in QUICK_SKIP) and s not in NAMED_ONLY]
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        for name in ALIASES.get(item, item).split(","):
            if name not in SYSTEMS:
                raise ValueError(f"unknown system {item!r}; valid: {', '.join(SYSTEMS)} (aliases: {', '.join(ALIASES)})")
            if name not in names:
                names.append(name)
    return [s for s in SYSTEMS if s in names]


def installed(module: str) -> bool:
    """True when `module` can be imported."""
    return importlib.util.find_spec(module) is not None


def flat_outputs(out: Any) -> list[torch.Tensor]:
    """Outputs of any system as a flat list of torch tensors (ONNX Runtime/OpenVINO arrays converted)."""
    import numpy as np

    if hasattr(out, "to_tuple") and not isinstance(out, torch.Tensor):
        out = out.to_tuple()
    return [torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
            for x in pytree.tree_leaves(out) if isinstance(x, (torch.Tensor, np.ndarray))]


@dataclass
class Context:
    """What a system needs to prepare one workload; the ONNX file is exported once and shared."""

    name: str
    model: torch.nn.Module
    inputs: tuple
    threads: int
    workdir: Path
    memory_probe: bool = False
    onnx_path: Path | None = None
    vtc_cache: Path | None = None
    export: dict = field(default_factory=dict)

    def onnx(self) -> Path:
        """The workload as an ONNX file (exported on first use; a failed export raises each time)."""
        if self.export.get("error"):
            raise SystemFailure("failed", f"ONNX export failed: {self.export['error']}")
        if self.onnx_path is not None and self.onnx_path.exists():
            return self.onnx_path
        path = self.workdir / f"{self.name}.onnx"
        errors = []
        for exporter, dynamo in (("dynamo", True), ("torchscript", False)):
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    torch.onnx.export(self.model, self.inputs, str(path), dynamo=dynamo, verbose=False,
                                      **({"external_data": False} if dynamo else {}))
            except Exception as e:  # noqa: BLE001 - any exporter failure is a result
                errors.append(f"{exporter}: {one_line(e, 160)}")
                continue
            wrong = self._wrong_under_onnxruntime(path) if dynamo else ""
            if wrong:  # e.g. efficientvit_b16: NaN in 1152 of 1.6 M outputs from the dynamo exporter's file only
                errors.append(f"{exporter}: {wrong}")
                continue
            self.export.update(exporter=exporter, export_s=time.perf_counter() - t0, path=str(path),
                               bytes=path.stat().st_size, errors=errors)
            self.onnx_path = path
            return path
        self.export["error"] = "; ".join(errors)
        raise SystemFailure("failed", f"ONNX export failed: {self.export['error']}")

    def _wrong_under_onnxruntime(self, path: Path) -> str:
        """Why the exported file's result under ONNX Runtime differs from eager ("" when it matches, or when
        ONNX Runtime is not installed): a file one exporter got wrong is exported again by the other, so the
        ONNX systems are timed on a correct graph rather than reported as failed."""
        if not installed("onnxruntime"):
            return ""
        import onnxruntime as ort

        from bench.harness import compare

        try:
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            arrays = self.numpy_inputs()
            got = sess.run(None, dict(zip([i.name for i in sess.get_inputs()], arrays)))
            with torch.no_grad():
                ref = flat_outputs(self.model(*self.inputs))
        except Exception:  # noqa: BLE001 - a file ONNX Runtime cannot run is judged when it is timed
            return ""
        ok, _, why = compare(ref, flat_outputs(got))
        return "" if ok else f"{why} under ONNX Runtime"

    def numpy_inputs(self) -> list:
        """The inputs as contiguous numpy arrays."""
        return [t.detach().contiguous().numpy() for t in self.inputs]


def _eager(ctx: Context) -> Prepared:
    model, inputs = ctx.model, ctx.inputs
    return Prepared(lambda: model(*inputs), 0.0)


def _inductor(mode: str | None):
    def prepare(ctx: Context) -> Prepared:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 512
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        t0 = time.perf_counter()
        compiled = torch.compile(copy.deepcopy(ctx.model), mode=mode, dynamic=False)
        inputs = ctx.inputs
        return Prepared(lambda: compiled(*inputs), time.perf_counter() - t0, {"mode": mode or "default"})
    return prepare


def _onnxruntime(ctx: Context) -> Prepared:
    if not installed("onnxruntime"):
        raise SystemFailure("not installed", "onnxruntime is not installed (pip install onnxruntime)")
    import onnxruntime as ort

    path = ctx.onnx()
    t0 = time.perf_counter()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = ctx.threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.enable_cpu_mem_arena = not ctx.memory_probe
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    arrays = ctx.numpy_inputs()
    if len(names) != len(arrays):
        raise SystemFailure("failed", f"the ONNX graph has {len(names)} inputs, the workload {len(arrays)}")
    feeds = dict(zip(names, arrays))
    return Prepared(lambda: sess.run(None, feeds), time.perf_counter() - t0,
                    {"arena": not ctx.memory_probe, "version": ort.__version__})


def _openvino(ctx: Context) -> Prepared:
    if not installed("openvino"):
        raise SystemFailure("not installed", "openvino is not installed (pip install openvino, or the bench extra)")
    import openvino as ov

    path = ctx.onnx()
    t0 = time.perf_counter()
    core = ov.Core()
    config = {"INFERENCE_NUM_THREADS": ctx.threads, "INFERENCE_PRECISION_HINT": "f32",
              "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
    arrays = ctx.numpy_inputs()
    if len(compiled.inputs) != len(arrays):
        raise SystemFailure("failed", f"the ONNX graph has {len(compiled.inputs)} inputs, the workload {len(arrays)}")
    req = compiled.create_infer_request()
    outputs = list(compiled.outputs)

    def run():
        res = req.infer(arrays, share_inputs=True)
        return [res[o] for o in outputs]
    return Prepared(run, time.perf_counter() - t0, {"version": ov.get_version(), "precision": "f32"})


_REJECTED: dict[str, str] = {}


def vtc_variant_available(name: str) -> str | None:
    """None when vtc accepts this variant's options, else why not (checked once on a trivial function)."""
    if name not in _REJECTED:
        import vtc

        try:
            vtc.compile(lambda x: x + 1, (torch.zeros(2),), **VTC_VARIANTS[name])
            _REJECTED[name] = ""
        except (TypeError, ValueError) as e:
            _REJECTED[name] = f"vtc.compile rejects {VTC_VARIANTS[name]}: {one_line(e, 160)}"
    return _REJECTED[name] or None


def _vtc(name: str):
    def prepare(ctx: Context) -> Prepared:
        import vtc

        why = vtc_variant_available(name)
        if why:
            raise SystemFailure("n/a", why)
        opts = VTC_VARIANTS[name]
        if ctx.vtc_cache is not None:
            ctx.vtc_cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.environ["VTC_CACHE_DIR"] = str(ctx.vtc_cache)
        if name in FROM_ONNX:  # the file exported for ONNX Runtime; inputs as contiguous torch tensors
            source, inputs = str(ctx.onnx()), [t.contiguous() for t in ctx.inputs]
            args = (inputs,)
        else:
            source, inputs = ctx.model, ctx.inputs
            args = tuple(inputs)
        t0 = time.perf_counter()
        compiled = vtc.compile(source, inputs, **opts)
        cold = time.perf_counter() - t0
        info: dict = {"options": opts, "compile_cold_s": cold, "report": _report(compiled.report)}
        if not ctx.memory_probe:
            t0 = time.perf_counter()
            vtc.compile(source, inputs, **opts)
            info["compile_warm_s"] = time.perf_counter() - t0
        return Prepared(lambda: compiled(*args), cold, info)
    return prepare


def _report(report) -> dict:
    d = report.to_dict()
    chains = d.pop("chains", [])
    d.pop("movement", None)
    d["views"] = sum(1 for c in chains if c["realized_as"] == "view")
    d["gathers"] = sum(1 for c in chains if c["realized_as"] == "gather")
    d["gather_bytes"] = sum(c["bytes"] for c in chains if c["realized_as"] == "gather")
    d["fallback_ops"] = sorted(set(d["fallback_ops"]))
    d["plan_key"] = plan_key(report)
    return d


def plan_key(report) -> str:
    """A digest of what the planner decided: every movement op's fate and every GEMM's choice and path.

    Two variants with the same key run the same kernels, so the report can tell a planner effect from load."""
    decisions = [(m.node, m.fate) for m in report.movement] + [(g["node"], g["choice"], g.get("path", ""))
                                                                  for g in report.gemm]
    return hashlib.sha1(repr(sorted(decisions)).encode()).hexdigest()[:16]


PREPARE: dict[str, Callable[[Context], Prepared]] = {
    "eager": _eager,
    "inductor": _inductor(None),
    "inductor-max-autotune": _inductor("max-autotune-no-cudagraphs"),
    "onnxruntime": _onnxruntime,
    "openvino": _openvino,
    **{n: _vtc(n) for n in VTC_VARIANTS},
}
assert tuple(PREPARE) == SYSTEMS
