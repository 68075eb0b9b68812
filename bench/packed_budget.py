"""The packed-weight budget (vtc.runtime.packed.BUDGET_BYTES) on decoding: memory and time.

    PYTHONPATH=$PWD python -m bench.packed_budget rss [--budget default|half] [--steps 20]
    VTC_PACKED_WEIGHTS_MB=0 PYTHONPATH=$PWD python -m bench.packed_budget rss   # no packed copies
    PYTHONPATH=$PWD python -m bench.packed_budget time [--rounds 25]

``rss``: transformers' Llama of ``bench.hf_decode`` (4 layers, hidden 512, vocab 32000; 168 MB of float32
weights) compiled for one-token steps on a StaticCache of 512 tokens (32 filled by eager), ``--steps`` steps;
prints the process's resident memory (VmRSS) before compiling and after the steps, and the report's
``packing``.  ``--budget half``: a budget of half the model's weight bytes (set before the first call).  One
process per budget: RSS is per process.

``time``: the bench units llama3_decode_b1 and llama3_prefill_b1 (one Llama-3 layer, 54 MB of weights) and the
transformers decode step, each compiled three times on copies of the model (no shared packed copy): at the default
budget, at half of its weights, and at half with the copies admitted in the plan's order (session 20's first come,
first served) instead of best-first; the calls interleaved in one process, 1 thread, CPU time
(``time.thread_time``), medians.
"""
from __future__ import annotations

import argparse
import copy
import gc
import time

import torch


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _hf_cache(model, cfg):
    """A StaticCache of 512 tokens filled by eager with a prompt of 32 (as bench.hf_decode's)."""
    import transformers as tf

    cache = tf.StaticCache(config=cfg, max_cache_len=512)
    prompt = torch.randint(1, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    model(prompt, cache=cache, cache_position=torch.arange(32))
    return cache


def _hf_step(model, cache):
    """(vtc-compiled one-token step at position 32 on `cache`, the compiled model)."""
    import vtc

    tok, pos = torch.tensor([[5]]), torch.tensor([32])
    compiled = vtc.compile(model, (tok,), {"cache": cache, "cache_position": pos})
    return lambda: compiled(tok, cache=cache, cache_position=pos).logits, compiled


def _with_budget(extra: int | None, call, plan_order: bool = False) -> None:
    """The first call (which builds the call plan and packs) under a budget of the bytes held now plus `extra`;
    `plan_order`: its copies admitted in the plan's order (``packed.admit_in_order``, session 20's first
    come, first served) instead of best-first."""
    from vtc.runtime import packed

    keep, admit = packed.BUDGET_BYTES, packed.admit_best_first
    if extra is not None:
        packed.BUDGET_BYTES = packed.HELD.bytes + extra
    if plan_order:
        packed.admit_best_first = packed.admit_in_order
    try:
        call()
    finally:
        packed.BUDGET_BYTES, packed.admit_best_first = keep, admit


def rss(budget: str, steps: int) -> None:
    import warnings

    from bench.hf_decode import _model

    torch.set_num_threads(1)
    cfg, model = _model()
    with torch.no_grad():
        cache = _hf_cache(model, cfg)
        gc.collect()
        before = _rss_mb()
        step, compiled = _hf_step(model, cache)
        warnings.simplefilter("ignore")
        _with_budget(_weight_bytes(model) // 2 if budget == "half" else None, step)
        for _ in range(steps):
            step()
    gc.collect()
    print(f"budget={budget}: weights {_weight_bytes(model) / 2**20:.1f} MB, RSS before compiling {before:.0f} MB, "
          f"after {steps} steps {_rss_mb():.0f} MB; packing {compiled.report.to_dict()['packing']}")


def _median_ms(fns: dict, rounds: int) -> dict:
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            t = time.thread_time()
            for _ in range(5):
                fn()
            samples[n].append((time.thread_time() - t) / 5 * 1e3)
    return {n: sorted(s)[len(s) // 2] for n, s in samples.items()}


UNITS = ("llama3_decode_b1", "llama3_prefill_b1")  # the prefill unit: MKL's packed copies (library Linears)


def timing(rounds: int) -> None:
    import warnings

    import vtc
    from bench.hf_decode import _model
    from bench.workloads import get
    from vtc.runtime import packed

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    with torch.no_grad():
        units = {name: get(name).build() for name in UNITS}
        cfg, hf = _model()
        fns, counts = {}, {}
        for label, half, plan_order in (("default", False, False), ("half", True, False),
                                        ("half plan order", True, True)):
            for name, (unit, inputs) in units.items():
                m = copy.deepcopy(unit)
                c = vtc.compile(m, inputs)
                fns[f"{name} {label}"] = lambda c=c, inputs=inputs: c(*inputs)
                _with_budget(_weight_bytes(m) // 2 if half else None, fns[f"{name} {label}"], plan_order)
                counts[f"{name} {label}"] = c.report.to_dict()["packing"]
            h = copy.deepcopy(hf)
            step, c = _hf_step(h, _hf_cache(h, cfg))
            fns[f"hf {label}"] = step
            _with_budget(_weight_bytes(h) // 2 if half else None, step, plan_order)
            counts[f"hf {label}"] = c.report.to_dict()["packing"]
        got = _median_ms(fns, rounds)
    for n in fns:
        p = counts[n]
        print(f"{n:<36} {got[n]:8.3f} ms  packed {p['packed_weights'] + p['packed_conv_weights']} "
              f"({p['packed_bytes'] / 2**20:.1f} MB), {p['unpacked_for_budget']} left unpacked")
    print(f"held {packed.HELD.bytes / 2**20:.1f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["rss", "time"])
    ap.add_argument("--budget", choices=["default", "half"], default="default")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args()
    if args.what == "rss":
        rss(args.budget, args.steps)
    else:
        timing(args.rounds)


if __name__ == "__main__":
    main()
