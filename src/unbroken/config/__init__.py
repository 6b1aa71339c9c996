"""One config tree: nested frozen dataclasses, loaded from a TOML file, then `--a.b=value` overrides.

Owns: every tunable of a run, its type, default and help text (schema.py), its reading and validation
(tree.py: a one-line ConfigError naming the bad key), the old names of keys that moved (tree.py: MOVED),
the JSON form handed to worker processes, and the listing of every key (listing.py: `unbroken config`,
docs/config.md). Does not own: what the values do.
"""
from unbroken.config.schema import (CheckpointConfig, ConfigError, CoordConfig, DataConfig, DetectorSection,
                                    EvalConfig, FaultsConfig, HardwareSection, LaunchConfig, MetricsConfig, ModelConfig,
                                    OptimConfig, ParallelConfig, RunConfig, SnapshotConfig)
from unbroken.config.tree import (MOVED, SECTIONS, Config, build, canonical, check_paths, load, parse_overrides,
                                  store_url_problem, upgrade, validate)

__all__ = ["MOVED", "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "CoordConfig", "DataConfig",
           "DetectorSection", "EvalConfig", "FaultsConfig", "HardwareSection", "LaunchConfig", "MetricsConfig", "ModelConfig",
           "OptimConfig", "ParallelConfig", "RunConfig", "SnapshotConfig", "build", "canonical", "check_paths", "load",
           "parse_overrides", "store_url_problem", "upgrade", "validate"]
