// The scorer of `kestrel eval` (src/evalclient): hand-written responses with known verdicts under the
// rules of docs/eval.md — last-integer extraction, the K2 Vendor Verifier tool-call rules, error
// accounting, response parsing from OpenAI bodies and saved files, and eval-set checking.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/check.h"
#include "evalclient/eval_set.h"
#include "evalclient/scorer.h"

using namespace kestrel::eval;
using json = nlohmann::json;

namespace {

const char* kWeatherTools = R"([{"type": "function", "function": {"name": "get_weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                 "unit": {"enum": ["c", "f"]}}, "required": ["city"], "additionalProperties": false}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}])";

EvalItem tool_item(bool call) {
  json j = {{"id", call ? "tool-call-1" : "tool-nofit-1"},
            {"task", "tool"},
            {"request", {{"messages", json::array({{{"role", "user"}, {"content", "weather in Paris?"}}})},
                         {"tools", json::parse(kWeatherTools)}}},
            {"expect", call ? json{{"call", true}, {"name", "get_weather"}} : json{{"call", false}}},
            {"meta", {{"kind", call ? "call" : "nofit"}}}};
  return parse_eval_item(j.dump(), "t:1");
}

EvalItem number_item(const char* task, const char* answer) {
  json j = {{"id", std::string(task) + "-1"},
            {"task", task},
            {"request", {{"messages", json::array({{{"role", "user"}, {"content", "?"}}})}}},
            {"expect", {{"answer", answer}}},
            {"meta", {{"context_tokens", 1024}, {"depth", 0.5}, {"effort", "low"}}}};
  return parse_eval_item(j.dump(), "t:1");
}

Response calls(std::vector<ToolCall> c, std::string finish = "tool_calls") {
  Response r;
  r.finish_reason = std::move(finish);
  r.tool_calls = std::move(c);
  return r;
}

Response text(std::string content, std::string reasoning = "") {
  Response r;
  r.finish_reason = "stop";
  r.content = std::move(content);
  r.reasoning_content = std::move(reasoning);
  return r;
}

}  // namespace

TEST(EvalScorer, LastIntegerExtraction) {
  EXPECT_EQ(last_integer("The passkey is 48213."), "48213");
  EXPECT_EQ(last_integer("12 apples, then 7"), "7");
  EXPECT_EQ(last_integer("answer: -42"), "-42");
  EXPECT_EQ(last_integer("5-3"), "-3");        // as re.findall(r"-?[0-9]+") reads it
  EXPECT_EQ(last_integer("x--7y"), "-7");
  EXPECT_EQ(last_integer("3.14"), "14");
  EXPECT_EQ(last_integer("48,213"), "213");
  EXPECT_EQ(last_integer("007"), "7");
  EXPECT_EQ(last_integer("-0"), "0");
  EXPECT_EQ(last_integer("a - b"), "");
  EXPECT_EQ(last_integer(""), "");
  EXPECT_EQ(last_integer("99999999999999999999999999 is big"), "99999999999999999999999999");
  EXPECT_EQ(normalize_integer("+0012"), "12");
  EXPECT_EQ(normalize_integer("1e3"), "");
  EXPECT_EQ(normalize_integer("-"), "");
}

TEST(EvalScorer, PasskeyAndArithUseTheLastIntegerOfContentOnly) {
  const EvalItem pk = number_item("passkey", "48213");
  EXPECT_TRUE(score_item(pk, text("The passkey is 48213")).correct);
  EXPECT_TRUE(score_item(pk, text("It is 048213.")).correct);
  EXPECT_FALSE(score_item(pk, text("48213, no wait, 1")).correct);
  // The reasoning holds the number but the answer does not: wrong.
  EXPECT_FALSE(score_item(pk, text("I forgot", "the passkey is 48213")).correct);
  EXPECT_EQ(score_item(pk, text("I forgot", "48213")).extracted, "");
  const EvalItem ar = number_item("arith", "-17");
  EXPECT_TRUE(score_item(ar, text("so the result is -17")).correct);
  EXPECT_FALSE(score_item(ar, text("so the result is 17")).correct);
  Response err;
  err.error = "HTTP 500: boom";
  const Verdict v = score_item(ar, err);
  EXPECT_TRUE(v.error);
  EXPECT_FALSE(v.correct);
}

TEST(EvalScorer, ToolCallsFollowTheVendorVerifier) {
  const EvalItem it = tool_item(true);
  auto check = [&](const Response& r, bool called, bool schema_valid, bool trigger, const char* cls) {
    const Verdict v = score_item(it, r);
    EXPECT_EQ(v.called, called);
    EXPECT_EQ(v.schema_valid, schema_valid) << v.schema_problem;
    EXPECT_EQ(v.correct, trigger);
    EXPECT_EQ(v.schema_class, cls);
  };
  check(calls({{"get_weather", R"({"city": "Paris", "days": 3, "unit": "c"})", ""}}), true, true, true, "");
  check(calls({{"get_weather", R"({"city": "Paris"})", ""}, {"get_time", "{}", ""}}), true, true, true, "");
  check(calls({{"get_weather", R"({"city": 7})", ""}}), true, false, true, "schema");            // wrong type
  check(calls({{"get_weather", R"({"days": 2})", ""}}), true, false, true, "schema");            // missing required
  check(calls({{"get_weather", R"({"city": "P", "country": "FR"})", ""}}), true, false, true, "schema");  // extra property
  check(calls({{"get_weather", R"({"city": "P", "days": 1.5})", ""}}), true, false, true, "schema");
  check(calls({{"get_weather", R"({"city": "P", "unit": "k"})", ""}}), true, false, true, "schema");
  check(calls({{"get_weather", R"({"city": "Paris")", ""}}), true, false, true, "bad_json");      // unparseable
  check(calls({{"get_weather", R"(["Paris"])", ""}}), true, false, true, "not_object");
  check(calls({{"get_wether", R"({"city": "Paris"})", ""}}), true, false, false, "unknown_tool");  // name wrong too
  check(calls({{"get_weather", "", "function.arguments is not a string"}}), true, false, true, "malformed");
  // One bad call spoils the response even when the first is fine.
  check(calls({{"get_weather", R"({"city": "Paris"})", ""}, {"get_time", R"({"x": )", ""}}), true, false, true, "bad_json");
  check(calls({}), true, false, false, "no_calls");
  // A valid call under the wrong finish_reason is not a call at all (and not in the schema count).
  check(calls({{"get_weather", R"({"city": "Paris"})", ""}}, "stop"), false, false, false, "");
  check(text("It is sunny."), false, false, false, "");
  // The wrong tool first: schema-valid, trigger wrong.
  check(calls({{"get_time", "{}", ""}}), true, true, false, "");

  const EvalItem nofit = tool_item(false);
  EXPECT_TRUE(score_item(nofit, text("No tool fits.")).correct);
  EXPECT_FALSE(score_item(nofit, calls({{"get_time", "{}", ""}})).correct);
  EXPECT_FALSE(score_item(nofit, text("x", "")).called);
}

TEST(EvalScorer, SummaryCountsSchemaOverCallsAndTriggerOverItems) {
  std::vector<EvalItem> items = {tool_item(true), tool_item(true), tool_item(true), tool_item(false),
                                 tool_item(false), number_item("passkey", "5"), number_item("arith", "9")};
  Response err;
  err.error = "no data from the server for 600 s";
  std::vector<Response> rs = {calls({{"get_weather", R"({"city": "A"})", ""}}),
                              calls({{"get_weather", R"({"city": 1})", ""}}),
                              err,
                              text("none"),
                              calls({{"get_time", "{}", ""}}),
                              text("5"),
                              text("8")};
  std::vector<Verdict> vs;
  for (size_t i = 0; i < items.size(); ++i) vs.push_back(score_item(items[i], rs[i]));
  const Summary s = summarize(items, rs, vs);
  EXPECT_EQ(s.items, 7);
  EXPECT_EQ(s.errors, 1);
  EXPECT_EQ(s.tool_n, 5);
  EXPECT_EQ(s.tool_calls, 3);         // items 0, 1, 4
  EXPECT_EQ(s.tool_schema_valid, 2);  // items 0, 4
  EXPECT_EQ(s.tool_trigger_correct, 3);  // items 0, 1, 3
  EXPECT_EQ(s.tool_errors, 1);
  EXPECT_EQ(s.tool_schema_failures.at("schema"), 1);
  EXPECT_EQ(s.passkey.correct, 1);
  EXPECT_EQ(s.arith.correct, 0);
  const auto j = summary_json(s);
  EXPECT_DOUBLE_EQ(j["tool"]["schema_accuracy"].get<double>(), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(j["tool"]["trigger_accuracy"].get<double>(), 3.0 / 5.0);
  const std::string t = format_tables(s);
  EXPECT_NE(t.find("schema accuracy (%)"), std::string::npos) << t;
  EXPECT_NE(t.find("66.7"), std::string::npos) << t;
  EXPECT_NE(t.find("Items: 7, errors: 1"), std::string::npos) << t;
}

TEST(EvalScorer, ResponsesFromOpenAIBodies) {
  Response r = response_from_http(200, R"({"choices": [{"index": 0, "finish_reason": "tool_calls",
      "message": {"role": "assistant", "content": null, "reasoning_content": "think",
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
                     {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"a": 1}}}]}}]})", "");
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.finish_reason, "tool_calls");
  EXPECT_EQ(r.content, "");
  EXPECT_EQ(r.reasoning_content, "think");
  ASSERT_EQ(r.tool_calls.size(), 2u);
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"a": 1})");
  EXPECT_EQ(r.tool_calls[1].problem, "function.arguments is not a string");
  EXPECT_EQ(response_from_http(0, "", "connection refused").error, "connection refused");
  EXPECT_EQ(response_from_http(503, "busy", "").error, "HTTP 503: busy");
  EXPECT_NE(response_from_http(200, "{not json", "").error.find("bad JSON"), std::string::npos);
  EXPECT_NE(response_from_http(200, R"({"choices": []})", "").error.find("choices[0].message"), std::string::npos);
  EXPECT_NE(response_from_http(200, R"({"choices": [{"message": {"content": 5}}]})", "").error.find("malformed"),
            std::string::npos);
  // The saved shape round-trips.
  const Response back = response_from_json(json(response_to_json(r)), "x");
  EXPECT_EQ(back.finish_reason, r.finish_reason);
  EXPECT_EQ(back.tool_calls.size(), 2u);
  EXPECT_EQ(back.tool_calls[1].problem, r.tool_calls[1].problem);
  EXPECT_THROW(response_from_json(json::parse(R"({"content": "x"})"), "x"), kestrel::Error);  // no finish_reason
}

TEST(EvalScorer, SavedResponsesMatchItemsById) {
  const auto dir = std::filesystem::temp_directory_path() / ("kestrel_eval_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::vector<EvalItem> items = {number_item("passkey", "5"), tool_item(true), tool_item(false)};
  auto write = [&](const std::string& body) {
    std::ofstream(dir / "r.json") << body;
    return (dir / "r.json").string();
  };
  std::vector<std::string> missing;
  const auto rs = read_saved_responses(
      write(R"({"items": [{"id": "tool-call-1", "error": "timeout"},
                          {"id": "passkey-1", "response": {"finish_reason": "stop", "content": "5"}}]})"),
      items, &missing);
  EXPECT_EQ(missing, std::vector<std::string>{"tool-nofit-1"});
  EXPECT_TRUE(score_item(items[0], rs[0]).correct);
  EXPECT_EQ(rs[1].error, "timeout");
  EXPECT_THROW(read_saved_responses(write(R"({"items": [{"id": "nope", "error": "x"}]})"), items, &missing), kestrel::Error);
  EXPECT_THROW(read_saved_responses(write(R"({"items": [{"id": "passkey-1"}]})"), items, &missing), kestrel::Error);
  EXPECT_THROW(read_saved_responses(write(R"([1, 2])"), items, &missing), kestrel::Error);
  std::filesystem::remove_all(dir);
}

TEST(EvalSet, MalformedItemsAreErrorsWithTheirLocation) {
  auto bad = [](const std::string& line, const char* needle) {
    try {
      parse_eval_item(line, "set.jsonl:3");
      ADD_FAILURE() << "accepted: " << line;
    } catch (const kestrel::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("set.jsonl:3"), std::string::npos) << m;
      EXPECT_NE(m.find(needle), std::string::npos) << m;
    }
  };
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  bad("{", "not valid JSON");
  bad(R"({"id": "a", "task": "poem", "request": {)" + msgs + "}}", "unknown task");
  bad(R"({"id": "a", "task": "arith", "request": {"messages": []}, "expect": {"answer": "1"}})", "messages");
  bad(R"({"id": "a", "task": "arith", "request": {)" + msgs + R"(}, "expect": {"answer": "one"}})", "not an integer");
  bad(R"({"id": "a", "task": "passkey", "request": {)" + msgs + R"(}, "expect": {"answer": "1"}, "meta": {}})",
      "context_tokens");
  bad(R"({"id": "a", "task": "tool", "request": {)" + msgs + R"(}, "expect": {"call": false}})", "needs request.tools");
  bad(R"({"id": "a", "task": "tool", "request": {)" + msgs +
          R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "unevaluatedProperties": false}}}]}, "expect": {"call": false}})",
      "unsupported keyword 'unevaluatedProperties'");
  bad(R"({"id": "a", "task": "tool", "request": {)" + msgs +
          R"(, "tools": [{"type": "function", "function": {"name": "f"}}]}, "expect": {"call": true, "name": "g"}})",
      "not a declared tool");
  const EvalItem ok = parse_eval_item(R"({"id": "a", "task": "arith", "request": {)" + msgs +
                                          R"(, "reasoning_effort": "high", "max_tokens": 5}, "expect": {"answer": 12}})",
                                      "x");
  EXPECT_EQ(ok.answer, "12");
  EXPECT_EQ(ok.effort, "high");
  const json body = json::parse(request_body(ok, "m", 7));
  EXPECT_EQ(body["model"], "m");
  EXPECT_EQ(body["stream"], false);
  EXPECT_EQ(body["temperature"], 0.0);
  EXPECT_EQ(body["seed"], 7);
  EXPECT_EQ(body["reasoning_effort"], "high");
  EXPECT_EQ(body["max_tokens"], 5);
  EXPECT_THROW(check_unique_ids({ok, ok}), kestrel::Error);
}

// Image items (issue #21): the answer is the whole content, trimmed, case-folded, one final '.' dropped;
// the summary has one row per meta.kind; a malformed item names what is missing.
TEST(EvalScorer, ImageAnswersAreExactMatchesPerKind) {
  auto item = [](const char* id, const char* kind, const char* answer) {
    json j = {{"id", id},
              {"task", "image"},
              {"request", {{"messages", json::array({{{"role", "user"}, {"content", "What colour?"}}})}}},
              {"expect", {{"answer", answer}}},
              {"meta", {{"kind", kind}}}};
    return parse_eval_item(j.dump(), "t:1");
  };
  const EvalItem red = item("c1", "colour", "Red"), four = item("n1", "count", "4");
  EXPECT_EQ(red.answer, "red");
  EXPECT_TRUE(score_item(red, text("red")).correct);
  EXPECT_TRUE(score_item(red, text(" RED.\n")).correct);
  EXPECT_FALSE(score_item(red, text("dark red")).correct);
  EXPECT_FALSE(score_item(red, text("reddish")).correct);
  EXPECT_FALSE(score_item(red, text("", "red")).correct);  // only content counts
  EXPECT_EQ(score_item(red, text("Blue.")).extracted, "blue");
  EXPECT_TRUE(score_item(four, text("4")).correct);
  EXPECT_FALSE(score_item(four, text("4 shapes")).correct);
  EXPECT_EQ(normalize_answer(" a. "), "a");
  EXPECT_EQ(normalize_answer("a.."), "a.");
  EXPECT_EQ(normalize_answer(" . "), "");
  Response err;
  err.error = "timeout";
  const std::vector<EvalItem> items = {red, four, item("c2", "colour", "blue")};
  const std::vector<Response> rs = {text("red"), text("5"), err};
  std::vector<Verdict> vs;
  for (size_t i = 0; i < items.size(); ++i) vs.push_back(score_item(items[i], rs[i]));
  const Summary s = summarize(items, rs, vs);
  EXPECT_EQ(s.image.n, 3);
  EXPECT_EQ(s.image.correct, 1);
  EXPECT_EQ(s.image.errors, 1);
  EXPECT_EQ(s.image_by_kind.at("colour").n, 2);
  EXPECT_EQ(s.image_by_kind.at("colour").correct, 1);
  EXPECT_EQ(s.image_by_kind.at("count").correct, 0);
  const auto j = summary_json(s);
  EXPECT_EQ(j["image"]["by_kind"]["colour"]["correct"], 1);
  EXPECT_NE(format_tables(s).find("colour"), std::string::npos);
  EXPECT_EQ(item_json(red, rs[0], vs[0], false)["verdict"]["correct"], true);
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  for (const auto& [line, needle] : std::vector<std::pair<std::string, const char*>>{
           {R"({"id": "a", "task": "image", "request": {)" + msgs + R"(}, "expect": {"answer": 3}, "meta": {"kind": "k"}})",
            "expect.answer"},
           {R"({"id": "a", "task": "image", "request": {)" + msgs + R"(}, "expect": {"answer": " . "}, "meta": {"kind": "k"}})",
            "expect.answer"},
           {R"({"id": "a", "task": "image", "request": {)" + msgs + R"(}, "expect": {"answer": "x"}})", "meta.kind"}}) {
    try {
      parse_eval_item(line, "set.jsonl:3");
      ADD_FAILURE() << "accepted: " << line;
    } catch (const kestrel::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
}
