"""Register blocks whose rows meet the output's modulo 4 KB (``vtc.codegen.tiles.LOADS_FIRST``): where a row of the
other operand 1-15 rows down lies in the same 64 bytes modulo 4 KB as a row of the output (a row stride of 2 or 4 KB
and the two buffers at nearly the same offset in their pages), the block computes all 16 rows before its 16 stores
(a load behind a store to the same address modulo 4 KB waits for it).  The predicate ``vtc_tile_rows_meet4k`` built
with the kernels' compiler against its definition; the form written only for one store, an operand with the store's
row stride, a multiple of 2 KB, and a working set within the last-level cache; results against eager and the
row-by-row form with the loads-first form forced ("always").  Fail before: the predicate's build, the form checks
(no ``first_ = vtc_tile_rows_meet4k``, no ``first_ = true``).
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import stream, tiles
from vtc.codegen.cpp import generate

from .util import POINTWISE_TOL, assert_no_movement, check, gen, kernels, rand, run_cpp_program

FLAG = "first_ = vtc_tile_rows_meet4k("


def _src(compiled) -> str:
    (k,) = kernels(compiled)
    return generate(k)


def _meet(diff: int, stride: int) -> bool:
    """A load at diff + k * stride bytes from a store's address (k = 1..15) overlaps its 64 bytes modulo 4 KB."""
    return any(abs((diff + k * stride + 2048) % 4096 - 2048) < 64 for k in range(1, 16))


def test_the_predicate_as_defined(tmp_path):
    cases = [(d, s) for s in (2048, 4096, 5792, 8192, 1024 * 4 + 64, 3000) for d in range(-4160, 4160, 32)]
    out = run_cpp_program("#include <cstdint>\n#include <cstdio>\n#include <algorithm>\n" + tiles.PRELUDE + r"""
int main() {
  alignas(64) static char base[16384];
  int64_t d, s;
  while (scanf("%ld %ld", &d, &s) == 2) printf("%d\n", (int)vtc_tile_rows_meet4k(base + 8192 + d, base + 8192, s));
}
""", tmp_path, stdin="".join(f"{d} {s}\n" for d, s in cases))
    got = [line == "1" for line in out.stdout.split()]
    assert got == [_meet(d, s) for d, s in cases]
    assert any(got) and not all(got)


@pytest.fixture
def always():
    before = tiles.LOADS_FIRST
    tiles.LOADS_FIRST = "always"
    yield
    tiles.LOADS_FIRST = before


SHAPES = [(16, 16), (17, 127), (33, 300), (40, 513), (32, 1024)]


@pytest.mark.parametrize("shape", [(16, 512), (33, 1024), (17, 2048), (16, 16), (33, 300), (40, 513)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_flag_where_rows_are_2kb_apart(shape):
    """The flag (from the operand's and the output's rows) where the rows are a multiple of 2 KB apart, else none."""
    g = gen(190)
    x, y = rand(shape[::-1], g), rand(shape, g)
    compiled = check(lambda x, y: x.t() + y, (x, y), **POINTWISE_TOL)
    assert_no_movement(compiled)
    src = _src(compiled)
    assert "vtc_tile_transpose16_regs(v0, " in src, src
    if shape[1] % 512 == 0:
        assert FLAG in src and f", {4 * shape[1]}); }}" in src and "s0_[r_] = s0;" in src, src
    else:
        assert FLAG not in src and "s0_[r_]" not in src, src


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fn", ["add", "where", "bcast"])
def test_loads_first_as_eager_and_as_row_by_row(shape, fn, always):
    """Every block loads first ("always", whatever the row stride): the same floats as eager and, bit for bit, as
    the row-by-row form; with a where (a value used twice), a per-row float and a per-column vector besides the row
    operand."""
    g = gen(191)
    x, y = rand(shape[::-1], g), rand(shape, g)
    r, c = rand((shape[0], 1), g), rand((shape[1],), g)
    f = {"add": lambda x, y: x.t() + y, "where": lambda x, y: torch.where(x.t() > y, x.t() * y, y - 1),
         "bcast": lambda x, y: (x.t() + y) * r - c}[fn]
    compiled = check(f, (x, y), **POINTWISE_TOL)
    src = _src(compiled)
    assert "first_ = true;" in src, src
    tiles.LOADS_FIRST = False
    rowwise = check(f, (x, y), **POINTWISE_TOL)
    assert FLAG not in _src(rowwise)
    assert torch.equal(compiled(x, y), rowwise(x, y))


def test_not_beyond_the_cache(monkeypatch):
    """A working set beyond the last-level cache (from memory the wait is hidden; 64 MB measured 7% slower loading
    first): no flag."""
    g = gen(196)
    x, y = rand((1024, 32), g), rand((32, 1024), g)
    monkeypatch.setattr(stream, "CACHE_BYTES", 256 << 10)
    src = _src(check(lambda x, y: x.t() + y, (x, y), **POINTWISE_TOL))
    assert "vtc_tile_transpose16_regs(v0, " in src and FLAG not in src, src


def test_the_switch_off_and_other_kernels_keep_one_form():
    """tiles.LOADS_FIRST off, a kernel with two stores (the sum into its output and into a cat's), and a y whose row
    stride is not the output's: no flag, one row loop."""
    g = gen(195)
    x, y = rand((1024, 32), g), rand((32, 1024), g)
    before = tiles.LOADS_FIRST
    tiles.LOADS_FIRST = False
    try:
        src = _src(check(lambda x, y: x.t() + y * 2, (x, y), **POINTWISE_TOL))
    finally:
        tiles.LOADS_FIRST = before
    assert "vtc_tile_transpose16_regs(v0, " in src and FLAG not in src, src

    def two_stores(x, y):
        t = x.t() + y
        return torch.cat((x.t()[:, :1] * 3, t), dim=-1), t

    two = [generate(k) for k in kernels(check(two_stores, (x, y), **POINTWISE_TOL)) if len(k.stores) == 2]
    assert two and "vtc_tile_transpose16_regs(v0, " in two[0] and FLAG not in two[0], two
    wide = rand((32, 1040), g)
    src = _src(check(lambda x, w: x.t() + w[:, :1024], (x, wide), **POINTWISE_TOL))
    assert "vtc_tile_transpose16_regs(v0, " in src and FLAG not in src, src
