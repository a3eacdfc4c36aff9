"""The model checks before launch, one copy for the driver's plan (:mod:`sftprof.launch.planning`) and each trial's
trainer (:mod:`sftprof.trainer`): the model's Hugging Face config and weights, the megatron settings against the
model, the tokenizer."""
from __future__ import annotations

from typing import Any

from sftprof.allocation import Layout
from sftprof.config import ConfigError, SFTProfileConfig
from sftprof.models.hf import check_weights_present, load_hf_config
from sftprof.tokenizer import TextTokenizer, hf_tokenizer_dir, load_tokenizer

PARTS = ("model", "settings", "tokenizer")


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
        # torch and megatron-core, imported here: the launcher plans without them for other backends
        from sftprof.models.megatron_config import check_model_settings
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
