"""Eviction policies: one scorer per module, one registry (name -> factory). See docs/policies.md."""

from __future__ import annotations

from .base import Observation, Policy
from .epikv import EpikvPolicy, epikv_lag, epikv_raw, epikv_single
from .h2o import H2OPolicy
from .keydiff import KeyDiffPolicy
from .knorm import KNormPolicy
from .lagkv import LagKVPolicy
from .none import NoEviction
from .random_policy import RandomPolicy
from .snapkv import SnapKVPolicy
from .streaming import StreamingLLM
from .tova import TOVAPolicy

REGISTRY = {
    "none": NoEviction,
    "streaming": StreamingLLM,
    "random": RandomPolicy,
    "knorm": KNormPolicy,
    "keydiff": KeyDiffPolicy,
    "lagkv": LagKVPolicy,
    "epikv": EpikvPolicy,
    "epikv_lag": epikv_lag,
    "epikv_raw": epikv_raw,
    "epikv_single": epikv_single,
    "h2o": H2OPolicy,
    "tova": TOVAPolicy,
    "snapkv": SnapKVPolicy,
}

#: Policies configured by a ``ScoringConfig`` (``cfg=``): the CLI's --layers/--window apply to them.
EPIKV_POLICIES = frozenset({"epikv", "epikv_lag", "epikv_raw", "epikv_single"})
#: Policies reading the attention matrix: they need flash attention off (SessionConfig(flash_attn=False)).
ATTENTION_POLICIES = frozenset({"h2o", "tova", "snapkv"})


def make_policy(name: str, **kwargs) -> Policy:
    """Instantiate a registered policy by name; ValueError naming the choices otherwise."""
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(REGISTRY))}") from None
    return factory(**kwargs)


__all__ = ["Observation", "Policy", "EpikvPolicy", "StreamingLLM", "NoEviction", "RandomPolicy", "KNormPolicy",
           "KeyDiffPolicy", "LagKVPolicy", "H2OPolicy", "TOVAPolicy", "SnapKVPolicy", "REGISTRY",
           "EPIKV_POLICIES", "ATTENTION_POLICIES", "make_policy"]
