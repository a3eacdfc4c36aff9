"""The model checks before launch, one copy for the driver's plan (:mod:`sftprof.launch.planning`) and each trial's
trainer (:mod:`sftprof.trainer`; the megatron engine repeats :func:`check_model_settings`): the model's Hugging Face
config and weights, the megatron settings against the model, the tokenizer.

Light on purpose: the driver imports this module, and nothing here imports megatron-core, Transformer Engine or the
model-building modules (:mod:`sftprof.models.megatron_config`, :mod:`sftprof.models.specs`, which import them and
``torch._dynamo``); only the weight checks import torch (as :func:`sftprof.models.hf.check_weights_present` does).
"""
from __future__ import annotations

import importlib.util
from typing import Any

from sftprof.allocation import Layout
from sftprof.compat import GATED_DELTA_NET_CP, check_megatron_version, megatron_at_least, megatron_core_version
from sftprof.config import ConfigError, SFTProfileConfig
from sftprof.models.hf import check_weights_present, hf_value, load_hf_config, resolve_model_dir
from sftprof.tokenizer import TextTokenizer, hf_tokenizer_dir, load_tokenizer

PARTS = ("model", "settings", "tokenizer")
LINEAR_ATTENTION_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
FLA_PACKAGES = "flash-linear-attention==0.6.0 and fla-core==0.6.0 (pip install -e '.[qwen3_5]')"


class ModelCheckError(ValueError):
    """A check of :func:`check_model` failed; ``part`` (one of :data:`PARTS`) says which: ``model`` (``actor.path``,
    its config or weights), ``settings`` (the megatron settings against the model: a ConfigError's message) or
    ``tokenizer``."""

    def __init__(self, message: str, part: str) -> None:
        super().__init__(message)
        self.part = part


def check_model(cfg: SFTProfileConfig, layout: Layout, bundled_tokenizer: bool) -> tuple[Any, TextTokenizer | None]:
    """The model's (text) Hugging Face config and the tokenizer a trial loads, each checked.

    Args:
        cfg: the trial's config.
        layout: ``cfg.actor.backend``'s layout (megatron: the settings are checked against the model).
        bundled_tokenizer: also load the bundled Qwen BPE when the trial uses it (the package's own, so the plan
            skips it: the tokenizer returned is then None).

    Raises:
        ModelCheckError: the model path, its config or weights, the megatron settings or the tokenizer are refused.
    """
    try:
        hf_config = load_hf_config(cfg.actor.path, cfg.actor.num_layers)
        check_weights_present(cfg.actor)
    except ValueError as err:
        raise ModelCheckError(str(err), "model") from err
    if layout.backend == "megatron":
        try:
            check_model_settings(cfg, hf_config, layout)
        except ConfigError as err:
            raise ModelCheckError(str(err), "settings") from err
    try:
        if not bundled_tokenizer and hf_tokenizer_dir(cfg.tokenizer_path, cfg.actor.path) is None:
            return hf_config, None
        return hf_config, load_tokenizer(cfg.tokenizer_path, cfg.actor.path, hf_config.model_type)
    except ValueError as err:
        raise ModelCheckError(str(err), "tokenizer") from err


def check_model_settings(cfg: SFTProfileConfig, hf: Any, layout: Layout) -> None:
    """Refuse, before any process group or GPU work, megatron trials that need the model config to judge.

    - the installed megatron-core must be a supported release (:func:`sftprof.compat.check_megatron_version`);
    - ``actor.init_from_scratch=false``: ``actor.path`` must be a model directory with a safetensors
      checkpoint of a family that has a weight mapping (:data:`sftprof.models.weights.MAPPINGS`);
    - gated delta-net models (Qwen3.5): :func:`check_linear_attention_layout`;
    - the layout must split the model evenly: attention heads and query groups by TP, gated delta-net heads by TP x
      CP, experts by EP, the expert FFN by ETP, the layers by PP; the sequence into ``2 * CP`` chunks whose per-rank
      length TP divides (sequence parallelism);
    - the chunked LM-head loss (``actor.loss`` path ``lm_head``) needs a vocabulary that TP divides (it
      has no mask for padded vocabulary rows; the logits path has).

    Raises:
        ConfigError: naming the setting, the value and what is accepted.
    """
    check_megatron_version()
    if not cfg.actor.init_from_scratch:
        # imported here: they import torch, which the driver does not import on its start (as check_weights_present)
        from sftprof.models.checkpoint import INDEX_NAME, SINGLE_NAME
        from sftprof.models.weights import MAPPINGS

        model_dir = resolve_model_dir(cfg.actor.path)
        if not ((model_dir / INDEX_NAME).is_file() or (model_dir / SINGLE_NAME).is_file()):
            raise ConfigError(f"actor.init_from_scratch=false: {model_dir} holds no safetensors checkpoint "
                              f"({INDEX_NAME} or {SINGLE_NAME}); accepted: a Hugging Face model directory with "
                              "safetensors weights, or actor.init_from_scratch=true (random init)")
        if hf.model_type not in MAPPINGS:
            raise ConfigError(f"actor.init_from_scratch=false: the megatron backend loads weights of "
                              f"{sorted(MAPPINGS)}, not model_type {hf.model_type!r}; set actor.init_from_scratch=true")
    check_linear_attention_layout(hf.model_type, layout)
    heads = hf.num_attention_heads
    groups = hf_value(hf, "num_key_value_heads", default=heads)
    experts = hf_value(hf, "num_experts", "num_local_experts")
    for what, size, name, parts in (
            ("num_attention_heads", heads, "TP", layout.tp), ("num_key_value_heads", groups, "TP", layout.tp),
            ("num_experts", experts, "EP", layout.ep),
            ("moe_intermediate_size", hf.moe_intermediate_size, "ETP", layout.etp),
            ("num_hidden_layers", hf.num_hidden_layers, "PP", layout.pp),
            # gated delta-net heads: split by TP, and by CP too (its context parallelism runs heads on CP ranks)
            ("linear_num_key_heads", hf_value(hf, "linear_num_key_heads", default=0), "TPxCP", layout.tp * layout.cp),
            ("linear_num_value_heads", hf_value(hf, "linear_num_value_heads", default=0), "TPxCP",
             layout.tp * layout.cp)):
        if size % parts:
            raise ConfigError(f"actor.backend={cfg.actor.backend!r}: the model's {what}={size} is not divisible by "
                              f"{name}={parts}; accepted: a layout whose {name} divides it (actor.num_layers cuts "
                              "layers)")
    seq, cp = cfg.profile.fake_seq_len, layout.cp
    if (cp > 1 and seq % (2 * cp)) or (seq // cp) % layout.tp:
        raise ConfigError(f"profile.fake_seq_len={seq}: must be divisible by 2*CP={2 * cp} (load-balanced context "
                          f"parallel chunks) and the per-CP-rank length by TP={layout.tp} (sequence parallel)")
    chunk = cfg.actor.loss.lm_head_loss_chunk_size
    if cfg.actor.loss.resolved_path() == "lm_head" and hf.vocab_size % layout.tp:
        raise ConfigError(f"actor.loss.lm_head_loss_chunk_size={chunk}: the chunked LM-head loss needs a vocabulary "
                          f"divisible by TP={layout.tp} (vocab_size {hf.vocab_size}); accepted: 0 (logits path, which "
                          "masks the padded vocabulary) or a TP that divides the vocabulary")


def check_linear_attention_layout(model_type: str, layout: Layout) -> None:
    """Refuse, before launch, a megatron trial of a gated delta-net model that cannot run here.

    Cheap (no megatron or transformers import): the driver's plan and the trainer call it before any
    process starts. Qwen3.5's gated delta-net layers are megatron-core's ``GatedDeltaNet``, which runs on
    flash-linear-attention's kernels (package ``fla``) and has context parallelism from megatron-core 0.18
    (:data:`sftprof.compat.GATED_DELTA_NET_CP`; before, "TODO: support CP" in ``megatron/core/ssm/gated_delta_net.py``).

    Args:
        model_type: the (text) HF ``model_type`` (of :func:`sftprof.models.hf.load_hf_config`'s config).
        layout: the trial's :class:`sftprof.allocation.Layout`; only ``megatron`` layouts are checked.
    Raises:
        ConfigError: CP > 1 with a megatron-core before 0.18 (names ``actor.backend``, the installed release and
            the accepted layouts), or ``fla`` not importable (names the packages to install).
    """
    if model_type not in LINEAR_ATTENTION_MODEL_TYPES or layout.backend != "megatron":
        return
    if layout.cp > 1 and not megatron_at_least(GATED_DELTA_NET_CP):
        installed = ".".join(map(str, megatron_core_version()))
        raise ConfigError(f"actor.backend={layout.describe()}: context parallelism (CP={layout.cp}) is not supported "
                          f"for {model_type} with megatron-core {installed}: its gated delta-net layers have no "
                          "context parallelism (megatron-core >= 0.18 has); accepted: a layout with c1 (TP with "
                          "sequence parallelism, e.g. megatron:(attn:d4t2|ffn:d1e8))")
    if importlib.util.find_spec("fla") is None:
        raise ConfigError(f"actor.path: {model_type} (gated delta-net linear attention) on the megatron backend needs "
                          f"the Python package 'fla' from {FLA_PACKAGES}; it is not installed")
