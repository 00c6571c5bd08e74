// String formats as grammar fragments (the content between the quotes). The validator treats
// `format` as an annotation (2020-12), so these shape plausible values rather than guard validity;
// each is plain ASCII without '"' or '\', identical inside a JSON string and as raw text.
#include "core/check.h"
#include "structured/json_lexical.h"

namespace kestrel::structured::detail {

using Frag = GrammarBuilder::Frag;

namespace {

struct F {
  GrammarBuilder& b;
  Frag lit(const char* s) { return b.literal(s); }
  Frag r(char lo, char hi) { return b.byte_range(uint8_t(lo), uint8_t(hi)); }
  Frag set(const std::string& chars) {
    std::bitset<256> s;
    for (char c : chars) s.set(uint8_t(c));
    return b.byte_set(s);
  }
  Frag digit() { return r('0', '9'); }
  Frag digits(size_t n) { return b.repeat([&] { return digit(); }, n, n); }
  Frag hex() { return set("0123456789abcdefABCDEF"); }
  Frag hexes(size_t n) { return b.repeat([&] { return hex(); }, n, n); }
  Frag alnum() { return b.alt({r('a', 'z'), r('A', 'Z'), digit()}); }

  Frag date() {
    Frag month = b.alt({b.seq(lit("0"), r('1', '9')), b.seq(lit("1"), r('0', '2'))});
    Frag day = b.alt({b.seq(lit("0"), r('1', '9')), b.seq(r('1', '2'), digit()), b.seq(lit("3"), r('0', '1'))});
    return b.seq({digits(4), lit("-"), month, lit("-"), day});
  }
  Frag hour() { return b.alt({b.seq(r('0', '1'), digit()), b.seq(lit("2"), r('0', '3'))}); }
  Frag minute() { return b.seq(r('0', '5'), digit()); }
  Frag time() {
    Frag second = b.alt({minute(), lit("60")});
    Frag frac = b.opt(b.seq(lit("."), b.repeat([&] { return digit(); }, 1, 9)));
    Frag offset = b.alt({set("Zz"), b.seq({set("+-"), hour(), lit(":"), minute()})});
    return b.seq({hour(), lit(":"), minute(), lit(":"), second, frac, offset});
  }
  Frag label() {
    // [A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?
    return b.seq(alnum(), b.opt(b.seq(b.star(b.alt({alnum(), lit("-")})), alnum())));
  }
  Frag hostname() { return b.seq(label(), b.star(b.seq(lit("."), label()))); }
  Frag octet() {
    return b.alt({b.seq(lit("25"), r('0', '5')), b.seq({lit("2"), r('0', '4'), digit()}),
                  b.seq({lit("1"), digit(), digit()}), b.seq(r('1', '9'), digit()), digit()});
  }
};

}  // namespace

GrammarBuilder::Frag format_content(GrammarBuilder& b, const std::string& format) {
  F f{b};
  if (format == "date") return f.date();
  if (format == "time") return f.time();
  if (format == "date-time") return b.seq({f.date(), f.set("Tt"), f.time()});
  if (format == "uuid")
    return b.seq({f.hexes(8), f.lit("-"), f.hexes(4), f.lit("-"), f.hexes(4), f.lit("-"), f.hexes(4), f.lit("-"),
                  f.hexes(12)});
  if (format == "ipv4")
    return b.seq({f.octet(), f.lit("."), f.octet(), f.lit("."), f.octet(), f.lit("."), f.octet()});
  if (format == "hostname") return f.hostname();
  if (format == "email") {
    Frag local = b.plus([&] { return b.alt({f.alnum(), f.set("._%+-")}); });
    return b.seq({local, f.lit("@"), f.label(), b.plus([&] { return b.seq(f.lit("."), f.label()); })});
  }
  if (format == "uri") {
    // scheme ":" then printable ASCII other than space and "<>\^`{|}.
    std::bitset<256> rest;
    for (int c = 0x21; c < 0x7F; ++c)
      if (std::string("\"<>\\^`{|}").find(char(c)) == std::string::npos) rest.set(c);
    Frag scheme = b.seq(b.alt({f.r('a', 'z'), f.r('A', 'Z')}), b.star(b.alt({f.alnum(), f.set("+.-")})));
    return b.seq({scheme, f.lit(":"), b.plus([&] { return b.byte_set(rest); })});
  }
  fail("format '{}' is not supported (supported: date, time, date-time, uuid, ipv4, email, hostname, uri)", format);
}

}  // namespace kestrel::structured::detail
