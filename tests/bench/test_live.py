"""``bench.live.CreatedStorages``: the bytes of the storages a computation creates, live and at their peak."""

import torch

from megaseq.bench.live import CreatedStorages


def test_created_storages_counted_until_freed_views_in_place_and_older_ones_not():
    a = torch.zeros(1000)  # made before: never counted, even when read or viewed
    with CreatedStorages() as live:
        b = a * 2  # 4,000 bytes
        v = b.view(10, 100)  # a view: nothing new
        b.add_(1)  # in place: nothing new
        c = torch.empty(500, dtype=torch.float64)  # 4,000 more
        live.mark("both")
        del b, v  # freed
        d = c + 1  # 4,000 more while c lives
        live.mark("end")
    assert live.marks["both"] == (8000, 8000)
    assert live.marks["end"] == (8000, 8000) and live.peak == 8000
    del c, d
    assert live.live == 0
