"""Rules: documented defaults, a user file overrides a subset, typos are errors."""

import re
from pathlib import Path

import pytest

from analysis.rules import RulesError, load_rules, rules_from_dict

DOC = Path(__file__).resolve().parents[3] / "docs" / "rules.md"


def test_defaults_load():
    rules = load_rules()
    assert rules.straggler.min_ratio == 1.1 and rules.hang.long_phases == ["checkpoint", "eval", "init"]
    assert rules.source == "defaults"


def test_a_user_file_overrides_a_subset(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[straggler]\nmin_ratio = 1.2\n[crash]\nsilence_s = 5\n")
    rules = load_rules(path)
    assert rules.straggler.min_ratio == 1.2 and rules.straggler.window_steps == 8
    assert rules.crash.silence_s == 5.0 and isinstance(rules.crash.silence_s, float)


@pytest.mark.parametrize("text, match", [
    ("[stragler]\nmin_ratio = 1.2\n", "unknown section"),
    ("[straggler]\nmin_raito = 1.2\n", "no key 'min_raito'"),
    ("[straggler]\nmin_ratio = 'fast'\n", "must be a float"),
    ("[nan]\nenabled = 1\n", "must be a bool"),
    ("[straggler\n", "not valid TOML"),
])
def test_mistakes_are_refused_by_name(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(RulesError, match=match):
        load_rules(path)


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(RulesError, match="cannot read"):
        load_rules(tmp_path / "nope.toml")


def test_every_key_is_documented_with_its_default():
    doc = DOC.read_text()
    for section, values in rules_from_dict().as_dict().items():
        assert f"## [{section}]" in doc, section
        block = doc.split(f"## [{section}]", 1)[1].split("\n## ", 1)[0]
        for key, default in values.items():
            row = re.search(rf"^\|\s*`{key}`\s*\|([^|]*)\|", block, re.M)
            assert row, f"docs/rules.md: [{section}] {key} is not documented"
            shown = row.group(1).strip().strip("`")
            expected = str(default).lower() if isinstance(default, bool) else (
                str(default).replace("'", '"') if isinstance(default, list) else f"{default:g}" if isinstance(
                    default, float) else str(default))
            assert shown == expected, f"[{section}] {key}: docs say {shown!r}, rules.toml {expected!r}"
