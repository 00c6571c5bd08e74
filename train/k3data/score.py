"""Scoring rules of the shared evaluation format (notes: eval-set format), for one parsed response.

- passkey / arith: correct iff the LAST integer (regex -?[0-9]+) of the final `content` equals expect.answer.
- tool (K2 Vendor Verifier style): schema-valid iff finish_reason == "tool_calls" and every call names a
  declared tool and its arguments parse as a JSON object valid against that tool's `parameters`; triggered
  correctly iff (finish_reason == "tool_calls") == expect.call and, when a call is expected, the names match.
The JSON Schema check covers the keywords the generated tools use (type incl. type lists, properties,
required, additionalProperties, enum, items, minimum, maximum) — CI has no `jsonschema` package.
"""
from __future__ import annotations

import json
import re

_INT = re.compile(r"-?[0-9]+")


def last_int_correct(content: str, answer: str) -> bool:
    found = _INT.findall(content or "")
    return bool(found) and found[-1] == str(answer)


def _is_type(v, t):
    if t == "string":
        return isinstance(v, str)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, float) and v.is_integer())
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "null":
        return v is None
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    return True


def validate(v, schema) -> bool:
    if not isinstance(schema, dict):
        return True
    t = schema.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        if not any(_is_type(v, x) for x in ts):
            return False
    if "enum" in schema and v not in schema["enum"]:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if "minimum" in schema and v < schema["minimum"]:
            return False
        if "maximum" in schema and v > schema["maximum"]:
            return False
    if isinstance(v, dict):
        props = schema.get("properties", {})
        for r in schema.get("required", []):
            if r not in v:
                return False
        for k, x in v.items():
            if k in props:
                if not validate(x, props[k]):
                    return False
            elif schema.get("additionalProperties") is False:
                return False
    if isinstance(v, list) and "items" in schema:
        return all(validate(x, schema["items"]) for x in v)
    return True


def tool_scores(parsed: dict, tools: list, expect: dict) -> dict:
    """-> {"called": bool, "schema_ok": bool | None (None when no call), "trigger_ok": bool}."""
    called = parsed.get("finish_reason") == "tool_calls"
    decl = {}
    for t in tools or []:
        fn = t.get("function", t)
        decl[fn["name"]] = fn.get("parameters", {})
    schema_ok = None
    if called:
        schema_ok = True
        for c in parsed.get("tool_calls", []):
            if c["name"] not in decl:
                schema_ok = False
                break
            try:
                args = json.loads(c["arguments"])
            except ValueError:
                schema_ok = False
                break
            if not isinstance(args, dict) or not validate(args, decl[c["name"]]):
                schema_ok = False
                break
    trigger_ok = called == bool(expect.get("call"))
    if trigger_ok and called:
        names = [c["name"] for c in parsed.get("tool_calls", [])]
        trigger_ok = bool(names) and names[0] == expect.get("name")
    return {"called": called, "schema_ok": schema_ok, "trigger_ok": trigger_ok}
