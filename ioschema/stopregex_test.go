package ioschema

import (
	"strings"
	"testing"
)

// TestStopRegexBounds: the tail a stop_regex match can span, in
// characters, as SGLang's get_max_seq_length bounds it (-1: unbounded),
// and Python-only syntax refused by name.
func TestStopRegexBounds(t *testing.T) {
	for _, c := range []struct {
		patterns []string
		want     int
		err      string
	}{
		{[]string{"abc"}, 3, ""},
		{[]string{`\d{2,4}x`}, 5, ""},
		{[]string{"(yes|no)</"}, 5, ""},
		{[]string{`^\s?END$`}, 4, ""},
		{[]string{"a", "wxyz"}, 4, ""},
		{[]string{"a+"}, -1, ""},
		{[]string{"ab", `<answer>.*</answer>`}, -1, ""},
		{[]string{`x{3,}`}, -1, ""},
		{[]string{`(?:)*b`}, 1, ""},
		{[]string{`foo(?=bar)`}, 0, "stop_regex \"foo(?=bar)\""},
		{[]string{`(a)\1`}, 0, "RE2 syntax"},
	} {
		res, err := (&SamplingParams{StopRegex: c.patterns}).Resolve(nil)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%q: %v, want an error with %q", c.patterns, err, c.err)
			}
			continue
		}
		if err != nil || res.StopRegexLen != c.want || len(res.StopRegex) != len(c.patterns) {
			t.Errorf("%q: bound %d (%d compiled), %v; want %d", c.patterns, res.StopRegexLen, len(res.StopRegex), err, c.want)
		}
	}
}
