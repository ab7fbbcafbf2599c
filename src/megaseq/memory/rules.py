"""The memory schemes' torch-free sizes and rules, shared by the runtime (``memory/``) and the planner.

No torch: the planner (``megaseq.plan``, which stands above the runtime) imports these, so the block sizes
the runtime allocates and the bytes the planner counts come from one definition, as ``ops.workspace`` is
for the kernels. The schemes' declarations themselves are ``megaseq.schemes``.
"""

from __future__ import annotations

from megaseq.models.registry import FAMILY_PACKAGES, family
from megaseq.schemes import SEGMENT_SETTING, segment_conflict

SLOT_ALIGN = 512  # bytes; each SCO boundary slot starts on this boundary (DMA-friendly, any dtype view)
# memory/vocab_loss.py updates the fp32 weight gradient this many vocabulary rows per matmul: the
# fp32-output addmm makes a temporary of its output (rows x H x 4 bytes), so a whole-vocabulary update
# would cost another V x H x 4
WEIGHT_GRAD_ROWS = 16384


def round_up(n: int, align: int = SLOT_ALIGN) -> int:
    return -(-n // align) * align


def kept_attention_layers(num_layers: int, keep: int, keep_host: int) -> tuple[range, range]:
    """(the layers keeping attention's output in pinned host memory, those keeping it on the GPU): of the last
    ``keep`` layers (``memory.keep_attention_layers``, at most all of them) the first ``keep_host``
    (``memory.keep_attention_host_layers``, at most those) are the host's. ``memory.offload.checkpoint_layers``
    installs them, the planner counts them."""
    kept = min(keep, num_layers)
    first, on_host = num_layers - kept, min(keep_host, kept)
    return range(first, first + on_host), range(first + on_host, num_layers)


def check_model_segments(family_name: str, segment_tokens: int, cp: int = 1,
                         layer_schemes: tuple[str, ...] = ()) -> None:
    """ValueError naming ``memory.model_segment_tokens`` and the fix for what sequence segments
    (``memory/model_segments.py``) cannot run; the planner checks forced settings with it, ``memory.apply``
    the settings a family's ``parallelize`` applies."""
    name = SEGMENT_SETTING
    if segment_tokens < 1:
        raise ValueError(f"{name} must be >= 1 (0: off), got {segment_tokens}")
    segmentable = [f for f in FAMILY_PACKAGES if family(f).segmentable]
    if family_name not in segmentable:
        raise ValueError(f"{name}={segment_tokens}: the {family_name} family's token mixers do not carry their "
                         f"state across segments (supported: {', '.join(segmentable)}); unset {name}")
    if segment_tokens % cp:
        raise ValueError(f"{name}={segment_tokens} with context parallelism cp={cp}: each segment is split over the "
                         f"cp ranks, so it must be a multiple of {cp}; set --{name} to a multiple of {cp}")
    if layer_schemes:
        raise ValueError(segment_conflict(segment_tokens, list(layer_schemes)))


def check_stream_base(freezes: bool, ep: int = 1) -> None:
    """ValueError naming ``memory.stream_base`` and the fix when it is asked for a run whose every parameter
    trains (it streams a frozen base: LoRA, ``train.trainable``) or whose routed experts are sharded over ep
    ranks (not streamed); the planner and the runtime both check it."""
    if not freezes:
        raise ValueError("memory.stream_base streams a frozen base, and every parameter of this run trains: turn "
                         "on LoRA (--lora.rank 16) or name what trains (--train.trainable ...), or set "
                         "--memory.stream_base false")
    if ep > 1:
        raise ValueError(f"memory.stream_base with parallel.ep {ep}: the routed experts sharded over ep are not "
                         "streamed; set --parallel.ep 1 (FSDP streams each rank's shards) or --memory.stream_base "
                         "false")
