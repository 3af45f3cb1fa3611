package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// AddedToken is an entry of tokenizer.json's added_tokens.
type AddedToken struct {
	ID         int32  `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

// trieNode is a byte trie over added-token contents.
type trieNode struct {
	next  map[byte]*trieNode
	token *AddedToken
}

// addedMatcher finds added tokens in text, leftmost-longest, as Hugging
// Face's AddedVocabulary does.
type addedMatcher struct {
	root *trieNode
}

func newAddedMatcher(tokens []*AddedToken) *addedMatcher {
	if len(tokens) == 0 {
		return nil
	}
	root := &trieNode{}
	for _, t := range tokens {
		n := root
		for i := 0; i < len(t.Content); i++ {
			c := t.Content[i]
			if n.next == nil {
				n.next = map[byte]*trieNode{}
			}
			child, ok := n.next[c]
			if !ok {
				child = &trieNode{}
				n.next[c] = child
			}
			n = child
		}
		n.token = t
	}
	return &addedMatcher{root: root}
}

// segment is a piece of input: either an added token or text to tokenize.
type segment struct {
	text  string
	token *AddedToken
}

// split cuts s into text segments and added-token segments.
func (m *addedMatcher) split(s string) []segment {
	if m == nil {
		return []segment{{text: s}}
	}
	var segs []segment
	textStart := 0
	for i := 0; i < len(s); {
		tok, end := m.longestAt(s, i)
		if tok == nil || !wordBoundaryOK(tok, s, i, end) {
			i++
			continue
		}
		start := i
		if tok.LStrip {
			for start > textStart {
				r, w := utf8.DecodeLastRuneInString(s[textStart:start])
				if !unicode.IsSpace(r) {
					break
				}
				start -= w
			}
		}
		if tok.RStrip {
			for end < len(s) {
				r, w := utf8.DecodeRuneInString(s[end:])
				if !unicode.IsSpace(r) {
					break
				}
				end += w
			}
		}
		if start > textStart {
			segs = append(segs, segment{text: s[textStart:start]})
		}
		segs = append(segs, segment{token: tok})
		i, textStart = end, end
	}
	if textStart < len(s) {
		segs = append(segs, segment{text: s[textStart:]})
	}
	return segs
}

func (m *addedMatcher) longestAt(s string, i int) (*AddedToken, int) {
	var best *AddedToken
	bestEnd := 0
	n := m.root
	for j := i; j < len(s); j++ {
		n = n.next[s[j]]
		if n == nil {
			break
		}
		if n.token != nil {
			best, bestEnd = n.token, j+1
		}
	}
	return best, bestEnd
}

// wordBoundaryOK enforces single_word: the match may not touch word runes.
func wordBoundaryOK(t *AddedToken, s string, start, end int) bool {
	if !t.SingleWord {
		return true
	}
	isWord := func(r rune) bool { return unicode.IsLetter(r) || unicode.IsDigit(r) || r == '_' }
	if start > 0 {
		if r, _ := utf8.DecodeLastRuneInString(s[:start]); isWord(r) {
			return false
		}
	}
	if end < len(s) {
		if r, _ := utf8.DecodeRuneInString(s[end:]); isWord(r) {
			return false
		}
	}
	return true
}
