"""Index safety of generated kernels that read through data-dependent mappings.

A gather-like movement op read by a generated kernel loads its index tensor
inside the kernel; the range checks run before the kernel.  An out-of-range
index raises IndexError naming the op and the bad value, and the kernel never
runs (a bad index of 2**40 would fault if it were read through).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .util import POINTWISE_TOL, ROW_TOL, assert_all_generated, compile_cpu, gen, rand

_G = gen(50)
_A = rand((6, 8), _G)


def case(fn, inputs, pos, size, ops, *, negative_ok=False, offset=0):
    """fn(inputs), whose input `pos` indexes a dim of `size`; the error may name any of `ops`.
    negative_ok: indices in [-size, 0) wrap (index, index_put); offset: the kernel reads input + offset."""
    return fn, inputs, pos, size, ops, negative_ok, offset


CASES = {
    "gather": case(lambda a, i: a.gather(1, i) + 1, (_A, torch.randint(0, 8, (6, 3), generator=_G)), 1, 8,
                   ("gather",)),
    "index_select": case(lambda a, i: a.index_select(0, i).sum(-1), (_A, torch.randint(0, 6, (4,), generator=_G)),
                         1, 6, ("index_select",)),
    "embedding": case(lambda w, i: F.embedding(i, w) * 2, (_A, torch.randint(0, 6, (2, 3), generator=_G)), 1, 6,
                      ("embedding",)),
    # torch.export captures index_copy as index_put (the graph has no index_copy node)
    "index_copy": case(lambda a, i, s: a.index_copy(0, i, s) + 1, (_A, torch.tensor([4, 1]), rand((2, 8), _G)), 1,
                       6, ("index_copy", "index_put"), negative_ok=True),
    "index_tensor": case(lambda a, i: torch.softmax(a[i], -1), (_A, torch.tensor([0, 5, 2])), 1, 6, ("index",),
                         negative_ok=True),
    "index_tensor_second_index": case(lambda a, i, j: a[i, j] * 2,
                                      (_A, torch.tensor([0, 5, 2]), torch.tensor([7, 0, 3])), 2, 8, ("index",),
                                      negative_ok=True),
    # an index tensor computed by a kernel (i + 2), and one that is itself a virtual (transposed) tensor
    "gather_computed_index": case(lambda a, i: a.gather(1, i + 2) + 1, (_A, torch.randint(0, 6, (6, 3), generator=_G)),
                                  1, 8, ("gather",), offset=2),
    "gather_transposed_index": case(lambda a, i: a.gather(1, i.t()) + 1,
                                    (_A, torch.randint(0, 8, (3, 6), generator=_G)), 1, 8, ("gather",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_out_of_range_index_raises_before_the_kernel_reads(name):
    fn, inputs, pos, size, op_names, negative_ok, offset = CASES[name]
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **ROW_TOL)
    assert_all_generated(compiled)  # the index is read inside a generated kernel, not by torch
    # one past the end; far past the end (would fault if the kernel read through it); below the range
    for bad in (size, 2 ** 40, -size - 1 if negative_ok else -1):
        args = list(inputs)
        args[pos] = args[pos].clone()
        args[pos].view(-1)[-1] = bad - offset
        with pytest.raises(IndexError) as err:
            compiled(*args)
        message = str(err.value)
        assert message.startswith(tuple(f"{op}:" for op in op_names)), message  # "gather: index 8 is ..."
        assert str(bad) in message, message
        with pytest.raises((IndexError, RuntimeError)):  # eager agrees that it is out of range
            fn(*args)
    # the compiled function is still fine after the errors
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **ROW_TOL)


def test_negative_indices_in_range_wrap_like_torch():
    a = rand((6, 8), gen(51))
    i = torch.tensor([-1, 0, -6, 3])
    fn = lambda a, i: a[i] * 2  # noqa: E731
    compiled = compile_cpu(fn, (a, i))
    torch.testing.assert_close(compiled(a, i), fn(a, i), **POINTWISE_TOL)
    assert_all_generated(compiled)


@pytest.mark.parametrize("plan", ["all", "greedy"])
def test_a_gather_from_a_0d_tensor_still_checks_its_index(plan):
    """out[i] = x[] reads no index, so no kernel reading it through its mapping would load (and check) the index:
    the gather is kept, and its own copy kernel raises as torch does (before: [11, 11, 11] for an index of 1).
    Found by the session 24 mutation audit (docs/testing.md)."""
    x, i = torch.tensor(5.0), torch.tensor([0, 0, 0])
    fn = lambda x, i: torch.gather(x, 0, i) * 2 + 1  # noqa: E731
    compiled = compile_cpu(fn, (x, i), plan=plan)
    torch.testing.assert_close(compiled(x, i), fn(x, i), **POINTWISE_TOL)
    (gather,) = compiled.report.to_dict()["movement"]
    assert gather["fate"] == "kept" and "range check of %i would not run" in gather["why"], gather
    for bad in (1, 2 ** 40, -1):
        with pytest.raises(IndexError, match=f"gather: index {bad} "):
            compiled(x, torch.tensor([0, bad, 0]))
        with pytest.raises((IndexError, RuntimeError)):
            fn(x, torch.tensor([0, bad, 0]))
    torch.testing.assert_close(compiled(x, i), fn(x, i), **POINTWISE_TOL)
