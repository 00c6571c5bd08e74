#!/usr/bin/env python3
"""LangChain's `with_structured_output` against `kestrel serve`, in its three modes (issue #23, point 2;
bench/RESULTS.md records the outcome). Not run in CI: it needs langchain-openai, which the test venv
does not carry.

    python -m venv /tmp/lc && /tmp/lc/bin/pip install langchain-openai
    build/src/cli/kestrel serve --port 8000 &          # the embedded k3-tiny
    /tmp/lc/bin/python bench/langchain_structured.py --base-url http://127.0.0.1:8000/v1

For each mode it prints what the server was sent (the request LangChain built, captured by an httpx
event hook), whether the server accepted it, and what LangChain parsed out of the answer. A fourth run
repeats json_schema with the city's string bounded (`max_length`, JSON Schema maxLength): k3-tiny was
never trained to answer in JSON, and in an unbounded string it writes on until max_tokens, while the
bound lets the grammar close the document."""
import argparse
import json
import time

import httpx
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Weather(BaseModel):
    """The weather report a user asked for."""
    city: str = Field(description="the city's name")
    celsius: int = Field(description="the temperature in degrees Celsius")


class BoundedWeather(BaseModel):
    """The weather report a user asked for."""
    city: str = Field(description="the city's name", max_length=12)
    celsius: int = Field(description="the temperature in degrees Celsius")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="default: the first id /v1/models lists")
    ap.add_argument("--question", default="What is the weather in Oslo? It is 12 degrees there.")
    a = ap.parse_args()
    model = a.model or httpx.get(a.base_url + "/models").json()["data"][0]["id"]
    sent = []

    def capture(req):
        if req.method == "POST":
            sent.append(json.loads(req.content))

    client = httpx.Client(event_hooks={"request": [capture]}, timeout=600)
    llm = ChatOpenAI(model=model, base_url=a.base_url, api_key="unused", temperature=0, max_tokens=400,
                     http_client=client, max_retries=0)
    for method, schema in (("function_calling", Weather), ("json_mode", Weather), ("json_schema", Weather),
                           ("json_schema", BoundedWeather)):
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
        except Exception as e:  # a refusal by the server surfaces here
            status, parsed, err, answer = type(e).__name__, None, e, None
        req = sent[-1] if sent else {}
        shape = {k: req[k] for k in ("tools", "tool_choice", "parallel_tool_calls", "response_format") if k in req}
        print(f"== {method} ({schema.__name__}): {time.time() - t0:.1f} s, server {status}")
        print(f"   sent (besides messages/model/sampling): {json.dumps(shape)[:400]}")
        print(f"   answer: {str(answer)[:300]!s}")
        print(f"   parsed: {parsed!r}; parsing error: {str(err)[:200] if err else None}")


if __name__ == "__main__":
    main()
