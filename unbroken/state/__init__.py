"""A rank's state, as bytes and back: the one home of how training state is named and encoded.

* :mod:`~unbroken.state.dtypes` -- the one table of torch dtypes by name, and the dtypes each
  format stores natively;
* :mod:`~unbroken.state.spec` -- the state tree's spec format and the tensor names it may use
  (no torch: the controller checks stored specs too);
* :mod:`~unbroken.state.tree` -- a nested state as flat tensors plus a JSON spec, and back
  (the storage tier's files, the memory tier's slots, the state transfer between ranks);
* :mod:`~unbroken.state.blob` -- a rank's own state as one self-describing blob (the per-step
  reports, the regroup order).

The lowest layer of the package: it imports nothing of unbroken but :mod:`unbroken.errors`
(scripts/import_graph.py holds it to that). Nothing here pickles. This ``__init__`` imports no
submodule, so importing the package does not import torch.
"""
