"""``bench.saved.SavedStorages``: what autograd keeps, each storage once, parameters left out, by op and label."""

import torch

from megaseq.bench.saved import OUTSIDE, SavedStorages
from megaseq.ops import dispatch


def test_each_storage_once_parameters_left_out_by_op_and_label():
    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    saved, original = SavedStorages([w]), dispatch.select
    with saved.recording():
        saved.label = "first"
        h = x @ w  # saves x (and w: a parameter, left out)
        y = h * h  # saves h twice: one storage
        saved.label = "second"
        z = dispatch.call("swiglu", y, y, None)  # saved inside the op's call
        u = z * 2  # saves nothing (a constant factor)
        v = dispatch.select("swiglu", "?", u, u, None).fn(u, u, None)  # an implementation kept and run
    (z.sum() + v.sum()).backward()
    by_op = saved.by_op()
    assert by_op[OUTSIDE] == x.nbytes + h.nbytes  # y's storage is saved by swiglu, under its op
    assert set(by_op) == {OUTSIDE, "swiglu"} and by_op["swiglu"] >= y.nbytes + u.nbytes
    assert saved.total() == sum(by_op.values())
    labels = saved.by_label()
    assert labels["first"]["total"] == x.nbytes + h.nbytes and "swiglu" in labels["second"]["by_op"]
    assert labels["first"]["largest"][0][0] == max(x.nbytes, h.nbytes)
    # outside recording nothing is counted, and the dispatcher is its own again
    before = dict(saved.seen)
    (x * x).sum().backward()
    assert saved.seen == before and dispatch.select is original
