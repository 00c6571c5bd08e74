#!/usr/bin/env python3
"""Train the tiny byte-level BPE vocabulary used by the nano test checkpoint.

Output: reference/data/test_tokenizer/tiktoken.model, tiktoken format (MODEL.md §7): one line per token,
`base64(bytes) SP rank`, rank = id. Ranks 0..255 are the single bytes in byte order, ranks 256..767 are
512 merges learned from the built-in text below (English prose, C++/Python code, a little Chinese and
Japanese). The result is committed, so checkpoint generation never re-trains; rerun this only to change
the vocabulary on purpose (then regenerate every golden file that depends on nano token ids).

Why it is shaped this way:
- Determinism: word counts come from a fixed text, the best pair is chosen by (count desc, left bytes,
  right bytes) so there are no hash-order ties, and no randomness is used at all.
- Pre-tokenisation approximates the K3 `pat_str` with the stdlib `re` (no \\p{Han}, no `&&`): Han runs are
  their own pieces, letters take one optional leading non-letter (usually the space), digits go in runs of
  at most 3, punctuation runs keep trailing newlines. Merges never cross pieces, as in the real tokenizer.
- Every new token is the concatenation of two lower-rank tokens, so tiktoken's rank-ordered merge loop can
  reach it. If a pair concatenates to bytes that already have a rank (e.g. "ab"+"c" vs "a"+"bc"), the pair
  is merged into that existing token instead of minting a duplicate: tiktoken needs unique byte strings.
"""
import argparse
import base64
import collections
import os
import re

NUM_MERGES = 512

HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
PAT = re.compile(
    rf"[{HAN}]+"
    rf"|(?:[^\r\n\w]|_)?[^\W\d_{HAN}]+(?:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\d{1,3}"
    r"| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

TEXT = r'''
The inference engine reads a checkpoint, builds the model, and then serves requests one token at a time.
Every request starts with a prompt. The prompt is split into tokens, the tokens are turned into vectors,
and the vectors pass through the layers of the model. Each layer reads the hidden state, mixes information
across positions with attention, and then transforms every position with a small network of experts.
The router picks the experts that should handle the current token, and the results are added together.
When the last layer is done, the final norm and the output head turn the hidden state into logits, and the
sampler chooses the next token. The new token is appended to the sequence and the whole process repeats
until the model writes the end of the message or the request reaches its limit.

A good test checkpoint is small, fast to load, and still exercises every code path of the real model.
That is why the weights are random but carefully scaled: the values should stay in a healthy range from
the first layer to the last, so that a mistake in the engine shows up as a clear difference in the output
instead of being hidden by overflow, underflow, or saturation. The same seed must always produce the same
bytes, on every machine and in every run, because the golden outputs of the tests depend on those bytes.

Linear attention keeps a state matrix for every head. The state decays a little at every step, the new key
and value are written into it with a learning rate, and the query reads the state back out. Full attention
keeps every key and value in a cache, compares the query with all of them, and takes a weighted average.
The indexer looks at all previous positions, scores them cheaply, and keeps only the best ones, so the
expensive attention only has to look at a small set of keys even when the context is very long.

In the morning the team met to discuss the results of the night run. The numbers looked right, but one of
the tests was slower than expected, and nobody could explain why. After lunch they found the problem: the
loader was reading the same shard twice. They fixed the bug, ran the tests again, and went home early.
It was a quiet evening. The weather was warm, the streets were full of people, and the river was calm.

#include <cstdint>
#include <vector>
#include <string>

namespace kestrel {

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  int dtype = 0;
  const void* data = nullptr;
};

int64_t num_elements(const Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  return n;
}

float dequantize(uint8_t code, uint8_t scale) {
  static const float lut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return std::ldexp(lut[code & 0xF], int(scale) - 127);
}

}  // namespace kestrel

def rms_norm(x, weight, eps=1e-5):
    """Normalize the last dimension of x and multiply by the weight."""
    variance = (x * x).mean(axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + eps))


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


class Config:
    def __init__(self, hidden_size=256, num_layers=8, num_heads=4):
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads

    def head_dim(self):
        return self.hidden_size // self.num_heads


for i in range(10):
    if i % 2 == 0:
        print("even", i)
    else:
        print("odd", i)

result = {"name": "test", "value": 42, "items": [1, 2, 3], "enabled": True}
with open("output.json", "w") as f:
    json.dump(result, f, indent=2)

今天天气很好，我们一起去公园散步。模型读取输入的文本，然后生成新的回答。
测试的目的是发现问题，而不是证明没有问题。中文和英文混合的文本也应该能够正确处理。
こんにちは、世界。これはテストの文章です。東京は今日も晴れています。
'''


def pretokenize(text):
    return collections.Counter(m.group(0).encode("utf-8") for m in PAT.finditer(text))


def train(text, num_merges=NUM_MERGES):
    vocab = [bytes([b]) for b in range(256)]
    rank_of = {tok: i for i, tok in enumerate(vocab)}
    words = [(list(w), c) for w, c in sorted(pretokenize(text).items())]
    new_tokens = 0
    while new_tokens < num_merges:
        counts = collections.Counter()
        for ids, c in words:
            for a, b in zip(ids, ids[1:]):
                counts[(a, b)] += c
        if not counts:
            raise SystemExit("training text too small for %d merges" % num_merges)
        (a, b), _ = min(counts.items(), key=lambda kv: (-kv[1], vocab[kv[0][0]], vocab[kv[0][1]]))
        merged = vocab[a] + vocab[b]
        if merged in rank_of:
            new_id = rank_of[merged]
        else:
            new_id = len(vocab)
            vocab.append(merged)
            rank_of[merged] = new_id
            new_tokens += 1
        for ids, _ in words:
            i = 0
            while i < len(ids) - 1:
                if ids[i] == a and ids[i + 1] == b:
                    ids[i:i + 2] = [new_id]
                i += 1
    return vocab


def write_tiktoken(vocab, path):
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for rank, tok in enumerate(vocab):
            f.write("%s %d\n" % (base64.b64encode(tok).decode("ascii"), rank))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "data", "test_tokenizer", "tiktoken.model"))
    args = ap.parse_args()
    vocab = train(TEXT)
    write_tiktoken(vocab, args.out)
    print("wrote %d tokens to %s" % (len(vocab), args.out))


if __name__ == "__main__":
    main()
