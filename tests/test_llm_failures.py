"""LLM replies and failures (issue 11, class 9): query checks, the failure-rate threshold, retrying failed items on
a re-run, capped and logged Retry-After waits, and finished outputs that a failing re-run never removes.

Everything runs against the fake OpenAI-compatible server on 127.0.0.1; retry waits go to an injected sleep.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from robustir.errors import ConfigError, EndpointError, RobustIRError
from robustir.filtering.llm_judge import JudgeConfig, judge_negatives, parse_yes_no
from robustir.llm import LLMCache, LLMClient, LLMConfig, LLMStageConfig
from robustir.outputs import StageOutput
from robustir.queries.generate import (DEFAULT_TEMPLATE_EN, DEFAULT_TEMPLATE_ZH, GenerateConfig, check_query,
                                      generate_queries, render_template, select_queries)

from fake_llm_server import FakeLLMServer, read_lines, write_passages as _write_passages, last_user  # noqa: E402

REFUSAL = "Sorry, I cannot help with that."


def make_client(server: FakeLLMServer, **overrides) -> LLMClient:
    settings = dict(base_url=server.url, model="fake-model", timeout_s=5.0, max_retries=0, concurrency=2)
    cache_path = overrides.pop("cache_path", None)
    sleep = overrides.pop("sleep", None)
    settings.update(overrides)
    return LLMClient(LLMConfig(**settings), cache=LLMCache(cache_path) if cache_path else None,
                     sleep=sleep or (lambda seconds: None))


def write_passages(path: Path, n: int, *, chinese: int = 0) -> Path:
    return _write_passages(path, n, chinese=chinese, text="Passage number {i} is about topic {i}.", title="")


def number_of(prompt: str) -> str:
    return prompt.split("Passage number ")[1].split(" ")[0]


def good_reply(messages) -> str:
    n = number_of(last_user(messages))
    return f"1. What is topic {n} about?\n2. Where is topic {n} described?"


# ----------------------------------------------------------------------------------------- check_query rules

INSTRUCTION = render_template(DEFAULT_TEMPLATE_EN, {"title": "", "text": "", "n": 3})


@pytest.mark.parametrize("text", [
    REFUSAL, "I'm sorry, but I can't generate questions for this passage.", "I am sorry", "My apologies.",
    "I apologize, the passage is unclear.", "As an AI language model, I do not browse the web.",
    "I cannot help with that", "I can't.", "I'm unable to provide questions for this text.",
    "We won't create such content.", "Unfortunately, the passage has no facts.",
    "I don't have enough information to write questions.", "The text does not contain enough detail.",
    "No questions can be written from this passage.",
    "抱歉，我无法回答这个问题。", "作为一个AI，我不能提供这些内容。", "我无法生成问题",
    "“I’m sorry, I can’t help with that.”",  # curly quotes and apostrophes
])
def test_refusals_are_rejected(text):
    assert check_query(text) == "refusal"


@pytest.mark.parametrize("text", [
    "Here are three questions about photosynthesis", "Here's a question: what is X?", "Sure, what is X?",
    "Certainly! What is the capital of France?", "Of course. Who wrote it?", "Okay, here you go",
    "Great question, really", "Based on the passage, what is X?", "The passage discusses the French revolution",
    "Hope this helps!", "以下是三个问题", "好的，这是问题", "根据文本，北京在哪里？",
])
def test_answer_boilerplate_is_rejected(text):
    assert check_query(text) == "answer boilerplate"


@pytest.mark.parametrize("text, reason", [
    ("", "empty"), ('""', "empty"), ("?!", "empty"), ("photosynthesis", "too short"), ("是", "too short"),
    (" ".join(["word"] * 65), "too long"), ("x" * 301 + " y", "too long"),
    ("The capital of France is Paris. It is known for the Eiffel Tower.", "multi-sentence answer"),
    ("What causes rain? Clouds form. Water falls.", "multi-sentence answer"),
    ("北京是中国的首都。它有很多名胜古迹。", "multi-sentence answer"),
    ("Passage number 3 is about topic 3.", "echoes the passage"),
    ("Write 3 different questions that a person might type into a search engine", "echoes the prompt"),
    ("Each question must be answerable from the passage.", "echoes the prompt"),
])
def test_non_queries_are_rejected(text, reason):
    assert check_query(text, passage="Passage number 3 is about topic 3.", instruction=INSTRUCTION) == reason


@pytest.mark.parametrize("text", [
    "python list comprehension", "best pizza near Berlin", "What is U.S. GDP growth in 2020?",
    "Apple vs. Samsung: which phone is better?", "Dr. Smith's theory of relativity explained",
    "I have a Mac. How do I install Python?", "I can't log in to my gmail account", "sorry seems to be the hardest word",
    "Sure Start children's centres funding", "OK Google commands list", "search engine ranking",
    "北京", "北京的历史有多长？", "北京 历史 名胜", "我不能登录微信怎么办", "東京タワーの高さは何メートルですか",
    "서울의 인구는 얼마입니까?", "Wie hoch ist der Eiffelturm?", "¿Cuál es la capital de Francia?",
    "Query: \"What is topic 3 about?\"", "1. What is topic 3 about?",
])
def test_valid_queries_in_any_language_are_accepted(text):
    assert check_query(text, passage="Passage number 3 is about topic 3.", instruction=INSTRUCTION) is None


def test_limits_are_configurable_and_checked():
    assert check_query("photosynthesis", min_words=1) is None
    assert check_query("one two three four", max_words=3) == "too long"
    with pytest.raises(ConfigError, match="max_query_words"):
        GenerateConfig(max_query_words=1, min_query_words=2)
    with pytest.raises(ConfigError, match="max_failure_rate"):
        GenerateConfig(max_failure_rate=1.5)
    with pytest.raises(ConfigError, match="max_failure_rate"):
        LLMStageConfig(max_failure_rate=-0.1)
    with pytest.raises(ConfigError, match="max_failure_rate"):
        JudgeConfig(max_failure_rate=2)
    with pytest.raises(ConfigError, match="max_retry_wait"):
        LLMConfig(max_retry_wait=0)


def test_select_queries_counts_each_rejection_and_keeps_the_good_ones():
    reply = ("Here are the questions:\n1. What is topic 3 about?\n2. As an AI, I cannot know.\n3. "
             + " ".join(["long"] * 70) + "\n4. Where is topic 3 described?")
    accepted, rejected = select_queries(reply, passage="Passage number 3 is about topic 3.", num_queries=3)
    assert accepted == ["What is topic 3 about?", "Where is topic 3 described?"]
    assert Counter(rejected) == {"refusal": 1, "too long": 1}
    assert select_queries(REFUSAL) == ([], ["refusal"])
    assert select_queries("I am sorry, I cannot help with that:") == ([], ["refusal"])  # a "preamble" line only
    assert select_queries("<think>only thoughts</think>") == ([], ["empty"])


@pytest.mark.parametrize("reply", ["Maybe", "Maybe yes", "Not sure", "probably relevant", "可能相关",
                                   "The passage covers the history of the city, its people, its food and many other "
                                   "things that a reader might find interesting or related in some way or another."])
def test_judge_replies_that_are_neither_yes_nor_no_are_not_guessed(reply):
    assert parse_yes_no(reply) is None


@pytest.mark.parametrize("reply, verdict", [
    ("No, because the passage talks about the history of the city, its people, its food and other things that do "
     "not answer the query at all.", False),
    ("The passage covers the history of the city, its people, its food and many other things a reader might find "
     "interesting. Final answer: **Yes**", True),
])
def test_judge_essays_count_only_with_an_explicit_verdict(reply, verdict):
    assert parse_yes_no(reply) is verdict


# ------------------------------------------------------------------------------------- generate: rejections


def test_refusals_are_failed_items_counted_per_reason(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 6)
    out = tmp_path / "train.jsonl"
    refusing = {"1", "4"}

    def reply(messages):
        n = number_of(last_user(messages))
        return REFUSAL if n in refusing else good_reply(messages)

    with FakeLLMServer(reply) as server:
        client = make_client(server, cache_path=tmp_path / "cache.sqlite", on_failure="skip")
        report = generate_queries(passages, out, client, num_queries=2, progress=False)
        client.close()
        assert {r["pos_id"] for r in read_lines(out)} == {"p0", "p2", "p3", "p5"}
        assert REFUSAL not in {r["query"] for r in read_lines(out)}
        assert (report.failed, report.rejected) == (2, 2)
        assert report.failed_reasons == {"no usable query": 2} and report.rejected_reasons == {"refusal": 2}
        assert "2 failed (2 no usable query), 2 queries rejected (2 refusal)" in report.summary()
        failed = read_lines(tmp_path / "train.jsonl.failed.jsonl")
        assert [f["_id"] for f in failed] == ["p1", "p4"] and "refusal" in failed[0]["error"]
        saved = json.loads((tmp_path / "train.jsonl.report.json").read_text())
        assert saved["rejected_reasons"] == {"refusal": 2}
        assert not StageOutput(out, reports=True).complete()  # failed items remain

        refusing.clear()  # the model answers now: the re-run asks again for the refused passages only
        before = server.count
        report = generate_queries(passages, out, make_client(server, cache_path=tmp_path / "cache.sqlite"),
                                  num_queries=2, progress=False)
        assert server.count - before == 2 and report.generated == 2 and report.failed == 0
    assert Counter(r["pos_id"] for r in read_lines(out)) == {f"p{i}": 2 for i in range(6)}
    assert StageOutput(out, reports=True).complete()


def test_non_queries_are_rejected_and_valid_keyword_and_cjk_queries_kept(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 2, chinese=2)
    out = tmp_path / "train.jsonl"

    def reply(messages):
        prompt = last_user(messages)
        if "下面是一段文本" in prompt:
            return "1. 北京 历史\n2. 北京是中国的首都。它有很多名胜古迹。\n3. 故宫在哪里"
        n = number_of(prompt)
        return (f"1. topic {n} overview\n2. The topic is old. It was first described long ago.\n"
                f"3. Passage number {n} is about topic {n}.\n4. photosynthesis")

    with FakeLLMServer(reply) as server:
        client = make_client(server)
        report = generate_queries(passages, out, client, num_queries=3, progress=False)
        client.close()
    queries = {r["pos_id"]: [] for r in read_lines(out)}
    for r in read_lines(out):
        queries[r["pos_id"]].append(r["query"])
    assert queries == {"p0": ["topic 0 overview"], "p1": ["topic 1 overview"],
                       "zh0": ["北京 历史", "故宫在哪里"], "zh1": ["北京 历史", "故宫在哪里"]}
    assert report.failed == 0 and report.rejected_reasons == {"multi-sentence answer": 4, "echoes the passage": 2,
                                                             "too short": 2}


# ----------------------------------------------------------------------------------- failure-rate threshold


def test_every_request_failing_under_skip_fails_the_stage_and_leaves_it_unfinished(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 5)
    out = tmp_path / "train.jsonl"
    with FakeLLMServer(lambda m: {"status": 500}) as server:
        client = make_client(server, on_failure="skip")
        with pytest.raises(EndpointError) as info:
            generate_queries(passages, out, client, progress=False)
        client.close()
    message = str(info.value)
    assert "5 of 5 passages failed (100%, more than max_failure_rate=0.5)" in message
    assert "commonest error (5x)" in message and "HTTP 500" in message
    assert "raise max_failure_rate" in message and "check the endpoint and model" in message and server.url in message
    assert not out.exists() and not (tmp_path / "train.jsonl.report.json").exists()
    assert not StageOutput(out, reports=True).complete()
    assert len(read_lines(tmp_path / "train.jsonl.failed.jsonl")) == 5


def test_threshold_stops_early_and_keeps_finished_items_for_resume(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 80)
    out, cache = tmp_path / "train.jsonl", tmp_path / "cache.sqlite"
    down = {"on": True}

    def reply(messages):
        n = int(number_of(last_user(messages)))
        return {"status": 503} if down["on"] and n >= 10 else good_reply(messages)

    with FakeLLMServer(reply) as server:
        client = make_client(server, cache_path=cache, on_failure="skip", max_consecutive_failures=0, concurrency=1)
        with pytest.raises(EndpointError, match=r"stopped after \d+ tried in this run"):
            generate_queries(passages, out, client, num_queries=2, progress=False, max_failure_rate=0.3)
        client.close()
        assert server.count < 80  # stopped early, not after every passage
        partial = read_lines(tmp_path / "train.jsonl.partial")
        assert {r["pos_id"] for r in partial} == {f"p{i}" for i in range(10)}  # finished passages are kept
        assert not out.exists()

        down["on"] = False
        asked_before = Counter(number_of(p) for p in server.prompts())
        client = make_client(server, cache_path=cache, on_failure="skip")
        report = generate_queries(passages, out, client, num_queries=2, progress=False, max_failure_rate=0.3)
        client.close()
    assert report.failed == 0 and report.resumed >= 9
    assert Counter(r["pos_id"] for r in read_lines(out)) == {f"p{i}": 2 for i in range(80)}
    asked = Counter(number_of(p) for p in server.prompts())
    assert all(asked[str(i)] == asked_before[str(i)] for i in range(9))  # finished passages were not asked again


def test_failures_under_the_threshold_finish_the_run(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 4)
    out = tmp_path / "train.jsonl"
    with FakeLLMServer(lambda m: {"status": 500} if "number 0 " in last_user(m) else good_reply(m)) as server:
        report = generate_queries(passages, out, make_client(server, on_failure="skip"), progress=False)
        with pytest.raises(EndpointError, match="1 of 4 passages failed"):
            generate_queries(passages, tmp_path / "strict.jsonl", make_client(server, on_failure="skip"),
                             progress=False, max_failure_rate=0.0)
    assert report.failed == 1 and out.exists() and (tmp_path / "train.jsonl.report.json").exists()
    assert StageOutput(out, reports=True).problems() == [
        "has failed items to retry (train.jsonl.failed.jsonl; re-run the stage, or merge with --allow-failures)"]


def test_cli_generate_threshold_is_one_line_exit_2_and_summary_shows_rejections(tmp_path, capsys):
    from robustir.cli.main import main

    passages = write_passages(tmp_path / "corpus.jsonl", 4)
    args = ["generate", "--input", str(passages), "--output", str(tmp_path / "q.jsonl"), "--model", "fake-model",
            "--no-progress", "--max-retries", "0"]
    with FakeLLMServer(lambda m: REFUSAL) as server:
        assert main(args + ["--base-url", server.url, "--max-failure-rate", "1"]) == 0
        assert "4 queries rejected (4 refusal)" in capsys.readouterr().out
        assert main(args + ["--base-url", server.url]) == 2  # default 0.5: every passage refused again
    err = capsys.readouterr().err
    assert "robustir generate: error:" in err and "4 of 4 passages failed" in err and "Traceback" not in err
    assert (tmp_path / "q.jsonl").exists()  # the finished (empty) output of the first run is still there


# ------------------------------------------------------------------------------------ judge: retry on re-run


def judge_input(path: Path, n: int = 6) -> Path:
    records = [{"query": f"query {i}", "pos": [f"pos {i}"], "neg": [f"neg {i}a", f"neg {i}b RELEVANT"],
                "neg_scores": [0.5, 0.4]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_judge_records_failed_judgements_and_retries_them_on_re_run(tmp_path, capsys):
    from robustir.cli.main import main

    source = judge_input(tmp_path / "mined.jsonl")
    out = tmp_path / "clean.jsonl"
    broken = {"1": "Maybe", "4": {"status": 500}}  # query number -> reply for its RELEVANT negative

    def reply(messages):
        prompt = last_user(messages)
        number = prompt.split("Query: query ")[1].split("\n")[0]
        if "RELEVANT" in prompt:
            return broken.get(number, "Yes")
        return "No"

    with FakeLLMServer(reply) as server:
        args = ["filter", "--method", "llm", "--input", str(source), "--output", str(out), "--base-url", server.url,
                "--model", "fake-model", "--no-progress", "llm.on_failure=skip", "llm.max_retries=0"]
        assert main(args) == 0
        printed = capsys.readouterr().out
        assert "2 failed judgements: 1 request failed, 1 unparseable reply" in printed
        assert "2 record(s) with failed judgements" in printed
        rows = read_lines(out)
        assert rows[1]["neg"] == ["neg 1a", "neg 1b RELEVANT"] and rows[4]["neg_scores"] == [0.5, 0.4]  # kept for now
        failed = read_lines(tmp_path / "clean.jsonl.failed.jsonl")
        assert [(f["record"], f["query"]) for f in failed] == [(1, "query 1"), (4, "query 4")]
        assert [n["reason"] for f in failed for n in f["negatives"]] == ["unparseable reply", "request failed"]
        assert not StageOutput(out, reports=True).complete()
        assert server.count == 12

        broken.clear()  # the endpoint behaves: the re-run judges records 1 and 4 again, not "already complete"
        assert main(args) == 0
        printed = capsys.readouterr().out
        assert "is complete; nothing to do" not in printed and "0 failed judgements" in printed
        assert server.count == 12 + 2  # only the two failed judgements were asked again (the rest: cache)
        rows = read_lines(out)
        assert all(r["neg"] == [f"neg {i}a"] and r["neg_scores"] == [0.5] for i, r in enumerate(rows))
        assert not (tmp_path / "clean.jsonl.failed.jsonl").exists()
        assert StageOutput(out, reports=True).complete()

        assert main(args) == 0  # now it is complete
        assert "is complete; nothing to do" in capsys.readouterr().out and server.count == 14


def test_judge_retry_refuses_a_changed_input(tmp_path):
    source = judge_input(tmp_path / "mined.jsonl")
    out = tmp_path / "clean.jsonl"
    with FakeLLMServer(lambda m: "Maybe" if "query 2" in last_user(m) else "No") as server:
        judge_negatives(source, out, make_client(server, on_failure="skip"), progress=False)
        lines = source.read_text().splitlines()
        lines[2] = lines[2].replace("query 2", "another query")
        source.write_text("\n".join(lines) + "\n")
        with pytest.raises(ConfigError, match="the input changed since the last run"):
            judge_negatives(source, out, make_client(server, on_failure="skip"), progress=False)


def test_judge_threshold_fails_the_stage(tmp_path):
    source = judge_input(tmp_path / "mined.jsonl", n=3)
    out = tmp_path / "clean.jsonl"
    with FakeLLMServer(lambda m: "I would need more context to say.") as server:
        with pytest.raises(EndpointError) as info:
            judge_negatives(source, out, make_client(server, on_failure="skip"), progress=False)
    assert "llm judge: 6 of 6 judgements failed" in str(info.value)
    assert "unparseable reply (neither yes nor no)" in str(info.value)
    assert not out.exists() and not StageOutput(out, reports=True).complete()


# ------------------------------------------------------------------------------------ Retry-After: cap + log


def test_long_retry_after_is_capped_and_logged_and_a_too_long_one_is_not_retried(caplog):
    waits: list[float] = []
    caplog.set_level(logging.DEBUG, logger="robustir.llm")
    with FakeLLMServer() as server:
        server.script({"status": 429, "headers": {"Retry-After": "90"}},
                      {"status": 503, "headers": {"Retry-After": "0.25"}})
        client = make_client(server, max_retries=5, max_retry_wait=30, sleep=waits.append)
        assert client.complete(["hello"])[0].startswith("1. What is")
        assert waits == [30.0, 0.25] and server.count == 3
        # More than the openai client ever waits (2 minutes): it does not retry, and the error says so.
        server.script({"status": 429, "headers": {"Retry-After": "3600"}})
        with pytest.raises(EndpointError) as info:
            client.complete(["again"])
        client.close()
    assert waits == [30.0, 0.25] and server.count == 4
    assert "gave up after 1 attempt(s)" in str(info.value) and "asked to wait 3600s" in str(info.value)
    assert "it was not retried" in str(info.value)
    info = [r.getMessage() for r in caplog.records if r.name == "robustir.llm" and r.levelno == logging.INFO]
    assert len(info) == 1  # the 0.25 s wait is logged at DEBUG only
    assert info[0].startswith(f"waiting 30 s before retry 1/5 of {server.url}/chat/completions: HTTP 429, server "
                              f"said Retry-After 90 (capped at max_wait: llm.max_retry_wait=30)")
    assert "far longer than the cap" in info[0]


def test_max_retry_wait_is_a_config_field_and_backoff_is_capped_too(caplog, monkeypatch):
    import openai._base_client

    monkeypatch.setattr(openai._base_client, "random", lambda: 0.0)  # the openai client's backoff jitter: none
    waits: list[float] = []
    caplog.set_level(logging.INFO, logger="robustir.llm")
    with FakeLLMServer(retry_after_ms=None) as server:  # no Retry-After: exponential backoff
        server.script({"status": 500}, {"status": 500}, {"status": 500}, {"status": 429, "headers": {"Retry-After": "7"}})
        client = make_client(server, max_retries=4, max_retry_wait=1.5, sleep=waits.append)
        assert client.complete(["hello"])[0]
        client.close()
    assert waits == [0.5, 1.0, 1.5, 1.5]
    info = [r.getMessage() for r in caplog.records if r.name == "robustir.llm" and r.levelno == logging.INFO]
    endpoint = f"{server.url}/chat/completions"
    assert [m.split(": ")[0] for m in info] == [f"waiting 1 s before retry 2/4 of {endpoint}",
                                                f"waiting 1.5 s before retry 3/4 of {endpoint}",
                                                f"waiting 1.5 s before retry 4/4 of {endpoint}"]
    assert "HTTP 500 (backoff)" in info[0] and "Retry-After 7 (capped at max_wait" in info[2]
    assert "far longer" in info[2]  # 7 s is more than twice the 1.5 s cap


# ------------------------------------------------------------------- finished outputs survive failing re-runs


def test_failing_generate_re_run_never_removes_the_finished_output(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 6)
    out, cache = tmp_path / "train.jsonl", tmp_path / "cache.sqlite"
    state = {"mode": "refuse p2"}

    def reply(messages):
        if state["mode"] == "down":
            return {"status": 500}
        if state["mode"] == "refuse p2" and number_of(last_user(messages)) == "2":
            return REFUSAL
        return good_reply(messages)

    with FakeLLMServer(reply) as server:
        generate_queries(passages, out, make_client(server, cache_path=cache, on_failure="skip"), num_queries=2,
                         progress=False)
        finished = out.read_bytes()
        assert (tmp_path / "train.jsonl.failed.jsonl").exists()

        state["mode"] = "down"
        with pytest.raises(EndpointError, match="HTTP 500"):  # on_failure: raise
            generate_queries(passages, out, make_client(server, cache_path=cache), num_queries=2, progress=False)
        assert out.read_bytes() == finished and not (tmp_path / "train.jsonl.partial").exists()
        assert not StageOutput(out, reports=True).complete()  # p2 is still listed as failed
        assert [f["_id"] for f in read_lines(tmp_path / "train.jsonl.failed.jsonl")] == ["p2"]
        with pytest.raises(EndpointError, match="max_failure_rate"):  # on_failure: skip, over the threshold
            generate_queries(passages, out, make_client(server, cache_path=cache, on_failure="skip"), num_queries=2,
                             progress=False, max_failure_rate=0.1)
        assert out.read_bytes() == finished and not (tmp_path / "train.jsonl.partial").exists()
        assert not StageOutput(out, reports=True).complete()

        state["mode"] = "ok"
        report = generate_queries(passages, out, make_client(server, cache_path=cache), num_queries=2,
                                  progress=False)
    assert report.generated == 1 and report.resumed == 5
    rows = read_lines(out)
    assert out.read_bytes().startswith(finished) and {r["pos_id"] for r in rows} == {f"p{i}" for i in range(6)}
    assert not (tmp_path / "train.jsonl.failed.jsonl").exists()


def test_complete_generate_output_with_a_dead_endpoint_stays_identical(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 3)
    out = tmp_path / "train.jsonl"
    with FakeLLMServer(good_reply) as server:
        generate_queries(passages, out, make_client(server), progress=False)  # no cache: nothing to fall back on
    finished = out.read_bytes()
    with FakeLLMServer(lambda m: {"status": 500}) as server:
        report = generate_queries(passages, out, make_client(server), progress=False)
        assert server.count == 0  # a finished output's passages are all done: nothing to ask
    assert out.read_bytes() == finished and report.resumed == 3 and report.generated == 0
    assert StageOutput(out, reports=True).complete()


def test_failing_judge_re_run_never_removes_the_finished_output(tmp_path):
    source = judge_input(tmp_path / "mined.jsonl")
    out, cache = tmp_path / "clean.jsonl", tmp_path / "cache.sqlite"
    state = {"mode": "maybe"}

    def reply(messages):
        prompt = last_user(messages)
        if state["mode"] == "down":
            return {"status": 500}
        if state["mode"] == "maybe" and "query 3" in prompt:
            return "Maybe"
        return "Yes" if "RELEVANT" in prompt else "No"

    with FakeLLMServer(reply) as server:
        judge_negatives(source, out, make_client(server, cache_path=cache, on_failure="skip"), progress=False)
        finished = out.read_bytes()
        state["mode"] = "down"
        with pytest.raises(RobustIRError):
            judge_negatives(source, out, make_client(server, cache_path=cache), progress=False)
        assert out.read_bytes() == finished and not (tmp_path / "clean.jsonl.partial").exists()
        assert (tmp_path / "clean.jsonl.failed.jsonl").exists()  # still to retry

        state["mode"] = "ok"
        report = judge_negatives(source, out, make_client(server, cache_path=cache), progress=False)
    assert report.failed == 0 and report.resumed == 5 and report.records_judged == 1
    rows = read_lines(out)
    assert rows[3]["neg"] == ["neg 3a"] and all(r["neg"] == [f"neg {i}a"] for i, r in enumerate(rows))
    assert not (tmp_path / "clean.jsonl.failed.jsonl").exists()


def test_zh_template_instruction_echo_is_rejected():
    instruction = render_template(DEFAULT_TEMPLATE_ZH, {"title": "", "text": "", "n": 3})
    assert check_query("每个问题都必须能根据这段文本回答。", instruction=instruction) == "echoes the prompt"
    assert check_query("北京的历史有多长？", instruction=instruction) is None


# ------------------------------------------------------------------------ issue 34: no stale output from LLM stages

def test_generate_with_another_model_or_prompt_is_refused_not_kept(tmp_path, capsys):
    """Issue 34: generate run again over the same output with another --model printed '0 passages done now (6
    earlier)', sent 0 requests and kept the first model's queries. A setting that matters is now refused naming it;
    --overwrite redoes; an operational setting (concurrency, timeout) reuses the output."""
    from robustir.cli.main import main

    passages = write_passages(tmp_path / "corpus.jsonl", 4)
    out = tmp_path / "q.jsonl"
    template = tmp_path / "t.txt"
    template.write_text("Write {n} questions about: {title} {text}")
    with FakeLLMServer(good_reply) as server:
        args = ["generate", "--input", str(passages), "--output", str(out), "--base-url", server.url, "--no-progress"]
        assert main(args + ["--model", "model-a"]) == 0
        first = out.read_text()
        capsys.readouterr()
        for change, named in ((["--model", "model-b"], "llm.model: \"model-a\" -> \"model-b\""),
                              (["--model", "model-a", "--temperature", "0.1"], "llm.temperature: 0.7 -> 0.1"),
                              (["--model", "model-a", "--prompt-template", str(template)], "prompt_template")):
            assert main(args + change) == 2, change
            err = capsys.readouterr().err
            assert named in err and "--overwrite" in err and "Traceback" not in err, err
            assert out.read_text() == first
        requests = server.count
        assert main(args + ["--model", "model-a", "--concurrency", "2", "--timeout", "30"]) == 0  # operational
        assert server.count == requests and out.read_text() == first
        template_run = args + ["--model", "model-a", "--prompt-template", str(template), "--overwrite"]
        assert main(template_run) == 0 and server.count == requests + 4
        template.write_text("Ask {n} questions on: {title} {text}")  # the template's content changed, not its path
        assert main(template_run[:-1]) == 2
        assert "prompt_template" in capsys.readouterr().err


def test_filter_llm_with_another_judge_is_refused_not_complete(tmp_path, capsys):
    """Issue 34: filter --method llm with another judge said 'complete; nothing to do'."""
    from robustir.cli.main import main

    source = judge_input(tmp_path / "mined.jsonl")
    out = tmp_path / "clean.jsonl"
    with FakeLLMServer(lambda m: "Yes" if "RELEVANT" in last_user(m) else "No") as server:
        args = ["filter", "--method", "llm", "--input", str(source), "--output", str(out), "--base-url", server.url,
                "--no-progress"]
        assert main(args + ["--model", "judge-a"]) == 0
        assert main(args + ["--model", "judge-a"]) == 0
        assert "is complete; nothing to do" in capsys.readouterr().out
        assert main(args + ["--model", "judge-b"]) == 2
        err = capsys.readouterr().err
        assert "llm.model: \"judge-a\" -> \"judge-b\"" in err and "--overwrite" in err
        count = server.count
        assert main(args + ["--model", "judge-b", "--overwrite"]) == 0 and server.count > count
