"""Eviction policies: one scorer per module, one registry (name -> factory)."""

from __future__ import annotations

from .base import Observation, Policy
from .epikv import EpikvPolicy
from .none import NoEviction
from .streaming import StreamingLLM

REGISTRY = {
    "epikv": EpikvPolicy,
    "streaming": StreamingLLM,
    "none": NoEviction,
}


def make_policy(name: str, **kwargs) -> Policy:
    """Instantiate a registered policy by name; ValueError naming the choices otherwise."""
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(REGISTRY))}") from None
    return factory(**kwargs)


__all__ = ["Observation", "Policy", "EpikvPolicy", "StreamingLLM", "NoEviction", "REGISTRY", "make_policy"]
