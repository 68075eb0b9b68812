"""Range checks of index tensors (vtc.runtime.checks) where no test looked (found by mutation testing,
docs/testing.md): the C loop's own bounds (a wrong answer there was hidden by torch's check, which runs after
every C failure), a strided tensor, and a bad index in the first element of a kernel's index tensor."""
from __future__ import annotations

import pytest
import torch

from vtc.index.mapping import IndexCheck
from vtc.runtime import checks

from .util import ROW_TOL, compile_cpu, gen, rand


def first_out_of_range(t: torch.Tensor, lo: int, hi: int) -> int:
    f = checks._first_out_of_range()
    if not f:
        pytest.skip("no C compiler: torch's check runs alone")
    return f(t.data_ptr(), t.numel(), lo, hi)


@pytest.mark.parametrize("n", [1, 2, 9, 64, 131])
def test_c_range_check_accepts_both_bounds_and_finds_the_first_bad_element(n):
    lo, hi = -3, 5
    good = torch.arange(n) % (hi - lo + 1) + lo
    good[0], good[-1] = lo, hi
    assert first_out_of_range(good, lo, hi) == -1
    for pos in sorted({0, n // 2, n - 1}):
        for bad in (lo - 1, hi + 1):
            t = good.clone()
            t[pos] = bad
            assert first_out_of_range(t, lo, hi) == pos, (pos, bad)


def test_check_range_reads_a_strided_tensor_through_its_strides():
    c = IndexCheck("i", 0, 9, "gather")
    with pytest.raises(IndexError, match="gather: index 500 is out of range"):
        checks.check_range(c, torch.tensor([0, 1, 2, 3, 500, 4])[::2])  # [0, 2, 500]: 500 is stored 5th
    checks.check_range(c, torch.tensor([0, 500, 2, 500, 4])[::2])  # [0, 2, 4]: the 500s are not in it


@pytest.mark.parametrize("bad", [8, -1])
def test_bad_first_element_of_an_index_tensor_raises_before_the_kernel_reads(bad):
    g = gen(52)
    a, i = rand((6, 8), g), torch.randint(0, 8, (6, 3), generator=g)
    fn = lambda a, i: a.gather(1, i) + 1  # noqa: E731
    compiled = compile_cpu(fn, (a, i))
    torch.testing.assert_close(compiled(a, i), fn(a, i), **ROW_TOL)
    i = i.clone()
    i[0, 0] = bad
    with pytest.raises(IndexError, match=f"gather: index {bad} is out of range"):
        compiled(a, i)
