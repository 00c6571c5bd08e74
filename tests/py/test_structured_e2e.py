"""Structured outputs end to end (issue #20) on the trained k3-tiny (models/k3-tiny) through `kestrel serve`
on the CPU, driven by the official openai client: a tools section only when tools are declared and
tool_choice allows it, only the named tool, every call's arguments valid against the tool's parameters,
json_schema answers that parse and validate (also through the client's pydantic `parse` helpers), and 400s
that name unsupported keywords. Requests are sampled (temperature 1, a seed each), so these hold for the
grammar, not for one lucky greedy answer."""
import json
import pathlib

import openai
import pydantic
import pytest

from serve_util import Server

ROOT = pathlib.Path(__file__).resolve().parents[2]
K3 = ROOT / "models" / "k3-tiny"
MODEL = "k3-tiny"


@pytest.fixture(scope="module")
def server(kestrel_bin):
    s = Server(kestrel_bin, K3, "--served-model-name", MODEL, "--max-num-seqs", "8", "--memory-budget", "512M")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def tool_requests(n):
    with open(K3 / "eval" / "tool.jsonl") as f:
        items = [json.loads(line) for line in f]
    return [it["request"] for it in items[:n]]


def check(schema, v, where="$"):
    """The JSON Schema subset the eval set's tools use; returns a list of errors."""
    errs = []
    t = schema.get("type")
    if isinstance(t, list):  # a list of types: valid when valid as one of them
        tries = [check({**schema, "type": x}, v, where) for x in t]
        return [] if any(e == [] for e in tries) else [f"{where}: none of the types {t}"]
    types = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}
    if t == "integer":
        if not (isinstance(v, int) and not isinstance(v, bool)):
            return [f"{where}: not an integer"]
    elif t == "number":
        if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            return [f"{where}: not a number"]
    elif t in types and not isinstance(v, types[t]):
        return [f"{where}: not a {t}"]
    if "enum" in schema and v not in schema["enum"]:
        errs.append(f"{where}: {v!r} not in enum")
    if "minimum" in schema and v < schema["minimum"]:
        errs.append(f"{where}: below minimum")
    if "maximum" in schema and v > schema["maximum"]:
        errs.append(f"{where}: above maximum")
    if isinstance(v, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in v:
                errs.append(f"{where}: missing {k}")
        for k, x in v.items():
            if k in props:
                errs += check(props[k], x, f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{where}: unexpected {k}")
    if isinstance(v, list) and "items" in schema:
        for i, x in enumerate(v):
            errs += check(schema["items"], x, f"{where}[{i}]")
    return errs


def test_hello_without_tools_never_calls_a_tool(client):
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=150, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert not c.message.tool_calls, c.message
        assert c.finish_reason in ("stop", "length")


def test_tool_choice_none_never_calls_a_tool(client):
    for i, req in enumerate(tool_requests(4)):
        r = client.chat.completions.create(model=MODEL, messages=req["messages"], tools=req["tools"], tool_choice="none",
                                           max_tokens=200, temperature=1.0, seed=i, reasoning_effort="low")
        assert not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_required_calls_are_schema_valid(client):
    calls = 0
    for i, req in enumerate(tool_requests(12)):
        r = client.chat.completions.create(model=MODEL, messages=req["messages"], tools=req["tools"],
                                           tool_choice="required", max_tokens=300, temperature=1.0, seed=100 + i,
                                           reasoning_effort="low")
        c = r.choices[0]
        if c.finish_reason == "length":  # reasoning ran to max_tokens before the (mandatory) call
            continue
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        params = {t["function"]["name"]: t["function"]["parameters"] for t in req["tools"]}
        for call in c.message.tool_calls:
            assert call.function.name in params
            assert check(params[call.function.name], json.loads(call.function.arguments)) == [], call
            calls += 1
    assert calls >= 10


def test_named_tool_choice_calls_only_that_tool(client):
    for i, req in enumerate(tool_requests(6)):
        name = req["tools"][-1]["function"]["name"]  # usually not the one the question is about
        r = client.chat.completions.create(model=MODEL, messages=req["messages"], tools=req["tools"],
                                           tool_choice={"type": "function", "function": {"name": name}},
                                           max_tokens=300, temperature=1.0, seed=200 + i, reasoning_effort="low")
        c = r.choices[0]
        if c.finish_reason == "length":
            continue
        assert [t.function.name for t in c.message.tool_calls] == [name]
        params = req["tools"][-1]["function"]["parameters"]
        assert check(params, json.loads(c.message.tool_calls[0].function.arguments)) == []


def test_streamed_required_tool_call(client):
    req = tool_requests(1)[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=req["messages"], tools=req["tools"],
                                                 tool_choice="required", max_tokens=300, temperature=0, stream=True,
                                                 reasoning_effort="low"))
    names, args = [], {}
    for ch in chunks:
        for t in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            if t.function and t.function.name:
                names.append(t.function.name)
            args[t.index] = args.get(t.index, "") + (t.function.arguments or "" if t.function else "")
    assert names and all(n in {t["function"]["name"] for t in req["tools"]} for n in names)
    assert all(isinstance(json.loads(a), dict) for a in args.values())


class Answer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    answer: int = pydantic.Field(ge=0, le=1000)
    unit: str
    sure: bool


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "sunny": {"type": "boolean"},
                                           "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]},
                                                    "maxItems": 3}},
          "required": ["city", "sunny", "days"], "additionalProperties": False}


def test_json_schema_answers_parse_and_validate(client):
    q = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=q, max_tokens=200, temperature=1.0, seed=seed,
                                           extra_body={"chat_template_kwargs": {"thinking": False}},
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "weather", "strict": True, "schema": SCHEMA}})
        c = r.choices[0]
        assert c.finish_reason == "stop" and not c.message.tool_calls
        doc = json.loads(c.message.content)
        assert check(SCHEMA, doc) == [] and set(doc) == {"city", "sunny", "days"} and len(doc["city"]) <= 20
        assert all(d in ("mon", "tue", "wed") for d in doc["days"]) and len(doc["days"]) <= 3
    # json_object: some object.
    r = client.chat.completions.create(model=MODEL, messages=q, max_tokens=200, temperature=1.0, seed=9,
                                       response_format={"type": "json_object"}, reasoning_effort="low")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_answers_complete_within_max_tokens(client):
    # k3-tiny was trained on tool-call arguments only: left alone it never closes the JSON string it opens
    # in json_object / json_schema mode and runs to max_tokens. Budget-aware completion (docs/
    # structured-outputs.md, "Finishing within max_tokens", on by default for JSON formats) keeps the answer
    # completable within max_tokens: a small max_tokens still gives a complete, valid answer (finish stop).
    q = [{"role": "user", "content": "What is the weather in Oslo? Answer in JSON."}]
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=q, max_tokens=40, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        c = r.choices[0]
        assert c.finish_reason == "stop" and r.usage.completion_tokens <= 40
        assert isinstance(json.loads(c.message.content), dict)
        r = client.chat.completions.create(model=MODEL, messages=q, max_tokens=60, temperature=1.0, seed=seed,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "weather", "strict": True, "schema": SCHEMA}})
        c = r.choices[0]
        assert c.finish_reason == "stop" and r.usage.completion_tokens <= 60
        assert check(SCHEMA, json.loads(c.message.content)) == []
    # An unbounded string, greedy: k3-tiny opens "city" and writes its arithmetic into it. Opted out per request
    # that is the old behaviour, the answer cut at max_tokens; by default the same request ends complete.
    weather = {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
               "required": ["city", "celsius"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True, "schema": weather}}
    q = [{"role": "user", "content": "What is the weather in Oslo? It is 12 degrees there."}]
    r = client.chat.completions.create(model=MODEL, messages=q, max_tokens=60, temperature=0, response_format=fmt,
                                       extra_body={"complete_within_max_tokens": False})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 60
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)
    r = client.chat.completions.create(model=MODEL, messages=q, max_tokens=60, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 60
    assert check(weather, json.loads(r.choices[0].message.content)) == []
    # Fewer tokens than the shortest complete answer: a 400 naming max_tokens and the minimum.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=q, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
    assert e.value.body["param"] == "max_tokens" and "shortest complete answer takes" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=q, max_tokens=40, response_format={"type": "json_object"},
                                       extra_body={"complete_within_max_tokens": "yes"})
    assert e.value.body["param"] == "complete_within_max_tokens"


def test_budget_errors_name_the_field_sent(client):
    # The budget's errors name the field the client sent: chat's max_completion_tokens, the Responses API's
    # max_output_tokens (they named max_tokens, which such a client never sent).
    q = [{"role": "user", "content": "What is the weather in Oslo?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=q, max_completion_tokens=5, response_format=fmt)
    assert e.value.body["param"] == "max_completion_tokens"
    msg = e.value.body["message"]
    assert msg.startswith("max_completion_tokens is 5, too few") and "raise max_completion_tokens" in msg
    with pytest.raises(openai.BadRequestError) as e:  # both sent: max_completion_tokens is the one used
        client.chat.completions.create(model=MODEL, messages=q, max_tokens=500, max_completion_tokens=5,
                                       response_format=fmt)
    assert e.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # beyond the context
        client.chat.completions.create(model=MODEL, messages=q, max_completion_tokens=10**7)
    assert e.value.body["param"] == "max_completion_tokens" and "or of max_completion_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=q, max_tokens=5, response_format=fmt)
    assert e.value.body["param"] == "max_tokens"
    text = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="What is the weather in Oslo?", max_output_tokens=5, text=text)
    assert e.value.body["param"] == "max_output_tokens"
    msg = e.value.body["message"]
    assert msg.startswith("max_output_tokens is 5, too few") and "max_completion_tokens" not in msg
    for bad in (10**7, -1):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=bad)
        assert e.value.body["param"] == "max_output_tokens" and "max_completion_tokens" not in e.value.body["message"]
    # A budget that fits is answered (the same field, the same request otherwise).
    r = client.responses.create(model=MODEL, input="What is the weather in Oslo?", max_output_tokens=60, text=text,
                                reasoning={"effort": "none"}, temperature=0)
    assert r.status == "completed" and check(SCHEMA, json.loads(r.output_text)) == []


def test_min_tokens_yields_to_the_grammars_end(client):
    # min_tokens holds the stop ids back only while the grammar allows another token (docs/structured-
    # outputs.md, "min_tokens"): a JSON answer complete before min_tokens ends there (stop, valid). Before,
    # that step had every id at -inf and the request ended with finish_reason "error".
    small = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"],
             "additionalProperties": False}
    q = [{"role": "user", "content": "Is it sunny in Oslo?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "sun", "strict": True, "schema": small}}
    for seed in range(2):
        answers = []
        for min_tokens in (0, 300):
            r = client.chat.completions.create(model=MODEL, messages=q, max_tokens=400, temperature=1.0, seed=seed,
                                               response_format=fmt, reasoning_effort="none",
                                               extra_body={"min_tokens": min_tokens})
            c = r.choices[0]
            assert c.finish_reason == "stop", (min_tokens, c.message.content)
            assert check(small, json.loads(c.message.content)) == []
            answers.append((c.message.content, r.usage.completion_tokens))
        # In chat the answer's closing markup is no stop id, and after it only <|end_of_msg|> may follow: there
        # is nothing to hold, and the same seed gives the same answer.
        assert answers[0] == answers[1] and answers[1][1] < 300
    # A bare document (completions): after the value, whitespace (at most 16 bytes) competes with the end,
    # so min_tokens within that holds the end back; beyond it the end wins.
    body = {"response_format": fmt}
    lengths = {}
    for min_tokens in (0, 3, 300):
        r = client.completions.create(model=MODEL, prompt="Is it sunny in Oslo? Answer in JSON:", max_tokens=400,
                                      temperature=0, extra_body={**body, "min_tokens": min_tokens})
        c = r.choices[0]
        assert c.finish_reason == "stop", (min_tokens, c.text)
        assert check(small, json.loads(c.text)) == []
        lengths[min_tokens] = r.usage.completion_tokens
    assert lengths[3] >= 4 and lengths[3] >= lengths[0]
    held = lengths[0] + 3
    r = client.completions.create(model=MODEL, prompt="Is it sunny in Oslo? Answer in JSON:", max_tokens=400,
                                  temperature=0, extra_body={**body, "min_tokens": held})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens >= held + 1
    assert check(small, json.loads(r.choices[0].text)) == []
    assert lengths[300] < 300
    # min_tokens = max_tokens under the budget: complete and valid, within max_tokens.
    r = client.chat.completions.create(model=MODEL, messages=q, max_tokens=30, temperature=1.0, seed=4,
                                       response_format={"type": "json_object"}, reasoning_effort="none",
                                       extra_body={"min_tokens": 30})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 30
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_pydantic_parse_helper(client):
    # The client's own strict-schema path (what LangChain's json_schema mode uses underneath).
    q = [{"role": "user", "content": "Sam has 4 books. Then Sam gets 3 more. How many books does Sam have now?"}]
    # The client raises LengthFinishReasonError for an answer cut by max_tokens (reasoning ran long): skipped.
    parsed = 0
    for seed in range(4):
        try:
            r = client.beta.chat.completions.parse(model=MODEL, messages=q, response_format=Answer, max_tokens=200,
                                                   temperature=1.0, seed=seed, reasoning_effort="low")
        except openai.LengthFinishReasonError:
            continue
        assert isinstance(r.choices[0].message.parsed, Answer)
        parsed += 1
    assert parsed >= 1
    tool = openai.pydantic_function_tool(Answer, name="give_answer")
    try:
        r = client.beta.chat.completions.parse(model=MODEL, messages=q, tools=[tool], tool_choice="required",
                                               max_tokens=300, temperature=1.0, seed=7, reasoning_effort="low")
        assert isinstance(r.choices[0].message.tool_calls[0].function.parsed_arguments, Answer)
    except openai.LengthFinishReasonError:
        pass


def test_unsupported_keywords_are_400s_naming_them(client):
    q = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=q, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}}}})
    assert "'pattern'" in e.value.message and "/properties/a" in e.value.message
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=q, max_tokens=5, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}}])
    assert "'multipleOf'" in e.value.message and e.value.body["param"] == "tools"
    deep = True
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=q, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": deep}})
