package tokenizer

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"ebb/assets"
)

var loaded sync.Map // family -> *Tokenizer

func load(t testing.TB, family string) *Tokenizer {
	t.Helper()
	if tk, ok := loaded.Load(family); ok {
		return tk.(*Tokenizer)
	}
	tk, err := Embedded(family)
	if err != nil {
		t.Fatal(err)
	}
	loaded.Store(family, tk)
	return tk
}

type oracleCase struct {
	Text    string  `json:"text"`
	IDs     []int32 `json:"ids"`
	Decode  []int32 `json:"decode"`
	Skipped string  `json:"skipped"`
}

func readOracle(t *testing.T, family string) []oracleCase {
	f, err := os.Open("testdata/oracle_" + family + ".jsonl.gz")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	var cases []oracleCase
	sc := bufio.NewScanner(gz)
	sc.Buffer(nil, 1<<22)
	for sc.Scan() {
		var c oracleCase
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			t.Fatal(err)
		}
		cases = append(cases, c)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(cases) < 3000 {
		t.Fatalf("oracle file has only %d cases", len(cases))
	}
	return cases
}

// TestOracle compares with Hugging Face's Rust tokenizer on thousands of
// strings (tools/tokenizer_goldens.js wrote the expected ids).
func TestOracle(t *testing.T) {
	for _, family := range assets.Tokenizers {
		t.Run(family, func(t *testing.T) {
			tk := load(t, family)
			var encoded, decoded, failed int
			for _, c := range readOracle(t, family) {
				if c.Decode != nil {
					decoded++
					if got := tk.Decode(c.Decode, false); got != c.Text {
						failed++
						t.Errorf("Decode(%v) = %q, want %q", c.Decode, got, c.Text)
					}
					if got := tk.Decode(c.Decode, true); got != c.Skipped {
						failed++
						t.Errorf("Decode(%v, skip) = %q, want %q", c.Decode, got, c.Skipped)
					}
				} else {
					encoded++
					if got := tk.Encode(c.Text, false); !slices.Equal(got, c.IDs) {
						failed++
						t.Errorf("Encode(%q)\n got %v\nwant %v", c.Text, got, c.IDs)
					}
				}
				if failed > 20 {
					t.Fatal("too many mismatches")
				}
			}
			t.Logf("%s: %d encodes, %d decodes identical to the oracle", family, encoded, decoded)
		})
	}
}

func TestRoundTrip(t *testing.T) {
	for _, family := range assets.Tokenizers {
		tk := load(t, family)
		for _, c := range readOracle(t, family) {
			if c.Decode != nil {
				continue
			}
			want := c.Text
			if family == "qwen3" {
				want = tk.normalize(want)
			}
			if got := tk.Decode(tk.Encode(c.Text, false), false); got != want {
				t.Fatalf("%s: Decode(Encode(%q)) = %q", family, c.Text, got)
			}
		}
	}
}

func TestKnownIDs(t *testing.T) {
	tk := load(t, "qwen3")
	if got, want := tk.Encode("Hello, my dog is cute", false), []int32{9707, 11, 847, 5562, 374, 18838}; !slices.Equal(got, want) {
		t.Fatalf("got %v want %v", got, want)
	}
	if id, ok := tk.TokenID("<|im_end|>"); !ok || id != 151645 || !tk.IsSpecial(id) {
		t.Fatalf("<|im_end|> = %d, %v", id, ok)
	}
}

func TestStreamDecoderNeverSplitsCharacters(t *testing.T) {
	for _, family := range assets.Tokenizers {
		tk := load(t, family)
		for _, text := range []string{"日本語のテキスト 😀👩‍👩‍👧‍👦 ok", "naïve café — €5", "plain ascii", "🇯🇵🇯🇵✨"} {
			ids := tk.Encode(text, false)
			d := tk.NewStreamDecoder(false)
			var sb strings.Builder
			for _, id := range ids {
				delta := d.Add(id)
				if !utf8.ValidString(delta) || strings.ContainsRune(delta, utf8.RuneError) {
					t.Fatalf("%s: delta %q is not whole characters", family, delta)
				}
				sb.WriteString(delta)
			}
			sb.WriteString(d.Flush())
			if got := sb.String(); got != tk.Decode(ids, false) {
				t.Fatalf("%s: streamed %q, want %q", family, got, text)
			}
		}
	}
}

func TestStreamDecoderInvalidBytes(t *testing.T) {
	tk := load(t, "qwen3")
	// Byte-level tokens for 0xE4 0xB8 (the start of a 3-byte character) then 'a'.
	b1, _ := tk.TokenID(string(tk.bl.toRune[0xE4]))
	b2, _ := tk.TokenID(string(tk.bl.toRune[0xB8]))
	a, _ := tk.TokenID("a")
	d := tk.NewStreamDecoder(false)
	if got := d.Add(b1) + d.Add(b2); got != "" {
		t.Fatalf("incomplete character emitted early: %q", got)
	}
	if got := d.Add(a); got != "\uFFFDa" {
		t.Fatalf("got %q, want one replacement then a", got)
	}
}

func TestLossyMatchesMaximalSubparts(t *testing.T) {
	cases := []struct{ in, want string }{
		{"a\xe4\xb8", "a\uFFFD"},
		{"\xe4\xb8\xe4\xb8\xad", "\uFFFD中"},
		{"\xff\xfe", "\uFFFD\uFFFD"},
		{"\xf0\x9f\x98", "\uFFFD"},
		{"\xed\xa0\x80", "\uFFFD\uFFFD\uFFFD"}, // surrogate: E D followed by A0 is not allowed
	}
	for _, c := range cases {
		if got := lossyString([]byte(c.in)); got != c.want {
			t.Errorf("lossyString(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}
