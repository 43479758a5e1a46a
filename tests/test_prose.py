"""A condensed message's opening (engine/prose.jac, engine/impl/prose.impl.jac): its first tokens
found from a prefix of the text, the same as from the whole text."""

from __future__ import annotations

import json
import random

import pytest

from engine.measure import get_tokenizer
from tests.conftest import TRACES


def texts() -> list[str]:
    """Assistant texts of the test traces, and texts made to be hard for a prefix: contractions,
    digit runs, accents, runs of spaces and line breaks, punctuation before spaces, no spaces."""
    found = []
    for name in ("mini_swe_agent_deepseek.jsonl", "swe_agent_demos.jsonl"):
        with open(TRACES / name) as f:
            for line in f:
                for message in json.loads(line).get("messages", []) if line.strip() else []:
                    if message.get("role") == "assistant" and isinstance(message.get("content"), str):
                        found.append(message["content"])
    rng = random.Random(5)
    words = ["it's", "don't", "12345", "1.5e-3", "naïve", "café", "über", "  ", "\n", "\n\n", " \n", "/tmp/x",
             "x)", "(y", "—", "数据库", "CamelCase", "HTTPServer", "you'LL", "a", "<|endoftext|>", "\t", "''", "r12"]
    for _ in range(300):
        found.append("".join(rng.choice(words) + rng.choice(["", " ", "  ", "\n"]) for _ in range(rng.randrange(20, 400))))
    found += ["x" * 3000, "word " * 600, "数据库" * 500, "a " + "\n" * 400 + "b " * 200]
    return found


@pytest.mark.parametrize("encoding", ["o200k_base", "cl100k_base", "p50k_base"])
def test_the_opening_tokens_of_a_prefix_are_those_of_the_whole_text(encoding, monkeypatch):
    """_head_ids gives the whole text's first tokens (at least CONDENSED_HEAD, or all of them), and
    encodes less than the whole text where a long text has a space after a letter past HEAD_CHARS."""
    import engine.prose as prose

    tokenizer = get_tokenizer(encoding)
    encode = type(tokenizer._enc).encode_ordinary
    seen = []
    monkeypatch.setattr(type(tokenizer._enc), "encode_ordinary", lambda enc, text: seen.append(len(text)) or encode(enc, text))
    shorter = 0
    for text in texts():
        seen[:] = []
        ids = prose._head_ids(text, tokenizer)
        whole = encode(tokenizer._enc, text)
        assert ids == whole[:len(ids)] and (len(ids) >= prose.CONDENSED_HEAD or ids == whole), text[:80]
        assert tokenizer._enc.decode(ids[:prose.CONDENSED_HEAD]) == tokenizer._enc.decode(whole[:prose.CONDENSED_HEAD])
        shorter += max(seen) < len(text)
    assert shorter > 100
