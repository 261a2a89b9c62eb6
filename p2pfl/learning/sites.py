"""The one way from a site.yaml to the site that trains it: `create_site(cfg)`.

It picks the training site class: `DataParallelSite` (p2pfl.learning.distributed)
when `training.devices > 1`, so local epochs fan out over that many processes,
else the single-process `LocalSite` (p2pfl.learning.train).
"""

from __future__ import annotations

from p2pfl.config import SiteConfig
from p2pfl.learning.data import SiteData
from p2pfl.learning.distributed import DataParallelSite
from p2pfl.learning.train import LocalSite


def create_site(cfg: SiteConfig, data: SiteData | None = None) -> LocalSite:
    """Seed, load the site's data (unless given), build the model and the
    optimizer, in the site class `training.devices` asks for."""
    site_class = DataParallelSite if cfg.training.devices > 1 else LocalSite
    return site_class.from_config(cfg, data)
