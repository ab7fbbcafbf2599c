"""``train.guard``'s exceptions."""

from __future__ import annotations

import pickle

from megaseq.train import guard


def test_a_non_finite_step_crosses_a_process_boundary():
    """A bench row runs in a worker process, which pickles what it raises: both values come back."""
    e = pickle.loads(pickle.dumps(guard.NonFiniteStep(float("nan"), 3.0)))
    assert isinstance(e, guard.NonFiniteStep) and e.grad_norm == 3.0 and "gradient norm 3.0" in str(e)
