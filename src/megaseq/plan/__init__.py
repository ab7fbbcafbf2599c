"""Memory and time planning, in pure Python (no torch): will a length fit, which fixes, at what cost.

    from megaseq.plan import plan, Mesh, Budgets, format_plan
    p = plan(get_preset("glm5-flash"), 1 << 20, Mesh(cp=64, gpus_per_host=8, fsdp=True))
    print(format_plan(p))

``mesh`` holds the mesh, dtypes and calibration, ``components`` and ``activations`` the per-component byte
formulas, ``layers`` (with ``linear_mixers``, ``sparse_attention``, ``mlp``) each layer kind's working set,
``layer_terms`` one layer's, ``phases`` sweeps a step's phases for one setting (``run.Run``), ``fixes`` the
memory schemes and the cheapest set that fits, ``planner`` the plan and its entry points, ``flops`` the
FLOPs / MFU / communication model, ``report`` the rendering. See docs/planner.md for the arithmetic.
"""

from megaseq.plan.components import count_params
from megaseq.plan.flops import comm_volume, mfu, step_flops
from megaseq.plan.given import validate_mesh
from megaseq.plan.mesh import GB, GIB, Calibration, Mesh, Precision, precision_for
from megaseq.plan.planner import Budgets, Plan, plan, plan_from_config
from megaseq.plan.report import format_plan, plan_json

__all__ = [
    "GB",
    "GIB",
    "Budgets",
    "Calibration",
    "Mesh",
    "Plan",
    "Precision",
    "comm_volume",
    "count_params",
    "format_plan",
    "mfu",
    "plan",
    "plan_from_config",
    "plan_json",
    "precision_for",
    "step_flops",
    "validate_mesh",
]
