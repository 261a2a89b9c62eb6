"""What a secure sum's settings guarantee, in numbers: the least Shamir
threshold a contributor accepts, how many colluding contributors a requester
needs to see one model, and the lines `p2pfl-node check` prints about both
(protocols/secagg.py gives the protocol, docs/threat-model.md the argument)."""

from __future__ import annotations

from pydantic import BaseModel

from p2pfl.config.secagg_ring import SECAGG_MAX_CONTRIBUTORS, SECAGG_MIN_SUM


def secagg_least_threshold(others: int) -> int:
    """floor(2 x others / 3) + 1: the least Shamir threshold a contributor
    accepts over `others` share holders (protocols/secagg_messages.py
    `least_threshold` gives the argument)."""
    return max(1, 2 * others // 3 + 1)


def _threshold(holders: int, configured: int | None) -> int:
    """t over `holders`: the least accepted, or the configured t if higher,
    never more than there are holders (protocols/secagg_messages.py
    `threshold_for`, which the contributors run)."""
    return min(holders, max(secagg_least_threshold(holders), configured or 0))


def secagg_colluders_needed(size: int, configured: int | None) -> int:
    """How many contributors must collude with a requester to see one honest
    model in a secure sum of `size` contributors: the sum minus theirs is one
    model once size - 1 collude, and the two-story split of Round 3 (one group
    of honest holders told "v stayed", another "v dropped", the colluders
    vouching for both) needs 2t - h of the h = size - 1 holders."""
    h = size - 1
    t = _threshold(h, configured)
    return max(1, min(size - 1, 2 * t - h))


def secagg_guarantee_lines(protocol: BaseModel, roster_size: int, wanted: int) -> list[str]:
    """What `check` prints for secure aggregation: the sums this node asks for
    (`wanted` neighbours, at least its secagg_min_contributors), their
    threshold and the dropouts they survive after masking, and the fewest
    colluding contributors that let a requester see a model, over every sum
    size this node answers (a requester picks the size)."""
    lines = []
    finetune = getattr(protocol, "finetune", None)
    for field, params in (("protocol", protocol), ("protocol.finetune", finetune)):
        if params is None or not getattr(params, "secure_aggregation", False):
            continue
        least = int(getattr(params, "secagg_min_contributors", SECAGG_MIN_SUM))
        configured = getattr(params, "secagg_threshold", None)
        others = max(0, roster_size - 1)
        top = min(others, SECAGG_MAX_CONTRIBUTORS)
        if top < least:
            lines.append(
                f"# {field}: WARNING secagg_min_contributors {least} > the {others} other sites: "
                "no secure sum can be made"
            )
            continue
        size = min(max(wanted, least), top)
        h = size - 1
        t = _threshold(h, configured)
        needed = min(secagg_colluders_needed(n, configured) for n in range(least, top + 1))
        lines.append(
            f"# {field}: secure sums of {size} contributors (threshold t = {t} of {h} holders) "
            f"survive {h - t} dropout(s) after masking; a requester must collude with {needed} "
            f"contributor(s) to see a site's model (sums of {least} to {top} answered)"
        )
        if needed < 2:
            lines.append(
                f"# {field}: WARNING one colluding peer and the requester see a model: raise "
                "secagg_min_contributors (3 or more) where the roster allows"
            )
    return lines
