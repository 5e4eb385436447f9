"""One tier vocabulary for every engine: `gpu`, `cpu`, `disk`, `external`.

Engines name the medium a block sits on in their own words: vLLM says `GPU`, `CPU` (its
offloading connector) and names its storage backends; SGLang says `GPU`, `CPU_PINNED`
(HiCache's host tier), `DISK` and `EXTERNAL` (a shared pool such as Mooncake). Answers,
metrics and the dashboard speak tiers; the raw medium stays available where it is shown.

| tier | vLLM medium | SGLang medium |
| --- | --- | --- |
| gpu | `GPU` (or none: before 0.10.2) | `GPU` |
| cpu | `CPU` | `CPU_PINNED`, `CPU` |
| disk | `DISK`, `STORAGE`, `LOCAL_DISK` | `DISK` |
| external | anything else (a remote or shared store) | `EXTERNAL` |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["TIERS", "TIER_GPU", "is_gpu", "tier_counts", "tier_of"]

TIER_GPU: Final = "gpu"
TIERS: Final = ("gpu", "cpu", "disk", "external")
"""Every tier, fastest first: the order a lookup's lower-tier run prefers."""

_BY_MEDIUM: Final = {
    "GPU": "gpu",
    "CPU": "cpu",
    "CPU_PINNED": "cpu",
    "HOST": "cpu",
    "DISK": "disk",
    "STORAGE": "disk",
    "LOCAL_DISK": "disk",
    "EXTERNAL": "external",
}


def tier_of(medium: str | None) -> str:
    """The tier of a medium name as an engine sent it (None: the GPU). Case-insensitive;
    a tier name maps to itself; an unknown medium is a remote store: `external`."""
    if medium is None:
        return TIER_GPU
    tier = _BY_MEDIUM.get(medium) or _BY_MEDIUM.get(medium.upper())
    if tier is not None:
        return tier
    lowered = medium.lower()
    return lowered if lowered in TIERS else "external"


def is_gpu(medium: str | None) -> bool:
    return medium is None or tier_of(medium) == TIER_GPU


def tier_counts(by_medium: Mapping[str, int]) -> dict[str, int]:
    """Counts per medium as counts per tier, fastest tier first (tiers with none left
    out). Two media of one tier add up: an engine names each tier one way."""
    out: dict[str, int] = {}
    for medium, count in by_medium.items():
        tier = tier_of(medium)
        out[tier] = out.get(tier, 0) + count
    return {tier: out[tier] for tier in TIERS if tier in out}
