"""The generated C++ itself: the innermost loop of a contiguous pointwise kernel is vectorised."""
from __future__ import annotations

import re


from vtc.codegen.cpp import generate
from vtc.runtime.cbuild import vectorized_loops

from .util import POINTWISE_TOL, check, gen, kernels, rand


def _loop_lines(source: str, var: str) -> range:
    """The lines (1-based) of the `for (int64_t <var> ...` loop, header to closing brace."""
    lines = source.splitlines()
    start = next(n for n, line in enumerate(lines) if re.search(rf"for \(int64_t {var} = 0;", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next(n for n in range(start + 1, len(lines)) if lines[n].strip() == "}"
               and len(lines[n]) - len(lines[n].lstrip()) == indent)
    return range(start + 1, end + 2)


def test_contiguous_pointwise_kernel_vectorises_its_innermost_loop():
    g = gen(70)
    x, y = rand((64, 256), g), rand((256,), g)
    compiled = check(lambda x, y: x + y, (x, y), **POINTWISE_TOL)
    (kernel,) = kernels(compiled)
    assert kernel.kind == "pointwise"
    source = generate(kernel)
    remarks = vectorized_loops(source)
    assert remarks, f"no loop of the add kernel was vectorised:\n{source}"
    inner = _loop_lines(source, "i1")  # the last dim: the `omp simd` loop
    hit = [r for r in remarks if int(r.split(":")[1]) in inner]
    assert hit, f"vectorised loops {remarks} are not the innermost loop (lines {inner.start}-{inner.stop - 1})"
