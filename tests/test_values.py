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
