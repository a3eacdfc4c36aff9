"""Theoretical memory of one rank for a trial's configuration, to set against a snapshot's peak.

Parameters per rank (``P_dense`` outside the experts, ``P_exp`` of the routed experts), for ``L`` layers
on this pipeline stage, hidden ``h``, ``n_q``/``n_kv`` heads of size ``d``, ``E`` experts of FFN size
``f``, vocabulary ``V``, TP ``t``, EP ``e``, expert TP ``t_e``:

- per layer: attention ``(h (n_q + 2 n_kv) d + n_q d h) / t`` + norms ``2 h + 2 d`` + router ``h E``;
  experts ``(E / e) * 3 h f / t_e`` (SwiGLU: gate, up, down);
- embedding ``V h / t`` on the first stage, output layer ``V h / t`` on the last (untied), final norm ``h``.

Bytes per parameter (the settings in ``config.yaml``):

- megatron: weights in ``actor.dtype``; gradient buffer in ``main_grads_dtype`` with the precision-aware
  optimizer, else fp32 when ``ddp.grad_reduce_in_fp32`` else ``actor.dtype``; optimizer state
  (main params, ``exp_avg``, ``exp_avg_sq`` in their configured dtypes; fp32 without the precision-aware
  optimizer; with it, bf16 weights and fp32 main params, Transformer Engine's FusedAdam keeps only the 16 bits
  of each fp32 main param that the bf16 weight lacks: megatron-core's ``store_param_remainders``, on by default,
  2 B) divided by the DP size of the parameter (DP x CP for dense parameters, expert DP for the
  experts) when ``ddp.use_distributed_optimizer``; plus, without the precision-aware optimizer, the
  fp32 copy of the gradient shard that megatron-core's distributed optimizer makes at the step
  (``copy_group_grads``), 4 bytes per sharded parameter.
- fsdp: weights, gradients and AdamW's two moments in ``actor.dtype``, all divided by the DP size.

Activations (a lower bound, stated as such): with full recompute only each layer's input is kept,
``L s h b`` bytes (``s`` tokens on this rank, ``b`` bytes of ``actor.dtype``); the LM head adds its
logits ``s V / t`` in ``actor.dtype`` unless the loss runs on the chunked LM-head path (``actor.loss``: ``path``
``lm_head``, or ``auto`` with ``lm_head_loss_chunk_size > 0``). The working set of the
layer being recomputed and back-propagated comes on top and is not estimated here.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["estimate_memory", "params_per_rank", "explain_estimate"]

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "uint8": 1}
_GIB = float(2**30)


def params_per_rank(hf, layout, coords: dict) -> tuple[int, int]:
    """``(P_dense, P_exp)`` parameters held by the rank with ``coords`` (module docstring formulas)."""
    h, nq, nkv = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads
    d = getattr(hf, "head_dim", None) or h // nq
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
    f = hf.moe_intermediate_size
    pp = layout.pp
    layers = hf.num_hidden_layers // pp
    t = layout.tp
    ep, etp = layout.ep, layout.etp
    dense = layers * ((h * (nq + 2 * nkv) * d + nq * d * h) // t + 2 * h + 2 * d + h * experts)
    if coords.get("pp", 0) == 0:
        dense += hf.vocab_size * h // t
    if coords.get("pp", 0) == pp - 1:
        dense += h + (0 if getattr(hf, "tie_word_embeddings", False) and pp == 1 else hf.vocab_size * h // t)
    expert = layers * (experts // ep) * 3 * h * f // etp
    return dense, expert


def estimate_memory(cfg: dict, hf, layout, coords: dict, seq_len: int) -> dict[str, Any]:
    """Estimated bytes of one rank by category (module docstring).

    Args:
        cfg: the trial's resolved config (``config.yaml`` as a nested dict).
        hf: the model's Hugging Face config (``sftprof.models.hf.load_hf_config``).
        layout: ``sftprof.allocation.Layout`` of ``actor.backend``; ``coords`` the rank's coordinates.
        seq_len: tokens per sample (``profile.fake_seq_len``).

    Returns:
        ``{"params_dense", "params_expert", "bytes_per_param": {"parameters", "gradients", "optimizer",
        "step_copy"}, "rows": [{"category", "bytes", "gib", "formula"}], "assumptions": [...]}`` (bytes per
        parameter before any sharding; ``step_copy``: megatron-core's fp32 gradient copy of the optimizer step).
    """
    a = cfg.get("actor") or {}
    m = a.get("megatron") or {}
    ddp = m.get("ddp") or {}
    wb = _BYTES.get(str(a.get("dtype", "bfloat16")), 2)
    dense, expert = params_per_rank(hf, layout, coords)
    n = dense + expert
    rows: list[dict] = []
    assumptions = []
    if layout.backend == "megatron":
        pa = bool(m.get("use_precision_aware_optimizer"))
        grad_b = (_BYTES.get(str(m.get("main_grads_dtype")), 4) if pa else 4 if ddp.get("grad_reduce_in_fp32") else wb)
        dist_opt = bool(ddp.get("use_distributed_optimizer", True))
        remainders = pa and wb == 2 and str(a.get("dtype")) == "bfloat16" and str(m.get("main_params_dtype")) == "float32"
        state_b = sum(2 if k == "main_params_dtype" and remainders else _BYTES.get(str(m.get(k)), 4) if pa else 4
                      for k in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"))
        dp_dense = layout.dp * layout.cp if dist_opt else 1
        dp_exp = layout.edp if dist_opt else 1
        opt = state_b * (dense / dp_dense + expert / dp_exp)
        step_copy = 0 if pa else 4 * (dense / dp_dense + expert / dp_exp)
        rows += [{"category": "parameters", "bytes": wb * n, "formula": f"{wb} B x {n:,} params"},
                 {"category": "gradients", "bytes": grad_b * n, "formula": f"{grad_b} B x {n:,} params"},
                 {"category": "optimizer", "bytes": int(opt + step_copy), "step_copy_bytes": int(step_copy),
                  "formula": f"{state_b} B state" + (" (fp32 main params as 16-bit remainders)" if remainders else "")
                             + ("" if pa else " + 4 B fp32 grad copy") +
                             f" x ({dense:,} / {dp_dense} + {expert:,} / {dp_exp}) params"}]
        assumptions.append(f"distributed optimizer {'on' if dist_opt else 'off'}; precision-aware optimizer "
                           f"{'on' if pa else 'off'}")
        per_param = {"parameters": wb, "gradients": grad_b, "optimizer": state_b, "step_copy": 0 if pa else 4}
    else:
        dp = layout.dp
        rows += [{"category": "parameters", "bytes": wb * n // dp, "formula": f"{wb} B x {n:,} / {dp}"},
                 {"category": "gradients", "bytes": wb * n // dp, "formula": f"{wb} B x {n:,} / {dp}"},
                 {"category": "optimizer", "bytes": 2 * wb * n // dp, "formula": f"2 x {wb} B x {n:,} / {dp}"}]
        assumptions.append("FSDP2: parameters, gradients and AdamW moments sharded over DP in actor.dtype")
        per_param = {"parameters": wb, "gradients": wb, "optimizer": 2 * wb, "step_copy": 0}
    s_local = seq_len // (layout.cp if layout.backend == "megatron" else 1)
    layers = hf.num_hidden_layers // layout.pp
    act = layers * s_local * hf.hidden_size * wb
    formula = f"{layers} layers x {s_local} tokens x {hf.hidden_size} x {wb} B (layer inputs)"
    logits = 0
    loss = a.get("loss") or {}
    path = loss.get("path", "auto")
    if not (path == "lm_head" or (path == "auto" and (loss.get("lm_head_loss_chunk_size") or 0) > 0)):
        logits = s_local * hf.vocab_size // layout.tp * wb
        act += logits
        formula += f" + logits {s_local} x {hf.vocab_size // layout.tp} x {wb} B"
    rows.append({"category": "activations", "bytes": act, "logits_bytes": logits, "formula": formula + " (lower bound: the working set of "
                                                                                "the layer in backward is not counted)"})
    for r in rows:
        r["bytes"] = int(r["bytes"])
        r["gib"] = round(r["bytes"] / _GIB, 4)
    return {"params_dense": dense, "params_expert": expert, "bytes_per_param": per_param, "rows": rows,
            "assumptions": assumptions}


def explain_estimate(s: dict, estimate: Optional[dict]) -> Optional[list[dict]]:
    """Measured vs estimated bytes per category, with the difference (bytes); None without an estimate.

    Blocks allocated before the recorded window have no stack: they are set against parameters,
    gradients and optimizer state together.
    """
    if not estimate:
        return None
    meas = {r["category"]: r["bytes"] for r in s.get("categories_at_peak") or []}
    est = {r["category"]: r["bytes"] for r in estimate["rows"]}
    rows = []
    for cat in ("parameters", "gradients", "optimizer", "activations"):
        rows.append({"category": cat, "measured_bytes": meas.get(cat, 0), "estimated_bytes": est.get(cat, 0)})
    if meas.get("before_window"):
        rows.append({"category": "parameters + gradients + optimizer + allocated before the window, together",
                     "measured_bytes": meas["before_window"] + sum(meas.get(c, 0) for c in ("parameters", "gradients", "optimizer")),
                     "estimated_bytes": sum(est.get(c, 0) for c in ("parameters", "gradients", "optimizer"))})
    for r in rows:
        r["difference_bytes"] = r["measured_bytes"] - r["estimated_bytes"]
    return rows
