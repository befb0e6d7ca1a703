"""serve-search's request reading (sgl_tts.serving.api) and choice ranking, without a server."""

from __future__ import annotations

import pytest

from sgl_tts.search import SearchResult, Trajectory
from sgl_tts.serving.api import APIError, Defaults, Limits, parse_request, question_of
from sgl_tts.serving.service import rank_choices

Q = [{"role": "user", "content": "Compute ((12+7)*3)-5."}]


def refused(body, limits=Limits()) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(body, limits)
    return info.value


def test_a_plain_request_gets_the_servers_defaults_and_the_program_named_by_the_model():
    req = parse_request({"model": "dvts", "messages": Q}, defaults=Defaults(n=8, beam_width=2, seed=5))
    c = req.config
    assert (c.program, c.n, c.beam_width, c.seed, c.temperature) == ("dvts", 8, 2, 5, 0.8)
    assert (req.question, req.choices, req.stream, req.include_usage, req.model) == \
           ("Compute ((12+7)*3)-5.", 1, False, False, "dvts")
    assert c.progress is False


def test_model_suffix_and_extra_body_set_the_budget_and_width():
    c = parse_request({"model": "beam_search:16x4", "messages": Q}).config
    assert (c.n, c.beam_width) == (16, 4)
    c = parse_request({"model": "best_of_n:8", "messages": Q}).config
    assert (c.program, c.n) == ("best_of_n", 8)
    c = parse_request({"model": "beam_search", "messages": Q, "budget": 12, "beam_width": 3, "max_depth": 9,
                       "step_tokens": [32, 16], "aggregation": "min", "seed": 7, "temperature": 0.5}).config
    assert (c.n, c.beam_width, c.max_depth, c.step_tokens, c.aggregation, c.seed, c.temperature) == \
           (12, 3, 9, [32, 16], "min", 7, 0.5)
    c = parse_request({"model": "mcts:6x2", "messages": Q, "threshold": 0.95, "negative_exit": True,
                       "aggregation": "min", "parallel": 2}).config
    assert (c.program, c.n, c.beam_width, c.threshold, c.negative_exit, c.parallel) == ("mcts", 6, 2, 0.95, True, 2)


def test_openai_fields_n_max_tokens_and_stream_options():
    req = parse_request({"model": "best_of_n:8", "messages": Q, "n": 3, "max_tokens": 40, "stream": True,
                         "stream_options": {"include_usage": True}, "user": "u1"})
    assert (req.choices, req.config.max_tokens, req.stream, req.include_usage) == (3, 40, True, True)
    assert parse_request({"model": "best_of_n", "messages": Q, "max_completion_tokens": 30}).config.max_tokens == 30


@pytest.mark.parametrize("body, status, param, words", [
    ({"messages": Q}, 400, "model", "'model' is required"),
    ({"model": "gpt-4o", "messages": Q}, 404, "model", "unknown model 'gpt-4o'"),
    ({"model": "beam_search:x4", "messages": Q}, 404, "model", "unknown model"),
    ({"model": "beam_search"}, 400, "messages", "non-empty list"),
    ({"model": "beam_search", "messages": []}, 400, "messages", "non-empty list"),
    ({"model": "beam_search", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages", "role 'tool'"),
    ({"model": "beam_search", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     400, "messages", "last message must be the user's"),
    ({"model": "beam_search", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages",
     "only text"),
    ({"model": "beam_search", "messages": Q, "budget": 0}, 400, "budget", "at least 1, got 0"),
    ({"model": "beam_search", "messages": Q, "budget": -3}, 400, "budget", "at least 1"),
    ({"model": "beam_search", "messages": Q, "budget": 65}, 400, "budget", "limit of 64 (--max-budget)"),
    ({"model": "beam_search:128", "messages": Q}, 400, "budget", "limit of 64"),
    ({"model": "beam_search:16", "messages": Q, "budget": 8}, 400, "budget", "sets budget 16 but the body sets 8"),
    ({"model": "beam_search", "messages": Q, "budget": "8"}, 400, "budget", "must be an integer"),
    ({"model": "beam_search", "messages": Q, "max_depth": 41}, 400, "max_depth", "limit of 40"),
    ({"model": "beam_search", "messages": Q, "step_tokens": 513}, 400, "step_tokens", "limit of 512"),
    ({"model": "beam_search", "messages": Q, "step_tokens": [8, 0]}, 400, "step_tokens", "positive integer"),
    ({"model": "beam_search", "messages": Q, "n": 0}, 400, "n", "at least 1, got 0"),
    ({"model": "beam_search:4", "messages": Q, "n": 5}, 400, "n", "limit of 4"),
    ({"model": "beam_search", "messages": Q, "max_tokens": 50}, 400, "max_tokens", "set 'step_tokens'"),
    ({"model": "beam_search", "messages": Q, "temperature": 3}, 400, "temperature", "from 0 to 2"),
    ({"model": "beam_search", "messages": Q, "seed": 1.5}, 400, "seed", "must be an integer"),
    ({"model": "beam_search", "messages": Q, "stream": "yes"}, 400, "stream", "true or false"),
    ({"model": "beam_search", "messages": Q, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "needs stream: true"),
    ({"model": "beam_search", "messages": Q, "tools": []}, 400, "tools", "unsupported field 'tools'"),
    ({"model": "beam_search", "messages": Q, "aggregation": "max"}, 400, None, "unknown aggregation 'max'"),
    ({"model": "dvts:2x4", "messages": Q}, 400, None, "DVTS needs N >= M"),
    ({"model": "beam_search", "messages": Q, "negative_exit": True}, 400, None, "settings of program mcts"),
])
def test_bad_requests_are_refused_with_a_status_the_field_and_a_clear_message(body, status, param, words):
    err = refused(body)
    assert err.status == status and err.param == param and words in err.message, err.body()
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_limits_come_from_the_server():
    assert refused({"model": "best_of_n", "messages": Q, "budget": 9}, Limits(max_budget=8)).code == "limit_exceeded"
    assert parse_request({"model": "best_of_n", "messages": Q, "budget": 9, "n": 2}, Limits(max_budget=9)).choices == 2


def test_the_question_is_the_conversation_in_order():
    assert question_of(Q) == "Compute ((12+7)*3)-5."
    assert question_of([{"role": "system", "content": "Be exact."},
                        {"role": "user", "content": [{"type": "text", "text": "Compute "},
                                                     {"type": "text", "text": "((1+2)*3)-4."}]}]) == \
        "Be exact.\n\nCompute ((1+2)*3)-4."


def traj(text: str, score: float, answer: str | None, finished: bool = True) -> Trajectory:
    return Trajectory(steps=text.split("\n\n"), step_scores=[score], score=score, answer=answer, tokens=3,
                      finished=finished)


def test_choices_are_the_picked_answers_best_trajectory_then_the_rest_by_score_without_repeats():
    ts = [traj("a\n\n1", 0.9, "1"), traj("b\n\n2", 0.5, "2"), traj("c\n\n2", 0.6, "2"),
          traj("a\n\n1", 0.9, "1"), traj("d\n\n3", 0.7, "3", finished=False)]
    # the pick (a vote, say) is "2": its best trajectory (0.6) comes first, then 0.9, 0.7, 0.5
    res = SearchResult("2", {"majority": "2"}, ts, 15, 0.1)
    got = rank_choices(res, 10)
    assert [(c.text, c.score, c.finished) for c in got] == [
        ("c\n\n2", 0.6, True), ("a\n\n1", 0.9, True), ("d\n\n3", 0.7, False), ("b\n\n2", 0.5, True)]
    assert [c.text for c in rank_choices(res, 2)] == ["c\n\n2", "a\n\n1"]
    # a pick no trajectory carries (none finished): best score first
    assert rank_choices(SearchResult(None, {}, ts, 15, 0.1), 1)[0].text == "a\n\n1"
