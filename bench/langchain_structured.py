#!/usr/bin/env python3
"""LangChain's `with_structured_output` against `kestrel serve`, in its three modes (issue #23, point 2;
bench/RESULTS.md records the outcome). Not run in CI: it needs langchain-openai, which the test venv
does not carry.

    python -m venv /tmp/lc && /tmp/lc/bin/pip install langchain-openai
    build/src/cli/kestrel serve --port 8000 &          # the embedded k3-tiny
    /tmp/lc/bin/python bench/langchain_structured.py --base-url http://127.0.0.1:8000/v1

For each mode it prints what the server was sent (the request LangChain built, captured by an httpx
event hook), whether the server accepted it, and what LangChain parsed out of the answer. The exit status
is the number of runs where the mechanism failed: the server refused, the answer did not end `stop`
(`tool_calls` for function_calling), or it is not a complete JSON document / tool call. A json_mode run
into the pydantic model whose valid JSON does not parse into it is reported as the model's (json_object
mode never names the keys, and k3-tiny was never trained to answer in JSON), not counted. Schemas: the pydantic model `Weather` in all three modes, and
the same schema as a plain dict (JSON Schema) in json_mode and json_schema — with a dict LangChain parses
json_mode's answer as any JSON (JsonOutputParser) rather than validating it into the model, and json_mode
(response_format json_object) does not send the schema, so only the dict run can pass there on a model
that does not know the keys. k3-tiny never closes a JSON string on its own; the server's budget-aware
completion (docs/structured-outputs.md, "Finishing within max_tokens", on by default) closes it within
max_tokens."""
import argparse
import json
import sys
import time

import httpx
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Weather(BaseModel):
    """The weather report a user asked for."""
    city: str = Field(description="the city's name")
    celsius: int = Field(description="the temperature in degrees Celsius")


WEATHER_DICT = {
    "title": "Weather", "description": "The weather report a user asked for.", "type": "object",
    "properties": {"city": {"type": "string", "description": "the city's name"},
                   "celsius": {"type": "integer", "description": "the temperature in degrees Celsius"}},
    "required": ["city", "celsius"], "additionalProperties": False}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="default: the first id /v1/models lists")
    ap.add_argument("--question", default="What is the weather in Oslo? It is 12 degrees there.")
    ap.add_argument("--max-tokens", type=int, default=400)
    a = ap.parse_args()
    model = a.model or httpx.get(a.base_url + "/models").json()["data"][0]["id"]
    sent = []

    def capture(req):
        if req.method == "POST":
            sent.append(json.loads(req.content))

    client = httpx.Client(event_hooks={"request": [capture]}, timeout=600)
    llm = ChatOpenAI(model=model, base_url=a.base_url, api_key="unused", temperature=0, max_tokens=a.max_tokens,
                     http_client=client, max_retries=0)
    failed = 0
    for method, schema in (("function_calling", Weather), ("json_mode", Weather), ("json_mode", WEATHER_DICT),
                           ("json_schema", Weather), ("json_schema", WEATHER_DICT)):
        sent.clear()
        t0 = time.time()
        chain = llm.with_structured_output(schema, method=method, include_raw=True)
        try:
            out = chain.invoke(a.question if method != "json_mode" else
                               a.question + " Answer in JSON with the keys city and celsius.")
            status = "200"
            parsed, err = out["parsed"], out["parsing_error"]
            raw = out["raw"]
            answer = raw.tool_calls or raw.content
            finish = raw.response_metadata.get("finish_reason")
            usage = raw.usage_metadata or {}
        except Exception as e:  # a refusal by the server surfaces here
            status, parsed, err, answer, finish, usage = type(e).__name__, None, e, None, None, {}
        # The mechanism: accepted, ended by the model or the grammar (not cut), a complete document or call.
        doc_ok = False
        if status == "200":
            if method == "function_calling":
                doc_ok = finish == "tool_calls" and bool(answer)
            else:
                try:
                    json.loads(answer)
                    doc_ok = finish == "stop"
                except (TypeError, ValueError):
                    doc_ok = False
        model_only = doc_ok and (parsed is None or err is not None) and method == "json_mode" and isinstance(schema, type)
        failed += not doc_ok or ((parsed is None or err is not None) and not model_only)
        req = sent[-1] if sent else {}
        shape = {k: req[k] for k in ("tools", "tool_choice", "parallel_tool_calls", "response_format") if k in req}
        name = schema.__name__ if isinstance(schema, type) else "dict"
        print(f"== {method} ({name}): {time.time() - t0:.1f} s, server {status}, finish {finish}, "
              f"{usage.get('output_tokens')} completion tokens")
        print(f"   sent (besides messages/model/sampling): {json.dumps(shape)[:400]}")
        print(f"   answer: {str(answer)[:300]!s}")
        print(f"   parsed: {parsed!r}; parsing error: {str(err)[:200] if err else None}")
        print(f"   mechanism: {'ok' if doc_ok else 'FAILED'}"
              + (" (not parsed into the model: the model's keys, not the mechanism)" if model_only else ""))
    return failed


if __name__ == "__main__":
    sys.exit(main())
