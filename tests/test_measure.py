"""Token counting and embeddings (offline)."""

import os

import numpy as np
import pytest

from contextrender import local as engine  # noqa: F401
from engine.measure import cut_middle, get_embedder, get_tokenizer, pack_vector, unpack_vector
from tests.conftest import assistant, call, in_new_process, recording_tokenizer, tool, user

TOK = get_tokenizer()


def test_tiktoken_loads_offline_from_bundled_files():
    assert os.environ["TIKTOKEN_CACHE_DIR"]
    assert TOK.count("hello world") == 2


def test_history_tokens_are_additive_over_messages():
    messages = [user("hi there"), assistant("sure", call("c1", "read", {"path": "a/b.py"})), tool("c1", "print(1)")]
    assert TOK.history_tokens(messages) == sum(TOK.message_tokens(m) for m in messages)
    with_parts = {"role": "user", "content": [{"type": "text", "text": "hi there"}, {"type": "image_url", "image_url": {"url": "x"}}]}
    assert TOK.message_tokens(with_parts) == TOK.message_tokens(user("hi there")) + 85


def test_wordllama_pooling_equals_the_library_embed():
    import wordllama

    reference = wordllama.WordLlama.load(cache_dir=os.path.dirname(wordllama.__file__), disable_download=True)
    texts = ["short text", "a much longer text about django/db/models/query.py line 230 " * 20, "x"]
    ours = get_embedder().embed(texts)
    theirs = np.stack([reference.embed([t])[0] for t in texts])
    theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
    assert np.allclose(ours, theirs, atol=1e-5)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_embedding_in_batches_gives_the_same_vectors(monkeypatch: pytest.MonkeyPatch):
    import engine.measure as measure

    texts = [f"result {i}: def parse_{i}(tokens): return tokens[{i % 7}:]" * (1 + i % 5) for i in range(11)] + [""]
    whole = get_embedder().embed(texts)
    monkeypatch.setattr(measure, "ENCODE_BATCH", 3)  # batches of 3, 3, 3, 3 texts
    assert np.array_equal(get_embedder().embed(texts), whole)


def _trace_texts() -> list[str]:
    import json

    from engine.measure import EMBED_CLIP
    from tests.conftest import TRACES

    texts = []
    for path in sorted(TRACES.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            for message in json.loads(line)["messages"]:
                if isinstance(message.get("content"), str):
                    texts.append(message["content"][:EMBED_CLIP])
                texts += [c["function"]["arguments"] for c in message.get("tool_calls") or []]
    return texts


def test_word_by_word_token_ids_are_the_tokenizers_own():
    """The embedder tokenises wordllama's SentencePiece BPE word by word (from its word cache):
    the ids `encode` gives, for the recorded traces and for texts made to find the edges (runs
    of spaces, a literal "▁", the tokenizer's special tokens, bytes without a token, empty)."""
    import random

    embedder = get_embedder()
    assert embedder._space_bounded
    tokenizer = embedder._wordllama.tokenizer
    rng = random.Random(30)
    alphabet = [" ", "  ", "▁", "\n", "\t", "a", "é", "日本", "🙂", "<s>", "</s>", "<unk>", "x1_", "-", ".", "\x00", "\r\n"]
    made = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(3000)]
    texts = _trace_texts() + made + ["", " ", "  ", "▁", "▁▁ a", " a", "a ", "a  ", "<s> x", "ab" * 200]
    for _ in range(2):  # cold, then from the word cache
        assert [embedder._text_ids(t) for t in texts] == [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def test_embedding_word_by_word_gives_the_vectors_of_the_tokenizers_ids(monkeypatch: pytest.MonkeyPatch):
    embedder = get_embedder()
    texts = _trace_texts()[:400] + ["", "   ", "<s> special"]
    ours = embedder.embed(texts)
    monkeypatch.setattr(embedder, "_space_bounded", False)  # the tokenizer's encode_batch
    assert np.array_equal(embedder.embed(texts), ours)


def test_pooling_gives_numpys_mean_of_the_token_rows_to_the_bit(monkeypatch: pytest.MonkeyPatch):
    """The rows summed in one reused buffer and divided at the end: the bits of
    `table[clipped ids].mean(axis=0)` for each text (the pooling before), in batches too."""
    import engine.measure as measure

    embedder = get_embedder()
    table = embedder._wordllama.embedding
    texts = _trace_texts()[:3000] + ["", "x", "<s> special", "a much longer text " * 500]

    def mean_of(text: str) -> np.ndarray:
        ids = embedder._text_ids(text)
        if not ids:
            return np.zeros(table.shape[1], dtype=np.float32)
        return table[np.clip(np.asarray(ids, dtype=np.int64), 0, table.shape[0] - 1)].mean(axis=0)

    expected = np.stack([mean_of(t) for t in texts]).view(np.uint32)
    assert np.array_equal(embedder._embed_wordllama(texts).view(np.uint32), expected)
    monkeypatch.setattr(measure, "ENCODE_BATCH", 7)
    assert np.array_equal(embedder._embed_wordllama(texts).view(np.uint32), expected)


JOINED_CASES = [
    ["the task: fix the bug in a.py", "THOUGHT: read it\n```bash\ncat a.py\n```"],
    ["ends with a dot.", " starts with a space"],
    ["ends with spaces   ", "\nstarts with a newline"],
    ["crlf line\r\n", "\r\nmore"],
    ["unicode: naïve café 日本語 🙂", "bytes 🙂 again ▁ literal"],
    ["x", "y", "three parts"],
    ["task " * 400, "read_file {\"path\": \"django/db/models/query.py\"}"],
]


@pytest.mark.parametrize("parts", JOINED_CASES)
def test_embed_joined_is_the_embedding_of_the_joined_text_to_the_bit(parts):
    embedder = get_embedder()
    joined = "\n".join(parts)
    assert embedder._newline_bounded
    # Twice: the first computes the first part's sum, the second uses the kept one.
    for _ in range(2):
        assert np.array_equal(embedder.embed_joined(parts), embedder.embed([joined])[0])


def test_embed_joined_tokenises_a_repeated_first_part_once(monkeypatch):
    embedder = get_embedder()
    task = "a task told once and embedded again with every new message " * 30
    seen = []
    token_ids = type(embedder)._token_ids
    monkeypatch.setattr(type(embedder), "_token_ids", lambda self, text: seen.append(text) or token_ids(self, text))
    for message in ["first answer", "second answer", "third answer with `code`"]:
        assert np.array_equal(embedder.embed_joined([task, message]), embedder.embed([task + "\n" + message])[0])
    assert seen == [task]


def test_embed_joined_tokenises_what_follows_the_first_part_word_by_word(monkeypatch):
    """The rest is tokenised from the word cache (`_text_ids`, the tokenizer's own ids), and the
    vector is still the joined text's to the bit, on the recorded traces' texts."""
    embedder = get_embedder()
    seen = []
    text_ids = type(embedder)._text_ids
    monkeypatch.setattr(type(embedder), "_text_ids", lambda self, text: seen.append(text) or text_ids(self, text))
    texts = _trace_texts()[:200]
    task = texts[0]
    for message in texts[1:]:
        seen.clear()
        assert np.array_equal(embedder.embed_joined([task, message]), embedder.embed([task + "\n" + message])[0])
        assert seen[0] == "\n" + message


def test_empty_text_embeds_to_zero():
    assert not get_embedder().embed([""]).any()


def test_vectors_round_trip_exactly():
    vector = get_embedder().embed(["round trip"])[0]
    assert np.array_equal(unpack_vector(pack_vector(vector)), vector)


@pytest.mark.parametrize("limit", [20, 100, 500])
def test_cut_middle_respects_the_limit_and_keeps_both_ends(limit):
    text = "START " + " ".join(f"w{i}" for i in range(3000)) + " END"
    cut = cut_middle(text, limit, TOK)
    assert TOK.count(cut) <= limit
    assert cut.startswith("START") and cut.endswith("END") and "tokens cut by ContextRender" in cut
    assert cut_middle("short", limit, TOK) == "short"


def test_cut_middle_cuts_a_text_once_per_limit_and_encoding():
    """A render cuts the same task to the same share at every request: the second cut is the
    first one's text, without tokenising the text again; another limit or encoding is cut anew."""
    text = "TASK " + " ".join(f"step{i}" for i in range(2000)) + " DONE"
    (counted, encoded) = recording_tokenizer(TOK)
    first = cut_middle(text, 321, counted)
    assert text in encoded
    encoded.clear()
    assert cut_middle(text, 321, counted) == first == cut_middle(text, 321, TOK)
    assert text not in encoded
    assert cut_middle(text, 123, counted) != first and text in encoded
    assert TOK.count(cut_middle(text, 123, counted)) <= 123


def test_thinking_counts_its_text_and_other_parts_a_flat_price():
    thinking = {"type": "thinking", "thinking": "First check the failing assertion.", "signature": "c2ln" * 100}
    message = {"role": "assistant", "content": [thinking, {"type": "text", "text": "Done."}, {"type": "redacted_thinking", "data": "x" * 900}]}
    assert TOK.message_tokens(message) == 4 + TOK.count("Done.") + TOK.count(thinking["thinking"]) + 85


def test_the_claude_estimate_scales_each_text_and_stays_additive():
    claude = get_tokenizer("claude")
    text = "def parse_header(line: str) -> dict:\n    return dict(part.split('=') for part in line.split(';'))\n" * 20
    assert claude.count(text) == -(-TOK.count(text) * 115 // 100)  # ceil(o200k x 1.15)
    messages = [user(text), assistant("ok", call("c1", "read", {"path": "a.py"})), tool("c1", text)]
    assert claude.history_tokens(messages) == sum(claude.message_tokens(m) for m in messages)
    cut = cut_middle(text * 10, 300, claude)
    assert claude.count(cut) <= 300 and "tokens cut by ContextRender" in cut
    with pytest.raises(ValueError, match="claude"):
        get_tokenizer("nope")


# Characters and runs at the edges of tiktoken's pre-tokeniser patterns: each kind of whitespace
# (and runs of it before a letter, a digit, a mark or the end), contractions in both cases, letters
# of every case class, marks, digits of other scripts, punctuation, emoji, a special token's text.
PATTERN_EDGES = [" ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\x0b", "\x0c", "\x85", "\xa0", "\u2009", "\u3000",
                 "\u2028", "a", "Z", "é", "É", "ǅ", "ʰ", "日本", "ß", "'s", "'T", "'re", "'LL", "’s", "0", "12", "3456",
                 "²", "½", "٣", "_", "-", ".", "/", "(", ")", "{", "}", '"', "'", ",", ";", ":", "🙂", "\u0301",
                 "\u200b", "<|endoftext|>", "x1_", "fooBar", "HTTPServer"]


@pytest.mark.parametrize("name", ["o200k_base", "cl100k_base", "p50k_base"])
def test_the_grouped_pattern_gives_tiktokens_own_ids(name):
    """The tokenizer's encoding has its pattern's alternatives before the lookahead in one group
    (fancy_regex hands the group to the regex crate whole): the same ids as tiktoken's own encoding,
    on the recorded traces' texts and on 20,000 strings made of the patterns' edges."""
    import random

    import tiktoken

    from engine.measure import LOOKAHEAD_ALTERNATIVE, grouped_pattern

    (ours, theirs) = (get_tokenizer(name)._enc, tiktoken.get_encoding(name))
    assert LOOKAHEAD_ALTERNATIVE in theirs._pat_str
    assert ours._pat_str == grouped_pattern(theirs._pat_str) == "(?:" + theirs._pat_str.replace(LOOKAHEAD_ALTERNATIVE, ")" + LOOKAHEAD_ALTERNATIVE, 1)
    rng = random.Random(8)
    made = ["".join(rng.choice(PATTERN_EDGES) for _ in range(rng.randint(0, 40))) for _ in range(20000)]
    for text in _trace_texts() + made:
        assert ours.encode_ordinary(text) == theirs.encode_ordinary(text), text
    assert grouped_pattern(r"\S+|\s+") == r"\S+|\s+"  # nothing looks ahead: as it is


def test_warm_up_loads_the_tokenizer_and_the_local_embedder(tmp_path):
    """In a new process nothing is loaded until warm_up (what the proxy and the server call before
    they serve) loads the default encoding and wordllama."""
    script = (
        "import json; import engine.measure as m; before = (sorted(m._tokenizers), len(m._embedder)); m.warm_up(); "
        "print(json.dumps([before, sorted(m._tokenizers), [e.model for e in m._embedder]]))"
    )
    assert in_new_process(script, tmp_path) == [[[], 0], ["o200k_base"], ["wordllama"]]


def test_a_text_is_tokenised_once_and_counted_as_before(monkeypatch):
    """A render counts again the calls it cuts, its stubs and the texts its log compares, the same
    at every request: a text's count is kept by its text (COUNT_CACHE_CHARS characters, forgotten
    all at once when full), and is the count tokenising it gives."""
    import engine.measure as measure
    from engine.measure import Tokenizer

    (counted, encoded) = recording_tokenizer(TOK)
    texts = ["def f(x):\n    return x + 1\n", '{"path": "src/a.py"}', "ünïcode ✓ text", "x" * 5000]
    assert [counted.count(t) for t in texts] == [len(TOK._enc.encode_ordinary(t)) for t in texts]
    assert [counted.count(t) for t in texts] == [len(TOK._enc.encode_ordinary(t)) for t in texts]
    assert encoded == texts  # each tokenised once
    claude = Tokenizer(encoding="claude", scale=1.15, _enc=TOK._enc)
    assert claude.count(texts[0]) == claude.count(texts[0]) == -(-len(TOK._enc.encode_ordinary(texts[0])) * 115 // 100)
    monkeypatch.setattr(measure, "COUNT_CACHE_CHARS", 6000)
    (counted, encoded) = recording_tokenizer(TOK)
    for t in texts + texts + ["y" * 1000, texts[0]]:
        counted.count(t)
    # 5,060 characters kept; the next text's 1,000 make it full: all forgotten, then counted again.
    assert encoded == texts + ["y" * 1000, texts[0]]


def test_a_text_weighed_by_cut_ids_is_encoded_once_for_its_cuts_and_cut_as_afresh(monkeypatch):
    """`cut_ids` keeps a text's ids (by encoding and text, CUT_IDS_CHARS characters, forgotten all
    at once when full) and cut_middle cuts the text from them: weighed, then cut at three limits,
    the text is encoded once, and each cut is the one a fresh process makes. A text cut_ids did
    not weigh is not kept by cut_middle."""
    import engine.measure as measure
    from engine.measure import Tokenizer, cut_ids

    (counted, encoded) = recording_tokenizer(TOK)
    text = "CUT TWICE " + " ".join(f"item{i}" for i in range(1500)) + " END"
    assert cut_ids(text, counted) == TOK._enc.encode_ordinary(text)
    cuts = [cut_middle(text, limit, counted) for limit in (300, 120, 48)]
    assert encoded.count(text) == 1
    unweighed = "NOT WEIGHED " + " ".join(f"thing{i}" for i in range(900))
    cut_middle(unweighed, 200, counted)
    cut_middle(unweighed, 100, counted)
    assert encoded.count(unweighed) == 2
    # The same cuts as with nothing kept (a fresh process).
    monkeypatch.setattr(measure, "_cuts", {})
    monkeypatch.setattr(measure, "_cut_ids", {})
    monkeypatch.setattr(measure, "_cut_ids_chars", [0])
    fresh = Tokenizer(encoding=TOK.encoding, scale=TOK.scale, _enc=TOK._enc)
    assert cuts == [cut_middle(text, limit, fresh) for limit in (300, 120, 48)]
    assert all(TOK.count(c) <= limit for (c, limit) in zip(cuts, (300, 120, 48)))
    # Bounded: past CUT_IDS_CHARS characters the kept ids are forgotten, and the text encoded again.
    monkeypatch.setattr(measure, "CUT_IDS_CHARS", len(text) + 10)
    monkeypatch.setattr(measure, "_cuts", {})
    monkeypatch.setattr(measure, "_cut_ids", {})
    monkeypatch.setattr(measure, "_cut_ids_chars", [0])
    encoded.clear()
    cut_ids(text, counted)
    assert cut_middle(text, 300, counted) == cuts[0]
    cut_ids("OTHER " + " ".join(f"entry{i}" for i in range(800)), counted)
    assert cut_middle(text, 120, counted) == cuts[1]
    assert encoded.count(text) == 2
