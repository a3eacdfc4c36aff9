"""FSDP2 engine: Hugging Face ``Qwen3MoeForCausalLM`` / ``Qwen3_5MoeForCausalLM`` sharded with ``fully_shard``.

Layout ``fsdp:d<N>``: every rank holds ``1/N`` of every parameter, gradient and AdamW state;
parameters are all-gathered per decoder layer for its forward and backward and gradients are
reduce-scattered (averaged over the DP ranks). Runs on CUDA with NCCL and on CPU with gloo.

Sharding units: each decoder layer, the LM head together with the loss (:class:`sftprof.loss.LMHeadLoss`),
then the root (embedding and final norm). The LM-head weight is unsharded only inside its own
module's forward, so the loss op that reads it (``sftprof.ops``) must run inside that forward:
that is why the head and the loss form one module.

Loss of a micro-batch (fp32): ``sum(-logprob(label) * loss_mask)`` over its tokens, computed
from the final hidden states by the path of ``actor.loss`` (:class:`sftprof.loss.SFTLoss`: the
chunked LM-head loss, or full logits then the chunked vocab-parallel log-probs or the fp32
reference). The MoE load-balancing auxiliary loss is not added (the reported loss is the pure SFT
loss).

Qwen3.5 (``qwen3_5_moe_text``): Hugging Face's text model runs its gated delta-net layers on
flash-linear-attention / causal-conv1d kernels when they are installed, else on its PyTorch reference
implementation (CPU runs); its multi-token-prediction (MTP) block is not built or trained. Inputs may
come padded (``attention_mask``): outputs and labels are repacked to the packed token order
(:mod:`sftprof.models.layers.bshd`) before the LM head and loss.
"""
from __future__ import annotations

import logging
import math
from typing import List

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from sftprof.data import MicroBatch
from sftprof.engine.base import Engine, StepResult
from sftprof.flops import countable_shape, train_step_flops
from sftprof.loss import LMHeadLoss, SFTLoss
from sftprof.models.checkpoint import CheckpointError, name_list
from sftprof.models.hf import CAUSAL_LM_CLASSES, check_weights_present, resolve_model_dir
from sftprof.models.weights import not_loaded
from sftprof.models.layers.bshd import repack
from sftprof.models.layers.routing import RoutingLoadMeter
from sftprof.capture.module_regions import register_model
from sftprof.capture.regions import OPTIMIZER_STEP, backward, forward, region

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CausalLMForSFT(nn.Module):
    """``model`` (the HF decoder, e.g. ``Qwen3MoeModel``) + ``lm_head`` (:class:`sftprof.loss.LMHeadLoss` holding
    the HF LM head's weight).

    Parameter names equal those of the Hugging Face ``*ForCausalLM`` it was built from. Inputs are
    ``[B, L]``; with ``attention_mask`` (``[B, L]`` bool, right padding: :func:`sftprof.models.layers.bshd.
    pad_sequences`) the hidden states, labels and loss weights are repacked to the packed ``[T]`` token
    order first, so padding never reaches the LM head or the loss.

    Raises:
        ValueError: the LM head has a bias.
    """

    def __init__(self, causal_lm: nn.Module, loss: SFTLoss) -> None:
        super().__init__()
        if causal_lm.lm_head.bias is not None:
            raise ValueError("CausalLMForSFT: an LM head with bias is not supported")
        self.model = causal_lm.model
        self.lm_head = LMHeadLoss(causal_lm.lm_head.weight, loss)

    def _packed(self, input_ids, attention_mask, *per_token):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        if attention_mask is None:
            return [hidden.flatten(0, 1)] + [t.flatten() for t in per_token]
        return [repack(t, attention_mask) for t in (hidden,) + per_token]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_weight: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``/``labels``/``loss_weight`` ``[B, L]`` -> fp32 scalar loss sum (:class:`LMHeadLoss`)."""
        return self.lm_head(*self._packed(input_ids, attention_mask, labels, loss_weight))

    def token_logprobs(self, input_ids: torch.Tensor, labels: torch.Tensor,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 log-probs ``[T]`` of ``labels`` in packed token order (:meth:`LMHeadLoss.logprobs`; unsharded model)."""
        return self.lm_head.logprobs(*self._packed(input_ids, attention_mask, labels))


def build_hf_causal_lm(cfg, hf_config) -> nn.Module:
    """Build the causal LM of :data:`CAUSAL_LM_CLASSES` in ``actor.dtype`` on the CPU (SDPA attention).

    Random init from the current RNG state (seed it first for identical weights on every rank)
    when ``actor.init_from_scratch`` is true; otherwise loads the weights of ``actor.path``, every parameter
    from the checkpoint (:func:`check_loading_info`).

    Raises:
        ValueError: the (text) config's ``model_type`` is not in :data:`CAUSAL_LM_CLASSES`, or
            ``init_from_scratch=false`` and the model directory holds no weights.
        CheckpointError: the checkpoint does not hold exactly the model's tensors
            (:func:`sftprof.models.hf.check_weights_present`, :func:`check_loading_info`).
    """
    if hf_config.model_type not in CAUSAL_LM_CLASSES:
        raise ValueError(f"actor.path={cfg.actor.path!r}: model_type {hf_config.model_type!r} is not supported by "
                         f"the fsdp backend; accepted: {list(CAUSAL_LM_CLASSES)}")
    causal_lm_cls = getattr(transformers, CAUSAL_LM_CLASSES[hf_config.model_type])
    dtype = DTYPES[cfg.actor.dtype]
    if getattr(hf_config, "mtp_num_hidden_layers", 0):
        log.info("fsdp engine: the model's multi-token-prediction block (%d layer(s)) is not built or trained",
                 hf_config.mtp_num_hidden_layers)
    if cfg.actor.init_from_scratch:
        return causal_lm_cls._from_config(hf_config, attn_implementation="sdpa", dtype=dtype)
    check_weights_present(cfg.actor)  # the driver and the trainer checked it before launch; kept for direct callers
    model_dir = resolve_model_dir(cfg.actor.path)
    model, info = causal_lm_cls.from_pretrained(str(model_dir), config=hf_config, attn_implementation="sdpa",
                                                dtype=dtype, output_loading_info=True)
    check_loading_info(info, model_dir, causal_lm_cls.__name__, hf_config.num_hidden_layers)
    return model


def check_loading_info(info: dict, model_dir, model_class: str, n_layers: int) -> None:
    """Refuse what transformers' ``from_pretrained`` would only log: parameters left at their random
    initialisation because the checkpoint lacks them (``missing_keys``), checkpoint tensors the model has no place
    for (``unexpected_keys``, apart from those outside the profiled model: layers beyond ``n_layers``, a
    multimodal checkpoint's vision tower and MTP block, :func:`sftprof.models.weights.not_loaded`). (A shape that
    differs from the parameter's, transformers raises itself.)

    Args:
        info: the loading info of ``from_pretrained(..., output_loading_info=True)``.
        model_dir: the checkpoint directory, for the message.
        model_class: the causal-LM class name, for the message.
        n_layers: the model's decoder layers (``actor.num_layers`` when it cuts them).
    Raises:
        CheckpointError: naming the directory, the class and the tensors of each kind.
    """
    problems = []
    unexpected = {n for n in info["unexpected_keys"] if not not_loaded(n, n_layers)}
    for names, what in ((set(info["missing_keys"]), "parameter(s) missing from the checkpoint (left at random "
                                                    "initialisation)"),
                        (unexpected, "checkpoint tensor(s) the model has no parameter for")):
        if names:
            problems.append(f"{len(names)} {what}: {name_list(names)}")
    if problems:
        raise CheckpointError(f"{model_dir}: {model_class}.from_pretrained: " + "; ".join(problems) + "; accepted: a "
                              "checkpoint holding every tensor of the model, or actor.init_from_scratch=true "
                              "(random weights)")


def _lr_factor(kind: str, step: int, total: int) -> float:
    """``actor.optimizer.lr_scheduler_type`` factor at ``step`` of ``total`` (no warm-up)."""
    if kind == "linear":
        return 1.0 - step / total
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * step / total))
    return 1.0


class FSDPEngine(Engine):
    """FSDP2 data-parallel engine (see module docstring and :mod:`sftprof.engine.base`).

    Args:
        cfg: trial config. Uses ``actor.{dtype, gradient_checkpointing, optimizer.*, loss.*}`` and
            ``total_train_steps``.
        layout: ``fsdp:d<N>`` layout; ``N`` must equal the world size.
        hf_config: ``qwen3_moe`` or ``qwen3_5_moe_text`` Hugging Face (text) config.
        device: this rank's device.

    Raises:
        ValueError: the world size differs from the layout, or see :func:`build_hf_causal_lm`.
    """

    def __init__(self, cfg, layout, hf_config, device: torch.device) -> None:
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(f"actor.backend={cfg.actor.backend!r} needs {layout.world_size} ranks, got {world}")
        self.cfg = cfg
        self.layout = layout
        self.hf_config = hf_config
        self.device = device
        self._rank_coords = layout.rank_coords(dist.get_rank())
        self.shape = countable_shape(hf_config)
        a = cfg.actor
        causal_lm = build_hf_causal_lm(cfg, hf_config)
        if a.gradient_checkpointing:
            causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = SFTLoss.from_config(cfg, hf_config.vocab_size)
        model = CausalLMForSFT(causal_lm, loss)
        mesh = init_device_mesh(device.type, (layout.dp,), mesh_dim_names=("dp",))
        # Parameters stay in actor.dtype; gradients are reduced in fp32 for bf16/fp16 models.
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model.lm_head, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.model = model
        register_model(model)  # model-part ranges in kernel traces (sftprof.capture.module_regions)
        self.routing = RoutingLoadMeter(
            [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")],
            hf_config.num_hidden_layers, hf_config.num_experts, 1, device)
        o = a.optimizer
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        total = cfg.total_train_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: _lr_factor(o.lr_scheduler_type, s, total))
        self.max_grad_norm = o.gradient_clipping if o.gradient_clipping > 0 else math.inf
        n_params = sum(p.numel() for p in model.parameters())
        log.info("fsdp engine: %s, %.3fB parameters, dtype %s, dp=%d, gradient checkpointing %s, loss path %s",
                 type(causal_lm).__name__, n_params / 1e9, a.dtype, layout.dp, a.gradient_checkpointing,
                 loss.describe(cuda=device.type == "cuda"))

    @property
    def rank_coords(self) -> dict:
        return dict(self._rank_coords)

    def train_step(self, micro_batches: List[MicroBatch], global_loss_tokens: int) -> StepResult:
        """See :meth:`sftprof.engine.base.Engine.train_step`.

        FSDP2 averages gradients over the ``dp`` ranks, so each micro-batch's backward uses
        ``loss_sum * dp / global_loss_tokens``: the averaged gradient is then that of the
        global token-mean loss.
        """
        if global_loss_tokens <= 0:
            raise ValueError(f"global_loss_tokens={global_loss_tokens}: must be > 0")
        self.model.train()
        scale = self.layout.dp / global_loss_tokens
        local_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        n_seqs = 0
        for i, mb in enumerate(micro_batches):
            input_ids = mb.input_ids.to(self.device, non_blocking=True)
            labels = mb.labels.to(self.device, non_blocking=True)
            weight = mb.loss_mask.to(self.device, dtype=torch.float32, non_blocking=True)
            with region(forward(i)):
                loss_sum = self.model(input_ids, labels, weight)
            with region(backward(i)):
                (loss_sum * scale).backward()
            local_sum += loss_sum.detach()
            n_seqs += mb.input_ids.shape[0]
        with region(OPTIMIZER_STEP):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(local_sum)
        moe_load = self.routing.step_record()
        seq_len = micro_batches[0].input_ids.shape[1]
        # HF gradient checkpointing re-runs every decoder layer's forward: Megatron's full/uniform recompute.
        flops = train_step_flops(self.shape, [seq_len] * (n_seqs * self.layout.dp),
                                 "full" if self.cfg.actor.gradient_checkpointing else "none") if self.shape else None
        return StepResult(loss=float(local_sum) / global_loss_tokens, grad_norm=float(grad_norm),
                          model_flops=flops.model if flops else None, recompute_flops=flops.recompute if flops else None,
                          moe_load=moe_load)
