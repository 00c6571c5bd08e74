"""Audit of kestrel's OpenAI surface with the real `openai` client (issue #23: nothing accepted and ignored).

Every parameter the installed client's `chat.completions.create`, `completions.create` and
`responses.create` can send (read from their signatures, so a newer client's parameters show up) is sent
once with a non-default value against a running `kestrel serve`. Each is then one of:
  refused   a 400 whose `param` names it (what docs/api.md promises for a field kestrel does not honour);
  honoured  answered, and listed in HONOURED below with where it acts (docs/api.md has them all);
  FINDING   answered but not listed as honoured (accepted and maybe ignored), or refused without naming
            it, or some other failure;
  unprobed  no sample value here for a parameter the client knows (a newer client): add one.
Also: each endpoint's body with every unknown field null (null means absent, docs/api.md), and nested
fields the client can send (message `name`, tool `strict`, chat_template_kwargs keys).

  python bench/openai_audit.py --base-url http://127.0.0.1:8000/v1 [--model k3-tiny]

Exit status 1 when there is a finding. bench/RESULTS.md records a run.
"""
import argparse
import inspect
import sys

import openai

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
RTOOL = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
         "parameters": TOOL["function"]["parameters"]}

# A non-default value per parameter (the client's spelling); extra keyword arguments the probe needs beside it.
CHAT = {
    "audio": ({"voice": "alloy", "format": "wav"}, {}), "frequency_penalty": (0.5, {}), "function_call": ("auto", {}),
    "functions": ([TOOL["function"]], {}), "logit_bias": ({"100": -1}, {}), "logprobs": (True, {}),
    "max_completion_tokens": (8, {}), "max_tokens": (8, {}), "metadata": ({"k": "v"}, {}), "modalities": (["text"], {}),
    "moderation": ({"model": "omni-moderation-latest"}, {}),
    "n": (2, {}), "parallel_tool_calls": (False, {"tools": [TOOL]}), "prediction": ({"type": "content", "content": "x"}, {}),
    "presence_penalty": (0.5, {}), "prompt_cache_key": ("k", {}), "prompt_cache_options": ({"mode": "explicit"}, {}),
    "prompt_cache_retention": ("24h", {}), "reasoning_effort": ("low", {}),
    "response_format": ({"type": "json_object"}, {"max_tokens": 60}), "safety_identifier": ("s", {}),
    "seed": (1, {}), "service_tier": ("auto", {}), "stop": (["\n\n"], {}), "store": (False, {}), "stream": (True, {}),
    "stream_options": ({"include_usage": True}, {"stream": True}), "temperature": (0.5, {}),
    "tool_choice": ("none", {"tools": [TOOL]}), "tools": ([TOOL], {}), "top_logprobs": (2, {"logprobs": True}),
    "top_p": (0.9, {}), "user": ("u-1", {}), "verbosity": ("low", {}), "web_search_options": ({}, {}),
}
COMPLETIONS = {
    "best_of": (2, {"n": 2}), "echo": (True, {}), "frequency_penalty": (0.5, {}), "logit_bias": ({"100": -1}, {}),
    "logprobs": (2, {}), "max_tokens": (8, {}), "n": (2, {}), "presence_penalty": (0.5, {}), "seed": (1, {}),
    "stop": (["\n\n"], {}), "stream": (True, {}), "stream_options": ({"include_usage": True}, {"stream": True}),
    "suffix": ("end", {}), "temperature": (0.5, {}), "top_p": (0.9, {}), "user": ("u-1", {}),
}
RESPONSES = {
    "background": (True, {}), "context_management": ([{"type": "compaction"}], {}), "conversation": ("conv_1", {}),
    "include": (["reasoning.encrypted_content"], {}), "instructions": ("Be brief.", {}), "max_output_tokens": (8, {}),
    "max_tool_calls": (1, {}), "metadata": ({"k": "v"}, {}), "moderation": ({"model": "omni-moderation-latest"}, {}),
    "parallel_tool_calls": (False, {"tools": [RTOOL]}),
    "previous_response_id": ("resp_1", {}), "prompt": ({"id": "pmpt_1"}, {}), "prompt_cache_key": ("k", {}),
    "prompt_cache_options": ({"mode": "explicit"}, {}),
    "prompt_cache_retention": ("24h", {}), "reasoning": ({"effort": "low"}, {}), "safety_identifier": ("s", {}),
    "service_tier": ("auto", {}), "store": (False, {}), "stream": (True, {}),
    "stream_options": ({"include_obfuscation": False}, {"stream": True}), "temperature": (0.5, {}),
    "text": ({"format": {"type": "json_object"}}, {"max_output_tokens": 60}), "tool_choice": ("none", {"tools": [RTOOL]}),
    "tools": ([RTOOL], {}), "top_logprobs": (2, {}), "top_p": (0.9, {}), "truncation": ("disabled", {}),
    "user": ("u-1", {}),
}
# Answered on purpose, and where each acts (docs/api.md says how).
HONOURED = {
    "chat": {"frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "n",
             "parallel_tool_calls", "presence_penalty", "reasoning_effort", "response_format", "seed", "stop", "stream",
             "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p",
             "user"},  # user: a string, recorded nowhere (OpenAI's is for abuse monitoring)
    "completions": {"best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
                    "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user"},
    "responses": {"instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "reasoning", "store",
                  "stream", "temperature", "text", "tool_choice", "tools", "top_p", "truncation", "user"},
}
# Nested fields: (endpoint, what, extra kwargs, expected "honoured" or "refused").
NESTED = [
    ("chat", "message name", {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]}, "honoured"),
    ("chat", "tool strict", {"tools": [{"type": "function", "function": {**TOOL["function"], "strict": True}}]},
     "honoured"),
    ("chat", "chat_template_kwargs.thinking", {"extra_body": {"chat_template_kwargs": {"thinking": False}}}, "honoured"),
    ("chat", "chat_template_kwargs unknown key", {"extra_body": {"chat_template_kwargs": {"add_vision_id": True}}},
     "refused"),
    ("chat", "response_format json_schema strict false",
     {"max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": False,
      "schema": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}}, "honoured"),
    ("chat", "content part input_audio", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, "refused"),
    ("chat", "content part file", {"messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "f"}}]}]}, "refused"),
    ("chat", "tool type custom", {"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "refused"),
    ("chat", "tool type custom, flat", {"extra_body": {"tools": [{"type": "custom", "name": "c"}]}}, "refused"),
    ("responses", "text.verbosity", {"text": {"verbosity": "low"}}, "refused"),
    ("responses", "reasoning.summary", {"reasoning": {"effort": "low", "summary": "auto"}}, "refused"),
    ("responses", "input_file part", {"input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "f"}]}]}, "refused"),
    ("responses", "web_search tool", {"tools": [{"type": "web_search"}]}, "refused"),
    ("responses", "reasoning.effort unknown", {"reasoning": {"effort": "extreme"}}, "refused"),
    ("chat", "reasoning_effort unknown", {"reasoning_effort": "extreme"}, "refused"),
    ("chat", "tool_choice allowed_tools", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}}, "refused"),
]


def call(client, endpoint, model, kw):
    base = {"model": model}
    if endpoint == "chat":
        base.update(messages=[{"role": "user", "content": "What is the weather in Oslo?"}], max_tokens=16)
        fn = client.chat.completions.create
    elif endpoint == "completions":
        base.update(prompt="Once upon a time", max_tokens=8)
        fn = client.completions.create
    else:
        base.update(input="What is the weather in Oslo?", max_output_tokens=16)
        fn = client.responses.create
    args = {**base, **kw}
    if endpoint == "chat" and "max_completion_tokens" in kw:
        args.pop("max_tokens")
    r = fn(**args)
    if args.get("stream"):
        for _ in r:
            pass
    return r


def probe(client, endpoint, model, name, kw, honoured):
    try:
        call(client, endpoint, model, kw)
    except openai.BadRequestError as e:
        param = (e.body or {}).get("param") if isinstance(e.body, dict) else None
        if param == name or (param and param.split(".")[0] == name):
            return "refused", f"400 param={param}"
        return "FINDING", f"400 param={param}: {e.message[:100]}"
    except Exception as e:  # noqa: BLE001 - any other failure is a finding, reported as such
        return "FINDING", f"{type(e).__name__}: {str(e)[:100]}"
    return ("honoured", "") if name in honoured else ("FINDING", "answered, not listed as honoured")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="k3-tiny")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="unused", max_retries=0, timeout=120)
    endpoints = {"chat": (client.chat.completions.create, CHAT), "completions": (client.completions.create, COMPLETIONS),
                 "responses": (client.responses.create, RESPONSES)}
    findings = 0
    print(f"openai {openai.__version__}")
    for endpoint, (fn, samples) in endpoints.items():
        skip = {"self", "model", "messages", "prompt", "input", "extra_headers", "extra_query", "extra_body", "timeout"}
        params = [p for p in inspect.signature(fn).parameters if p not in skip]
        print(f"\n## {endpoint}: {len(params)} client parameters")
        for name in params:
            if name not in samples:
                print(f"  unprobed  {name}")
                continue
            value, extra = samples[name]
            verdict, note = probe(client, endpoint, a.model, name, {name: value, **extra}, HONOURED[endpoint])
            findings += verdict == "FINDING"
            print(f"  {verdict:9} {name} {note}")
        # Unknown fields sent as null: absent (docs/api.md).
        verdict, note = probe(client, endpoint, a.model, "<null>", {"extra_body": {"kestrel_unknown_field": None}},
                              {"<null>"})
        findings += verdict == "FINDING"
        print(f"  {'honoured' if verdict == 'honoured' else verdict:9} an unknown field sent as null {note}")
    print("\n## nested fields")
    for endpoint, what, kw, expect in NESTED:
        verdict, note = probe(client, endpoint, a.model, what.split()[0], kw, {what.split()[0]})
        # A refusal must name a field (`param`), as docs/api.md promises.
        ok = (verdict == "honoured") if expect == "honoured" else (
            verdict == "refused" or (note.startswith("400") and not note.startswith("400 param=None")))
        findings += not ok
        got = "400 " + note[4:] if note.startswith("400") else verdict
        print(f"  {'ok' if ok else 'FINDING':9} {endpoint}: {what}: expected {expect}, got {got}")
    print(f"\n{findings} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
