"""Theoretical memory of one rank for a trial's configuration, to set against a snapshot's peak.

Parameters per rank (``P_dense`` outside the experts, ``P_exp`` of the routed experts), for ``L`` layers
on this pipeline stage, hidden ``h``, ``n_q``/``n_kv`` heads of size ``d``, ``E`` experts of FFN size
``f``, vocabulary ``V``, TP ``t``, EP ``e``, expert TP ``t_e``:

- per layer: attention ``(h (g n_q + 2 n_kv) d + n_q d h) / t`` (``g`` 2 with an attention output gate, else 1),
  or a gated delta-net's (``linear_attention`` in ``layer_types``: its in-projection, conv1d, decay and output
  projection) + norms ``2 h + 2 d`` + router ``h E`` + a shared expert's ``3 h f_s / t + h`` where the model has one;
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
layer being recomputed and back-propagated comes on top: :func:`predict_peak` adds it.

:func:`predict_peak` predicts the step's peak allocated bytes of one rank (steady state, step >= 1, with the
optimizer state allocated) as the largest of three moments, with ``s`` the tokens of one micro-batch on the rank
(``seq_len x`` sequences per micro-batch ``/ CP``), ``U = s h b / t`` (a hidden-sized tensor, sequence-parallel
over TP), ``T = s k t_e / t`` tokens after the MoE dispatch (``k`` experts per token, balanced routing; one rank
with EP 1), ``Q = s n_q d b / t`` and ``KV = s n_kv d b / t``:

- the layer backward: parameters, gradients, optimizer state (without the fp32 gradient copy, made later), with
  Transformer Engine its cuBLAS / GEMM workspaces (0.156 GiB in 5 blocks in every TE snapshot, none with
  ``transformer_impl=local``; ``auto`` is taken as TE, which every measured run of it had), the saved activations
  (full recompute: each recompute group's input ``U``; a layer's saved set ``A`` where it is not recomputed, for
  every micro-batch in flight: ``PP - pp_rank`` with PP > 1), the routers' state every layer keeps for its auxiliary
  loss (``13 s E`` bytes with TE: fp32 probabilities, a mask and TE's row-id map; ``5 s E`` with local specs, which
  keep no row-id map), one layer's working set ``A + B`` and, with full recompute, the retained input gradients.
  Full attention ``A = 2 U + 2 U + 3 Q + 2 KV`` (the layer's input and its residual after attention, the two norm
  outputs, q/k/v after RoPE, the attention output); a gated delta-net ``A = 4 U + b s (2 c_qk + 2 c_v + 2 n_v +
  2 c_qk + c_v + 2 c_v) / t + 2 S`` (its in-projection, conv and core outputs, ``S = ceil(s / 64) n_v d_k d_v b / t``
  chunk states, taken twice for their gradient); MoE ``A = 2 T h b + 3 T f b / t_e`` (dispatched tokens, expert
  output, FC1 output and activation) and ``B = 2 T h b`` (their gradients after the permutation), ``+ T h b`` with
  EP > 1 (the all-to-all's output, megatron-core's ``mappings.py`` all-to-all, alive beside the permuted tokens:
  measured on the simulated EP-8 rank, 4 and 48 layers, where the MoE sites at the peak held ``5 T h b + 3 T f b``
  against ``4 T h b + 3 T f b`` at EP 1). A recomputed group's working set leaves out its input (saved already).
  Calibrated on the alive-at-peak list of the 4-layer Qwen3-30B-A3B 131072-token snapshot with
  ``LM_HEAD_LOSS_CHUNK_SIZE=2048`` (TE, one H200: full attention 3 U + 3 Q + 2 KV and MoE 4 T h b + 3 T f b, site by
  site); the gated delta-net terms are derived, not calibrated.
  Retained input gradients (full recompute): the input gradient that megatron-core's ``CheckpointFunction.backward``
  returns for a recompute group (allocated in its ``torch.autograd.backward``, ``random.py``) stays alive until the
  micro-batch's backward ends, so the backward of group ``g`` (of ``G``, counted from the first layer) holds
  ``(G - 1 - g) U`` more: measured with ``uniform`` 1 layer, ``L - 1`` blocks of ``U`` at the peak (the first layer's
  backward) at 4 layers (131072 and 16384 tokens on one GPU, 32768 on the simulated EP-8 rank) and at 48 layers
  (47 blocks, 5.9 GiB). Assumed, not measured: a group of ``recompute_num_layers`` layers retains one gradient
  (``uniform``), ``block`` retains one per recomputed layer; ``selective`` (its checkpointed modules) and ``none``
  retain none.
- the LM head backward, unless the loss is chunked: the same static part, saved activations and router state,
  the logits ``s V b / t``, the output layer's weight gradient ``V h b / t`` and ``3 U`` (final norm output, the
  hidden gradient).
- the optimizer step: the static part with megatron-core's fp32 gradient copy (without the precision-aware
  optimizer) and what the last micro-batch still holds: its router state and, with full recompute, its group inputs
  and all ``G`` retained input gradients (measured, TE hidden, fp32 Adam: 4 + 4 blocks of ``U`` and the router's
  state alive in the step of both one-GPU 4-layer snapshots); with local specs (TE hidden: megatron-core's
  ``local_multi_tensor_scale`` for gradient clipping, ``dst.copy_(src * scale)``) the fp32 product of the largest
  main-gradient tensor: a layer's experts' FC1 ``(E / e) 2 h f / t_e`` over the expert DP size, else the embedding's
  ``V h / t`` over DP x CP, 4 B (measured at one GPU: 1.5 GiB Qwen3-30B-A3B, 2.0 GiB Qwen3.5).

Recompute: ``full`` with ``uniform`` keeps one input per ``recompute_num_layers`` layers and recomputes that many
at once; ``block`` recomputes the first ``recompute_num_layers`` layers and saves ``A`` of the others; ``selective``
saves ``A`` less what ``recompute_modules`` re-run (``core_attn``: ``Q``; ``layernorm``: ``2 U``; ``moe``: the MoE
``A``; ``shared_experts``: a shared expert's); ``none`` (or ``actor.gradient_checkpointing`` false) saves ``A`` of
every layer. Outside this estimate: what the allocator reserves and does not use (``expandable_segments`` keep it
small) and what the process holds outside PyTorch (CUDA context, NCCL, cuDNN and Triton): see
:mod:`sftprof.analysis.memory.fit`.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from sftprof.allocation import Layout
from sftprof.analysis.memory.schema import Estimate, EstimateCheckRow, EstimateRow

__all__ = ["estimate_memory", "params_per_rank", "explain_estimate", "predict_peak", "chunked_lm_head", "layer_sets",
           "transformer_engine"]

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "uint8": 1}
_GIB = float(2**30)


def _attention_params(hf: Any, layer_type: str, t: int) -> int:
    """Parameters of one layer's attention block (its norm included) on a rank of TP ``t``."""
    h, nq, nkv = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads
    d = getattr(hf, "head_dim", None) or h // nq
    if layer_type == "linear_attention":  # gated delta-net: in_proj (q, k, v, z, b, a), conv1d, A_log, dt_bias, norm
        qk = hf.linear_num_key_heads * hf.linear_key_head_dim
        v, nv = hf.linear_num_value_heads * hf.linear_value_head_dim, hf.linear_num_value_heads
        gdn: int = (h * (2 * qk + 2 * v + 2 * nv) + (2 * qk + v) * hf.linear_conv_kernel_dim + 2 * nv + v * h) // t \
            + hf.linear_value_head_dim + h
        return gdn
    gate = 2 if getattr(hf, "attn_output_gate", False) else 1  # the output gate doubles the query projection
    full: int = (h * (gate * nq + 2 * nkv) * d + nq * d * h) // t + h + 2 * d
    return full


def params_per_rank(hf: Any, layout: Layout, coords: Mapping[str, int]) -> tuple[int, int]:
    """``(P_dense, P_exp)`` parameters held by the rank with ``coords`` (module docstring formulas)."""
    h = hf.hidden_size
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
    f = hf.moe_intermediate_size
    shared = getattr(hf, "shared_expert_intermediate_size", None) or 0
    pp = layout.pp
    layers = hf.num_hidden_layers // pp
    t = layout.tp
    ep, etp = layout.ep, layout.etp
    first = coords.get("pp", 0) * layers
    types = list(getattr(hf, "layer_types", None) or []) or ["full_attention"] * hf.num_hidden_layers
    dense = sum(_attention_params(hf, types[i], t) for i in range(first, first + layers))
    dense += layers * (h + h * experts + ((3 * h * shared) // t + h if shared else 0))  # MLP norm, router, shared expert
    if coords.get("pp", 0) == 0:
        dense += hf.vocab_size * h // t
    if coords.get("pp", 0) == pp - 1:
        dense += h + (0 if getattr(hf, "tie_word_embeddings", False) and pp == 1 else hf.vocab_size * h // t)
    expert = layers * (experts // ep) * 3 * h * f // etp
    return dense, expert


def estimate_memory(cfg: dict[str, Any], hf: Any, layout: Layout, coords: Mapping[str, int], seq_len: int) -> Estimate:
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
    rows: list[EstimateRow] = []
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
        rows += [{"category": "parameters", "bytes": wb * n, "formula": f"{wb} B x {n:,} params", "gib": _gib(wb * n)},
                 {"category": "gradients", "bytes": grad_b * n, "formula": f"{grad_b} B x {n:,} params",
                  "gib": _gib(grad_b * n)},
                 {"category": "optimizer", "bytes": int(opt + step_copy), "step_copy_bytes": int(step_copy),
                  "formula": f"{state_b} B state" + (" (fp32 main params as 16-bit remainders)" if remainders else "")
                             + ("" if pa else " + 4 B fp32 grad copy") +
                             f" x ({dense:,} / {dp_dense} + {expert:,} / {dp_exp}) params",
                  "gib": _gib(int(opt + step_copy))}]
        assumptions.append(f"distributed optimizer {'on' if dist_opt else 'off'}; precision-aware optimizer "
                           f"{'on' if pa else 'off'}")
        per_param = {"parameters": wb, "gradients": grad_b, "optimizer": state_b, "step_copy": 0 if pa else 4}
    else:
        dp = layout.dp
        rows += [{"category": "parameters", "bytes": wb * n // dp, "formula": f"{wb} B x {n:,} / {dp}",
                  "gib": _gib(wb * n // dp)},
                 {"category": "gradients", "bytes": wb * n // dp, "formula": f"{wb} B x {n:,} / {dp}",
                  "gib": _gib(wb * n // dp)},
                 {"category": "optimizer", "bytes": 2 * wb * n // dp, "formula": f"2 x {wb} B x {n:,} / {dp}",
                  "gib": _gib(2 * wb * n // dp)}]
        assumptions.append("FSDP2: parameters, gradients and AdamW moments sharded over DP in actor.dtype")
        per_param = {"parameters": wb, "gradients": wb, "optimizer": 2 * wb, "step_copy": 0}
    s_local = seq_len // (layout.cp if layout.backend == "megatron" else 1)
    layers = hf.num_hidden_layers // layout.pp
    act: int = layers * s_local * hf.hidden_size * wb
    formula = f"{layers} layers x {s_local} tokens x {hf.hidden_size} x {wb} B (layer inputs)"
    logits = 0
    if not chunked_lm_head(cfg):
        logits = s_local * hf.vocab_size // layout.tp * wb
        act += logits
        formula += f" + logits {s_local} x {hf.vocab_size // layout.tp} x {wb} B"
    rows.append({"category": "activations", "bytes": act, "logits_bytes": logits,
                 "formula": formula + " (lower bound: the working set of the layer in backward is not counted)",
                 "gib": _gib(act)})
    return {"params_dense": dense, "params_expert": expert, "bytes_per_param": per_param, "rows": rows,
            "assumptions": assumptions}


def _gib(nbytes: int) -> float:
    """Bytes in GiB, 4 decimals (a row's ``gib``)."""
    return round(nbytes / _GIB, 4)


def explain_estimate(s: Mapping[str, Any], estimate: Optional[Estimate]) -> Optional[list[EstimateCheckRow]]:
    """Measured vs estimated bytes per category, with the difference (bytes); None without an estimate.

    Blocks allocated before the recorded window have no stack: they are set against parameters,
    gradients and optimizer state together.
    """
    if not estimate:
        return None
    meas = {r["category"]: r["bytes"] for r in s.get("categories_at_peak") or []}
    est = {r["category"]: r["bytes"] for r in estimate["rows"]}
    pairs = [(cat, meas.get(cat, 0), est.get(cat, 0))
             for cat in ("parameters", "gradients", "optimizer", "activations")]
    if meas.get("before_window"):
        pairs.append(("parameters + gradients + optimizer + allocated before the window, together",
                      meas["before_window"] + sum(meas.get(c, 0) for c in ("parameters", "gradients", "optimizer")),
                      sum(est.get(c, 0) for c in ("parameters", "gradients", "optimizer"))))
    return [{"category": cat, "measured_bytes": m, "estimated_bytes": e, "difference_bytes": m - e}
            for cat, m, e in pairs]


def chunked_lm_head(cfg: Mapping[str, Any]) -> bool:
    """True when the loss runs on the chunked LM-head path, which holds no logits (``actor.loss``)."""
    loss = (cfg.get("actor") or {}).get("loss") or {}
    path = loss.get("path", "auto")
    return path == "lm_head" or (path == "auto" and (loss.get("lm_head_loss_chunk_size") or 0) > 0)


# Bytes of router state per token and expert (module docstring), measured: TE keeps fp32 probabilities (4), the
# routing mask (1) and its row-id map (8); the local specs the probabilities and the mask
ROUTER_BYTES_PER_TOKEN_EXPERT = 13
ROUTER_BYTES_PER_TOKEN_EXPERT_LOCAL = 5
TE_WORKSPACE_BYTES = 167_777_280  # cuBLAS / TE GEMM workspaces: 0.156 GiB in 5 blocks in every TE snapshot
GDN_CHUNK = 64  # tokens per chunk of fla's chunked gated delta rule (one state per chunk)


def transformer_engine(cfg: Mapping[str, Any]) -> bool:
    """True unless ``actor.megatron.transformer_impl`` is ``local`` (``auto`` taken as TE: module docstring)."""
    return str(((cfg.get("actor") or {}).get("megatron") or {}).get("transformer_impl", "auto")) != "local"


def layer_sets(hf: Any, layer_type: str, s: int, t: int, etp: int, b: int, ep: int = 1) -> dict[str, int]:
    """Bytes one layer saves for backward at ``s`` tokens on a rank, by megatron-core recompute module (``core_attn``,
    ``layernorm``, ``moe``, ``shared_experts``; ``other``: the layer's input and its residual after attention), and
    its MoE backward's working set ``moe_backward`` at EP ``ep`` (module docstring: ``A`` and ``B``)."""
    h = hf.hidden_size
    u = s * h * b // t
    if layer_type == "linear_attention":
        qk = hf.linear_num_key_heads * hf.linear_key_head_dim
        v = hf.linear_num_value_heads * hf.linear_value_head_dim
        nv = hf.linear_num_value_heads
        states = -(-s // GDN_CHUNK) * nv * hf.linear_key_head_dim * hf.linear_value_head_dim * b // t
        core_attn = s * b * (2 * qk + 2 * v + 2 * nv + 2 * qk + v + 2 * v) // t + 2 * states
    else:
        nq, nkv = hf.num_attention_heads, hf.num_key_value_heads
        d = getattr(hf, "head_dim", None) or h // nq
        core_attn = (3 * nq + 2 * nkv) * s * d * b // t
    tokens = s * hf.num_experts_per_tok * etp // t
    f = hf.moe_intermediate_size // etp
    shared = getattr(hf, "shared_expert_intermediate_size", None) or 0
    return {"core_attn": core_attn, "layernorm": 2 * u, "other": 2 * u,
            "moe": 2 * tokens * h * b + 3 * tokens * f * b, "shared_experts": 3 * s * shared * b // t,
            "moe_backward": (2 + (ep > 1)) * tokens * h * b}


def _largest_main_grad(hf: Any, layout: Layout) -> int:
    """Elements of the rank's largest fp32 main-gradient tensor (module docstring, the optimizer step)."""
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
    fc1 = experts // layout.ep * 2 * hf.hidden_size * hf.moe_intermediate_size // layout.etp // layout.edp
    largest: int = max(fc1, hf.vocab_size * hf.hidden_size // layout.tp // (layout.dp * layout.cp))
    return largest


def predict_peak(cfg: dict[str, Any], hf: Any, layout: Layout, coords: Mapping[str, int],
                 seq_len: int) -> dict[str, Any]:
    """The step's predicted peak allocated bytes of the rank with ``coords`` (megatron; module docstring).

    Args:
        cfg: the trial's resolved config as a nested dict; ``hf``, ``layout``, ``coords``, ``seq_len``: as for
            :func:`estimate_memory`.

    Returns:
        ``{"peak_bytes", "phase", "rows": [{"category", "bytes", "formula"}], "phases": {phase: bytes},
        "assumptions"}``: ``rows`` are the categories at the peak (parameters, gradients, optimizer, saved
        activations, router state, layer working set, retained input gradients or logits, ...), summing to
        ``peak_bytes``.

    Raises:
        ValueError: an fsdp layout (this prediction models megatron-core's layers and recompute).
    """
    if layout.backend != "megatron":
        raise ValueError(f"predict_peak: the megatron backend only (actor.backend has {layout.backend!r})")
    est = estimate_memory(cfg, hf, layout, coords, seq_len)
    a = cfg.get("actor") or {}
    m = a.get("megatron") or {}
    b = _BYTES.get(str(a.get("dtype", "bfloat16")), 2)
    te = transformer_engine(cfg)
    rows_by = {r["category"]: r for r in est["rows"]}
    opt = rows_by["optimizer"]
    static = [{"category": c, "bytes": rows_by[c]["bytes"], "formula": rows_by[c]["formula"]}
              for c in ("parameters", "gradients")]
    static.append({"category": "optimizer", "bytes": opt["bytes"] - opt.get("step_copy_bytes", 0),
                   "formula": opt["formula"].replace(" + 4 B fp32 grad copy", "")})
    if te:
        static.append({"category": "library workspaces", "bytes": TE_WORKSPACE_BYTES,
                       "formula": "cuBLAS / Transformer Engine GEMM workspaces (measured)"})
    n_seqs = int((cfg.get("train_dataset") or {}).get("batch_size", 1)) // max(1, layout.dp)
    spec = a.get("mb_spec") or {}
    n_mb = max(1, min(n_seqs, int(spec.get("n_mbs", 1) or 1)))
    s = seq_len * -(-max(1, n_seqs) // n_mb) // layout.cp
    t, etp, h = layout.tp, layout.etp, hf.hidden_size
    layers = hf.num_hidden_layers // layout.pp
    first = coords.get("pp", 0) * layers
    types = list(getattr(hf, "layer_types", None) or []) or ["full_attention"] * hf.num_hidden_layers
    sets = [layer_sets(hf, types[i], s, t, etp, b, layout.ep) for i in range(first, first + layers)]
    saved_of = [sum(v for k, v in x.items() if k != "moe_backward") for x in sets]
    moe_b = max(x["moe_backward"] for x in sets)
    u = s * h * b // t
    gran = m.get("recompute_granularity", "full") if a.get("gradient_checkpointing", True) else "none"
    n_rc = int(m.get("recompute_num_layers", 1) or 1)
    groups: list[range] = []  # checkpointed groups of layers, full recompute
    if gran == "full" and m.get("recompute_method", "uniform") == "uniform":
        groups = [range(i, min(i + n_rc, layers)) for i in range(0, layers, n_rc)]
        saved, what = len(groups) * u, f"{len(groups)} group inputs U"
    elif gran == "full":  # block: the first n_rc layers recomputed, the others saved
        groups = [range(i, i + 1) for i in range(min(n_rc, layers))]
        saved = len(groups) * u + sum(saved_of[n_rc:])
        what = f"{len(groups)} layer inputs U + saved sets A of {max(0, layers - n_rc)} layers"
    else:
        again = set(m.get("recompute_modules") or []) if gran == "selective" else set()
        saved = sum(x - sum(sets[i][k] for k in again if k in sets[i]) for i, x in enumerate(saved_of))
        what = f"saved sets A of {layers} layers" + (f" less {', '.join(sorted(again))} (recomputed)" if again else "")
        work = max(sum(sets[i][k] for k in again if k in sets[i]) for i in range(layers)) if again else 0
    in_flight = min(n_mb, layout.pp - coords.get("pp", 0)) if layout.pp > 1 else 1
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
    per = ROUTER_BYTES_PER_TOKEN_EXPERT if te else ROUTER_BYTES_PER_TOKEN_EXPERT_LOCAL
    router = layers * s * experts * per // t
    router_formula = f"{layers} layers x {s} tokens x {experts} experts x {per} B / {t}"
    router_row = {"category": "router state", "bytes": in_flight * router, "formula": router_formula
                  + (f" x {in_flight} micro-batches in flight" if in_flight > 1 else "")}
    common = [{"category": "saved activations", "bytes": in_flight * saved,
               "formula": f"{what}" + (f" x {in_flight} micro-batches in flight" if in_flight > 1 else "")
               + f" (s = {s} tokens per micro-batch on the rank)"}, router_row]
    work_row = {"category": "layer working set", "formula": "one layer's saved set A recomputed + its MoE backward B"}
    if groups:  # the group whose backward, with the input gradients of the groups after it, holds the most
        held = [sum(saved_of[i] for i in g) - u + moe_b + (len(groups) - 1 - j) * u for j, g in enumerate(groups)]
        j = held.index(max(held))
        later = len(groups) - 1 - j
        backward = static + common + [
            dict(work_row, bytes=held[j] - later * u,
                 formula="one recompute group's saved sets A less its input + its MoE backward B"),
            {"category": "retained input gradients", "bytes": later * u,
             "formula": f"{later} x U: the input gradients of the {later} recompute groups back-propagated before, "
                        "held until the micro-batch's backward ends"}]
    else:
        backward = static + common + [dict(work_row, bytes=work + moe_b)]
    phases = {"layer backward": backward}
    if layout.pp == 1 or coords.get("pp", 0) == layout.pp - 1:
        if not chunked_lm_head(cfg):
            v = hf.vocab_size // t
            phases["LM head backward"] = static + common + [
                {"category": "logits", "bytes": s * v * b, "formula": f"{s} x {v} x {b} B"},
                {"category": "LM head gradients", "bytes": v * h * b + 3 * u,
                 "formula": f"weight gradient {v} x {h} x {b} B + 3 U"}]
    step = static + [dict(router_row, bytes=router, formula=router_formula + " of the last micro-batch")]
    if groups:
        step += [{"category": "saved activations", "bytes": len(groups) * u,
                  "formula": f"{len(groups)} group inputs U of the last micro-batch"},
                 {"category": "retained input gradients", "bytes": len(groups) * u,
                  "formula": f"{len(groups)} x U of the last micro-batch"}]
    if opt.get("step_copy_bytes"):
        step.append({"category": "fp32 gradient copy", "bytes": opt["step_copy_bytes"],
                     "formula": "4 B x sharded parameters"})
    clip = float((a.get("optimizer") or {}).get("gradient_clipping", 1.0) or 0)
    if not te and clip > 0:
        n = _largest_main_grad(hf, layout)
        step.append({"category": "gradient clipping product", "bytes": 4 * n,
                     "formula": f"4 B x {n:,}: the largest fp32 main gradient scaled out of place (local specs)"})
    phases["optimizer step"] = step
    totals = {k: int(sum(r["bytes"] for r in v)) for k, v in phases.items()}
    phase = max(totals, key=lambda k: totals[k])
    rows = [dict(r, bytes=int(r["bytes"])) for r in phases[phase]]
    return {"peak_bytes": totals[phase], "phase": phase, "rows": rows, "phases": totals,
            "assumptions": est["assumptions"] + [
                f"recompute {gran}; balanced MoE routing; {n_mb} micro-batch(es) of {s} tokens on the rank"]}
