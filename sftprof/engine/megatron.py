"""The ``megatron`` backend: megatron-core GPTModel (MoE) SFT step on GPUs.

Build (:class:`MegatronEngine`):

1. precision settings are validated and translated first (:func:`sftprof.models.megatron_config.
   optimizer_config_kwargs`), so a bad combination stops before any CUDA work;
2. ``parallel_state.initialize_model_parallel`` from the layout (TP, PP, CP, EP, ETP; megatron order
   ``tp-cp-ep-dp-pp``), ``model_parallel_cuda_manual_seed``;
3. ``TransformerConfig`` from the HF config (:mod:`sftprof.models.megatron_config`): sequence parallel
   when TP > 1, alltoall token dispatcher, recompute, deterministic mode, router dtype;
4. ``GPTModel`` with the layer spec of :mod:`sftprof.models.specs` (TE or local + SDPA/grouped GEMM),
   random init, or with ``actor.init_from_scratch=false`` the Hugging Face safetensors checkpoint in
   ``actor.path`` (:func:`sftprof.models.megatron_load.load_hf_checkpoint`: each rank reads only its
   shard); the vocabulary is padded to a multiple of TP and the padding's logits are masked;
5. on the ``lm_head`` loss path (``actor.loss``), :class:`sftprof.loss.LMHeadLoss` joins the model as a
   submodule that holds the output weight, so megatron's DDP hooks see the weight used (see the class);
6. megatron ``DistributedDataParallel`` and the (distributed) optimizer over DP x CP.

Step (:meth:`MegatronEngine.train_step`): micro-batches go through ``get_forward_backward_func()``
(no pipelining or 1F1B with PP). Each CP rank keeps its load-balanced slice of the sequence
(:func:`sftprof.data.cp_shard`). On the last pipeline stage the loss is computed by the path of
``actor.loss`` (:class:`sftprof.loss.SFTLoss`, chosen once at build): on the vocab-parallel logits, with
the padded vocabulary masked (``logprobs`` and ``reference`` paths), or on the final hidden states by
:class:`sftprof.loss.LMHeadLoss` (``lm_head`` path, no full logits). The routers' load
(:class:`sftprof.models.layers.routing.RoutingLoadMeter`) is summed over all ranks once per step. The loss function returns the local
loss sum and local loss-token count with ``calculate_per_token_loss=True``; Megatron sums gradients over
DP x CP and divides them by the all-reduced token count, so gradients are those of the global
token-mean loss. (Megatron then also scales the MoE auxiliary loss as in its per-token-loss mode.)
The optimizer step clips the gradient norm at ``actor.optimizer.gradient_clipping``.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Dict, List

import torch
import torch.distributed as dist

from sftprof.allocation import Layout
from sftprof.compat import apply_megatron_compat, build_with_te_wgrad_fusion
from sftprof.config import SFTProfileConfig
from sftprof.data import MicroBatch, cp_shard
from sftprof.engine.base import Engine, StepResult
from sftprof.flops import countable_shape, train_step_flops
from sftprof.loss import LMHeadLoss, SFTLoss
from sftprof.models import megatron_config as mc
from sftprof.models.checks import check_model_settings
from sftprof.models.hf import resolve_model_dir
from sftprof.models.megatron_load import load_hf_checkpoint
from sftprof.models.layers.routing import RoutingLoadMeter
from sftprof.models.specs import decoder_block_spec, have_transformer_engine
from sftprof.capture.module_regions import part_range, register_model
from sftprof.capture.regions import OPTIMIZER_STEP, backward, forward, region

log = logging.getLogger(__name__)


class _BackwardRegionMark(torch.autograd.Function):
    """Identity whose backward opens (``opening=True``, placed on the stage output) or closes (on the
    stage input) the ``sftprof/backward/mb<i>`` region."""

    @staticmethod
    def forward(ctx, x, engine, mb, opening):
        ctx.engine, ctx.mb, ctx.opening = engine, mb, opening
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.opening:
            ctx.engine._open_backward_region(ctx.mb)
        else:
            ctx.engine._close_backward_region(ctx.mb)
        return grad, None, None, None


class MegatronEngine(Engine):
    """megatron-core model + DDP + optimizer on this rank (see the module docstring).

    Args:
        cfg: trial config; ``actor.*`` (``actor.loss`` picks the loss path) and ``actor.megatron.*`` are used.
        layout: a ``megatron`` layout whose world size equals the process-group size.
        hf_config: HF (text) config of a ``qwen3_moe`` or ``qwen3_5_moe_text`` model (the latter needs fla, CP = 1).
        device: this rank's CUDA device (``torch.cuda.set_device`` done by the trainer).
    Raises:
        ConfigError: precision settings (e.g. the precision-aware optimizer without TE:
            ``USE_PRECISION_AWARE_OPTIMIZER``), a non-megatron layout, or a combination
            :func:`sftprof.models.checks.check_model_settings` refuses.
        CheckpointError: ``init_from_scratch=false`` and the checkpoint cannot be loaded (names the file or tensors).
        NotImplementedError: Qwen3.5 without fla or with CP > 1.
        RuntimeError: no CUDA device, or the world size does not match the layout.
    """

    def __init__(self, cfg: SFTProfileConfig, layout: Layout, hf_config, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError("actor.backend=megatron needs CUDA GPUs (megatron-core layers are CUDA-only); "
                               "use actor.backend=fsdp:dN on CPU")
        if dist.get_world_size() != layout.world_size:
            raise RuntimeError(f"layout {layout.describe()} needs {layout.world_size} ranks, the process group has "
                               f"{dist.get_world_size()}")
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg, self.layout, self.hf_config, self.device = cfg, layout, hf_config, device
        gpt_kwargs = mc.gpt_model_kwargs(hf_config, layout.tp)
        # the loss path, chosen once; the ops check the TP shards against the padded vocabulary
        self.loss = SFTLoss.from_config(cfg, gpt_kwargs["vocab_size"])
        have_te = have_transformer_engine()
        opt_kwargs = mc.optimizer_config_kwargs(cfg, have_te)
        check_model_settings(cfg, hf_config, layout)
        m = cfg.actor.megatron
        if m.use_deterministic_algorithms:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            if have_te and os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") != "0":
                # megatron-core's TE attention refuses deterministic_mode unless TE's own switch says so
                log.info("megatron: deterministic mode: NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (was %s)",
                         os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "unset"))
                os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
            torch.use_deterministic_algorithms(True)
        apply_megatron_compat()
        simulated = cfg.actor.simulate.rank >= 0
        # a simulated rank's fake process group has no store for gloo groups (Megatron-LM's --fake-process-group
        # turns them off too); nothing here uses them (they serve checkpointing of the distributed optimizer)
        parallel_state.initialize_model_parallel(**mc.parallel_state_kwargs(layout),
                                                 create_gloo_process_groups=not simulated)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)

        tcfg = mc.build_transformer_config(hf_config, cfg, layout, have_te)
        self.tcfg = tcfg
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()
        self.vocab_size = hf_config.vocab_size
        spec = decoder_block_spec(tcfg, have_te, cp_attention=m.cp_attention, moe_sorted_permute=m.moe_sorted_permute,
                                  moe_dedup_alltoall=m.moe_dedup_alltoall,
                                  attention_forward_chunks=m.attention_forward_chunks,
                                  cp_comm_overlap=m.cp_comm_overlap, moe_alltoall_chunks=m.moe_alltoall_chunks)
        def build():
            return GPTModel(config=tcfg, transformer_layer_spec=spec, pre_process=self.pre_process,
                            post_process=self.post_process, **gpt_kwargs)

        gpt = build_with_te_wgrad_fusion(build) if tcfg.gradient_accumulation_fusion else build()
        if m.cp_attention != type(m).cp_attention and (layout.cp == 1 or have_te):  # a value set on purpose
            log.info("megatron: actor.megatron.cp_attention=%s has no effect here (%s)", m.cp_attention,
                     "Transformer Engine's attention does its own context parallelism" if have_te else
                     "CP = 1: one plain causal SDPA call")
        if m.cp_comm_overlap != type(m).cp_comm_overlap and (layout.cp == 1 or have_te or m.cp_attention != "blocks"):
            log.info("megatron: actor.megatron.cp_comm_overlap=%s has no effect here (%s)", m.cp_comm_overlap,
                     "Transformer Engine's attention" if have_te else "CP = 1" if layout.cp == 1 else
                     "it applies to actor.megatron.cp_attention=blocks")
        if m.attention_forward_chunks != type(m).attention_forward_chunks and (layout.cp > 1 or have_te):
            log.info("megatron: actor.megatron.attention_forward_chunks=%s has no effect here (%s)",
                     m.attention_forward_chunks, "Transformer Engine's attention" if have_te else
                     "CP > 1: actor.megatron.cp_attention decides")
        if m.moe_alltoall_chunks != type(m).moe_alltoall_chunks:
            from sftprof.models.layers.moe_dedup import dedup_alltoall_applies  # imports megatron-core

            if have_te or not m.moe_dedup_alltoall or not dedup_alltoall_applies(tcfg):
                log.info("megatron: actor.megatron.moe_alltoall_chunks=%s has no effect here (it applies to the "
                         "deduplicating all-to-all dispatcher: actor.megatron.moe_dedup_alltoall, EP > 1, expert TP 1, "
                         "without Transformer Engine)", m.moe_alltoall_chunks)
        if m.moe_router_force_load_balancing:
            log.info("megatron: actor.megatron.moe_router_force_load_balancing=true: every MoE router's logits are "
                     "random (megatron-core's benchmark option); the routing is not the model's")
        # Vocabulary padding (V' > V, only when V is not a multiple of TP) lives on the last TP rank.
        tp_rank, v_local = parallel_state.get_tensor_model_parallel_rank(), gpt_kwargs["vocab_size"] // layout.tp
        self.vocab_valid_local = min(v_local, max(0, self.vocab_size - tp_rank * v_local))
        self.n_params = sum(p.numel() for p in gpt.parameters())
        if cfg.actor.init_from_scratch:
            log.info("megatron: random initialisation (actor.init_from_scratch=true) of %s", cfg.actor.path)
        else:
            load_hf_checkpoint(gpt, resolve_model_dir(cfg.actor.path), hf_config)
        log.info("megatron: %s, %d layers on this stage, %.3f B parameters on this rank; %s; transformer_engine=%s; "
                 "loss path %s", cfg.actor.path, len(gpt.decoder.layers), self.n_params / 1e9, layout.describe(),
                 have_te, self.loss.describe(cuda=True))
        # megatron-core creates some parameters on the CPU (the MoE router's weight: TopKRouter.__init__) and
        # moves them at their first forward by replacing .data, which detaches the gradient accumulator DDP
        # hooked below: the router's gradients would never reach main_grad. Move everything before DDP.
        gpt.cuda(device)
        self.lm_head_loss = None
        if not self.loss.uses_logits and self.post_process:
            # GPTModel returns the final (normed) hidden states instead of logits when post_process is False.
            gpt.post_process = False
            tied = gpt.share_embeddings_and_output_weights
            weight = gpt.shared_embedding_or_output_weight() if tied else gpt.output_layer.weight
            gpt.lm_head_loss = self.lm_head_loss = LMHeadLoss(
                weight, self.loss, parallel_state.get_tensor_model_parallel_group(), tcfg.sequence_parallel)
        if self.pre_process:
            gpt.embedding.register_forward_hook(self._mark_stage_input)
        self.gpt = gpt
        register_model(gpt)  # model-part ranges in kernel traces (sftprof.capture.module_regions)
        self.routing = RoutingLoadMeter(
            [(layer.layer_number - 1, layer.mlp.router) for layer in gpt.decoder.layers],
            hf_config.num_hidden_layers, tcfg.num_moe_experts, layout.ep, device)

        ddp_config = DistributedDataParallelConfig(**mc.ddp_config_kwargs(cfg))
        self.model = DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=gpt)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(**opt_kwargs), [self.model],
                                                use_gloo_process_groups=not simulated)
        mc.use_fused_torch_adam(self.optimizer)  # the fused Adam that TE/Apex would give (no-op with them)
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.grad_scale_func = self.optimizer.scale_loss
        if ddp_config.overlap_grad_reduce:
            tcfg.no_sync_func = self.model.no_sync
            tcfg.grad_sync_func = self.model.start_grad_sync
        if ddp_config.overlap_param_gather:
            tcfg.param_sync_func = self.model.start_param_sync
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self._rank_coords = layout.rank_coords(dist.get_rank())
        self.shape = countable_shape(hf_config)
        self._bwd_regions: Dict[int, contextlib.ExitStack] = {}
        self._mb_index = 0
        self._flops_logged = False

    @property
    def rank_coords(self) -> dict:
        return dict(self._rank_coords)

    # ---- backward-region markers -------------------------------------------------------------------
    def _open_backward_region(self, mb: int) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(region(backward(mb)))
        self._bwd_regions[mb] = stack

    def _close_backward_region(self, mb: int) -> None:
        stack = self._bwd_regions.pop(mb, None)
        if stack is not None:
            stack.close()

    def _mark_stage_input(self, module, inputs, output):
        if torch.is_grad_enabled() and output.requires_grad:
            return _BackwardRegionMark.apply(output, self, self._mb_index, False)
        return output

    # ---- step --------------------------------------------------------------------------------------
    def _prepare(self, mb: MicroBatch) -> dict:
        b, s = mb.input_ids.shape
        if s % (2 * self.cp_size if self.cp_size > 1 else 1) or (s // self.cp_size) % self.layout.tp:
            raise ValueError(f"profile.fake_seq_len={s}: must be divisible by 2*CP={2 * self.cp_size} and the "
                             f"per-CP-rank length by TP={self.layout.tp} (sequence parallel)")
        pos = torch.arange(s, dtype=torch.int64).expand(b, s)

        def shard(t):
            return cp_shard(t, self.cp_size, self.cp_rank, dim=1).to(self.device, non_blocking=True)

        return {"input_ids": shard(mb.input_ids), "position_ids": shard(pos), "labels": shard(mb.labels),
                "loss_mask": shard(mb.loss_mask)}

    def _loss_sum(self, output: torch.Tensor, batch: dict) -> torch.Tensor:
        """Local sum of ``-logprob * loss_mask`` (fp32 scalar) from the last stage's output (:attr:`loss`'s path)."""
        mask = batch["loss_mask"]
        if self.lm_head_loss is not None:
            # output: final hidden states [s_local(/tp under SP), b, h]; tokens in [s, b] order.
            return self.lm_head_loss(output, batch["labels"].t().reshape(-1), mask.t().reshape(-1).to(torch.float32))
        # output: vocab-parallel logits [b, s_local, V'/tp]
        logits = self.mask_vocab_padding(output)
        with part_range("lm_head_loss"):  # no module runs the loss here: its kernels are still the LM head's
            return self.loss.from_logits(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                         mask.reshape(-1).to(torch.float32), tp_group=self.tp_group)

    def mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [..., V'/tp]`` with the padded vocabulary columns of this TP rank set to -inf (no-op
        without padding), so the log-softmax runs over the model's real vocabulary only."""
        if self.vocab_valid_local == logits.shape[-1]:
            return logits
        return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= self.vocab_valid_local,
                                  float("-inf"))

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        mb = self._mb_index
        with region(forward(mb)):
            if not self.pre_process:
                dec = self.gpt.decoder
                if dec.input_tensor is not None and dec.input_tensor.requires_grad:
                    dec.input_tensor = _BackwardRegionMark.apply(dec.input_tensor, self, mb, False)
            output = model(batch["input_ids"], batch["position_ids"], None)
            if self.post_process:
                output = self._loss_sum(output, batch)
            output = _BackwardRegionMark.apply(output, self, mb, True)
        self._mb_index += 1
        n_tokens = batch["loss_mask"].sum().to(torch.int)

        def loss_func(loss_sum):
            return loss_sum, n_tokens, {"loss_sum": loss_sum.detach().clone(), "n_tokens": n_tokens}

        return output, loss_func

    def train_step(self, micro_batches: List[MicroBatch], global_loss_tokens: int) -> StepResult:
        """Forward + backward of ``micro_batches`` through megatron's schedule, then the optimizer step.

        Raises:
            ValueError: sequence length not divisible as CP/SP need, micro-batches of unequal size with
                PP > 1, or ``global_loss_tokens <= 0``.
            RuntimeError: the loss tokens counted over DP x CP differ from ``global_loss_tokens``.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if global_loss_tokens <= 0:
            raise ValueError(f"global_loss_tokens={global_loss_tokens}: must be > 0")
        sizes = {mb.input_ids.shape[0] for mb in micro_batches}
        if self.layout.pp > 1 and len(sizes) > 1:
            raise ValueError(f"pipeline parallelism needs equal micro-batch sizes, got {sorted(sizes)} sequences; "
                             "make train_dataset.batch_size / dp a multiple of actor.mb_spec.n_mbs")
        seq_len = micro_batches[0].input_ids.shape[1]
        data = [self._prepare(mb) for mb in micro_batches]
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._mb_index = 0
        try:
            losses = get_forward_backward_func()(
                forward_step_func=self._forward_step, data_iterator=iter(data), model=[self.model],
                num_microbatches=len(data), seq_length=seq_len, micro_batch_size=max(sizes), forward_only=False)
        finally:
            for mb in list(self._bwd_regions):
                self._close_backward_region(mb)
        with region(OPTIMIZER_STEP):
            _, grad_norm, _ = self.optimizer.step()
        moe_load = self.routing.step_record()
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.post_process:
            for d in losses:
                stats[0] += d["loss_sum"].double()
                stats[1] += d["n_tokens"].double()
            dist.all_reduce(stats, group=self.dp_cp_group)
        if self.layout.pp > 1:
            dist.all_reduce(stats, group=self.pp_group)
        loss_sum, counted = stats.tolist()
        # a simulated rank's all-reduces do not sum (fake process group): it counts its own tokens only
        if self.cfg.actor.simulate.rank < 0 and int(round(counted)) != global_loss_tokens:
            raise RuntimeError(f"loss tokens counted over DP x CP = {counted:.0f} differ from global_loss_tokens="
                               f"{global_loss_tokens}")
        seqs = [seq_len] * (sum(mb.input_ids.shape[0] for mb in micro_batches) * self.layout.dp)
        m = self.cfg.actor.megatron
        gran = m.recompute_granularity if self.cfg.actor.gradient_checkpointing else "none"
        flops = (train_step_flops(self.shape, seqs, gran, m.recompute_method, m.recompute_num_layers, self.layout.pp)
                 if self.shape else None)
        if flops and not self._flops_logged and dist.get_rank() == 0:
            log.info("megatron: step FLOPs (global batch) model %.4g, recompute %.4g (%s; not in model FLOPs/MFU)",
                     flops.model, flops.recompute, gran)
        self._flops_logged = True
        return StepResult(loss=loss_sum / global_loss_tokens, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                          model_flops=flops.model if flops else None, recompute_flops=flops.recompute if flops else None,
                          moe_load=moe_load)
