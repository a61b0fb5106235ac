"""LLM client, query generation and LLM judge, against a fake OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path

import pytest

from robustir.errors import EndpointError
from robustir.data.cjk import cjk_share
from robustir.queries.generate import (DEFAULT_TEMPLATE_EN, generate_queries, parse_questions,
                                      render_template)
from robustir.llm import LLMCache, LLMClient, LLMConfig, RateLimiter, strip_reasoning
from robustir.filtering.llm_judge import judge_negatives, parse_yes_no

from fake_llm_server import FakeLLMServer, read_lines, write_passages, last_user  # noqa: E402


def make_client(server: FakeLLMServer, **overrides) -> LLMClient:
    settings = dict(base_url=server.url if server is not None else None, model="fake-model", timeout_s=5.0, max_retries=3, concurrency=4)
    cache_path = overrides.pop("cache_path", None)
    sleep = overrides.pop("sleep", None)
    settings.update(overrides)
    return LLMClient(LLMConfig(**settings), cache=LLMCache(cache_path) if cache_path else None, sleep=sleep)


def passage_of(prompt: str) -> str:
    return prompt.split("Passage number ")[1].split(" ")[0]


# --------------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("reply, expected", [
    ("1. What is A?\n2. What is B?\n3. What is C?", ["What is A?", "What is B?", "What is C?"]),
    ("Here are three questions:\n\n1) What is A?\n2) **What is B?**\n- What is C?\nHope this helps!",
     ["What is A?", "What is B?", "What is C?"]),
    ('```json\n["What is A?", "What is B?", ""]\n```', ["What is A?", "What is B?"]),
    ('{"questions": [{"question": "What is A?"}, "What is B?"]}', ["What is A?", "What is B?"]),
    ("1、北京的历史有多长？\n2．北京是哪个国家的首都？\n（3）北京的历史有多长？", ["北京的历史有多长？", "北京是哪个国家的首都？"]),
    ("一、什么是北京？\n二、北京在哪里？", ["什么是北京？", "北京在哪里？"]),
    ("<think>the user wants questions\n1. not this</think>\nQ1: What is A?\nQ2: What is a?", ["What is A?"]),
    ("What is A?\nWhat is B?", ["What is A?", "What is B?"]),
    ("1. " + "x" * 400 + "\n2. ok?\n3. \n4. What is D?", ["What is D?"]),
    ("", []),
])
def test_parse_questions(reply, expected):
    assert parse_questions(reply, max_queries=5) == expected


def test_parse_questions_caps_at_n():
    assert parse_questions("1. a one?\n2. b two?\n3. c three?", max_queries=2) == ["a one?", "b two?"]


@pytest.mark.parametrize("reply, expected", [
    ("Yes", True), ("yes.", True), ("**Yes** - it answers the query", True), ("Answer: no", False),
    ("No, the passage is about something else.", False), ("The passage is not relevant.", False),
    ("The passage is relevant to the query.", True), ("Irrelevant", False), ("是", True), ("否", False),
    ("不相关。", False), ("相关", True), ("答案：是", True), ("不是", False), ("<think>hmm yes?</think>No", False),
    ("I cannot tell", None), ("I am not sure.", None), ("It does not answer the query.", False),
    ("The passage is not really relevant", False), ("", None), (None, None), ("maybe", None),
])
def test_parse_yes_no(reply, expected):
    assert parse_yes_no(reply) is expected


def test_small_helpers():
    assert cjk_share("北京 is big") == pytest.approx(2 / 7)
    assert cjk_share("") == 0.0
    assert strip_reasoning("<think>a</think> b") == "b" and strip_reasoning("chain</think>answer") == "answer"
    # empty title: the "Title:" line disappears; other braces survive
    prompt = render_template("T: {title}\n{text} {\"k\": 1} {n}\n", {"title": "", "text": "body", "n": 2})
    assert prompt == 'body {"k": 1} 2\n'


# --------------------------------------------------------------------------------------------------- client


def test_retries_honour_retry_after_then_succeed():
    waits: list[float] = []
    with FakeLLMServer() as server:
        server.script({"status": 429, "headers": {"Retry-After": "0.02"}}, {"status": 503},
                      {"status": 500, "headers": {"retry-after-ms": "5"}})
        client = make_client(server, max_retries=5, sleep=waits.append)  # the injected sleep records the waits
        replies = client.complete(["hello"])
        client.close()
    assert replies[0].startswith("1. What is") and server.count == 4
    stats = client.stats
    assert (stats.requests, stats.retries, stats.failures, stats.completions) == (4, 3, 0, 1)
    # Retry-After (seconds) and retry-after-ms (the fake server's default 1 ms on the bare 503) were honoured,
    # not a default backoff of 0.5 s and more.
    assert waits == pytest.approx([0.02, 0.001, 0.005])


@pytest.mark.parametrize("on_failure", ["raise", "skip"])
def test_retries_used_up_is_a_clear_error(on_failure):
    with FakeLLMServer(lambda m: {"status": 429, "headers": {"Retry-After": "0.001"}}) as server:
        client = make_client(server, max_retries=2, on_failure=on_failure)
        if on_failure == "raise":
            with pytest.raises(EndpointError) as info:
                client.complete(["hello"])
            message = str(info.value)
        else:
            completion = next(client.stream(["hello"]))
            assert completion.text is None
            message = completion.error or ""
        client.close()
    assert server.count == 3  # one request and max_retries=2 retries by the openai client
    assert (client.stats.requests, client.stats.retries, client.stats.failures) == (3, 2, 1)
    assert "gave up after 3 attempt(s)" in message and "HTTP 429" in message
    if on_failure == "raise":  # the skip record keeps the first line only
        assert "requests_per_minute" in message and "asked to wait 0.001s" in message


def test_timeout_is_a_clear_error():
    with FakeLLMServer() as server:
        server.script({"delay": 1.0})
        client = make_client(server, timeout_s=0.2, max_retries=0)
        with pytest.raises(EndpointError, match=r"gave up after 1 attempt\(s\); last error: no reply within "
                                                r"llm.timeout_s=0.2s"):
            client.complete(["hello"])
        client.close()
    assert server.count == 1


@pytest.mark.parametrize("on_failure", ["raise", "skip"])
def test_wrong_base_url_is_a_clear_error_without_retries(on_failure):
    with FakeLLMServer() as server:
        client = make_client(server, base_url=server.url[: -len("/v1")], on_failure=on_failure)
        with pytest.raises(EndpointError) as info:
            client.complete(["hello"])
        client.close()
    message = str(info.value)
    assert "404" in message and server.url[: -len("/v1")] + "/chat/completions" in message
    assert "/v1" in message and "fake-model" in message and "no route" in message
    assert server.posts == 1  # a 404 is never retried


def test_wrong_model_name_is_a_clear_error(caplog):
    with FakeLLMServer(check_model=True) as server:
        client = make_client(server, model="fake-modle", on_failure="skip")
        with caplog.at_level(logging.WARNING, logger="robustir.llm"):
            assert client.preflight() == ["fake-model"]
        assert "'fake-modle' is not among the models" in caplog.text
        with pytest.raises(EndpointError) as info:  # fatal even under skip: every request would fail
            client.complete(["a", "b"])
        client.close()
    message = str(info.value)
    assert "HTTP 404" in message and "The model `fake-modle` does not exist" in message
    assert "does not serve the model 'fake-modle'" in message and server.url + "/models" in message
    assert server.count == 0 and 1 <= server.posts <= 2  # a 404 is never retried


def test_missing_api_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("ROBUSTIR_TEST_KEY", raising=False)
    with FakeLLMServer(api_key="sk-right") as server:
        client = make_client(server, api_key_env="ROBUSTIR_TEST_KEY")
        with pytest.raises(EndpointError, match="(?s)/models answered HTTP 401.*ROBUSTIR_TEST_KEY"):
            client.preflight()
        with pytest.raises(EndpointError, match="ROBUSTIR_TEST_KEY"):
            client.complete(["hello"])
        client.close()
        assert server.posts == 1
        monkeypatch.setenv("ROBUSTIR_TEST_KEY", "sk-right")
        client = make_client(server, api_key_env="ROBUSTIR_TEST_KEY")
        assert client.complete(["hello"])[0]
        client.close()


def test_unreachable_endpoint_preflight():
    with FakeLLMServer() as server:
        url = server.url
    client = LLMClient(LLMConfig(base_url=url, model="m", timeout_s=2, max_retries=0))  # stopped: refused
    with pytest.raises(EndpointError, match="(?s)cannot reach the LLM endpoint .*/v1/models: .*Fix: start the"):
        client.preflight()
    with pytest.raises(EndpointError) as info:
        client.complete(["hello"])
    client.close()
    message = str(info.value)
    assert f"cannot reach the LLM endpoint {url}/chat/completions" in message and "(1 attempt(s))" in message
    assert f"correct --base-url (now '{url}')" in message


def test_bad_request_is_skipped_per_item_under_skip():
    def reply(messages):
        return {"status": 400} if "too long" in last_user(messages) else "fine"

    with FakeLLMServer(reply) as server:
        client = make_client(server, on_failure="skip")
        assert client.complete(["a", "too long", "b"]) == ["fine", None, "fine"]
        client.close()
        assert server.count == 3  # the 400 was not retried
        client = make_client(server, on_failure="raise")
        with pytest.raises(EndpointError, match="(?s)400.*context window"):
            client.complete(["too long"])
        client.close()


def test_malformed_replies_retry_then_fail_cleanly():
    bad = [{"body": "<html>not json</html>"}, {"json": {"choices": []}}, {"content": "   "}, {"json": [1, 2]}]
    with FakeLLMServer() as server:
        server.script(*bad)
        client = make_client(server, max_retries=4)
        assert client.complete(["x"])[0].startswith("1.")  # four malformed replies, then a good one
        assert server.count == 5
        client.close()

        server.script(*bad)
        client = make_client(server, max_retries=3)
        with pytest.raises(EndpointError, match="gave up after 4 attempt"):
            client.complete(["y"])
        client.close()

        server.script(*bad)
        client = make_client(server, max_retries=3, on_failure="skip", concurrency=1)
        replies = client.complete(["z", "w"])
        assert replies[0] is None and replies[1].startswith("1.")
        assert client.stats.failures == 1
        client.close()


def test_consecutive_failures_stop_a_skip_run():
    with FakeLLMServer(lambda m: {"status": 500}) as server:
        client = make_client(server, on_failure="skip", max_retries=0, max_consecutive_failures=3, concurrency=1)
        with pytest.raises(EndpointError, match="3 LLM requests in a row failed"):
            client.complete([f"q{i}" for i in range(10)])
        client.close()


def test_cache_avoids_repeated_requests(tmp_path):
    cache = tmp_path / "cache.sqlite"
    prompts = ["one", "two", "three", "two"]
    with FakeLLMServer() as server:
        first = make_client(server, cache_path=cache, concurrency=1)
        replies = first.complete(prompts)
        first.close()
        assert server.count == 3 and first.stats.cache_hits == 1  # the repeated prompt came from the cache
        second = make_client(server, cache_path=cache)
        assert second.complete(prompts) == replies
        assert server.count == 3 and second.stats.cache_hits == 4
        second.close()
        other = make_client(server, cache_path=cache, temperature=0.1)  # other sampling params: other key
        other.complete(["one"])
        other.close()
        assert server.count == 4


def test_concurrency_limit_is_respected():
    with FakeLLMServer(delay=0.25) as server:
        client = make_client(server, concurrency=3)
        replies = client.complete([f"prompt {i}" for i in range(9)])
        client.close()
    assert len(replies) == 9 and all(replies)
    assert server.max_in_flight == 3


class FakeClock:
    """A clock that moves only when told to: ``sleep`` records the wait and (if ``advance``) moves time on."""

    def __init__(self, advance: bool = True) -> None:
        self.now, self.advance, self.sleeps = 0.0, advance, []
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.sleeps.append(seconds)
            if self.advance:
                self.now += seconds


def test_rate_limiter_spaces_starts_on_a_fake_clock():
    clock = FakeClock()
    limiter = RateLimiter(600, clock=clock, sleep=clock.sleep)  # one start per 0.1 s
    assert [limiter.wait() for _ in range(4)] == pytest.approx([0.0, 0.1, 0.1, 0.1])
    assert clock.sleeps == pytest.approx([0.1, 0.1, 0.1]) and clock.now == pytest.approx(0.3)
    clock.now += 0.05  # part of an interval passed on its own: only the rest is waited
    assert limiter.wait() == pytest.approx(0.05)
    clock.now += 10.0  # a long idle spell earns no burst: the second start waits a full interval again
    assert [limiter.wait() for _ in range(2)] == pytest.approx([0.0, 0.1])
    assert limiter.reserve() == pytest.approx(0.1) and clock.now == pytest.approx(10.5)  # reserved, not slept


def test_rate_limiter_zero_is_unlimited():
    clock = FakeClock()
    limiter = RateLimiter(0, clock=clock, sleep=clock.sleep)
    assert [limiter.wait() for _ in range(100)] == [0.0] * 100 and clock.sleeps == []
    with pytest.raises(Exception, match="requests_per_minute must be >= 0"):
        RateLimiter(-1)


def test_client_waits_for_the_rate_limiter_before_every_request():
    clock = FakeClock(advance=False)  # every request reserves its slot at t=0: the slots are 0.1 s apart
    with FakeLLMServer() as server:
        server.script({"status": 500})  # one request is retried (by the openai client): the retry waits too
        client = LLMClient(LLMConfig(base_url=server.url, model="fake-model", concurrency=4),
                           limiter=RateLimiter(600, clock=clock, sleep=clock.sleep))
        assert all(client.complete([f"p{i}" for i in range(5)]))
        client.close()
    assert server.count == 6
    assert sorted(clock.sleeps) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])  # the first start did not wait


def test_close_wakes_a_request_waiting_for_the_rate_limiter():
    waiting = threading.Event()
    with FakeLLMServer() as server:
        client = make_client(server, requests_per_minute=1, concurrency=2)  # the second start is 60 s away
        stop_wait = client._limiter._sleep  # the client's stop event's wait: close() sets the event
        client._limiter._sleep = lambda seconds: (waiting.set(), stop_wait(seconds))
        results = []
        worker = threading.Thread(target=lambda: results.extend(client.stream(["a", "b"])))
        worker.start()
        assert waiting.wait(timeout=30)
        client.close()
        worker.join(timeout=30)
    assert not worker.is_alive() and server.count == 1
    # either prompt may take the limiter's first slot (two workers race for it): one is answered, the one that
    # waited is cancelled (this asserted "a" answered, and failed whenever "b" won the race)
    answered = [r for r in results if r.ok]
    cancelled = [r for r in results if not r.ok]
    assert len(answered) == 1 and len(cancelled) == 1
    assert cancelled[0].text is None and "cancelled" in cancelled[0].error


def test_replies_keep_input_order():
    # Replies are produced in reverse order within each wave of 4 concurrent requests: request n waits until
    # request n + 1 has been answered (waits point forward only, so the four workers cannot deadlock).
    prompts = [f"n{i}" for i in range(40)]
    answered = {p: threading.Event() for p in prompts}
    produced: list[str] = []

    def reply(messages):
        prompt = last_user(messages)
        i = int(prompt[1:])
        if i % 4 != 3:
            assert answered[prompts[i + 1]].wait(timeout=60)
        produced.append(prompt)
        answered[prompt].set()
        return "echo " + prompt

    with FakeLLMServer(reply) as server:
        client = make_client(server, concurrency=4)
        assert client.complete(prompts) == [f"echo {p}" for p in prompts]
        client.close()
    assert produced[:4] == ["n3", "n2", "n1", "n0"] and sorted(produced) == sorted(prompts)


# --------------------------------------------------------------------------------------------------- generate


def test_generate_end_to_end(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 5, chinese=2)
    out = tmp_path / "train.jsonl"

    def reply(messages):
        prompt = last_user(messages)
        if "下面是一段文本" in prompt:
            return "1. 北京的历史有多长？\n2. 北京在哪里？"
        return f"Sure! Here are the questions:\n1. What is topic {passage_of(prompt)}?\n2. Why topic?\n3. Why topic?"

    with FakeLLMServer(reply) as server:
        client = make_client(server, cache_path=tmp_path / "cache.sqlite")
        report = generate_queries(passages, out, client, num_queries=3, beir_dir=tmp_path / "beir", progress=False)
        client.close()
    rows = read_lines(out)
    assert len(rows) == 5 * 2 + 2 * 2  # duplicates dropped: 2 distinct English questions per passage
    first = rows[0]
    assert first == {"query": "What is topic 0?", "pos": ["Passage number 0 talks about topic 0 in some detail."],
                     "neg": [], "pos_id": "p0", "doc_id": "p0", "qid": "p0-q0"}
    assert {r["query"] for r in rows if r["pos_id"] == "zh1"} == {"北京的历史有多长？", "北京在哪里？"}
    zh_prompt = [p for p in server.prompts() if "第1段" in p][0]
    assert "标题" not in zh_prompt  # no title: the title line is left out
    assert "Title: Title 3" in [p for p in server.prompts() if "number 3" in p][0]
    assert report.generated == 7 and report.queries_written == 14 and report.failed == 0
    assert report.llm["requests"] == 7 and report.llm["prompt_tokens"] > 0
    saved = json.loads((tmp_path / "train.jsonl.report.json").read_text())
    assert saved["queries_written"] == 14
    assert len(read_lines(tmp_path / "beir" / "queries.jsonl")) == 14
    assert (tmp_path / "beir" / "qrels" / "train.tsv").read_text().splitlines()[1] == "p0-q0\tp0\t1"
    assert not (tmp_path / "train.jsonl.partial").exists()


def test_generate_custom_template_file(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 2)
    template = tmp_path / "prompt.txt"
    template.write_text('Give {n} queries as JSON {"queries": [...]} for: {text}', encoding="utf-8")
    from robustir.llm import load_template

    with FakeLLMServer(lambda m: '{"queries": ["q a one", "q b two"]}') as server:
        client = make_client(server)
        generate_queries(passages, tmp_path / "out.jsonl", client, num_queries=2,
                         template=load_template(template, ("text",)), progress=False)
        client.close()
    assert ('Give 2 queries as JSON {"queries": [...]} for: '
            "Passage number 0 talks about topic 0 in some detail.") in server.prompts()
    assert [r["query"] for r in read_lines(tmp_path / "out.jsonl")][:2] == ["q a one", "q b two"]


class ExplodingBackend:
    """Delegates to a real client but raises after ``after`` replies: a crash in the middle of a run."""

    def __init__(self, inner, after: int) -> None:
        self.inner, self.after = inner, after

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def stream(self, conversations):
        for i, completion in enumerate(self.inner.stream(conversations)):
            if i == self.after:
                raise RuntimeError("injected crash")
            yield completion


def check_complete_output(out: Path, n: int, per_passage: int = 3) -> None:
    rows = read_lines(out)
    counts = Counter(r["pos_id"] for r in rows)
    assert counts == {f"p{i}": per_passage for i in range(n)}  # no passage lost, none duplicated
    assert len({(r["pos_id"], r["query"]) for r in rows}) == len(rows)


def test_generate_crash_resume_pays_nothing_twice(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 12)
    out, cache = tmp_path / "train.jsonl", tmp_path / "cache.sqlite"
    with FakeLLMServer() as server:
        client = make_client(server, cache_path=cache, concurrency=2)
        with pytest.raises(RuntimeError, match="injected"):
            generate_queries(passages, out, ExplodingBackend(client, after=4), progress=False)
        client.close()  # waits for requests still in flight; their replies land in the cache
        assert not out.exists() and len(read_lines(tmp_path / "train.jsonl.partial")) >= 3 * 3
        client = make_client(server, cache_path=cache)
        report = generate_queries(passages, out, client, progress=False)
        client.close()
        check_complete_output(out, 12)
        assert report.resumed >= 3
        assert Counter(passage_of(p) for p in server.prompts()) == {str(i): 1 for i in range(12)}

        # a third run over the finished output requests nothing and changes nothing
        before = out.read_text()
        client = make_client(server, cache_path=cache)
        report = generate_queries(passages, out, client, progress=False)
        client.close()
        # a finished output's last group is whole: nothing is redone
        assert server.count == 12 and out.read_text() == before and report.generated == 0 and report.resumed == 12


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from robustir.queries.generate import generate_queries
    from robustir.llm import LLMCache, LLMClient, LLMConfig
    url, passages, out, cache, after = sys.argv[1:6]

    class KilledBackend:  # SIGKILLs its own process when asked for reply number `after` + 1
        def __init__(self, inner):
            self.inner = inner
        def __getattr__(self, name):
            return getattr(self.inner, name)
        def stream(self, conversations):
            for i, completion in enumerate(self.inner.stream(conversations)):
                if i == int(after):
                    os.kill(os.getpid(), signal.SIGKILL)
                yield completion

    client = LLMClient(LLMConfig(base_url=url, model="fake-model", concurrency=2), cache=LLMCache(cache))
    generate_queries(passages, out, KilledBackend(client), progress=False)
""")


def test_generate_resume_after_sigkill(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 16)
    out, cache = tmp_path / "train.jsonl", tmp_path / "cache.sqlite"
    partial = tmp_path / "train.jsonl.partial"
    with FakeLLMServer() as server:
        # killed with requests in flight, after the 8th passage's queries were written (one flushed write each)
        proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, server.url, str(passages), str(out), str(cache),
                               "8"], env={**os.environ, "NO_PROXY": "127.0.0.1"}, timeout=120)
        assert proc.returncode == -signal.SIGKILL
        written_before = {r["pos_id"] for r in read_lines(partial)}
        assert written_before == {f"p{i}" for i in range(8)} and not out.exists()
        requests_before = server.count
        client = make_client(server, cache_path=cache)
        generate_queries(passages, out, client, progress=False)
        client.close()
    check_complete_output(out, 16)
    asked = Counter(passage_of(p) for p in server.prompts())
    assert all(asked[pid[1:]] == 1 for pid in written_before)  # finished passages were never asked again
    assert server.count <= 16 + 2 and server.count - requests_before <= 16 - len(written_before) + 2


def test_generate_failures_are_recorded_and_retried(tmp_path):
    passages = write_passages(tmp_path / "corpus.jsonl", 6)
    out, cache = tmp_path / "train.jsonl", tmp_path / "cache.sqlite"
    broken = {"2": {"status": 400}, "4": "I am sorry, I cannot help with that:"}

    def reply(messages):
        number = passage_of(last_user(messages))
        return broken.get(number, f"1. What is {number}?\n2. Where is {number}?")

    with FakeLLMServer(reply) as server:
        client = make_client(server, cache_path=cache, on_failure="skip")
        report = generate_queries(passages, out, client, num_queries=2, progress=False)
        client.close()
        assert report.failed == 2 and report.generated == 4
        failed = read_lines(tmp_path / "train.jsonl.failed.jsonl")
        assert [f["_id"] for f in failed] == ["p2", "p4"] and "400" in failed[0]["error"]
        assert out.exists() and {r["pos_id"] for r in read_lines(out)} == {"p0", "p1", "p3", "p5"}

        broken.clear()  # the endpoint recovers: the next run retries only the failed passages
        client = make_client(server, cache_path=cache, on_failure="skip")
        report = generate_queries(passages, out, client, num_queries=2, progress=False)
        client.close()
    assert report.generated == 2 and report.failed == 0 and report.resumed == 4  # p2 and p4
    check_complete_output(out, 6, per_passage=2)
    assert not (tmp_path / "train.jsonl.failed.jsonl").exists()
    assert Counter(passage_of(p) for p in server.prompts()) == {"0": 1, "1": 1, "2": 2, "3": 1, "4": 2, "5": 1}


def test_cli_generate_with_shards(tmp_path, capsys):
    from robustir.cli.main import main

    passages = write_passages(tmp_path / "corpus.jsonl", 6)
    with FakeLLMServer() as server:
        for shard in ("1/2", "2/2"):
            code = main(["generate", "--input", str(passages), "--output", str(tmp_path / "q.jsonl"),
                         "--base-url", server.url, "--model", "fake-model", "--num-queries", "2",
                         "--concurrency", "2", "--shard", shard, "--no-progress", "llm.temperature=0.0"])
            assert code == 0
        assert all(body["temperature"] == 0.0 and body["model"] == "fake-model" for body in server.requests)
    first = read_lines(tmp_path / "q.shard-00001-of-00002.jsonl")
    second = read_lines(tmp_path / "q.shard-00002-of-00002.jsonl")
    assert {r["pos_id"] for r in first} == {"p0", "p2", "p4"} and {r["pos_id"] for r in second} == {"p1", "p3", "p5"}
    assert len(first) == 6 and "6 queries written" in capsys.readouterr().out
    assert (tmp_path / "q.shard-00001-of-00002.jsonl.llm-cache.sqlite").exists()


def test_cli_generate_reports_bad_endpoint_without_traceback(tmp_path, capsys):
    from robustir.cli.main import main

    passages = write_passages(tmp_path / "corpus.jsonl", 2)
    with FakeLLMServer() as server:
        code = main(["generate", "--input", str(passages), "--output", str(tmp_path / "q.jsonl"),
                     "--base-url", server.url[:-3], "--model", "fake-model", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "robustir generate: error:" in err and "404" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------------- judge


def test_llm_judge_removes_negatives_judged_relevant(tmp_path):
    records = [
        {"query": "what is topic A", "pos": ["A is a letter."],
         "neg": ["RELEVANT: A again", "B is a letter", "UNSURE text", "A is a letter."],
         "neg_scores": [0.9, 0.8, 0.7, 0.6], "pos_id": "p1"},
        {"query": "北京在哪里", "pos": ["北京在中国。"], "neg": ["相关文本RELEVANT", "上海在中国。"]},
        {"query": "no negatives", "pos": ["x"], "neg": []},
        {"query": "what is C", "pos": ["C"], "neg": ["RELEVANT C", "FAIL this one"]},
    ]
    source = tmp_path / "mined.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    original = source.read_bytes()

    def reply(messages):
        prompt = last_user(messages)
        chinese = "查询：" in prompt
        if "FAIL" in prompt:
            return {"status": 500}
        if "RELEVANT" in prompt:
            return "是" if chinese else "Yes."
        if "UNSURE" in prompt:
            return "It is hard to say."
        return "否" if chinese else "No"

    with FakeLLMServer(reply) as server:
        client = make_client(server, cache_path=tmp_path / "cache.sqlite", on_failure="skip", max_retries=1)
        report = judge_negatives(source, tmp_path / "clean.jsonl", client, progress=False)
        client.close()
    assert source.read_bytes() == original
    rows = read_lines(tmp_path / "clean.jsonl")
    assert [r["query"] for r in rows] == [r["query"] for r in records]
    assert rows[0]["neg"] == ["B is a letter", "UNSURE text"] and rows[0]["neg_scores"] == [0.8, 0.7]
    assert rows[0]["removed"] == [{"text": "RELEVANT: A again", "reason": "llm_judge"},
                                  {"text": "A is a letter.", "reason": "equals_positive"}]
    assert rows[0]["pos_id"] == "p1"
    assert rows[1]["neg"] == ["上海在中国。"] and rows[2]["neg"] == [] and rows[3]["neg"] == ["FAIL this one"]
    assert server.count == 3 + 2 + 1 + 2  # equals_positive is never asked; FAIL was tried twice
    assert (report.negatives_judged, report.removed, report.removed_equal_positive) == (7, 3, 1)
    # "hard to say" is not a verdict: a failed judgement like the failed request, kept for now and retried later
    assert (report.undecidable, report.failed, report.kept, report.queries_with_removals) == (2, 2, 4, 3)
    assert report.failed_reasons == {"request failed": 1, "unparseable reply": 1} and report.failed_records == 2
    assert report.removed_per_query == {"0": 1, "1": 2, "2": 1}
    saved = json.loads((tmp_path / "clean.jsonl.report.json").read_text())
    assert saved["removed"] == 3 and saved["undecidable"] == 2
    with pytest.raises(Exception, match="never overwrites"):
        judge_negatives(source, source, client, progress=False)


def test_llm_judge_asks_about_positives_removes_false_ones_and_corrects_labels(tmp_path):
    """Issue 50 item 5: with positives=True every positive is asked too; one judged not relevant leaves ``pos``; a
    record left without a positive takes its negatives judged relevant (promote), or stays ``"pos": []`` -- which
    training skips -- when none was."""
    from robustir.data.training_data import load_training_data

    records = [
        {"query": "q clean", "pos": ["RELEVANT true answer"], "neg": ["other passage"]},
        {"query": "q near miss", "pos": ["near-miss passage"], "pos_ids": ["d7"],
         "neg": ["RELEVANT the real answer", "unrelated"], "neg_scores": [0.9, 0.1]},
        {"query": "q two positives", "pos": ["RELEVANT one", "wrong one"], "pos_scores": [0.8, 0.7], "neg": ["n"]},
        {"query": "q nothing right", "pos": ["wrong"], "neg": ["also wrong"]},
        {"query": "q undecided", "pos": ["UNSURE passage"], "neg": []},
    ]
    source = tmp_path / "mined.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")

    def reply(messages):
        prompt = last_user(messages)
        return "It is hard to say." if "UNSURE" in prompt else ("yes" if "RELEVANT" in prompt else "no")

    with FakeLLMServer(reply) as server:
        client = make_client(server, cache_path=tmp_path / "cache.sqlite", max_retries=1)
        report = judge_negatives(source, tmp_path / "judged.jsonl", client, progress=False, positives=True,
                                 keep_removed=False, max_failure_rate=0.9)
        client.close()
        assert server.count == 2 + 3 + 3 + 2 + 1  # every negative and every positive of each record, once each
    rows = read_lines(tmp_path / "judged.jsonl")
    assert rows[0]["pos"] == ["RELEVANT true answer"] and "removed" not in rows[0]
    # the near miss goes, the negative judged relevant takes its place (label correction), its stale ids go too
    assert rows[1]["pos"] == ["RELEVANT the real answer"] and rows[1]["neg"] == ["unrelated"]
    assert rows[1]["neg_scores"] == [0.1] and "pos_ids" not in rows[1]
    assert {(r["text"], r["reason"]) for r in rows[1]["removed"]} == {
        ("near-miss passage", "llm_judge_positive"), ("RELEVANT the real answer", "llm_judge"),
        ("RELEVANT the real answer", "promoted")}
    assert rows[2]["pos"] == ["RELEVANT one"] and rows[2]["pos_scores"] == [0.8]
    assert rows[3]["pos"] == [] and rows[3]["removed"] == [{"text": "wrong", "reason": "llm_judge_positive",
                                                            "positive": True}]
    assert rows[4]["pos"] == ["UNSURE passage"]  # no verdict: kept, and listed to judge again
    assert (report.positives_judged, report.positives_removed, report.records_corrected,
            report.records_without_positives) == (6, 3, 1, 1)
    examples, _ = load_training_data(tmp_path / "judged.jsonl")  # the emptied record is skipped, not an error
    assert [e.query for e in examples] == ["q clean", "q near miss", "q two positives", "q undecided"]

    with FakeLLMServer(reply) as server:  # promote off: the near-miss record is left without a positive
        client = make_client(server, cache_path=tmp_path / "cache2.sqlite", max_retries=1)
        judge_negatives(source, tmp_path / "dropped.jsonl", client, progress=False, positives=True, promote=False,
                        max_failure_rate=0.9)
        client.close()
    assert read_lines(tmp_path / "dropped.jsonl")[1]["pos"] == []


def test_llm_judge_resume(tmp_path):
    source = tmp_path / "mined.jsonl"
    records = [{"query": f"query {i}", "pos": [f"pos {i}"], "neg": [f"neg {i}a", f"neg {i}b RELEVANT"]}
               for i in range(8)]
    source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    out, cache = tmp_path / "clean.jsonl", tmp_path / "cache.sqlite"
    with FakeLLMServer(lambda m: "yes" if "RELEVANT" in last_user(m) else "no") as server:
        client = make_client(server, cache_path=cache, concurrency=2)
        with pytest.raises(RuntimeError):
            judge_negatives(source, out, ExplodingBackend(client, after=7), progress=False)
        client.close()
        client = make_client(server, cache_path=cache)
        report = judge_negatives(source, out, client, progress=False)
        client.close()
        assert server.count == 16  # every (query, negative) asked exactly once over both runs
    rows = read_lines(out)
    assert [r["query"] for r in rows] == [r["query"] for r in records]
    assert all(r["neg"] == [f"neg {i}a"] for i, r in enumerate(rows))
    assert report.resumed == 3 and report.records_judged == 5


# --------------------------------------------------------------------------------------------------- local HF


def test_hf_backend_on_tiny_random_model(tmp_path, minilm_path):
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from robustir.llm import HFGenerator

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "tiny-lm")
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]{% endif %}")
    tokenizer.save_pretrained(tmp_path / "tiny-lm")

    generator = HFGenerator(str(tmp_path / "tiny-lm"), max_new_tokens=6, batch_size=2, device="cpu",
                            cache=LLMCache(tmp_path / "cache.sqlite"))
    conversations = ["write a question", [{"role": "user", "content": "another, longer prompt here"}], "third"]
    assert "[user] write a question" in generator.render(conversations[0])
    replies = generator.complete(conversations)
    assert len(replies) == 3 and all(isinstance(r, str) for r in replies)
    assert generator.complete(conversations) == replies and generator.stats.cache_hits == 3

    greedy = HFGenerator(str(tmp_path / "tiny-lm"), max_new_tokens=6, batch_size=3, device="cpu")
    assert all(isinstance(r, str) for r in greedy.complete(conversations))
    generate_queries(write_passages(tmp_path / "c.jsonl", 2), tmp_path / "o.jsonl", greedy,
                     template=DEFAULT_TEMPLATE_EN, progress=False)


def test_a_section_given_in_part_keeps_the_fields_own_defaults():
    # JudgeConfig.llm defaults to a yes/no judge (temperature 0, 16 tokens), not LLMConfig's generation defaults
    from robustir.config import load_config
    from robustir.filtering.llm_judge import JudgeConfig

    config = load_config(JudgeConfig, None, ["llm.model=m", "llm.base_url=http://127.0.0.1:1/v1"])
    assert (config.llm.model, config.llm.temperature, config.llm.max_tokens) == ("m", 0.0, 16)
    assert load_config(JudgeConfig, None, ["llm.temperature=0.3"]).llm.temperature == 0.3


def test_pointed_at_robustir_serve_the_fix_says_so(tiny_model_dir):
    """``robustir generate --base-url`` given robustir serve's address (an embeddings server) names the mistake."""
    from robustir.serving import ServeConfig, create_app, running_server

    with running_server(create_app(tiny_model_dir, None, ServeConfig())) as url:
        client = make_client(None, base_url=url + "/v1", model="Qwen2.5-7B-Instruct")
        with pytest.raises(EndpointError) as info:
            client.complete(["hello"])
        client.close()
    message = str(info.value)
    assert "HTTP 404" in message and "is robustir serve, an embeddings server, not an LLM" in message
    assert "does not serve the model" not in message
