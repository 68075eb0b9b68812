"""vtc's benchmark suite (issue 6): workloads, the systems compared, the harness and the report.

Layout::

    bench/workloads/   real architectures with random weights (units, whole models,
                       FlashTensor attention variants, movement-chain micro-benchmarks)
    bench/systems.py   one adapter per system: eager, Inductor, ONNX Runtime, OpenVINO, vtc variants
    bench/harness.py   timing (interleaved blocks, medians), the per-process memory probe, the JSON
    bench/report.py    JSON -> BENCHMARKS.md + bench/results/speedup.png (numbers never edited by hand)

Run it as ``vtc bench`` (``vtc/commands/bench.py``) or ``python -m bench.harness`` from the repo root.
"""
