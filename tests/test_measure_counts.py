"""Token counts by bpe-openai where it is installed (engine/impl/measure.counts.impl.jac): the same
counts as tiktoken's `encode_ordinary`, or tiktoken's own."""

import json
import random
from pathlib import Path

import pytest

from contextrender import local as engine  # noqa: F401
from engine.measure import Tokenizer, get_tokenizer
from tests.conftest import TRACES

pytest.importorskip("bpe_openai")

TOK = get_tokenizer()
# The whole recorded traces where the project's shared folder is beside it (the benchmarks' set),
# else the tests' fixture.
FULL_TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def trace_texts() -> list[str]:
    folder = FULL_TRACES if (FULL_TRACES / "tau_bench.jsonl").is_file() else TRACES
    texts: set[str] = set()

    def walk(value):
        if isinstance(value, str):
            texts.add(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for name in ("mini_swe_agent_deepseek.jsonl", "swe_agent_demos.jsonl", "tau_bench.jsonl"):
        with open(folder / name) as f:
            for line in f:
                walk(json.loads(line))
    return sorted(texts)


def test_the_default_encoding_and_its_scaled_estimate_count_with_one_bpe_openai_tokenizer():
    assert TOK._fast is not None
    assert get_tokenizer("claude")._fast is TOK._fast
    assert get_tokenizer("cl100k_base")._fast not in (None, TOK._fast)


def test_bpe_openai_counts_the_recorded_traces_as_tiktoken_does():
    texts = trace_texts()
    assert len(texts) > 500
    differ = [t for t in texts if TOK._fast.count(t) != len(TOK._enc.encode_ordinary(t))]
    assert differ == []
    # And through a tokenizer's cache, against one that has tiktoken alone.
    plain = Tokenizer(encoding=TOK.encoding, scale=TOK.scale, _enc=TOK._enc)
    fast = Tokenizer(encoding=TOK.encoding, scale=TOK.scale, _enc=TOK._enc, _fast=TOK._fast)
    assert [fast.count(t) for t in texts[:2000]] == [plain.count(t) for t in texts[:2000]]


def test_bpe_openai_counts_random_texts_of_the_pre_tokeniser_s_edge_cases_as_tiktoken_does():
    # Spaces before letters and at the ends, newlines, contractions, digits, cased and uncased
    # scripts, combining marks, emoji, non-breaking and zero-width spaces.
    pieces = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "a", "B", "é", "日本", "😀", "1", "123", "'s", "'S", "’",
              ".", "..", "-", "_", "\u00a0", "\u200b", "ß", "İ", "ǅ", "x'll", " 'd", "\u0301", "Ⅻ", "٣", "𝔄"]
    rng = random.Random(30)
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(20000)]
    assert [t for t in texts if TOK._fast.count(t) != len(TOK._enc.encode_ordinary(t))] == []


def test_a_lone_surrogate_is_counted_as_tiktoken_counts_it():
    # bpe-openai refuses a text it cannot encode as UTF-8; tiktoken replaces the surrogate.
    fast = Tokenizer(encoding=TOK.encoding, scale=TOK.scale, _enc=TOK._enc, _fast=TOK._fast)
    assert fast.count("a\ud800b c") == len(TOK._enc.encode_ordinary("a\ud800b c"))


def test_a_bpe_openai_tokenizer_that_counts_otherwise_is_not_used():
    import engine.measure as measure

    class Other:
        """An encoding of the same name that counts each character a token (another vocabulary)."""

        def encode_ordinary(self, text):
            return list(text)

    assert measure._checked_fast_counter("o200k_base", Other()) is None
    assert measure._checked_fast_counter("no_such_encoding", TOK._enc) is None
