"""Swin-T with a vtc codegen switch off and on, and OpenVINO, in one process: whole calls and the layer norm steps.

    T=1 CPU=1 N=20 PYTHONPATH=$PWD python bench/norm_swin_ab.py SWITCH [openvino]
    STEPS=1 T=1 CPU=1 N=15 PYTHONPATH=$PWD python bench/norm_swin_ab.py \
        vtc.codegen.row_blocks.BLOCKS,vtc.codegen.ops.SHIFTED_MEAN openvino

SWITCH: MODULE.ATTR, or several joined by commas.  The model is compiled twice (the switches False, then True: the
kernels' sources differ, so the kernel cache keeps both), and checked against eager.  Each round times one call of
every system, in turn (OpenVINO last), N rounds, the first 3 dropped.  vtc's calls run the call plan's closures one
by one (as ``bench/step_profile.py``), so the layer norm kernels' own times are summed per call too.  T threads
(default 1); CPU=1: the calling thread's CPU time; STEPS=1: each layer norm kernel's median, off and on.
"""
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

T = int(os.environ.get("T", 1))
torch.set_num_threads(T)
CLOCK = time.thread_time if os.environ.get("CPU") else time.perf_counter

import vtc  # noqa: E402
from bench.step_profile import timed_plan_call  # noqa: E402
from bench.systems import flat_outputs  # noqa: E402
from bench.workloads import get  # noqa: E402


def main(switch: str, systems: list[str]) -> None:
    switches = [(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]) for name in switch.split(",")]
    model, inputs = get("swin_t_model").build()
    flat = [t for t in inputs if isinstance(t, torch.Tensor)]
    with torch.no_grad():
        ref = model(*inputs)
    comps = {}
    for tag, value in (("off", False), ("on", True)):
        for mod, attr in switches:
            setattr(mod, attr, value)
        comps[tag] = vtc.compile(model, inputs)
        with torch.no_grad():
            out = comps[tag](*inputs)
        err = max(float((a - b).abs().max()) for a, b in zip(flat_outputs(ref), flat_outputs(out)))
        print(f"vtc-{tag}: max |error| against eager {err:.2e}")
    ov = None
    if "openvino" in systems:
        from bench.systems import Context, _openvino
        ov = _openvino(Context("swin_t_model", model, tuple(inputs), T, Path(tempfile.mkdtemp()))).fn
    total = {s: [] for s in [*comps, *(["openvino"] if ov else [])]}
    norms = {s: [] for s in comps}
    steps = {s: {} for s in comps}
    rounds = int(os.environ.get("N", 20))
    with torch.no_grad():
        for r in range(rounds):
            for tag, c in comps.items():
                times: dict = {}
                t0 = CLOCK()
                timed_plan_call(c._first.executor, flat, times)
                if r >= 3:
                    total[tag].append(CLOCK() - t0)
                    norms[tag].append(sum(v[0] for k, v in times.items() if "layer_norm" in k))
                    for k, v in times.items():
                        steps[tag].setdefault(k, []).append(v[0])
            if ov:
                t0 = CLOCK()
                ov()
                if r >= 3:
                    total["openvino"].append(CLOCK() - t0)
    print(f"swin_t_model, {T} thread(s), {'CPU' if os.environ.get('CPU') else 'wall'} time, {rounds - 3} rounds, "
          f"load {os.getloadavg()[0]:.2f}; ms min / median")
    for s, v in total.items():
        extra = (f"  layer norms {min(norms[s]) * 1e3:.3f} / {statistics.median(norms[s]) * 1e3:.3f}"
                 if s in norms else "")
        print(f"  {s:9s} call {min(v) * 1e3:.2f} / {statistics.median(v) * 1e3:.2f}{extra}")
    if os.environ.get("STEPS"):  # each layer norm kernel: median ms off, on
        for k in steps["off"]:
            if "layer_norm" in k:
                print(f"    {k:32s} " + "  ".join(f"{statistics.median(steps[t][k]) * 1e3:.3f}" for t in steps))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else [])
