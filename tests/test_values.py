"""Value abstraction of Tool-Flow Analysis (paper A.2) and the recall tokens (B.4)."""

from contextrender import local as engine  # noqa: F401  (puts the Jac modules on the path)
from engine.values import extract_values, recall_tokens


def test_customer_id_example():
    assert extract_values("customer_id=C142XYZ") == {"customer_id", "C142XYZ"}


def test_venmo_contacts_example():
    text = (
        "Contacts: Kathryn kathrynmaldonado@gmail.com; Troy tr_solo@gmail.com; "
        "Nancy nan_ritt@gmail.com"
    )
    values = extract_values(text)
    assert {"tr_solo", "nan_ritt", "gmail.com"} <= values
    for excluded in ("kathrynmaldonado", "Kathryn", "Troy", "Nancy", "Contacts"):
        assert excluded not in values


def test_separators_and_stripping():
    text = '"/home/user/src/my_module.py", [ORD-123456], {"k": "v_alue."} see ...abc_def_.'
    values = extract_values(text)
    # Slashes separate path segments; leading/trailing . - _ are stripped, inner ones kept.
    assert {"my_module.py", "ORD-123456", "v_alue", "abc_def"} <= values
    assert "home" not in values and "user" not in values


def test_length_and_character_filter():
    # Too short after stripping; all-lowercase words; Titlecase words.
    assert extract_values("ab_12 __x1__ lowercaseword Titlecase") == set()
    # Uppercase-only words, digits, hyphens and periods qualify.
    assert extract_values("WARNING 123456 well-known v1.2.3") == {"WARNING", "123456", "well-known", "v1.2.3"}


def test_recall_tokens_allow_titlecase_but_need_upper_or_underscore():
    assert recall_tokens("Kathryn tr_solo lowercaseword gmail.com C142XYZ ab_c") == {"Kathryn", "tr_solo", "C142XYZ"}


def _spec_values(text: str) -> set[str]:
    """Appendix A.1 as written: candidates, stripped, >= 6 characters, a mark, not titlecase."""
    import re

    values = set()
    for candidate in set(re.findall(r"[A-Za-z0-9][A-Za-z0-9_.\-]{4,}", text)):
        value = candidate.strip("._-")
        if len(value) >= 6 and re.search(r"[_A-Z0-9.\-]", value) and not re.fullmatch(r"[A-Z][a-z]+", value):
            values.add(value)
    return values


def test_values_are_the_specs_on_the_recorded_traces():
    """The verdicts by string tests (engine/values.jac) against appendix A.1's regexes as written,
    on the recorded traces' texts and on words at the edges of each rule."""
    import json

    from tests.conftest import TRACES

    texts = [
        "", "__init__ __init__.py ...x...", "A" * 70 + " " + "-" * 9 + "abcdef_1-" + " Django v1.2.3-rc1",
        "Abcdef ABCDEF abcdef abcDef AbcDef aBcdef abc-def Abcdefg1 aaaaaa_ x.Abcdef. -Hello- Hello_ HELLOs HeLLo",
        "Éabcdefgh abcdeéfgh ÀBCDEFG naïveté Straße 123456 12345 a1b2c3 ______abc _abcdefg_",
    ]
    for path in sorted(TRACES.glob("*.jsonl")):
        for line in path.read_text().splitlines()[:60]:
            for message in json.loads(line)["messages"]:
                texts.append(message["content"] if isinstance(message.get("content"), str) else "")
                texts += [c["function"]["arguments"] for c in message.get("tool_calls") or []]
    assert [extract_values(text) for text in texts] == [_spec_values(text) for text in texts]
