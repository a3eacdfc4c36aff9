"""What a simulated rank (docs/simulated_rank.md) assumes, in the words of the trainer's log, the plan and the
summary's first line. Imports nothing heavy: the driver and postprocessing read it without torch."""
from __future__ import annotations

ROUTING_ASSUMED = {  # backend -> what the simulated rank's MoE routing is (one sentence, said on the summary's first line)
    "megatron": "balanced routing (random router logits; every EP peer sends this rank's own token counts)",
    "fsdp": "NOT balanced routing: FSDP2's all-gather hands back this rank's parameter shard N times, so the router's "
            "rows repeat and its routing may collapse (the step table's expert max/mean says how far); expert times are "
            "those of that routing",
}


def assumed(backend: str) -> str:
    """What a simulated trial of ``backend`` (``megatron`` or ``fsdp``) assumed, for the summary's first line."""
    return f"{ROUTING_ASSUMED[backend]}; loss and grad norm are this rank's alone"
