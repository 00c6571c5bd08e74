#!/usr/bin/env python3
"""Writes the benchmark texts: long English (Debian license texts) and long CJK (Chinese and
Japanese gettext catalogues shipped in Debian), each repeated to about --mb megabytes.

    python3 bench/make_bench_text.py --out /tmp/bench --mb 8
"""
import argparse
import gettext
import glob
import os


def catalog_text(langs):
    parts = []
    for lang in langs:
        for path in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
            try:
                with open(path, "rb") as f:
                    cat = gettext.GNUTranslations(f)._catalog
            except Exception:
                continue
            parts.extend(v for k, v in sorted(cat.items(), key=lambda kv: str(kv[0])) if isinstance(v, str) and v)
    return "\n".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mb", type=float, default=8)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    english = "\n".join(open(p, encoding="utf-8", errors="replace").read()
                        for p in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(p))
    cjk = catalog_text(["zh_CN", "zh_TW", "ja"])
    for name, text in (("english.txt", english), ("cjk.txt", cjk)):
        data = text.encode("utf-8")
        reps = max(1, int(a.mb * 1e6 / len(data)))
        with open(os.path.join(a.out, name), "wb") as f:
            f.write(data * reps)
        print(name, len(data) * reps, "bytes")


if __name__ == "__main__":
    main()
