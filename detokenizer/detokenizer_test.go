package detokenizer

import (
	"strings"
	"testing"

	"ebb/ioschema"
	"ebb/tokenizer"
)

func qwen(t *testing.T) *tokenizer.Tokenizer {
	t.Helper()
	tok, err := tokenizer.Embedded("qwen3")
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// feed sends ids one token per batch and returns the deltas.
func feed(d *Detokenizer, rid string, ids []int32, stops []string, noTrim bool, final *ioschema.FinishReason) []string {
	var out []string
	for i, id := range ids {
		b := &ioschema.BatchTokenIDOutput{Stop: [][]string{stops}, NoStopTrim: []bool{noTrim}, SkipSpecialTokens: []bool{true}}
		b.Outputs().Rids = []string{rid}
		b.Outputs().OutputIDs = []ioschema.Int32s{{id}}
		fr := (*ioschema.FinishReason)(nil)
		if i == len(ids)-1 {
			fr = final
		}
		b.Outputs().FinishedReasons = []*ioschema.FinishReason{fr}
		out = append(out, d.Process(b).OutputStrs[0])
	}
	return out
}

func TestDeltasAreWholeCharactersAndAddUp(t *testing.T) {
	tok := qwen(t)
	d := New(tok)
	text := "héllo 世界 👩‍👩‍👧 done"
	ids := tok.Encode(text, false)
	deltas := feed(d, "a", ids, nil, false, ioschema.FinishLength(len(ids)))
	for _, s := range deltas {
		if strings.ContainsRune(s, '\uFFFD') {
			t.Fatalf("delta %q splits a character", s)
		}
	}
	if got := strings.Join(deltas, ""); got != text {
		t.Fatalf("got %q", got)
	}
	if d.Pending() != 0 {
		t.Fatal("finished request kept state")
	}
}

func TestStopStringsHeldBackAndTrimmed(t *testing.T) {
	tok := qwen(t)
	cases := []struct {
		name   string
		noTrim bool
		want   string
	}{{"trim", false, "one two "}, {"no_stop_trim", true, "one two STOP"}}
	for _, c := range cases {
		d := New(tok)
		ids := tok.Encode("one two STOP", false)
		deltas := feed(d, c.name, ids, []string{"STOP"}, c.noTrim, ioschema.FinishStopString("STOP"))
		for i, s := range deltas[:len(deltas)-1] {
			if !c.noTrim && strings.Contains(strings.Join(deltas[:i+1], ""), "ST") {
				t.Fatalf("%s: a partial stop string was sent early: %q", c.name, s)
			}
		}
		if got := strings.Join(deltas, ""); got != c.want {
			t.Fatalf("%s: got %q, want %q", c.name, got, c.want)
		}
	}
}

func TestHoldBackReleasesWhenNoMatch(t *testing.T) {
	tok := qwen(t)
	d := New(tok)
	ids := tok.Encode("a ST and more", false)
	got := strings.Join(feed(d, "x", ids, []string{"STOP"}, false, ioschema.FinishLength(9)), "")
	if got != "a ST and more" {
		t.Fatalf("got %q", got)
	}
}

func TestHoldBack(t *testing.T) {
	for _, c := range []struct {
		text  string
		stops []string
		want  int
	}{{"abc", []string{"cd"}, 1}, {"abc", []string{"bcd", "cd"}, 2}, {"abc", []string{"x"}, 0}, {"", []string{"ab"}, 0}, {"abc", []string{"abc"}, 0}} {
		if got := holdBack(c.text, c.stops); got != c.want {
			t.Errorf("holdBack(%q, %q) = %d, want %d", c.text, c.stops, got, c.want)
		}
	}
}

// BenchmarkLongRollout is a token's cost in a 16,384-token output, the
// length of a long chain of thought, one token a step as decode sends them.
func BenchmarkLongRollout(b *testing.B) {
	tok, err := tokenizer.Embedded("qwen3")
	if err != nil {
		b.Fatal(err)
	}
	ids := tok.Encode(strings.Repeat("Let the chain of thought run on, step by step. ", 1500), false)[:16384]
	batch := &ioschema.BatchTokenIDOutput{SkipSpecialTokens: []bool{true}}
	batch.Outputs().Rids = []string{"long"}
	batch.Outputs().FinishedReasons = []*ioschema.FinishReason{nil}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d := New(tok)
		for _, id := range ids {
			batch.Outputs().OutputIDs = []ioschema.Int32s{{id}}
			d.Process(batch)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(ids)), "ns/token")
}
