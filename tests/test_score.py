"""engine/score.jac: the paper's terms on worked examples (c_t with the 1/n weighting, U's terms,
q_t, R with the similarity penalty) and greedy selection's budget check at the exact fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

import contextrender.core  # noqa: F401  (puts the Jac modules on the path and imports jaclang)
from contextrender import Engine
from engine.score import (
    ABLATIONS, greedy_select, latest_exchange_text, observed_use, query_vector, reuse_counts, term_weights, usefulness,
)
from tests.conftest import assistant, call, tool, user


def select(usefulness_, costs, remaining, vectors=None, wrapper=None, owners=None, penalty=0.5):
    n = len(costs)
    vectors = np.eye(n) if vectors is None else np.asarray(vectors, dtype=float)
    return greedy_select(np.asarray(usefulness_, dtype=float), vectors, costs, wrapper or [0] * n,
                         owners or [-1] * n, remaining, penalty)


def test_a_result_that_costs_exactly_what_is_left_is_taken():
    chosen = select([1.0, 0.5], costs=[10, 5], remaining=10)
    assert [p.candidate for p in chosen.picks] == [0] and chosen.remaining == 0
    # One token less and it does not fit: the next best that does is taken instead.
    assert [p.candidate for p in select([1.0, 0.5], costs=[10, 5], remaining=9).picks] == [1]


def test_the_wrapper_is_paid_once_per_owner_and_counted_in_the_fit():
    # Two results of one assistant message folded away: the first pays the 3-token wrapper, the second not.
    chosen = select([1.0, 0.9], costs=[5, 5], wrapper=[3, 3], owners=[7, 7], remaining=13)
    assert [(p.candidate, p.cost) for p in chosen.picks] == [(0, 8), (1, 5)] and chosen.remaining == 0
    assert chosen.final_cost == [5, 5]  # the wrapper is paid: neither owes it any more


def test_r_is_u_minus_the_penalty_times_the_largest_similarity_to_a_chosen_result():
    # 1 is a copy of 0: once 0 is taken its R drops by the penalty (0.9 - 0.5 = 0.4) below 2's 0.6.
    vectors = [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    chosen = select([1.0, 0.9, 0.6], costs=[1, 1, 1], remaining=2, vectors=vectors)
    assert [p.candidate for p in chosen.picks] == [0, 2]
    assert chosen.picks[1].score == pytest.approx(0.6)
    assert chosen.final_score[1] == pytest.approx(0.4)


def test_exact_ties_favour_the_older_result():
    assert [p.candidate for p in select([0.5, 0.5, 0.5], costs=[1, 1, 1], remaining=1).picks] == [0]


def test_no_candidate_or_no_room_selects_nothing():
    assert select([], costs=[], remaining=100).picks == []
    nothing = select([1.0], costs=[11], remaining=10)
    assert nothing.picks == [] and nothing.remaining == 10


def test_reuse_counts_weigh_each_use_one_over_the_holders_for_the_first_holder():
    # "ORD_1" is held by results 0 and 2 and used 3 times: 1.5 to result 0. "x@y.z" only by 1, used twice.
    counts = reuse_counts({"ORD_1": 3, "x@y.z": 2}, {"ORD_1": [0, 2], "x@y.z": [1]}, 3)
    assert list(counts) == [1.5, 2.0, 0.0]
    assert list(observed_use(counts, [0, 1, 0], 2.0)) == [1.5, 4.0, 0.0]


def test_usefulness_is_the_weighted_sum_of_recency_reuse_and_clipped_relevance():
    terms = usefulness(np.array([0.0, 2.0]), np.array([0.0, 5.0]), np.array([0.8, -0.3]), (1.0, 1.0, 1.0), 0.3, 0.2)
    assert list(terms.recency) == pytest.approx([1.0, math.exp(-0.6)])
    assert list(terms.reuse) == pytest.approx([0.0, 1 - math.exp(-1.0)])
    assert list(terms.relevance) == pytest.approx([0.8, 0.0])  # a negative cosine adds nothing
    assert list(terms.total) == pytest.approx([1.8, math.exp(-0.6) + 1 - math.exp(-1.0)])
    no_relevance = usefulness(np.array([1.0]), np.array([0.0]), None, (1.0, 1.0, 1.0), 0.3, 0.2)
    assert list(no_relevance.relevance) == [0.0]


def test_an_ablation_zeroes_the_weights_of_the_terms_it_drops():
    assert term_weights(ABLATIONS["cr-recency"], 1.0, 2.0, 3.0) == (1.0, 0.0, 0.0)
    assert term_weights(ABLATIONS["contextrender"], 1.0, 2.0, 3.0) == (1.0, 2.0, 3.0)


def test_the_query_mixes_the_first_user_message_with_the_latest_exchange():
    messages = [user("first ask"), assistant("looking", call("c1", "read_file", {"path": "a.py"})), tool("c1", "x"),
                user("now the tests")]
    assert latest_exchange_text(messages) == 'now the tests\nlooking\nread_file {"path": "a.py"}'

    class Fixed:
        model = "fixed"

        def embed(self, texts):
            return [np.array([0.0, 2.0])]

        def embed_joined(self, parts):
            self.parts = parts
            return self.embed(["\n".join(parts)])[0]

    fixed = Fixed()
    mixed = query_vector(np.array([3.0, 0.0]), messages, fixed, 0.4)
    assert list(mixed) == pytest.approx([0.4, 0.6])
    # The latest user message comes first, apart: the embedder keeps its sum for the next request.
    assert fixed.parts == ["now the tests", 'looking\nread_file {"path": "a.py"}']
    assert list(query_vector(np.array([3.0, 0.0]), messages, Fixed(), 0.0)) == pytest.approx([0.0, 1.0])


def test_a_history_that_costs_exactly_the_budget_is_sent_whole(tmp_path):
    engine = Engine(tmp_path / "store")
    messages = [user("Refund ORD_0001"), assistant(None, call("c1", "lookup", {"id": "ORD_0001"})),
                tool("c1", "order ORD_0001: " + "item " * 200), assistant("Done.")]
    whole = engine.render("fit", messages, budget=100_000)
    cost = whole.history_tokens
    exact = engine.render("fit", messages, budget=cost)
    assert exact.history_tokens == cost and exact.omitted == 0 and exact.kept == whole.kept
    tighter = engine.render("fit", messages, budget=cost - 1)
    assert tighter.history_tokens <= cost - 1 and tighter.omitted + tighter.compacted >= 1


def test_a_continued_selection_starts_from_the_similarity_so_far():
    """`similar` gives each candidate's D at the start (fold_index_refill continues a selection):
    a candidate close to one picked before is penalised as if the selection had never stopped."""
    vectors = [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    fresh = select([1.0, 0.9, 0.7], costs=[5, 5, 5], remaining=5, vectors=vectors)
    assert [p.candidate for p in fresh.picks] == [0]
    # Continued after candidate 0: candidate 1 (the same vector) scores 0.9 - 0.5, under candidate 2's 0.7.
    n = 3
    continued = greedy_select(np.asarray([1.0, 0.9, 0.7]), np.asarray(vectors), [11, 5, 5], [0] * n, [-1] * n, 5, 0.5,
                              np.asarray(vectors) @ np.asarray(vectors)[0])
    assert [p.candidate for p in continued.picks] == [2]


def test_the_headroom_fades_further_beyond_headroom_far_times_b():
    from engine.score import headroom_share

    assert headroom_share(0.5, 1000, 800, 0.0) == 0.5
    assert headroom_share(0.5, 1000, 4000, 0.0) == 0.125
    # Off below `far` times B; beyond it a further far * B / full.
    assert headroom_share(0.5, 1000, 4000, 5.0) == 0.125
    assert headroom_share(0.5, 1000, 4000, 2.0) == 0.0625


def test_the_exchange_from_positions_is_the_latest_exchange():
    """exchange_parts (the render's f_t, from the positions of the user and assistant messages)
    is latest_exchange_parts, empty texts skipped for an earlier one, on every prefix."""
    from engine.score import exchange_parts, latest_exchange_parts

    messages = [
        {"role": "user", "content": "fix it"}, {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "assistant", "content": "looking", "tool_calls": [{"id": "a", "function": {"name": "read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x"}, {"role": "user", "content": ""},
        {"role": "assistant", "content": None}, {"role": "user", "content": [{"type": "text", "text": "now"}]},
    ]
    for end in range(len(messages) + 1):
        part = messages[:end]
        users = [e for e in range(end) if part[e]["role"] == "user"]
        assistants = [e for e in range(end) if part[e]["role"] == "assistant"]
        assert exchange_parts(part, reversed(users), reversed(assistants)) == latest_exchange_parts(part)


def test_greedy_select_is_the_plain_loop_of_a4_bit_for_bit():
    """greedy_select (its arrays written in place) against A.4 written plainly (every pick's cost
    with its wrapper, R = U - penalty * D, the first feasible maximum, D updated by the pick's
    cosines): the same picks, R, costs, final scores and costs, bit for bit, with exact ties,
    shared wrappers, a continued selection and float32 vectors."""

    def plain(worth, vectors, costs, wrapper, owners, remaining, penalty, similar=None):
        (costs, wrapper, owners) = (np.asarray(costs), np.asarray(wrapper), np.asarray(owners))
        similarity = np.zeros(len(costs)) if similar is None else np.asarray(similar, dtype=np.float64).copy()
        (taken, picks) = (np.zeros(len(costs), dtype=bool), [])
        while True:
            (cost, score) = (costs + wrapper, worth - penalty * similarity)
            feasible = ~taken & (cost <= remaining)
            if not feasible.any():
                return picks, [float(s) for s in score], [int(c) for c in cost], remaining
            best = int(np.argmax(np.where(feasible, score, -np.inf)))
            (taken[best], remaining) = (True, remaining - int(cost[best]))
            picks.append((best, float(score[best]), int(cost[best])))
            if owners[best] >= 0:
                wrapper[owners == owners[best]] = 0
            similarity = np.maximum(similarity, vectors @ vectors[best])

    rng = np.random.default_rng(3)
    for _ in range(400):
        n = int(rng.integers(1, 40))
        worth = rng.choice([0.5, 1.0, 1.25], n) if rng.random() < 0.3 else rng.uniform(0, 3, n)
        vectors = rng.standard_normal((n, 16)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        costs = rng.integers(1, 300, n).tolist()
        owners = rng.integers(-1, 5, n).tolist()
        wrapper = [4 if o >= 0 else 0 for o in owners]
        remaining = int(rng.integers(0, 3000))
        similar = rng.uniform(0, 1, n) if rng.random() < 0.3 else None
        got = greedy_select(worth, vectors, costs, wrapper, owners, remaining, 0.5, similar)
        expected = plain(worth, vectors, costs, list(wrapper), owners, remaining, 0.5, similar)
        assert ([(p.candidate, p.score, p.cost) for p in got.picks], got.final_score, got.final_cost, got.remaining) == expected


def test_a_selection_over_a_view_of_rows_is_the_one_over_their_copy():
    """A partial re-render's greedy reads its candidates' embeddings as a view of its base's rows
    (a suffix: the same rows in the same order), and greedy_select takes each similarity row with
    `dot`: a gemv's rows depend on the array it is given (the same row differs when computed in a
    matrix of other rows), but a suffix's view and its copy give the same bytes, and `dot` the
    same as `@`. Checked on random float32 embeddings, and on whole selections."""
    rng = np.random.default_rng(5)
    for _ in range(3000):
        (whole, dim) = (int(rng.integers(2, 400)), int(rng.choice([16, 64, 256])))
        matrix = rng.standard_normal((whole, dim)).astype(np.float32)
        matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
        candidates = np.sort(rng.choice(whole, int(rng.integers(1, whole + 1)), replace=False))
        rows = matrix[candidates]
        start = int(rng.integers(0, len(candidates)))
        (view, copy) = (rows[start:], matrix[candidates[start:]])
        pick = int(rng.integers(0, len(copy)))
        assert view.dot(view[pick]).tobytes() == (copy @ copy[pick]).tobytes()
        n = len(copy)
        (worth, costs) = (rng.uniform(0, 3, n), rng.integers(1, 300, n).tolist())
        owners = rng.integers(-1, 4, n).tolist()
        wrapper = [4 if o >= 0 else 0 for o in owners]
        remaining = int(rng.integers(0, 2000))
        (a, b) = (greedy_select(worth, view, costs, wrapper, owners, remaining, 0.5),
                  greedy_select(worth, copy, costs, wrapper, owners, remaining, 0.5))
        assert repr(([(p.candidate, p.score, p.cost) for p in a.picks], a.final_score, a.final_cost, a.remaining)) == \
            repr(([(p.candidate, p.score, p.cost) for p in b.picks], b.final_score, b.final_cost, b.remaining))
