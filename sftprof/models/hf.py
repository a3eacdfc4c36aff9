"""Hugging Face model configs: a model directory or a bundled config (config only, no weights).

Bundled configs (``sftprof/models/configs/<name>/config.json``):

- ``qwen3_30b_a3b``: Qwen3-30B-A3B (``qwen3_moe``), the public config;
- ``qwen3_5_35b_a3b``: Qwen3.5-35B-A3B (``qwen3_5_moe``), the public config;
- ``tiny_qwen3_moe``: a 2-layer Qwen3-MoE-shaped model (hidden 128, 8 experts top-2) with the
  real Qwen3 vocabulary (151936), for CPU runs and tests;
- ``tiny_qwen3_5_moe``: a 4-layer Qwen3.5-MoE-shaped text model (``qwen3_5_moe_text``: 3 gated
  delta-net + 1 gated full-attention layer, hidden 64, 4 experts top-2 and a gated shared expert,
  partial RoPE 0.25) with the real Qwen3.5 vocabulary (248320), for CPU runs and tests.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sftprof.config import ConfigError

if TYPE_CHECKING:  # transformers is imported lazily: the driver's checks stay fast
    from transformers import PretrainedConfig


CONFIG_DIR = Path(__file__).resolve().parent / "configs"
BUNDLED_CONFIGS = tuple(sorted(p.name for p in CONFIG_DIR.iterdir() if (p / "config.json").is_file()))
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
# The model families sftprof builds, by config.json's model_type (a multimodal Qwen3.5 config is read for its text
# model, qwen3_5_moe_text): the megatron backend maps these configs (sftprof/models/megatron_config.py) and weights
# (sftprof/models/megatron_load.py); the fsdp backend trains the Hugging Face causal-LM class of the text model_type
# (CAUSAL_LM_CLASSES, sftprof/engine/fsdp.py).
MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")
CAUSAL_LM_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}

log = logging.getLogger(__name__)


class ModelPathError(ValueError):
    """``actor.path`` names neither a model directory with ``config.json`` nor a bundled config."""


def hf_value(hf: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that the HF config ``hf`` sets to something other than None (transformers' aliases:
    ``num_experts`` / ``num_local_experts``), else ``default``."""
    for name in names:
        value = getattr(hf, name, None)
        if value is not None:
            return value
    return default


def resolve_model_dir(path: str) -> Path:
    """Return the directory holding ``config.json`` for ``actor.path`` (directory or bundled name).

    Raises:
        ModelPathError: no such directory with a config.json and no bundled config of that name.
    """
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        return p
    if path in BUNDLED_CONFIGS:
        return CONFIG_DIR / path
    raise ModelPathError(
        f"actor.path={path!r}: not a directory with config.json; accepted: a Hugging Face model directory "
        f"or a bundled config name {list(BUNDLED_CONFIGS)}")


def has_weights(model_dir: Path) -> bool:
    """True when ``model_dir`` holds weight files (safetensors, bin or pt)."""
    return any(any(model_dir.glob(pat)) for pat in WEIGHT_PATTERNS)


def check_weights_present(actor) -> None:
    """Refuse ``actor.init_from_scratch=false`` unless ``actor.path`` holds weights that build the whole model
    (checked before launch; of the weights only the safetensors headers are read).

    A safetensors checkpoint is matched whole against the model of ``actor.path``'s config cut to
    ``actor.num_layers`` (:func:`sftprof.models.weights.check_checkpoint`): the index against its shards, the
    tensors the family's weight rules read against the checkpoint's. Other weight files (``*.bin``, ``*.pt``; the
    fsdp backend loads them) are matched when the trial loads them.

    Args:
        actor: the ``actor`` section of the trial config (``path``, ``init_from_scratch``, ``num_layers``).
    Raises:
        ConfigError: no weight file (``*.safetensors``, ``*.bin``, ``*.pt``) in the model directory; names the
            directory and the accepted settings.
        CheckpointError: the safetensors index is damaged or names a missing shard, a shard's header cannot be
            read, the index and the shards' headers disagree, the model needs tensors the checkpoint lacks or the
            checkpoint holds tensors the model does not read (each message names the file and the tensors).
        ModelPathError: ``actor.path`` is neither a model directory nor a bundled config, or its config is invalid
            (:func:`load_hf_config`).
    """
    if actor.init_from_scratch:
        return
    model_dir = resolve_model_dir(actor.path)
    if not has_weights(model_dir):
        raise ConfigError(f"actor.init_from_scratch=false: {model_dir} holds no weights ({', '.join(WEIGHT_PATTERNS)}); "
                          "accepted: actor.init_from_scratch=true (random init), or MODEL_PATH / actor.path = a "
                          "Hugging Face model directory with weights")
    # imported here: they import torch, which the driver (sftprof.launch imports this module) does not import
    from sftprof.models.checkpoint import INDEX_NAME, SINGLE_NAME, SafetensorsCheckpoint
    from sftprof.models.weights import check_checkpoint

    if (model_dir / INDEX_NAME).is_file() or (model_dir / SINGLE_NAME).is_file():
        check_checkpoint(SafetensorsCheckpoint(model_dir), load_hf_config(actor.path, actor.num_layers))


# JSON's names for what json.loads returns (a config.json that is not an object is named by its kind)
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


# Sizes of the model config that must be positive integers where the config has them (the text model's keys)
POSITIVE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "num_experts", "num_experts_per_tok", "decoder_sparse_step", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")


# The sizes each (text) model type is built from: transformers fills in a default for each one the file leaves out,
# but keeps a JSON null (config.json saved by transformers 5 with "num_local_experts": null gave num_experts=None, and
# every trial died with TypeError: '>' not supported between instances of 'NoneType' and 'int').
_SIZES = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
          "moe_intermediate_size", "num_experts", "num_experts_per_tok")
REQUIRED_KEYS = {
    "qwen3_moe": _SIZES + ("intermediate_size", "decoder_sparse_step"),  # head_dim: hidden_size / heads when absent
    "qwen3_5_moe_text": _SIZES + ("head_dim", "shared_expert_intermediate_size", "linear_num_key_heads",
                                  "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                  "linear_conv_kernel_dim"),
}


def _file_key(config, key: str, raw: dict | None) -> str:
    """``key`` as ``config.json`` (``raw``, the text model's keys) spells it: the key itself, or the alias transformers
    reads as it (its ``attribute_map``: Qwen3-MoE's ``num_local_experts`` for ``num_experts``)."""
    if raw is None or key in raw:
        return key
    amap = getattr(config, "attribute_map", None) or {}
    aliases = [v for k, v in amap.items() if k == key] + [k for k, v in amap.items() if v == key]
    alias = next((a for a in aliases if a in raw), None)
    return key if alias is None else alias


def check_model_config(config: PretrainedConfig, where: str, prefix: str = "", raw: dict | None = None) -> None:
    """Refuse a model config that no layout can build, before any trial starts.

    Checked on the (text) config as transformers read it: each of :data:`POSITIVE_KEYS` that it has is an integer
    >= 1 (a JSON ``null`` included: transformers keeps it), and each of :data:`REQUIRED_KEYS` of its ``model_type``
    is there; ``num_experts_per_tok`` (the router's top-k) at most ``num_experts`` (else every rank fails at its first
    forward: ``RuntimeError: selected index k out of range``); ``num_key_value_heads`` divides
    ``num_attention_heads`` (GQA); ``linear_num_key_heads`` divides ``linear_num_value_heads`` (Qwen3.5's gated
    delta-net). (transformers checks ``layer_types`` against ``num_hidden_layers`` itself.)

    Args:
        config: the text config (:func:`text_config`).
        where: the message's start, naming ``actor.path`` and the file (``"actor.path='m': m/config.json"``).
        prefix: the keys' place in the file (``"text_config."`` for a multimodal Qwen3.5 config).
        raw: the file's keys at that place (to name a key as the file spells it), None: name transformers' keys.

    Raises:
        ModelPathError: ``<where> has <prefix><key>=<value>...; accepted: ...`` (``null`` for a JSON null, with
            ``(transformers reads it as <key>)`` where the file spells the key otherwise) or ``<where> names no
            <prefix><key>; ...``, the first violation found.
    """
    def get(key):
        return getattr(config, key, None)

    required = REQUIRED_KEYS.get(getattr(config, "model_type", None), ())
    for key in POSITIVE_KEYS:
        if not hasattr(config, key):
            if key in required:
                raise ModelPathError(f"{where} names no {prefix}{key}; accepted: an integer >= 1 (a "
                                     f"{config.model_type} model is built from it)")
            continue
        value = get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            name = _file_key(config, key, raw)
            shown = "null" if value is None else repr(value)
            read_as = "" if name == key else f" (transformers reads it as {key})"
            raise ModelPathError(f"{where} has {prefix}{name}={shown}{read_as}; accepted: an integer >= 1")
    k, e = get("num_experts_per_tok"), get("num_experts")
    if k is not None and e is not None and k > e:
        raise ModelPathError(f"{where} has {prefix}num_experts_per_tok={k} > {prefix}num_experts={e}; accepted: "
                             f"num_experts_per_tok from 1 to num_experts (each token's router picks that many experts)")
    for heads, groups in (("num_attention_heads", "num_key_value_heads"),
                          ("linear_num_value_heads", "linear_num_key_heads")):
        h, g = get(heads), get(groups)
        if h is not None and g is not None and h % g:
            raise ModelPathError(f"{where} has {prefix}{heads}={h} and {prefix}{groups}={g}; accepted: {groups} "
                                 f"dividing {heads} (each key/value head serves a whole group of heads)")


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of ``config`` (``text_config`` for multimodal Qwen3.5 configs)."""
    return getattr(config, "text_config", None) or config


def import_config_reader() -> None:
    """Import what :func:`load_hf_config` imports on its first call (``transformers.AutoConfig``, which imports
    torch, and each model family's config class: the config's first load took 12.1 s in a fresh process on one H100
    host), by reading every bundled config once, so that a process can pay for it before it needs a config
    (``postprocess_profile.py --after-trial FD``)."""
    for name in BUNDLED_CONFIGS:
        load_hf_config(name)


def load_hf_config(path: str, num_layers: int = 0) -> PretrainedConfig:
    """Load the HF config for ``actor.path`` and cut it to ``num_layers`` decoder layers.

    Args:
        path: model directory or bundled config name (:data:`BUNDLED_CONFIGS`).
        num_layers: keep only the first ``num_layers`` layers (0 = as configured); per-layer
            lists such as ``layer_types`` are cut to match.

    Returns:
        The (text) config, e.g. ``Qwen3MoeConfig``.

    Raises:
        ModelPathError: see :func:`resolve_model_dir`; ``config.json`` is not valid JSON or not a JSON object, its
            ``model_type`` is missing, not a string or not one of :data:`MODEL_TYPES`, transformers cannot read it,
            or it describes a model no layout can build (:func:`check_model_config`: a size that is not a positive
            integer, a JSON null or missing where the model needs it, top-k above the number of experts, ...); each
            message names the file and the key.
        ValueError: ``num_layers`` exceeds the configured number of layers.
    """
    from transformers import AutoConfig

    model_dir = resolve_model_dir(path)
    config_file = model_dir / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelPathError(f"actor.path={path!r}: {config_file} is not a valid JSON file ({err}); accepted: a "
                             "Hugging Face model directory whose config.json holds the model's config") from err
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in MODEL_TYPES:
        if not isinstance(raw, dict):
            what = f"holds a JSON {_JSON_KINDS.get(type(raw), type(raw).__name__)}, not an object of config keys"
        elif "model_type" not in raw:
            what = "names no model_type"
        elif not isinstance(model_type, str):
            what = f"has model_type {model_type!r}, not a string"
        else:
            what = f"has model_type {model_type!r}, a model family sftprof does not build"
        raise ModelPathError(f"actor.path={path!r}: {config_file} {what}; accepted: model_type "
                             f"{' / '.join(MODEL_TYPES)} (Qwen3-MoE, Qwen3.5-MoE)")
    try:
        config = text_config(AutoConfig.from_pretrained(str(model_dir)))
    except Exception as err:  # e.g. a field of the wrong type (huggingface_hub's StrictDataclassError is no ValueError)
        raise ModelPathError(f"actor.path={path!r}: transformers cannot read {config_file}: "
                             f"{' '.join(str(err).split())}") from err
    nested = isinstance(raw.get("text_config"), dict)
    check_model_config(config, f"actor.path={path!r}: {config_file}", "text_config." if nested else "",
                       raw["text_config"] if nested else raw)
    if num_layers:
        full = config.num_hidden_layers
        if num_layers > full:
            raise ValueError(f"actor.num_layers={num_layers}: the model has only {full} layers")
        config.num_hidden_layers = num_layers
        for key in ("layer_types", "mlp_only_layers"):
            value = getattr(config, key, None)
            if isinstance(value, list) and key == "layer_types":
                setattr(config, key, value[:num_layers])
            elif isinstance(value, list):
                setattr(config, key, [i for i in value if i < num_layers])
        if hasattr(config, "max_window_layers"):
            config.max_window_layers = min(config.max_window_layers, num_layers)
    return config


def save_random_checkpoint(hf_config: PretrainedConfig, out_dir: str | Path, dtype=None, seed: int = 0,
                           device: str = "cpu", max_shard_size: str = "2GB") -> Path:
    """Write a randomly initialised ``*ForCausalLM`` of ``hf_config`` with ``save_pretrained`` (sharded
    safetensors + index) to ``out_dir``, for profiling or testing the weight-loading path without a download.

    Args:
        hf_config: the (text) config, e.g. from :func:`load_hf_config` (cut to fewer layers if wanted).
        out_dir: target directory (created; existing files of the same names are replaced).
        dtype: torch dtype of the weights (default: the config's ``torch_dtype`` or float32).
        seed: torch seed of the initialisation (the same seed gives the same weights on the same device).
        device: where the model is initialised (``"cuda"`` is much faster for billions of parameters).
        max_shard_size: ``save_pretrained``'s shard size.
    Returns:
        ``Path(out_dir)``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype or getattr(hf_config, "torch_dtype", None))
    model.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
    return Path(out_dir)
