package ioschema

import (
	"fmt"
	"regexp"
	"regexp/syntax"
)

// StopRegex is one of a request's stop_regex patterns, compiled.
type StopRegex struct {
	Pattern string // as the request sent it: a match's finish_reason.matched
	re      *regexp.Regexp
}

// MatchString reports whether s holds a match.
func (r StopRegex) MatchString(s string) bool { return r.re.MatchString(s) }

// compileStopRegexes compiles stop_regex patterns and returns the most
// characters a match of any of them can span (as SGLang's
// get_max_seq_length bounds the tail it searches, a character at most a
// token), or -1 where one is unbounded (a star, a plus, an open repeat):
// then the whole output is searched, as SGLang does. Go takes RE2 syntax,
// so Python's lookarounds and backreferences are errors here.
func compileStopRegexes(patterns []string) ([]StopRegex, int, error) {
	out, most := make([]StopRegex, 0, len(patterns)), 0
	for _, p := range patterns {
		re, err := regexp.Compile(p)
		if err != nil {
			return nil, 0, fmt.Errorf("stop_regex %q: %w (RE2 syntax: no lookarounds or backreferences)", p, err)
		}
		parsed, err := syntax.Parse(p, syntax.Perl)
		if err != nil {
			return nil, 0, fmt.Errorf("stop_regex %q: %w", p, err)
		}
		n := maxMatchLen(parsed.Simplify())
		if n < 0 || most < 0 {
			most = -1
		} else {
			most = max(most, n)
		}
		out = append(out, StopRegex{Pattern: p, re: re})
	}
	return out, most, nil
}

// maxMatchLen is the most characters a match of re spans, -1 if unbounded.
func maxMatchLen(re *syntax.Regexp) int {
	switch re.Op {
	case syntax.OpLiteral:
		return len(re.Rune)
	case syntax.OpCharClass, syntax.OpAnyChar, syntax.OpAnyCharNotNL:
		return 1
	case syntax.OpCapture, syntax.OpQuest:
		return maxMatchLen(re.Sub[0])
	case syntax.OpConcat, syntax.OpAlternate:
		total := 0
		for _, s := range re.Sub {
			n := maxMatchLen(s)
			switch {
			case n < 0:
				return -1
			case re.Op == syntax.OpConcat:
				total += n
			default:
				total = max(total, n)
			}
		}
		return total
	case syntax.OpStar, syntax.OpPlus:
		if maxMatchLen(re.Sub[0]) == 0 {
			return 0
		}
		return -1
	case syntax.OpRepeat:
		n := maxMatchLen(re.Sub[0])
		if n == 0 {
			return 0
		}
		if re.Max < 0 || n < 0 {
			return -1
		}
		return re.Max * n
	}
	return 0 // empty matches and assertions (^, $, \b) span nothing
}
