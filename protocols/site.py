"""The site a protocol trains, built from the federation's common initial weights.

The DFU paper starts every client from the same model. Every site draws that
model from `federation.seed` itself, so no message is needed for it. How a site
is built (seed, data, the model once, the site class) is
`p2pfl.learning.sites.build_site`; this is the classifier's call to it.
"""

from __future__ import annotations

from p2pfl.config import SiteConfig
from p2pfl.learning.distributed import create_site
from p2pfl.learning.sites import common_initial_model as common_initial_model  # re-exported
from p2pfl.learning.sites import common_initial_state as common_initial_state  # re-exported
from p2pfl.learning.train import LocalSite


def build_site(config: SiteConfig) -> LocalSite:
    """The site's LocalSite (model, optimizer, data), its model built once from
    the common initial weights, its inference batch size calibrated before any
    round."""
    site = create_site(config, common_initial=True)
    site.calibrate_eval_batch()
    return site
