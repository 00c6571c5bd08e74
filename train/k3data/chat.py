"""K3 tokenizer, chat encoder and output parser in Python (MODEL.md §7), for training data and evaluation.

The encoder is a port of src/tokenizer/chat.cpp and must stay byte-identical to it: the prompt is a list of
segments, each encoded on its own (no BPE merge across segment boundaries); control segments (<|open|>,
<|close|>, <|sep|>, <|end_of_msg|>, image prompts) allow special tokens, every other segment is ordinary text.
tests/py/test_k3data_chat.py compares it with `kestrel tokenize --chat` on generated requests.

Training needs one more thing the engine does not: which tokens the model is meant to generate.  Every
segment carries a `target` flag, set for an assistant turn's tokens after its generation prompt
(`<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`) up to and including its <|end_of_msg|>.

The parser is a port of src/tokenizer/parser.cpp's state machine, run over a whole output at once: markers
are recognised by the special ids <|open|>/<|close|> ... <|sep|>, string arguments are kept raw, typed
arguments are parsed and re-serialised the Python json.dumps way.  Invalid UTF-8 is replaced (U+FFFD).

numpy-free and torch-free on purpose: CI runs it with tiktoken only.
"""
from __future__ import annotations

import base64
import json
import os
import re

import tiktoken

K3_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
MAX_ENCODE_CHARS = 400_000
MAX_SAME_CLASS_RUN = 25_000
NUM_SPECIALS = 256

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
EFFORTS = ("low", "medium", "high", "max")


class ChatError(ValueError):
    """A request the encoder rejects (the C++ encoder fails with an error for the same requests)."""


def _split_runs(s: str, limit: int):
    """Parts of s with no more than `limit` consecutive str.isspace() / non-space characters."""
    if not s:
        yield s
        return
    run_space, run_len, start = s[0].isspace(), 0, 0
    for i, ch in enumerate(s):
        sp = ch.isspace()
        if sp != run_space:
            run_space, run_len = sp, 1
        else:
            run_len += 1
            if run_len > limit:
                yield s[start:i]
                start, run_len = i, 1
    yield s[start:]


class Tokenizer:
    """tiktoken.model (`base64 rank` lines) + tokenizer_config.json (`added_tokens_decoder`); the 256 special
    slots follow the base ranks, unnamed ones are `<|reserved_token_{id}|>`."""

    def __init__(self, model_dir: str):
        ranks = {}
        with open(os.path.join(model_dir, "tiktoken.model"), encoding="ascii") as f:
            for line in f:
                if line.strip():
                    b64, rank = line.split()
                    ranks[base64.b64decode(b64)] = int(rank)
        self.n_base = len(ranks)
        names = {}
        cfg = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(cfg):
            with open(cfg, encoding="utf-8") as f:
                for k, v in json.load(f).get("added_tokens_decoder", {}).items():
                    names[int(k)] = v["content"]
        self.specials = {names.get(i, f"<|reserved_token_{i}|>"): i
                         for i in range(self.n_base, self.n_base + NUM_SPECIALS)}
        self.vocab_size = self.n_base + NUM_SPECIALS
        self.enc = tiktoken.Encoding("k3", pat_str=K3_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=self.specials)
        self._bytes = [None] * self.vocab_size
        for b, r in ranks.items():
            self._bytes[r] = b
        for name, i in self.specials.items():
            self._bytes[i] = name.encode("utf-8")

    def _encode(self, text: str, allow_special: bool) -> list:
        ids = []
        for c in range(0, len(text), MAX_ENCODE_CHARS):
            for part in _split_runs(text[c:c + MAX_ENCODE_CHARS], MAX_SAME_CLASS_RUN):
                if allow_special:
                    ids.extend(self.enc.encode(part, allowed_special="all"))
                else:
                    ids.extend(self.enc.encode(part, disallowed_special=()))
        return ids

    def encode(self, text: str) -> list:
        """Ordinary text: special-token names in it are encoded as plain text."""
        return self._encode(text, False)

    def encode_special(self, text: str) -> list:
        return self._encode(text, True)

    def special(self, name: str) -> int:
        if name not in self.specials:
            raise KeyError(f"no special token {name!r}")
        return self.specials[name]

    def is_special(self, i: int) -> bool:
        return self.n_base <= i < self.vocab_size

    def token_bytes(self, i: int) -> bytes:
        return self._bytes[i]

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self._bytes[i] for i in ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", "replace")


# ----------------------------------------------------------------------------------------------------------
# JSON helpers with the C++ (json_py.cpp) byte behaviour
# ----------------------------------------------------------------------------------------------------------
def _deep_sort(v):
    if isinstance(v, dict):
        return {k: _deep_sort(v[k]) for k in sorted(v)}
    if isinstance(v, list):
        return [_deep_sort(e) for e in v]
    return v


def _dumps(v, compact: bool) -> str:
    if compact:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(v, ensure_ascii=False)


def _escape_str(s: str) -> str:
    """JSON string body escaping (no quotes), as py_json_escape_append."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


def _escape_attr(v: str) -> str:
    return v.replace("&", "&amp;").replace('"', "&quot;")


def _unescape_attr(v: str) -> str:
    out, i = [], 0
    while i < len(v):
        if v.startswith("&quot;", i):
            out.append('"')
            i += 6
        elif v.startswith("&amp;", i):
            out.append("&")
            i += 5
        else:
            out.append(v[i])
            i += 1
    return "".join(out)


def _xtml_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, dict):
        return "object"
    return "array"


def _str_field(obj: dict, key: str, what: str) -> str:
    v = obj.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ChatError(f"{what}: '{key}' must be a string")
    return v


# ----------------------------------------------------------------------------------------------------------
# encoder
# ----------------------------------------------------------------------------------------------------------
class _Builder:
    def __init__(self, images=None):
        self.segs = []          # (text, allow_special, target)
        self.target = False
        self.images = images    # image resolver (see render_request) or None
        self.num_images = 0

    def control(self, t):
        if t:
            self.segs.append((t, True, self.target))

    def text(self, t):
        if t:
            self.segs.append((t, False, self.target))

    def open(self, tag, attrs=()):
        self.control(OPEN)
        self.text(tag)
        for k, v in attrs:
            self.text(" " + k)
            self.text('="')
            self.text(_escape_attr(v))
            self.text('"')
        self.control(SEP)

    def close(self, tag):
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def end_of_msg(self):
        self.control(END_OF_MSG)

    def internal_system(self, type_, body):
        self.open("message", [("role", "system"), ("type", type_)])
        self.text(body)
        self.close("message")
        self.end_of_msg()

    def image(self, part):
        """An image part: without a resolver the bare placeholder (the rendered template); with one, the
        engine's expansion (src/tokenizer/chat.cpp ChatEncoder::image, MODEL.md §6 "Prompt"):
        <|media_begin|>image {W}x{H}<|media_content|> + N × <|media_pad|> + <|media_end|>, one control segment."""
        index = self.num_images
        self.num_images += 1
        if self.images is None:
            self.control(IMAGE_PLACEHOLDER)
            return
        w, h, n = self.images(part, index)
        if w <= 0 or h <= 0 or n <= 0:
            raise ChatError(f"image {index} has an empty expansion")
        self.control(f"<|media_begin|>image {w}x{h}<|media_content|>" + "<|media_pad|>" * n + "<|media_end|>")

    def content(self, c, what):
        if c is None:
            return
        if isinstance(c, str):
            self.text(c)
            return
        if not isinstance(c, list):
            raise ChatError(f"{what}: content must be a string, null or an array of parts")
        for part in c:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ChatError(f"{what}: each content part needs a string 'type'")
            t = part["type"]
            if t == "text":
                self.text(_str_field(part, "text", what))
            elif t in ("image_url", "image", "input_image"):
                self.image(part)
            else:
                raise ChatError(f"{what}: unsupported content part type '{t}'")


def _tools_body(tools, dynamic: bool) -> str:
    js = _dumps(_deep_sort(tools), True)
    if dynamic:
        return ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
                "```json\n" + js + "\n```")
    return "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n" + js + "\n```"


def _declare_tools(b, tools, dynamic):
    b.open("message", [("role", "system"), ("type", "tool-declare")])
    b.text(_tools_body(tools, dynamic))
    b.close("message")
    b.end_of_msg()


def _call_function(call):
    f = call.get("function")
    return f if isinstance(f, dict) else call


def _call_name(call, i):
    fn = _call_function(call)
    if not isinstance(fn.get("name"), str):
        raise ChatError(f"assistant tool_calls[{i}]: function.name must be a string")
    return fn["name"]


def _parse_args_string(s: str):
    """(parsed object | None when unparseable).  JSON that is not an object is an error, as in C++."""
    try:
        v = json.loads(s, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(v, dict):
        raise ChatError("tool_calls arguments must be a JSON object")
    return v


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def _assistant_body(b, m, thinking, mi):
    what = f"messages[{mi}]"
    if thinking:
        b.open("think")
        b.target = True  # everything after the generation prompt is generated by the model
        if m.get("reasoning_content") is not None:
            r = m["reasoning_content"]
        else:
            r = m.get("reasoning")
        if r is not None:
            if not isinstance(r, str):
                raise ChatError(f"{what}: reasoning_content must be a string")
            if r.strip():
                b.text(r)
        b.close("think")
        b.open("response")
    else:
        b.open("response")
        b.target = True
    if "content" in m:
        b.content(m["content"], what)
    b.close("response")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ChatError(f"{what}: tool_calls must be an array")
    if not calls:
        return
    b.open("tools")
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            raise ChatError(f"{what}: tool_calls[{i}] must be an object")
        name = _call_name(call, i)
        b.open("call", [("tool", name), ("index", str(i + 1))])
        fn = _call_function(call)
        args = fn.get("arguments")
        json_block = None
        if args is None:
            args = {}
        elif isinstance(args, str):
            if not args.strip():
                args = {}
            else:
                parsed = _parse_args_string(args)
                if parsed is None:
                    json_block, args = args, {}
                else:
                    args = parsed
        elif not isinstance(args, dict):
            raise ChatError(f"{what}: tool_calls[{i}] arguments must be a JSON object or a string")
        if json_block is not None:
            b.open("json", [("type", "object")])
            b.text(json_block)
            b.close("json")
        else:
            for k, v in args.items():
                b.open("argument", [("key", k), ("type", _xtml_type(v))])
                b.text(v if isinstance(v, str) else _dumps(v, False))
                b.close("argument")
        b.close("call")
    b.close("tools")


def _bool_like(v, what):
    if isinstance(v, bool):
        return v
    if isinstance(v, dict) and v.get("type") in ("enabled", "disabled"):
        return v["type"] == "enabled"
    raise ChatError(f"{what} must be a boolean or {{\"type\": \"enabled\"|\"disabled\"}}")


def _id_text(v):
    return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))


def render_request(req: dict, images=None):
    """Request dict (OpenAI chat shape) -> (segments [(text, allow_special, target)], thinking).
    images (optional): resolver (part, index) -> (width, height, number of <|media_pad|>) for each image part
    in render order; None leaves each image part as the bare <|kimi_image_placeholder|>."""
    if not isinstance(req, dict):
        raise ChatError("the chat request must be a JSON object")
    messages = req.get("messages")
    if not isinstance(messages, list):
        raise ChatError("the chat request needs a 'messages' array")
    kwargs = req.get("chat_template_kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    thinking = True
    if req.get("thinking") is not None:
        thinking = _bool_like(req["thinking"], "'thinking'")
    for k in ("thinking", "enable_thinking"):
        if kwargs.get(k) is not None:
            thinking = _bool_like(kwargs[k], "chat_template_kwargs.thinking")
    effort = None
    if req.get("reasoning_effort") is not None:
        if not isinstance(req["reasoning_effort"], str):
            raise ChatError("'reasoning_effort' must be a string")
        if req["reasoning_effort"] == "none":
            thinking = False
        else:
            effort = req["reasoning_effort"]
    if kwargs.get("thinking_effort") is not None:
        if not isinstance(kwargs["thinking_effort"], str):
            raise ChatError("chat_template_kwargs.thinking_effort must be a string")
        effort = kwargs["thinking_effort"]
    if thinking and effort is not None and effort not in EFFORTS:
        raise ChatError(f"unsupported reasoning effort '{effort}'; supported: low, medium, high, max")

    b = _Builder(images)
    tools = req.get("tools")
    tools = [] if tools is None else tools
    if not isinstance(tools, list):
        raise ChatError("'tools' must be an array")
    tool_names = []
    for i, t in enumerate(tools):
        fn = t["function"] if isinstance(t, dict) and "function" in t else t
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatError(f"tools[{i}] needs function.name")
        tool_names.append(fn["name"])
    if tools:
        _declare_tools(b, tools, False)
    if thinking and effort is not None:
        b.internal_system("thinking-effort",
                          "`thinking_effort` guides on how much to think in your thinking channel (not including the "
                          "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                          "Now the system is invoked with `thinking_effort=" + effort + "`.")

    last_calls = None
    tool_counter = 0
    mi = 0
    while mi < len(messages):
        m = messages[mi]
        what = f"messages[{mi}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"{what}: needs a string 'role'")
        role = m["role"]
        name = _str_field(m, "name", what)
        sys_tools = isinstance(m.get("tools"), list) and len(m["tools"]) > 0
        if role == "user" or (role == "system" and not sys_tools) or role == "developer":
            attrs = [("role", "user" if role == "user" else "system")]
            if name:
                attrs.append(("name", name))
            b.open("message", attrs)
            if "content" in m:
                b.content(m["content"], what)
            b.close("message")
            b.end_of_msg()
            mi += 1
        elif role == "system":
            _declare_tools(b, m["tools"], True)
            mi += 1
        elif role == "assistant":
            last_calls = m["tool_calls"] if isinstance(m.get("tool_calls"), list) else None
            tool_counter = 0
            attrs = [("role", "assistant")]
            if name:
                attrs.append(("name", name))
            b.open("message", attrs)
            _assistant_body(b, m, thinking, mi)
            b.close("message")
            b.end_of_msg()
            b.target = False
            mi += 1
        elif role == "tool":
            end = mi
            while end < len(messages) and isinstance(messages[end], dict) and messages[end].get("role", "") == "tool":
                end += 1
            by_id = {}
            if last_calls is not None:
                for i, c in enumerate(last_calls):
                    if not isinstance(c, dict) or c.get("id") is None:
                        continue
                    cid = _id_text(c["id"])
                    if cid not in by_id:
                        by_id[cid] = (i + 1, _call_name(c, i))
            run = []  # [msg, name, index]
            all_matched = True
            for k in range(mi, end):
                t = messages[k]
                tool_counter += 1
                idv = t["tool_call_id"] if "tool_call_id" in t else t.get("id")
                if idv is not None and _id_text(idv) in by_id:
                    idx, nm = by_id[_id_text(idv)]
                    run.append([t, nm, idx])
                    continue
                all_matched = False
                tname = _str_field(t, "tool", "tool message") or _str_field(t, "name", "tool message")
                if not tname and last_calls is not None and tool_counter <= len(last_calls):
                    tname = _call_name(last_calls[tool_counter - 1], tool_counter - 1)
                if not tname:
                    raise ChatError(f"messages[{k}]: tool message needs a tool_call_id matching a preceding tool "
                                    "call, or a name")
                run.append([t, tname, tool_counter])
            if all_matched:
                run.sort(key=lambda r: r[2])
            else:
                base = tool_counter - len(run)
                for k, r in enumerate(run):
                    r[2] = base + k + 1
            for t, nm, idx in run:
                b.open("message", [("role", "tool"), ("tool", nm), ("index", str(idx))])
                if "content" in t:
                    b.content(t["content"], "tool message")
                b.close("message")
                b.end_of_msg()
            mi = end
        else:
            raise ChatError(f"{what}: unsupported role '{role}'")

    tc = req.get("tool_choice")
    if tc is not None:
        def required():
            b.internal_system("tool-choice",
                              "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.")
        if isinstance(tc, str):
            if tc == "required":
                required()
            elif tc == "none":
                b.internal_system("tool-choice", "The system is invoked with `tool_choice=none`.\n"
                                                 "You MUST NOT call any tools in the next message.")
            elif tc != "auto":
                raise ChatError(f"unsupported tool_choice '{tc}'")
        elif isinstance(tc, dict):
            fn = tc["function"] if "function" in tc else tc
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ChatError("tool_choice object needs function.name")
            if fn["name"] not in tool_names:
                raise ChatError(f"tool_choice names '{fn['name']}', which is not among the declared tools")
            required()
        else:
            raise ChatError("tool_choice must be a string or an object")

    rf = req.get("response_format")
    if rf is not None:
        if isinstance(rf, dict) and isinstance(rf.get("type"), str):
            typ = rf["type"]
        elif isinstance(rf, str):
            typ = rf
        else:
            typ = ""
        head = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
                "formatting.")
        if typ == "json_object":
            b.internal_system("response-format", "The system is invoked with `response_format=json_object`.\n" + head)
        elif typ == "json_schema":
            schema = None
            if isinstance(rf, dict) and rf.get("json_schema") is not None:
                js = rf["json_schema"]
                if isinstance(js, dict) and "schema" in js:
                    schema = js["schema"]
                elif isinstance(js, dict) and "json_schema" in js:
                    schema = js["json_schema"]
                else:
                    schema = js
            b.internal_system("response-format", "The system is invoked with `response_format=json_schema`.\n" + head
                              + "\nThe JSON data must match the following schema:\n```json\n"
                              + _dumps(_deep_sort(schema), True) + "\n```")
        elif typ != "text":
            raise ChatError(f"unsupported response_format type '{typ}'")

    gen = True
    if isinstance(req.get("add_generation_prompt"), bool):
        gen = req["add_generation_prompt"]
    if isinstance(kwargs.get("add_generation_prompt"), bool):
        gen = kwargs["add_generation_prompt"]
    if gen:
        b.open("message", [("role", "assistant")])
        b.open("think" if thinking else "response")
    return b.segs, thinking


def encode_segments(tok: Tokenizer, segs) -> tuple:
    """-> (ids, target flags) — one flag per id."""
    ids, tgt = [], []
    for text, allow, target in segs:
        part = tok.encode_special(text) if allow else tok.encode(text)
        ids.extend(part)
        tgt.extend([target] * len(part))
    return ids, tgt


def encode_request(tok: Tokenizer, req: dict, images=None) -> list:
    """A whole OpenAI-style request (as `kestrel tokenize --chat` reads it) -> prompt ids."""
    segs, _ = render_request(req, images)
    return encode_segments(tok, segs)[0]


def render_text(req: dict, images=None) -> str:
    """The rendered prompt text (what `kestrel tokenize --chat` prints before the ids)."""
    return "".join(s[0] for s in render_request(req, images)[0])


def _request(messages, tools, reasoning_effort, thinking, add_generation_prompt):
    req = {"messages": messages, "thinking": bool(thinking), "add_generation_prompt": bool(add_generation_prompt)}
    if tools:
        req["tools"] = tools
    if reasoning_effort is not None:
        req["reasoning_effort"] = reasoning_effort
    return req


def encode_chat(tok: Tokenizer, messages, tools=None, reasoning_effort=None, thinking=True,
                add_generation_prompt=True, images=None) -> list:
    """The shared interface (notes/evalformat.md): prompt ids for `messages`."""
    return encode_request(tok, _request(messages, tools, reasoning_effort, thinking, add_generation_prompt), images)


def encode_training(tok: Tokenizer, messages, tools=None, reasoning_effort=None, thinking=True, images=None):
    """A finished conversation -> (ids, loss mask): the mask is 1 exactly on the tokens the model generates in
    its assistant turns (everything after each turn's generation prompt, through its <|end_of_msg|>)."""
    segs, _ = render_request(_request(messages, tools, reasoning_effort, thinking, False), images)
    ids, tgt = encode_segments(tok, segs)
    return ids, [1 if t else 0 for t in tgt]


def generation_prompt_ids(tok: Tokenizer, thinking=True) -> list:
    b = _Builder()
    b.open("message", [("role", "assistant")])
    b.open("think" if thinking else "response")
    return encode_segments(tok, b.segs)[0]


def encode_completion(tok: Tokenizer, message: dict, thinking=True) -> list:
    """The ids a model generates for the assistant `message` after the generation prompt, <|end_of_msg|> included."""
    b = _Builder()
    b.open("message", [("role", "assistant")])
    _assistant_body(b, message, thinking, 0)
    b.close("message")
    b.end_of_msg()
    ids, tgt = encode_segments(tok, b.segs)
    return [i for i, t in zip(ids, tgt) if t]


# ----------------------------------------------------------------------------------------------------------
# output parser (port of src/tokenizer/parser.cpp, whole output at once)
# ----------------------------------------------------------------------------------------------------------
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_MAX_HEADER_BYTES = 4096


def _parse_header(h: str):
    i = h.find(" ")
    name = h if i < 0 else h[:i]
    if not name or not _NAME_RE.match(name):
        return None
    attrs = []
    i = len(name)
    while i < len(h):
        if h[i] != " ":
            return None
        i += 1
        eq = h.find('="', i)
        if eq < 0 or eq == i:
            return None
        key = h[i:eq]
        if " " in key or '"' in key:
            return None
        q = h.find('"', eq + 2)
        if q < 0:
            return None
        attrs.append((key, _unescape_attr(h[eq + 2:q])))
        i = q + 1
    return name, attrs


class _Parser:
    def __init__(self, tok, thinking, known_tools):
        self.tok = tok
        self.known = list(known_tools or [])
        self.open_id, self.close_id, self.sep_id = tok.special(OPEN), tok.special(CLOSE), tok.special(SEP)
        self.terms = [tok.specials[t] for t in (END_OF_MSG, "[EOS]", "[EOT]") if t in tok.specials]
        self.where = "think" if thinking else "response"
        self.header = None           # (is_open, bytearray) while inside a marker
        self.pending = bytearray()   # text bytes not yet emitted
        self.reasoning, self.content = [], []
        self.calls = []              # dicts: name, arguments (list of str), complete, error
        self.errors = []
        self.arg_is_string = False
        self.call_has_args = self.call_has_json = False
        self.arg_key = ""
        self.arg_raw = []

    def flush(self):
        if self.pending:
            self.emit(self.pending.decode("utf-8", "replace"))
            self.pending = bytearray()

    def emit_args(self, s):
        if s and self.calls:
            self.calls[-1]["arguments"].append(s)

    def emit(self, s):
        if not s:
            return
        w = self.where
        if w == "think":
            self.reasoning.append(s)
        elif w == "arg":
            if self.arg_is_string:
                self.emit_args(_escape_str(s))
            else:
                self.arg_raw.append(s)
        elif w == "json":
            self.emit_args(s)
        else:
            self.content.append(s)

    def abort_header(self):
        is_open, hb = self.header
        self.header = None
        self.emit(OPEN if is_open else CLOSE)
        self.pending += hb

    def push(self, i):
        if not (0 <= i < self.tok.vocab_size):
            self.errors.append(f"token id {i} is outside the vocabulary")
            return
        if not self.tok.is_special(i):
            if self.header is not None:
                self.header[1].extend(self.tok.token_bytes(i))
                if len(self.header[1]) > _MAX_HEADER_BYTES:
                    self.abort_header()
                return
            self.pending += self.tok.token_bytes(i)
            return
        if self.header is not None:
            if i == self.sep_id:
                is_open, hb = self.header
                self.header = None
                if not self.apply_marker(is_open, hb.decode("utf-8", "replace")):
                    self.emit(OPEN if is_open else CLOSE)
                    self.emit(hb.decode("utf-8", "replace"))
                    self.emit(SEP)
                return
            self.abort_header()
        if i in (self.open_id, self.close_id):
            self.flush()
            self.header = (i == self.open_id, bytearray())
            return
        self.flush()
        if i in self.terms:
            return
        self.emit(self.tok.token_bytes(i).decode("utf-8", "replace"))

    def close_argument(self, truncated):
        self.flush()
        raw = "".join(self.arg_raw)
        if self.arg_is_string:
            if not truncated:
                self.emit_args('"')
        elif truncated:
            self.emit_args(raw)
        else:
            try:
                v = json.loads(raw, parse_constant=_reject_constant)
                self.emit_args(_dumps(v, False))
            except (ValueError, RecursionError):
                self.errors.append(f"tool call {len(self.calls) - 1}: argument '{self.arg_key}' is not valid JSON")
                if not self.calls[-1]["error"]:
                    self.calls[-1]["error"] = f"argument '{self.arg_key}' is not valid JSON"
                self.emit_args('"' + _escape_str(raw) + '"')
        self.arg_raw = []
        self.where = "call"

    def close_call(self, complete):
        c = self.calls[-1]
        if complete:
            if not self.call_has_json:
                self.emit_args("}" if self.call_has_args else "{}")
            c["complete"] = True
            try:
                ok = isinstance(json.loads("".join(c["arguments"])), dict)
            except ValueError:
                ok = False
            if not ok and not c["error"]:
                c["error"] = "arguments are not a JSON object"
                self.errors.append(f"tool call {len(self.calls) - 1}: arguments are not a JSON object")
        self.where = "tools"

    def apply_marker(self, is_open, header):
        m = _parse_header(header)
        if m is None:
            return False
        n, attrs = m
        bare = not attrs
        a = dict(attrs)
        w = self.where
        if is_open:
            if n in ("think", "response", "tools") and bare and w in ("top", "think", "response", "done"):
                if w in ("think", "response"):
                    self.errors.append(f"block '{n}' opened inside an unclosed block")
                self.where = n
                return True
            if n == "call" and w == "tools":
                if "tool" not in a:
                    return False
                c = {"name": a["tool"], "arguments": [], "complete": False, "error": ""}
                if self.known and c["name"] not in self.known:
                    c["error"] = f"unknown tool '{c['name']}'"
                    self.errors.append(f"tool call {len(self.calls)}: unknown tool '{c['name']}'")
                self.calls.append(c)
                self.call_has_args = self.call_has_json = False
                self.where = "call"
                return True
            if n == "argument" and w == "call":
                if "key" not in a:
                    return False
                self.arg_key = a["key"]
                self.arg_is_string = a.get("type") is None or a["type"] == "string"
                head = ', "' if (self.call_has_args or self.call_has_json) else '{"'
                if self.call_has_json:
                    self.errors.append("tool call mixes a json block and arguments")
                head += _escape_str(a["key"]) + '": '
                if self.arg_is_string:
                    head += '"'
                self.emit_args(head)
                self.call_has_args = True
                self.arg_raw = []
                self.where = "arg"
                return True
            if n == "json" and w == "call":
                if self.call_has_args or self.call_has_json:
                    self.errors.append("tool call mixes a json block and arguments")
                self.call_has_json = True
                self.where = "json"
                return True
            return False
        if not bare:
            return False
        if n in ("think", "response", "tools") and w == n:
            self.where = "top"
            return True
        if n == "call" and w == "call":
            self.close_call(True)
            return True
        if n == "argument" and w == "arg":
            self.close_argument(False)
            return True
        if n == "json" and w == "json":
            self.flush()
            self.where = "call"
            return True
        if n == "message" and w not in ("arg", "json", "call"):
            if w in ("think", "response", "tools"):
                self.errors.append("message closed inside an unclosed block")
            self.where = "done"
            return True
        return False

    def finish(self, stopped):
        if self.header is not None:
            self.errors.append("output ended inside a marker")
            self.abort_header()
        self.flush()
        if self.where in ("call", "arg", "json"):
            if self.where == "arg":
                self.close_argument(True)
            c = self.calls[-1]
            c["complete"] = False
            c["error"] = c["error"] or "truncated"
            self.errors.append(f"output ended inside tool call {len(self.calls) - 1}")
            self.where = "tools"
        any_complete = any(c["complete"] for c in self.calls)
        return "length" if not stopped else ("tool_calls" if any_complete else "stop")


def parse_output(tok: Tokenizer, ids, thinking=True, known_tools=None, stopped=None) -> dict:
    """Generated ids (after the generation prompt) -> {"reasoning_content", "content", "tool_calls": [{"name",
    "arguments" (JSON text)}], "finish_reason", "errors"}.  `stopped`: generation ended on a stop token (True)
    or on the token limit (False); None = decide by whether the last id is a stop token."""
    p = _Parser(tok, thinking, known_tools)
    ids = [int(i) for i in ids]
    for i in ids:
        p.push(i)
    if stopped is None:
        stopped = bool(ids) and ids[-1] in p.terms
    fr = p.finish(stopped)
    return {"reasoning_content": "".join(p.reasoning), "content": "".join(p.content),
            "tool_calls": [{"name": c["name"], "arguments": "".join(c["arguments"]),
                            **({"error": c["error"]} if c["error"] else {})} for c in p.calls],
            "finish_reason": fr, "errors": p.errors}
