"""What the genbuffer CLI reads from its --config YAML.

The `genbuffer:` section itself is `p2pfl.config.GenbufferSection`, part of
site.yaml (re-exported here). `load_genbuffer_config` accepts either a full
site.yaml, validated and resolved by `p2pfl.config` as `p2pfl-node check` does
(except that the roster and key files need not exist), or a standalone YAML
holding only `genbuffer:`, `data:` and `seed:`.
Relative paths are taken relative to the YAML file's folder; in a site.yaml
`out_dir` defaults to `<node.state_dir>/genbuffer`, in a standalone YAML to
`genbuffer/` beside it. Either way `out_dir` is the site's PRIVATE folder: the
generators, the training state, the grids of real images and the per-image
distances go there, and the CLI makes it 0700 (the state dir too), its files
0600. Only a buffer the privacy gate accepted is written elsewhere (`--out`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from p2pfl.config import (  # GenbufferSection is imported from here too
    ConfigError,
    DataSection,
    GenbufferSection,
    Section,
    SiteConfig,
    config_error,
    config_from_dict,
    read_yaml,
    resolve_data_source,
    resolve_genbuffer_paths,
)


@dataclass
class GenbufferConfig:
    """What the genbuffer CLI needs from a YAML file."""

    path: Path
    genbuffer: GenbufferSection
    data: DataSection | None
    seed: int
    # a site.yaml's node.state_dir, which the CLI tightens to 0700 as run_node does
    state_dir: Path | None = None


class StandaloneGenbufferFile(Section):
    """A YAML made for the genbuffer CLI alone, without the daemon's sections."""

    genbuffer: GenbufferSection = GenbufferSection()
    data: DataSection | None = None
    seed: int = 0


# Keys that only a site.yaml has: any of them means the file is one, and is validated whole.
SITE_ONLY_KEYS = frozenset(SiteConfig.model_fields) - {"genbuffer", "data"}


def genbuffer_config_from_dict(raw: dict[str, Any], path: Path) -> GenbufferConfig:
    """Validate and resolve a parsed YAML mapping: a site.yaml or a standalone genbuffer file."""
    base = path.parent
    if SITE_ONLY_KEYS & raw.keys():
        # The key files and roster are the daemon's business, not the GAN's.
        site = config_from_dict(raw, path, check_files=False)
        # The data split seed is the daemon's, so the GAN trains on the node's own split.
        seed = site.federation.seed + site.training.seed
        return GenbufferConfig(
            path=path,
            genbuffer=site.genbuffer,
            data=site.data,
            seed=seed,
            state_dir=site.node.state_dir,
        )
    try:
        standalone = StandaloneGenbufferFile.model_validate(raw)
    except ValidationError as exc:
        raise config_error(path, exc) from None
    if standalone.data is not None:
        resolve_data_source(standalone.data, base)
    resolve_genbuffer_paths(standalone.genbuffer, base)
    return GenbufferConfig(
        path=path, genbuffer=standalone.genbuffer, data=standalone.data, seed=standalone.seed
    )


def load_genbuffer_config(path: str | Path) -> GenbufferConfig:
    """Read site.yaml (or a standalone genbuffer YAML). Raises ConfigError only."""
    path = Path(path)
    raw = read_yaml(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(path, "", "top level must be a mapping", "start it with `genbuffer:`")
    return genbuffer_config_from_dict(raw, path)
