"""vtc: a DNN inference compiler that removes data movement with virtual tensors.

    compiled = vtc.compile(model, example_inputs)     # or torch.compile(model, backend="vtc")
    out = compiled(*example_inputs)
    print(compiled.report)                             # what was removed, what is still moved
"""
from vtc.compiler import Compiled, FallbackWarning, NewSizesWarning, compile  # noqa: A004 - the public name is vtc.compile
from vtc.frontend import torch_backend as _torch_backend  # noqa: F401 - registers backend "vtc"
from vtc.frontend.torch_export import CaptureError, InputShapeError
from vtc.runtime.packed import PackedBudgetWarning

__all__ = ["CaptureError", "Compiled", "FallbackWarning", "InputShapeError", "NewSizesWarning", "PackedBudgetWarning",
           "compile"]
__version__ = "0.1.0"
