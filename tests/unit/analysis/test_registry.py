"""Detectors register by name, run in order, and can be switched off in the rules."""

import pytest

from analysis import KINDS, Analyzer, detector_names, register, rules_from_dict
from analysis.registry import build_detectors


def test_builtin_detectors_in_order_cover_every_kind():
    names = detector_names()
    assert names == ["crash", "hang", "nan", "loss_spike", "grad_spike", "loss_scale_collapse", "straggler",
                     "slow_link", "device_health", "data_stall", "checkpoint_slow", "replica_divergence",
                     "node_history", "preflight"]
    kinds = {k for d in build_detectors(rules_from_dict()) for k in d.kinds}
    assert kinds == set(KINDS)


def test_a_detector_can_be_disabled_or_chosen():
    a = Analyzer(rules_from_dict({"hang": {"enabled": False}}))
    assert "hang" not in [d.name for d in a.detectors]
    assert [d.name for d in Analyzer(detectors=["nan"]).detectors] == ["nan"]
    with pytest.raises(KeyError, match="no detector"):
        Analyzer(detectors=["nope"])


def test_a_name_registered_twice_is_an_error():
    class Again:
        name = "nan"

    with pytest.raises(ValueError, match="already registered"):
        register(Again)
