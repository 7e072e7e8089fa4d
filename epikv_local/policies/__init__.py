"""Policies: small scorers (higher = keep), one per module, and the one registry of named configurations.

Owns: the scorer contract (:mod:`.base`), the EPIKV scoring math (:mod:`.scoring`, numpy only) and every
policy. A policy is a dataclass whose fields are its settings; its traits (``evicts``, ``needs_attention``,
``calibratable``) are class attributes, read from the registry's classes by callers (never by name). The
engine binds a policy to a model (``Policy.bind``) and runs every policy's scores through one selection step.

May import: numpy and :mod:`epikv_local.errors`. Never the engine, the front doors or the evaluation code.
See docs/policies.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..errors import ConfigError
from .base import ModelShape, Observation, Policy, Signals
from .epikv import EpikvPolicy
from .facts import FactsPolicy
from .h2o import H2OPolicy
from .keydiff import KeyDiffPolicy
from .knorm import KNormPolicy
from .lagkv import LagKVPolicy
from .mix import EpikvMixPolicy
from .none import NoEviction
from .random_policy import RandomPolicy
from .rkv import RKVPolicy, RKVRedundancyPolicy
from .said import SaidEpikvPolicy, SaidPolicy
from .snapkv import SnapKVPolicy
from .streaming import StreamingLLM
from .surprise import SurprisePolicy
from .tova import TOVAPolicy
from .triattention import TriAttentionPolicy


@dataclass(frozen=True)
class PolicySpec:
    """A registered name: a policy class and the settings that make this named configuration."""

    name: str
    cls: type[Policy]
    preset: dict = field(default_factory=dict)
    help: str = ""
    #: True: not a configuration of its own but whatever a model's calibration selected (resolved by the
    #: front doors, ``epikv_local.api.calibration.resolve_policy``, which know the model file)
    from_calibration: bool = False
    #: the recent window's share of the budget this configuration was designed with (None: the budget's
    #: default); the front doors use it unless the caller gives a recent window or share
    recent_fraction: float | None = None

    @property
    def option_names(self) -> tuple[str, ...]:
        """Settings a user may give (the class's dataclass fields)."""
        return tuple(f.name for f in fields(self.cls) if f.init)


_SPECS = [
    PolicySpec("none", NoEviction, help="no eviction (plain llama.cpp)"),
    PolicySpec("streaming", StreamingLLM, help="StreamingLLM: sinks + recent window"),
    PolicySpec("random", RandomPolicy, help="seeded random scores (sanity baseline)"),
    PolicySpec("knorm", KNormPolicy, help="low key L2 norm = keep"),
    PolicySpec("keydiff", KeyDiffPolicy, help="keys least similar to the mean key = keep"),
    PolicySpec("lagkv", LagKVPolicy, help="LagKV: key spread against the next chunk (K only)"),
    PolicySpec("epikv", EpikvPolicy, help="EPIKV: rolling z-score of the residual-stream change, two bands"),
    PolicySpec("epikv_lag", EpikvPolicy, {"normalization": "lag"}, "EPIKV with median/MAD normalisation"),
    PolicySpec("epikv_raw", EpikvPolicy, {"normalization": "raw"}, "EPIKV on raw g (no normalisation)"),
    PolicySpec("epikv_span", EpikvPolicy, {"span": 2}, "EPIKV with each token's score the max within 2 positions "
               "(keeps spans, not fragments)"),
    PolicySpec("epikv_single", EpikvPolicy, {"ref_layers": (10,)}, "EPIKV with band A only"),
    PolicySpec("epikv_mix", EpikvMixPolicy, help="EPIKV rank-mixed with KeyDiff (and TriAttention); calibrated weights"),
    PolicySpec("triattention", TriAttentionPolicy, help="TriAttention: expected future attention from pre-RoPE "
               "query statistics"),
    PolicySpec("said", SaidPolicy, help="the words a caller gave (every chat turn) before the model's own; "
               "a base scorer within each (streaming)"),
    PolicySpec("said_epikv", SaidEpikvPolicy, help="as said, EPIKV's score within each group (on one prompt it is "
               "epikv)"),
    PolicySpec("said_prompt", SaidEpikvPolicy, {"prompt": True, "share": 0.5},
               "as said_epikv, the starting prompt in the given tier too (at most half the cache): with the prompt "
               "counted against the budget, the question is kept before the model's own text"),
    PolicySpec("said_facts", SaidEpikvPolicy, {"prompt": True, "share": 0.5, "base": "facts"},
               "as said_prompt, the model's own numbers (and the tokens beside them) before the rest of its text; "
               "a quarter of the budget for the recent window", recent_fraction=0.25),
    PolicySpec("said_surprise", SaidPolicy, {"prompt": True, "share": 0.5, "base": "surprise", "given_order": "base"},
               "as said_prompt, with the model's surprisal for EPIKV: the prompt's most surprising words (at most half "
               "the cache) before the rest, everything ordered by surprise (a fact inside a long prompt, a question)"),
    PolicySpec("said_prompt_surprise", SaidEpikvPolicy, {"prompt": True, "share": 0.5, "given_order": "surprise"},
               "as said_prompt, the caller's words ordered by the model's surprisal (a fact inside a long prompt), "
               "the model's own text by EPIKV"),
    PolicySpec("said_words", SaidEpikvPolicy, {"prompt": True, "share": 0.5, "template_last": True},
               "as said_prompt, the chat template's own text (role markers, a default system prompt) below the "
               "caller's words in the given tier: the question before the boilerplate around it"),
    PolicySpec("said_words_surprise", SaidEpikvPolicy, {"prompt": True, "share": 0.5, "given_order": "surprise",
                                                        "template_last": True},
               "as said_words, the caller's words ordered by the model's surprisal (a fact inside a long prompt), "
               "the chat template's text below them"),
    PolicySpec("said_words_either", SaidEpikvPolicy, {"prompt": True, "share": 0.5,
                                                      "given_order": "oldest_or_surprise", "template_last": True},
               "as said_words, a caller's word kept while it is among the oldest or the most surprising (a "
               "question whole from its start, a fact deep in a long prompt), the chat template's text below"),
    PolicySpec("said_words_deep", SaidEpikvPolicy, {"prompt": True, "share": 0.5, "template_last": True,
                                                    "surprise_beyond": 2.0},
               "as said_words while each turn's words fit in two tiers (a question kept whole from its start); "
               "beyond that the overflow's worth of the tier goes to that turn's most surprising words (a fact "
               "deep in a long text), below the short turns' words. The default: on one protected prompt it is "
               "epikv"),
    PolicySpec("facts", FactsPolicy, help="numbers and the tokens beside them before the rest (a share of the "
               "cache at most); EPIKV's score within each"),
    PolicySpec("surprise", SurprisePolicy, help="the spans the model did not expect: its own surprisal of each "
               "token, the best window mean covering it (every token's logits: prefill pays the output layer)"),
    PolicySpec("rkv_redundancy", RKVRedundancyPolicy, help="R-KV's redundancy term: older near-duplicate keys go"),
    PolicySpec("rkv", RKVPolicy, help="R-KV: attention importance minus key redundancy (flash attention off)"),
    PolicySpec("calibrated", Policy, help="the policy, settings and recent share that `epikv-local calibrate` "
               "selected for this model among the signals", from_calibration=True),
    PolicySpec("h2o", H2OPolicy, help="H2O: accumulated attention (flash attention off)"),
    PolicySpec("tova", TOVAPolicy, help="TOVA: newest query's attention (flash attention off)"),
    PolicySpec("snapkv", SnapKVPolicy, help="SnapKV: pooled attention of a window (flash attention off)"),
]

#: name -> PolicySpec of every registered policy
REGISTRY: dict[str, PolicySpec] = {s.name: s for s in _SPECS}
#: the policy of every front door when none is named: EPIKV's score for the model's own tokens, the caller's words
#: (later chat turns; a counted prompt too) kept before them, the chat template's text last, the most surprising
#: words of a turn too long for two tiers. On one protected prompt it evicts exactly as ``epikv`` (tested); chosen on
#: the accuracy and recall benchmarks: with the prompt protected it recalled 10 of 12 multi-turn facts at 192
#: cells where ``said_epikv`` recalled 4 (p = 0.031), the same 12 of 12 at 256; with the prompt counted it is the
#: one policy significantly above StreamingLLM on GSM8K, MATH and the passkey (docs/benchmarks.md)
DEFAULT_POLICY = "said_words_deep"


def policy_spec(name: "str | PolicySpec") -> PolicySpec:
    """The registered spec of ``name`` (a spec is returned as is: unregistered configurations, e.g. a model's
    calibration under its own name, go through the same path); ConfigError naming the choices otherwise."""
    if isinstance(name, PolicySpec):
        return name
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(sorted(REGISTRY))}") from None


def make_policy(name: "str | PolicySpec", **options) -> Policy:
    """A new policy of the registered configuration ``name`` with ``options`` overriding its settings.

    ConfigError for an unknown name, a setting the policy does not have, or a value out of range."""
    spec = policy_spec(name)
    if spec.from_calibration:
        raise ConfigError(f"policy {spec.name!r} is chosen per model by its calibration: give a model file "
                          "(the CLI and epikv_local.Llama do) or run `epikv-local calibrate` first")
    unknown = sorted(set(options) - set(spec.option_names))
    if unknown:
        has = ", ".join(spec.option_names) or "no settings"
        raise ConfigError(f"policy {spec.name!r} has no setting {', '.join(map(repr, unknown))} (it has: {has})")
    policy = spec.cls(**{**spec.preset, **options})
    policy.name = spec.name  # the registered name (variants share a class)
    return policy


__all__ = ["ModelShape", "Observation", "Policy", "PolicySpec", "Signals", "EpikvPolicy", "StreamingLLM",
           "NoEviction", "RandomPolicy", "SurprisePolicy", "KNormPolicy", "KeyDiffPolicy", "LagKVPolicy",
           "H2OPolicy", "TOVAPolicy",
           "SnapKVPolicy", "EpikvMixPolicy", "TriAttentionPolicy", "RKVPolicy", "RKVRedundancyPolicy", "SaidPolicy", "SaidEpikvPolicy", "FactsPolicy",
           "DEFAULT_POLICY",
           "REGISTRY", "make_policy", "policy_spec"]
