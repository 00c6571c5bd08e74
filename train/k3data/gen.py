"""Procedural training/evaluation data in the K3 chat format (issue #8 "Data").

Every generator is a pure function of an integer seed (random.Random(seed)); training uses seeds < 1,000,000
and the evaluation sets (make_eval.py) seeds ≥ 1,000,000, so no evaluation conversation is trained on.
No file outside this package is read: filler text comes from word lists below.

A generator returns a conversation dict {"task", "messages", "tools"?, "reasoning_effort"?, "expect", "meta"}:
the last message is the assistant turn to learn (training) or is dropped and scored (evaluation).
- arith: multi-step word problems; the reasoning's length follows reasoning_effort (low: the equations;
  high: one sentence per step; max: digit-by-digit work plus a check), the content is the bare answer.
- tool: 2–4 tools declared in JSON Schema (string/number/integer/boolean/null/object/array params, enums,
  required fields); a request that fits one tool -> a call with schema-valid arguments, the tool result,
  the final answer; or a request no tool fits -> a plain answer.
- passkey: a 5-digit key hidden at a given depth of natural-ish filler, asked for at the end.
- chat: short multi-turn small talk and recall of what the user said earlier.
"""
from __future__ import annotations

import json
import random

# ----------------------------------------------------------------------------------------------------------
# word lists
# ----------------------------------------------------------------------------------------------------------
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe"]
ITEMS = ["apples", "books", "coins", "stamps", "marbles", "pencils", "cookies", "shells", "cards", "stickers",
         "eggs", "boxes", "tickets", "flowers", "bottles", "candles", "ribbons", "buttons"]
CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Madrid", "Nairobi", "Seoul", "Toronto",
          "Sydney", "Mumbai", "Rome", "Dublin", "Quito", "Hanoi", "Vienna", "Lagos", "Denver", "Prague"]
COUNTRIES = {"France": "Paris", "Germany": "Berlin", "Japan": "Tokyo", "Peru": "Lima", "Egypt": "Cairo",
             "Norway": "Oslo", "Spain": "Madrid", "Kenya": "Nairobi", "Italy": "Rome", "Ireland": "Dublin",
             "Ecuador": "Quito", "Austria": "Vienna", "Vietnam": "Hanoi", "Canada": "Ottawa"}
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "brown"]
ANIMALS = ["cat", "dog", "horse", "rabbit", "parrot", "turtle", "fox", "owl", "goat", "dolphin"]
ADJ = ["quiet", "old", "small", "bright", "busy", "green", "narrow", "warm", "cold", "wide", "calm", "long",
       "heavy", "gentle", "early", "late", "simple", "strange", "common", "distant"]
NOUNS = ["river", "village", "market", "garden", "road", "library", "harbor", "forest", "bridge", "kitchen",
         "station", "valley", "school", "window", "meadow", "tower", "farm", "museum", "island", "street"]
VERBS = ["walked past", "looked at", "painted", "visited", "cleaned", "described", "repaired", "crossed",
         "watched", "remembered", "photographed", "left", "found", "measured", "opened", "closed"]
PEOPLE = ["the farmer", "a teacher", "the baker", "an old man", "the children", "a traveler", "the mayor",
          "my neighbor", "the engineer", "a student", "the captain", "the doctor"]
TIMES = ["in the morning", "after lunch", "at noon", "before sunset", "on Monday", "every spring",
         "during the storm", "last winter", "at dawn", "in the evening", "once a year", "yesterday"]


def filler_sentence(r: random.Random) -> str:
    k = r.randrange(6)
    if k == 0:
        return f"{r.choice(PEOPLE).capitalize()} {r.choice(VERBS)} the {r.choice(ADJ)} {r.choice(NOUNS)} {r.choice(TIMES)}."
    if k == 1:
        return f"The {r.choice(NOUNS)} near the {r.choice(NOUNS)} was {r.choice(ADJ)} and {r.choice(ADJ)}."
    if k == 2:
        return f"{r.choice(TIMES).capitalize()}, {r.choice(PEOPLE)} {r.choice(VERBS)} a {r.choice(ADJ)} {r.choice(NOUNS)}."
    if k == 3:
        return f"The grass is green, the sky is {r.choice(COLORS)}, and the {r.choice(NOUNS)} is {r.choice(ADJ)}."
    if k == 4:
        return f"Nobody knew why the {r.choice(ANIMALS)} liked the {r.choice(ADJ)} {r.choice(NOUNS)} so much."
    return f"There was a {r.choice(ADJ)} {r.choice(NOUNS)} where {r.choice(PEOPLE)} lived with a {r.choice(ANIMALS)}."


# ----------------------------------------------------------------------------------------------------------
# arithmetic
# ----------------------------------------------------------------------------------------------------------
def _num(r, digits):
    return r.randint(10 ** (digits - 1) if digits > 1 else 1, 10 ** digits - 1)


def _digit_add(a, b):
    """Column addition, units first: 'units 7 + 8 = 15, write 5 carry 1; tens ...'."""
    names = ["units", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands"]
    out, carry, i = [], 0, 0
    x, y = a, b
    while x or y or carry:
        dx, dy = x % 10, y % 10
        s = dx + dy + carry
        part = f"{names[min(i, 5)]} {dx} + {dy}" + (f" + {carry}" if carry else "") + f" = {s}"
        if s >= 10:
            part += f", write {s - 10} carry 1"
        out.append(part)
        carry = 1 if s >= 10 else 0
        x, y, i = x // 10, y // 10, i + 1
    return "; ".join(out)


def _digit_sub(a, b):
    names = ["units", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands"]
    out, borrow, i = [], 0, 0
    x, y = a, b
    while x:
        dx, dy = x % 10, y % 10
        d = dx - borrow - dy
        part = f"{names[min(i, 5)]} {dx}" + (" - 1" if borrow else "") + f" - {dy}"
        if d < 0:
            part += f": borrow, {d + 10}"
            borrow = 1
            d += 10
        else:
            part += f" = {d}"
            borrow = 0
        out.append(part)
        x, y, i = x // 10, y // 10, i + 1
    return "; ".join(out)


def _digit_mul(a, b):
    """a × one-digit b, digit by digit."""
    out, carry, i, x = [], 0, 0, a
    while x or carry:
        d = x % 10
        p = d * b + carry
        out.append(f"{d} × {b}" + (f" + {carry}" if carry else "") + f" = {p}" + (f", write {p % 10} carry {p // 10}" if p >= 10 else ""))
        carry, x, i = p // 10, x // 10, i + 1
    return "; ".join(out)


def arith(seed: int, effort: str | None = None, digits: int | None = None, steps: int | None = None) -> dict:
    r = random.Random(seed)
    effort = effort or r.choice(["low", "high", "max"])
    digits = digits or r.choice([1, 2, 2, 3, 3])
    steps = steps or r.choice([1, 2, 2, 3])
    name, item = r.choice(NAMES), r.choice(ITEMS)
    total = _num(r, digits)
    story = [f"{name} has {total} {item}."]
    eqs, sentences, detail = [], [f"{name} starts with {total} {item}."], []
    for _ in range(steps):
        op = r.choice(["add", "add", "sub", "mul"] if total < 1000 else ["add", "sub"])
        if op == "add":
            n = _num(r, digits)
            verb = r.choice(["buys", "finds", "gets", "is given", "wins"])
            story.append(f"Then {name} {verb} {n} more.")
            new = total + n
            eqs.append(f"{total} + {n} = {new}")
            sentences.append(f"After getting {n} more: {total} + {n} = {new}.")
            detail.append(f"{total} + {n}: {_digit_add(total, n)}. So {total} + {n} = {new}.")
        elif op == "sub" and total > 1:
            n = r.randint(1, total - 1)
            verb = r.choice(["gives away", "loses", "sells", "uses"])
            story.append(f"Then {name} {verb} {n}.")
            new = total - n
            eqs.append(f"{total} - {n} = {new}")
            sentences.append(f"After removing {n}: {total} - {n} = {new}.")
            detail.append(f"{total} - {n}: {_digit_sub(total, n)}. So {total} - {n} = {new}.")
        else:
            n = r.randint(2, 9)
            story.append(f"Then the number of {item} is multiplied by {n}.")
            new = total * n
            eqs.append(f"{total} × {n} = {new}")
            sentences.append(f"Multiplying by {n}: {total} × {n} = {new}.")
            detail.append(f"{total} × {n}: {_digit_mul(total, n)}. So {total} × {n} = {new}.")
        total = new
    q = f"How many {item} does {name} have now?"
    user = " ".join(story) + " " + q
    if effort == "low":
        reasoning = " ".join(e + "." for e in eqs)
    elif effort in ("high", "medium"):
        reasoning = " ".join(sentences) + f" So {name} has {total} {item}."
    else:
        reasoning = ("Let me work through this carefully, one step at a time.\n" + "\n".join(detail)
                     + f"\nCheck: the steps were " + ", then ".join(eqs) + f". The final count is {total}.")
    msgs = [{"role": "user", "content": user},
            {"role": "assistant", "reasoning_content": reasoning, "content": str(total)}]
    return {"task": "arith", "messages": msgs, "reasoning_effort": effort, "expect": {"answer": str(total)},
            "meta": {"effort": effort, "digits": digits, "steps": steps}}


# ----------------------------------------------------------------------------------------------------------
# tools
# ----------------------------------------------------------------------------------------------------------
def _fn(name, desc, props, required):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


TOOLS = {
    "get_weather": _fn("get_weather", "Get the current weather for a city.", {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    "convert_currency": _fn("convert_currency", "Convert an amount of money between currencies.", {
        "amount": {"type": "number"}, "from_currency": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]},
        "to_currency": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]}},
        ["amount", "from_currency", "to_currency"]),
    "set_alarm": _fn("set_alarm", "Set an alarm.", {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23}, "minute": {"type": "integer", "minimum": 0,
                                                                            "maximum": 59},
        "label": {"type": "string"}, "repeat_daily": {"type": "boolean"}}, ["hour", "minute"]),
    "search_flights": _fn("search_flights", "Search for flights.", {
        "origin": {"type": "string"}, "destination": {"type": "string"},
        "passengers": {"type": "integer", "minimum": 1}, "nonstop": {"type": "boolean"}},
        ["origin", "destination", "passengers"]),
    "create_event": _fn("create_event", "Create a calendar event.", {
        "title": {"type": "string"}, "attendees": {"type": "array", "items": {"type": "string"}},
        "duration_minutes": {"type": "integer"},
        "location": {"type": "object", "properties": {"name": {"type": "string"}, "room": {"type": "integer"}},
                     "required": ["name"]}}, ["title", "attendees", "duration_minutes"]),
    "send_email": _fn("send_email", "Send an email.", {
        "to": {"type": "string"}, "subject": {"type": "string"}, "urgent": {"type": "boolean"},
        "cc": {"type": "array", "items": {"type": "string"}}}, ["to", "subject"]),
    "set_thermostat": _fn("set_thermostat", "Set the thermostat.", {
        "temperature": {"type": "number"}, "mode": {"type": "string", "enum": ["heat", "cool", "auto"]},
        "zone": {"type": ["string", "null"]}}, ["temperature", "mode", "zone"]),
    "calculate_tip": _fn("calculate_tip", "Calculate a tip.", {
        "bill": {"type": "number"}, "percent": {"type": "integer"}}, ["bill", "percent"]),
    "lookup_word": _fn("lookup_word", "Look up the definition of an English word.", {
        "word": {"type": "string"}, "examples": {"type": "boolean"}}, ["word"]),
    "add_todo": _fn("add_todo", "Add items to the to-do list.", {
        "items": {"type": "array", "items": {"type": "string"}}, "priority": {"type": "integer", "minimum": 1,
                                                                             "maximum": 5},
        "due": {"type": ["string", "null"]}}, ["items"]),
}
TASKS = ["call a plumber", "buy milk", "pay rent", "water the plants", "book a dentist", "wash the car",
         "read chapter 3", "call mom", "fix the bike", "send the report"]
WORDS = ["serendipity", "harbor", "gentle", "meadow", "lantern", "quartz", "voyage", "ember", "tranquil", "orbit"]


def _call_case(r, name):
    """(user text, arguments dict, tool result dict, final answer)."""
    if name == "get_weather":
        c = r.choice(CITIES)
        args = {"city": c}
        unit = r.choice([None, "celsius", "fahrenheit"])
        if unit:
            args["unit"] = unit
        t = r.randint(-5, 35)
        u = {"celsius": "C", "fahrenheit": "F", None: "C"}[unit]
        user = r.choice([f"What's the weather like in {c}?", f"How warm is it in {c} right now?",
                         f"Tell me the weather in {c}" + (f" in {unit}." if unit else ".")])
        return user, args, {"temperature": t, "unit": u, "conditions": r.choice(["sunny", "rainy", "cloudy"])}, \
            f"It is {t}°{u} in {c} right now."
    if name == "convert_currency":
        a = r.choice([r.randint(1, 999), round(r.uniform(1, 500), 2)])
        f, t = r.sample(["USD", "EUR", "JPY", "GBP"], 2)
        res = round(a * r.uniform(0.5, 2.0), 2)
        return (f"Convert {a} {f} to {t}.", {"amount": a, "from_currency": f, "to_currency": t},
                {"result": res}, f"{a} {f} is about {res} {t}.")
    if name == "set_alarm":
        h, m = r.randint(0, 23), r.choice([0, 15, 30, 45, r.randint(0, 59)])
        args = {"hour": h, "minute": m}
        user = f"Set an alarm for {h:02d}:{m:02d}"
        if r.random() < 0.5:
            lab = r.choice(["gym", "meeting", "medicine", "wake up"])
            args["label"] = lab
            user += f" labeled {lab}"
        if r.random() < 0.5:
            args["repeat_daily"] = True
            user += ", every day"
        return user + ".", args, {"ok": True}, f"Your alarm is set for {h:02d}:{m:02d}."
    if name == "search_flights":
        o, d = r.sample(CITIES, 2)
        p = r.randint(1, 6)
        args = {"origin": o, "destination": d, "passengers": p}
        user = f"Find flights from {o} to {d} for {p} " + ("person" if p == 1 else "people")
        if r.random() < 0.5:
            ns = r.random() < 0.5
            args["nonstop"] = ns
            user += ", nonstop only" if ns else ", stops are fine"
        n = r.randint(0, 9)
        return user + ".", args, {"flights_found": n}, f"I found {n} flights from {o} to {d}."
    if name == "create_event":
        title = r.choice(["Team sync", "Lunch", "Project review", "Birthday party", "Study group"])
        people = r.sample(NAMES, r.randint(1, 3))
        dur = r.choice([15, 30, 45, 60, 90])
        args = {"title": title, "attendees": people, "duration_minutes": dur}
        user = f"Create an event '{title}' with {', '.join(people)} for {dur} minutes"
        if r.random() < 0.6:
            loc = {"name": r.choice(NOUNS).capitalize() + " Hall"}
            if r.random() < 0.5:
                loc["room"] = r.randint(1, 400)
                user += f" in {loc['name']}, room {loc['room']}"
            else:
                user += f" in {loc['name']}"
            args["location"] = loc
        return user + ".", args, {"event_id": r.randint(1000, 9999)}, f"The event '{title}' is created."
    if name == "send_email":
        to = r.choice(NAMES).lower() + "@example.com"
        subj = r.choice(["Meeting notes", "Invoice", "Hello", "Weekend plans", "Report"])
        args = {"to": to, "subject": subj}
        user = f"Send an email to {to} with the subject '{subj}'"
        if r.random() < 0.5:
            args["urgent"] = r.random() < 0.5
            user += ", marked urgent" if args["urgent"] else ", not urgent"
        if r.random() < 0.4:
            cc = [r.choice(NAMES).lower() + "@example.com" for _ in range(r.randint(1, 2))]
            args["cc"] = cc
            user += ", cc " + " and ".join(cc)
        return user + ".", args, {"sent": True}, f"The email to {to} has been sent."
    if name == "set_thermostat":
        t = r.choice([r.randint(16, 28), r.randint(16, 27) + 0.5])
        mode = r.choice(["heat", "cool", "auto"])
        zone = r.choice([None, "bedroom", "kitchen", "office"])
        user = f"Set the thermostat to {t} degrees on {mode}" + (f" in the {zone}." if zone else " for the whole house.")
        return user, {"temperature": t, "mode": mode, "zone": zone}, {"ok": True}, \
            f"The thermostat is set to {t} degrees ({mode})."
    if name == "calculate_tip":
        b = r.choice([r.randint(10, 300), round(r.uniform(10, 300), 2)])
        p = r.choice([10, 15, 18, 20, 25])
        tip = round(b * p / 100, 2)
        return (f"What's a {p}% tip on a bill of {b}?", {"bill": b, "percent": p}, {"tip": tip},
                f"A {p}% tip on {b} is {tip}.")
    if name == "lookup_word":
        w = r.choice(WORDS)
        args = {"word": w}
        user = f"What does '{w}' mean?"
        if r.random() < 0.5:
            args["examples"] = True
            user = f"Define '{w}' and give examples."
        return user, args, {"definition": f"the meaning of {w}"}, f"'{w}' means: the meaning of {w}."
    items = r.sample(TASKS, r.randint(1, 3))
    args = {"items": items}
    user = "Add " + " and ".join(items) + " to my to-do list"
    if r.random() < 0.5:
        args["priority"] = r.randint(1, 5)
        user += f" with priority {args['priority']}"
    if r.random() < 0.3:
        args["due"] = r.choice([None, "tomorrow", "Friday"])
        user += f", due {args['due']}" if args["due"] else ", no due date"
    return user + ".", args, {"added": len(items)}, f"Added {len(items)} item(s) to your to-do list."


NOFIT = [("Tell me a joke.", "Why did the scarecrow win an award? Because he was outstanding in his field."),
         ("What is the capital of {country}?", "The capital of {country} is {capital}."),
         ("Say hello in a friendly way.", "Hello! It is nice to meet you."),
         ("What color do you get by mixing blue and yellow?", "Mixing blue and yellow gives green."),
         ("How many legs does a {animal} have?", "A {animal} has {legs} legs."),
         ("Thanks for your help!", "You're welcome! Happy to help.")]
LEGS = {"cat": 4, "dog": 4, "horse": 4, "rabbit": 4, "parrot": 2, "turtle": 4, "fox": 4, "owl": 2, "goat": 4,
        "dolphin": 0}


def _types(v):
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, dict):
        return "object"
    return "array"


def tool(seed: int, kind: str | None = None) -> dict:
    r = random.Random(seed)
    kind = kind or ("nofit" if r.random() < 0.25 else "call")
    names = r.sample(sorted(TOOLS), r.randint(2, 4))
    tools = [TOOLS[n] for n in names]
    effort = r.choice([None, None, "low", "high"])
    if kind == "call":
        name = r.choice(names)
        user, args, result, final = _call_case(r, name)
        cid = f"call_{r.randint(0, 10**6)}"
        reasoning = f"The user wants this done; the {name} tool fits. I will call it."
        msgs = [{"role": "user", "content": user},
                {"role": "assistant", "reasoning_content": reasoning, "content": "",
                 "tool_calls": [{"id": cid, "type": "function",
                                 "function": {"name": name, "arguments": json.dumps(args)}}]},
                {"role": "tool", "tool_call_id": cid, "content": json.dumps(result)},
                {"role": "assistant", "reasoning_content": "The tool returned the result; I will report it.",
                 "content": final}]
        expect = {"call": True, "name": name}
        meta = {"kind": "call", "types": sorted({_types(v) for v in args.values()})}
    else:
        q, a = r.choice(NOFIT)
        country = r.choice(sorted(COUNTRIES))
        animal = r.choice(ANIMALS)
        fmt = {"country": country, "capital": COUNTRIES[country], "animal": animal, "legs": LEGS[animal]}
        msgs = [{"role": "user", "content": q.format(**fmt)},
                {"role": "assistant", "reasoning_content": "None of the tools fits this request; I answer directly.",
                 "content": a.format(**fmt)}]
        expect = {"call": False}
        meta = {"kind": "nofit", "types": []}
    out = {"task": "tool", "messages": msgs, "tools": tools, "expect": expect, "meta": meta}
    if effort:
        out["reasoning_effort"] = effort
    return out


# ----------------------------------------------------------------------------------------------------------
# passkey
# ----------------------------------------------------------------------------------------------------------
PASSKEY_INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will ask you about the pass key afterwards.\n\n")
PASSKEY_Q = "\n\nWhat is the pass key? Answer with the number only."


def passkey(seed: int, context_tokens: int = 1024, depth: float | None = None, tok=None) -> dict:
    """`context_tokens`: target prompt length in tokens (counted with `tok` when given, else ≈ 1.25 tokens per
    word, fine for training); `depth` in [0, 1]: where the key sentence sits in the filler."""
    r = random.Random(seed)
    depth = r.random() if depth is None else depth
    key = r.randint(10000, 99999)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    budget = max(context_tokens - (130 if tok is not None else 80), 16)
    sents, n = [], 0
    while n < budget:
        s = filler_sentence(r)
        sents.append(s)
        n += len(tok.encode(" " + s)) if tok is not None else int(len(s.split()) * 1.25) + 1
    pos = round(depth * len(sents))
    body = " ".join(sents[:pos] + [needle] + sents[pos:])
    msgs = [{"role": "user", "content": PASSKEY_INTRO + body + PASSKEY_Q},
            {"role": "assistant", "reasoning_content": f"The text says the pass key is {key}.", "content": str(key)}]
    return {"task": "passkey", "messages": msgs, "expect": {"answer": str(key)},
            "meta": {"context_tokens": context_tokens, "depth": depth}}


# ----------------------------------------------------------------------------------------------------------
# chat
# ----------------------------------------------------------------------------------------------------------
def chat(seed: int) -> dict:
    r = random.Random(seed)
    name, color, animal, city = r.choice(NAMES), r.choice(COLORS), r.choice(ANIMALS), r.choice(CITIES)
    country = r.choice(sorted(COUNTRIES))
    facts = [(f"My name is {name}.", f"Nice to meet you, {name}!", "What is my name?", f"Your name is {name}."),
             (f"My favorite color is {color}.", f"{color.capitalize()} is a lovely color.",
              "What is my favorite color?", f"Your favorite color is {color}."),
             (f"I have a pet {animal}.", f"A {animal} sounds like a great companion.", "What pet do I have?",
              f"You have a pet {animal}."),
             (f"I live in {city}.", f"{city} is a nice place to live.", "Where do I live?", f"You live in {city}.")]
    r.shuffle(facts)
    n = r.randint(1, 3)
    msgs = []
    if r.random() < 0.3:
        msgs.append({"role": "system", "content": "You are a helpful, concise assistant."})
    for f in facts[:n]:
        msgs += [{"role": "user", "content": f[0]}, {"role": "assistant", "reasoning_content": "", "content": f[1]}]
    if r.random() < 0.3:
        msgs += [{"role": "user", "content": f"What is the capital of {country}?"},
                 {"role": "assistant", "reasoning_content": "", "content": f"The capital of {country} is "
                                                                          f"{COUNTRIES[country]}."}]
    f = r.choice(facts[:n])
    msgs += [{"role": "user", "content": f[2]},
             {"role": "assistant", "reasoning_content": "The user told me earlier.", "content": f[3]}]
    return {"task": "chat", "messages": msgs, "expect": {}, "meta": {"turns": n + 1}}


GENERATORS = {"arith": arith, "tool": tool, "passkey": passkey, "chat": chat}
