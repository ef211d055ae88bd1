"""Configuration: schema (one dataclass per TOML table), loading and validation.

Keys other than retrain's own load through an installed key dialect
(:mod:`retrain.config.dialect`); retrain.compat installs the original retrain's.
"""

from retrain.config.flags import flag_table
from retrain.config.load import (
    DEFAULT_CONFIG,
    config_from_dict,
    load_config,
    load_dotenv,
    parse_overrides,
    read_toml,
)
from retrain.config.schema import TABLES, Config, FieldSpec, all_fields, table_fields
from retrain.errors import ConfigError

__all__ = [
    "DEFAULT_CONFIG",
    "TABLES",
    "Config",
    "ConfigError",
    "FieldSpec",
    "all_fields",
    "config_from_dict",
    "flag_table",
    "load_config",
    "load_dotenv",
    "parse_overrides",
    "read_toml",
    "table_fields",
]
