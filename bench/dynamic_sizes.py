"""New sizes: call time of a compiled model on new sequence lengths, and kernel speed with sizes as arguments.

Part 1, the transformers Llama of ``bench/workloads/models.py`` (quick: 2 layers, hidden 512), compiled at
32 tokens, then called with new lengths; ``dynamic=False`` (capture and build again per size, what vtc did
before) and the default (a symbolic capture, size-generic kernels) side by side in one process, each with
its own empty kernel cache.  Per call: seconds, C++ compiler runs (``cbuild.compile_count``), max error
against eager.

Part 2, kernels with their sizes as constants vs as arguments (the same kernel text otherwise), medians of
interleaved runs at 2 threads, and the number of loops the compiler reports vectorised in each source.

    python -m bench.dynamic_sizes [--threads 2] [--out bench/results/dynamic_sizes.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SEQS = (17, 127, 64, 9, 1)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _calls(dynamic: bool | None) -> list[dict]:
    import vtc
    from bench.workloads import models
    from vtc.runtime import cbuild

    os.environ["VTC_CACHE_DIR"] = tempfile.mkdtemp(prefix="vtc-dyn-bench-")
    model, (ids,) = models._llama(True)
    model.eval()
    rows = []
    c0, t0 = cbuild.compile_count, time.perf_counter()
    compiled = vtc.compile(model, (ids,), dynamic=dynamic)
    with torch.no_grad():
        compiled(ids)
        rows.append({"seq": ids.shape[1], "s": time.perf_counter() - t0, "compiler_runs": cbuild.compile_count - c0})
        for seq in SEQS:
            x = torch.randint(1, 32000, (1, seq), generator=torch.Generator().manual_seed(seq))
            c0, t0 = cbuild.compile_count, time.perf_counter()
            out = compiled(x)
            dt = time.perf_counter() - t0
            err = (out.logits - model(x).logits).abs().max().item()
            rows.append({"seq": seq, "s": dt, "compiler_runs": cbuild.compile_count - c0, "max_err": err})
    return rows


def _kernels() -> list[dict]:
    import vtc
    from vtc.codegen.cpp import generate
    from vtc.runtime import cbuild, generic

    cases = {
        "pointwise x*sigmoid(x)+y [8,512,1024]": (lambda x, y: x * torch.sigmoid(x) + y,
                                                  lambda n: (torch.randn(8, n, 1024), torch.randn(8, n, 1024))),
        "softmax [32,512,512]": (lambda x, y: torch.softmax(x, dim=-1) + y,
                                 lambda n: (torch.randn(32, n, 512), torch.randn(32, n, 512))),
        "transpose+add [16,512,512]": (lambda x, y: x.transpose(-1, -2) * 2 + y,
                                       lambda n: (torch.randn(16, n, 512), torch.randn(16, 512, n))),
        "permute->softmax [16,512,512]": (lambda x, y: torch.softmax(x.permute(0, 2, 1), dim=-1) + y,
                                          lambda n: (torch.randn(16, 512, n), torch.randn(1))),
    }

    def times(fn, x, reps):
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(*x)
            out.append(time.perf_counter() - t0)
        return out

    rows = []
    for name, (f, make) in cases.items():
        x = make(512)
        static = vtc.compile(f, x, dynamic=False)
        gen = vtc.compile(f, make(300), dynamic=True)
        torch.testing.assert_close(gen(*x), f(*x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(static(*x), f(*x), rtol=1e-4, atol=1e-4)
        spec = gen._specs[next(reversed(gen._specs))]
        kernels = [s.kernel for s in spec.executor.steps if s.kind == "kernel"]
        a, b = [], []
        for _ in range(5):
            a += times(static, x, 10)
            b += times(gen, x, 10)
        vec_c = vec_g = 0
        for k in kernels:
            vec_c += len(cbuild.vectorized_loops(generate(k.step.kernel)))
            t = next((t for ts in generic._TEMPLATES.values() for t in ts if t.name == k.step.kernel.name), None)
            vec_g += len(cbuild.vectorized_loops(t.source)) if t is not None else 0
        rows.append({"kernel": name, "constants_ms": statistics.median(a) * 1e3, "arguments_ms": statistics.median(b) * 1e3,
                     "generic_kernels": sum(bool(k._sizes) for k in kernels), "kernels": len(kernels),
                     "vectorised_loops_constants": vec_c, "vectorised_loops_arguments": vec_g})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dynamic_sizes.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"command": f"python -m bench.dynamic_sizes --threads {args.threads}", "uptime_before": _uptime(),
              "threads": args.threads}
    result["llama_calls"] = {"dynamic=False (before)": _calls(False), "default (after)": _calls(None)}
    result["kernels"] = _kernels()
    result["uptime_after"] = _uptime()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for label, rows in result["llama_calls"].items():
        print(label)
        for r in rows:
            print(f"  seq {r['seq']:4d}: {r['s']:6.2f} s, compiler runs {r['compiler_runs']}")
    for r in result["kernels"]:
        print(f"{r['kernel']:40s} constants {r['constants_ms']:8.3f} ms, arguments {r['arguments_ms']:8.3f} ms, "
              f"vectorised loops {r['vectorised_loops_constants']} -> {r['vectorised_loops_arguments']}")
    print(result["uptime_before"], "|", result["uptime_after"])


if __name__ == "__main__":
    main()
