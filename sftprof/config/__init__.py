"""Typed configuration of an sftprof trial: YAML + ``${...}`` interpolation + dotted ``key=value`` overrides.

One module per job; this package's names are the public surface (``from sftprof.config import load_config``):

- :mod:`~sftprof.config.schema`: the dataclasses (one per section, each key's default) and each section's ``check``;
- :mod:`~sftprof.config.sources`: checks of one source (the YAML file, or the overrides) before merging;
- :mod:`~sftprof.config.loading`: :func:`load_config` (read, check, merge, resolve, validate), presets, the rule
  that one command line sets a key once, :func:`load_config_or_exit` for entry points;
- :mod:`~sftprof.config.validation`: :func:`validate`, the rules that span sections;
- :mod:`~sftprof.config.settings`: a key's driver variable and its one check, declared beside the key in the schema,
  and the names allowed as folders;
- :mod:`~sftprof.config.paths`: the trial's log dir;
- :mod:`~sftprof.config.errors`: :class:`ConfigError` (every message names the key, the value and what is
  accepted) and the exit of an entry point on one (status 2, before any process group starts).

The driver's environment variables are another way to set some of these keys: each is declared beside its key
(:mod:`~sftprof.config.settings`), and the driver turns it into the argument ``key=value``
(:mod:`sftprof.launch.variables`).
"""
from sftprof.config.errors import CONFIG_ERROR_PREFIX, ConfigError, exit_config_error
from sftprof.config.loading import (PRESET_DIR, last_value_per_key, load_config, load_config_or_exit,
                                    reject_repeated_keys, resolve_config_path, to_yaml, variable_conflict)
from sftprof.artifacts import RUN_ROOT_FILEROOT
from sftprof.config.paths import standalone_fileroot, trial_log_dir
from sftprof.config.schema import (CP_ATTENTION_METHODS, FAKE_SEQ_LEN_WHY, MEMORY_MAX_ENTRIES_MAX, PRECISION_FIELDS,
                                   TOKENS_PER_RANK_MAX, TRANSFORMER_IMPLS, MegatronSettings, SFTProfileConfig,
                                   n_micro_batches)
from sftprof.config.settings import NAME_ACCEPTED, SETTING, Setting, is_folder_name, parse_text
from sftprof.config.validation import validate

__all__ = ["CONFIG_ERROR_PREFIX", "CP_ATTENTION_METHODS", "ConfigError", "RUN_ROOT_FILEROOT", "standalone_fileroot", "FAKE_SEQ_LEN_WHY",
           "MEMORY_MAX_ENTRIES_MAX", "MegatronSettings", "NAME_ACCEPTED", "PRECISION_FIELDS", "PRESET_DIR", "SETTING", "Setting",
           "SFTProfileConfig", "TOKENS_PER_RANK_MAX", "TRANSFORMER_IMPLS", "exit_config_error",
           "is_folder_name", "last_value_per_key", "load_config", "load_config_or_exit", "n_micro_batches", "parse_text",
           "reject_repeated_keys", "resolve_config_path", "to_yaml", "trial_log_dir", "validate",
           "variable_conflict"]
