// Writes the tokenizer oracle files that tokenizer/oracle_test.go compares
// against: Hugging Face's Rust tokenizer (npm `tokenizers`) encoding thousands
// of varied strings, and decoding random id sequences.
//
//   npm install tokenizers@0.23.2
//   node tools/tokenizer_goldens.js assets tokenizer/testdata
"use strict";
const fs = require("fs");
const path = require("path");
const zlib = require("zlib");
const { Tokenizer } = require("tokenizers");

const [assetsDir, outDir] = process.argv.slice(2);

let state = 0x9e3779b97f4a7c15n;
function rand() { // splitmix64, so the corpus is the same on every run
  state = (state + 0x9e3779b97f4a7c15n) & 0xffffffffffffffffn;
  let z = state;
  z = ((z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n) & 0xffffffffffffffffn;
  z = ((z ^ (z >> 27n)) * 0x94d049bb133111ebn) & 0xffffffffffffffffn;
  return Number((z ^ (z >> 31n)) >> 11n) / 2 ** 53;
}
const pick = (a) => a[Math.floor(rand() * a.length)];
const int = (n) => Math.floor(rand() * n);

const words = ["the", "The", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world",
  "don't", "I'm", "we'll", "they've", "you're", "she'd", "it's", "DON'T", "I'M", "Ca'T", "o'clock",
  "naïve", "café", "résumé", "Straße", "Ελληνικά", "русский", "עברית", "العربية", "हिन्दी", "ไทย",
  "中文", "日本語のテキスト", "한국어", "漢字", "😀", "👩‍👩‍👧‍👦", "🇯🇵", "✨", "∑", "≠", "€", "£100", "½",
  "x", "y_1", "foo_bar", "camelCase", "snake_case", "ALLCAPS", "1234567", "3.14159", "0x1F", "1e-9",
  "٣٤٥", "१२३", "Ⅻ", "²", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'ſ", "'LL", "''",
  "e\u0301", "A\u030a", "\u1e9b\u0323", "ﬁ", "Å", "ｆｕｌｌ", "\u00a0", "\u3000", "\u2028", "\u200b",
  "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<|begin_of_text|>",
  "<|eot_id|>", "<|start_header_id|>", "<|im_start", "im_end|>", "<tool_call>", "<|reserved_special_token_5|>"];
const seps = [" ", "  ", "   ", "\n", "\n\n", "\r\n", "\r\n\r\n", "\t", " \n ", "\n  ", ", ", ". ", "! ",
  "?", "...", " - ", "\u00a0", "", "\t\t", "   \n\n   "];
const code = ["def f(x):\n    return x**2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
  "if err != nil {\n\t\treturn fmt.Errorf(\"x: %w\", err)\n\t}", "SELECT * FROM t WHERE id=42;",
  "<div class=\"a\">\n  <p>Hi</p>\n</div>", "x = [1,2,3]  # comment", "fn main() { println!(\"{}\", 1); }",
  "$ ls -la /usr/bin | grep -E '^d'", "{\"key\": [1, 2.5, null, \"v\"]}", "    \n    \n"];

function randomCodepoints(n) {
  let s = "";
  const ranges = [[0x20, 0x7e], [0xa0, 0x24f], [0x370, 0x3ff], [0x400, 0x4ff], [0x590, 0x6ff],
    [0x900, 0x97f], [0x3040, 0x30ff], [0x4e00, 0x9fff], [0xac00, 0xd7a3], [0x1f300, 0x1faff],
    [0x2000, 0x206f], [0x0300, 0x036f], [0x0, 0x1f], [0xfe00, 0xfe0f], [0x10000, 0x1007f]];
  for (let i = 0; i < n; i++) {
    const [a, b] = pick(ranges);
    s += String.fromCodePoint(a + int(b - a + 1));
  }
  return s;
}

function randomBytes(n) {
  const b = Buffer.alloc(n);
  for (let i = 0; i < n; i++) b[i] = int(256);
  return b.toString("utf8"); // invalid sequences become U+FFFD, as a Go string converted to valid UTF-8
}

function corpus() {
  const out = ["", " ", "  ", "\n", "a", "Hello, my dog is cute", "1234567890", " 12 345 6789 ",
    "    leading", "trailing    ", "tab\tsep", "a\r\nb\rc\nd", "   \n\n   x", "!!!???...", " !x", "'s'S'ſ'll"];
  for (let i = 0; i < 1200; i++) { // prose-like word salad
    let s = "";
    const n = 1 + int(30);
    for (let j = 0; j < n; j++) s += pick(words) + pick(seps);
    out.push(s);
  }
  for (let i = 0; i < 300; i++) out.push(pick(code) + pick(seps) + pick(code));
  for (let i = 0; i < 800; i++) out.push(randomCodepoints(1 + int(80)));
  for (let i = 0; i < 300; i++) out.push(randomBytes(1 + int(120)));
  for (let i = 0; i < 200; i++) { // whitespace and digit runs
    let s = "";
    for (let j = 0; j < 1 + int(12); j++) {
      s += pick([" ".repeat(int(9)), "\n".repeat(int(4)), "\r\n", "\t".repeat(int(3)), String(int(1e9)),
        "0".repeat(int(12)), pick(words), "\u3000", "\u00a0\u00a0", " \n", "\n "]);
    }
    out.push(s);
  }
  for (let i = 0; i < 200; i++) { // chat-template-like text with special tokens
    out.push("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n" + pick(words) +
      pick(seps) + pick(words) + "<|im_end|>\n<|im_start|>assistant\n" + pick(["<think>\n\n</think>\n\n", ""]) +
      pick(words) + pick(["<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>", "<|im_end|>"]));
  }
  return out;
}

(async () => {
  fs.mkdirSync(outDir, { recursive: true });
  const texts = corpus();
  for (const name of ["qwen3", "llama3"]) {
    const json = zlib.gunzipSync(fs.readFileSync(path.join(assetsDir, name, "tokenizer.json.gz")));
    const tmp = path.join(require("os").tmpdir(), `ebb-${name}-tokenizer.json`);
    fs.writeFileSync(tmp, json);
    const tok = Tokenizer.fromFile(tmp);
    const vocab = name === "qwen3" ? 151669 : 128256;
    const lines = [];
    for (const text of texts) {
      const enc = await tok.encode(text, null, { addSpecialTokens: false });
      lines.push(JSON.stringify({ text, ids: enc.getIds() }));
    }
    for (let i = 0; i < 500; i++) { // decode-only cases: random ids, some special
      const ids = [];
      for (let j = 0; j < 1 + int(40); j++) ids.push(rand() < 0.05 ? vocab - 1 - int(20) : int(vocab));
      lines.push(JSON.stringify({ decode: ids, text: await tok.decode(ids, false),
        skipped: await tok.decode(ids, true) }));
    }
    const file = path.join(outDir, `oracle_${name}.jsonl.gz`);
    fs.writeFileSync(file, zlib.gzipSync(lines.join("\n") + "\n", { level: 9 }));
    console.log(`${file}: ${lines.length} cases`);
  }
})();
