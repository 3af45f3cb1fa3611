// Package tokenizer implements Hugging Face's byte-level BPE tokenizers
// (Qwen2/Qwen3, Llama-3, GPT-2 style) from tokenizer.json, in linear time on
// any input.
package tokenizer

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/text/unicode/norm"

	"ebb/assets"
)

// Tokenizer encodes text to token ids and back. It is safe for concurrent use.
type Tokenizer struct {
	bpe             *bpeModel
	bl              *byteLevel
	normalize       func(string) string
	split           splitter
	addPrefixSpace  bool
	rawAdded        *addedMatcher // added tokens matched before normalization
	normalizedAdded *addedMatcher // added tokens matched after it
	added           map[int32]*AddedToken
	maxTokenBytes   int // the most text bytes one token stands for (0: unknown)
	idToToken       []string
	prefix, suffix  []int32 // special tokens the post-processor adds
}

// Load reads dir/tokenizer.json.
func Load(dir string) (*Tokenizer, error) {
	data, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	t, err := FromJSON(data)
	if err != nil {
		return nil, fmt.Errorf("tokenizer %s: %w", dir, err)
	}
	return t, nil
}

type fileJSON struct {
	AddedTokens   []*AddedToken   `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         struct {
		Type         string           `json:"type"`
		Vocab        map[string]int32 `json:"vocab"`
		Merges       json.RawMessage  `json:"merges"`
		IgnoreMerges bool             `json:"ignore_merges"`
		ByteFallback bool             `json:"byte_fallback"`
		Prefix       *string          `json:"continuing_subword_prefix"`
		Suffix       *string          `json:"end_of_word_suffix"`
	} `json:"model"`
}

// component is the shape shared by normalizers, pre-tokenizers,
// post-processors and decoders in tokenizer.json.
type component struct {
	Type           string                          `json:"type"`
	Normalizers    []component                     `json:"normalizers"`
	Pretokenizers  []component                     `json:"pretokenizers"`
	Processors     []component                     `json:"processors"`
	Decoders       []component                     `json:"decoders"`
	Pattern        struct{ Regex, String *string } `json:"pattern"`
	Behavior       string                          `json:"behavior"`
	Invert         bool                            `json:"invert"`
	AddPrefixSpace bool                            `json:"add_prefix_space"`
	UseRegex       bool                            `json:"use_regex"`
	Single         []templatePiece                 `json:"single"`
	SpecialTokens  map[string]struct {
		IDs []int32 `json:"ids"`
	} `json:"special_tokens"`
}

type templatePiece struct {
	SpecialToken *struct{ ID string } `json:"SpecialToken"`
	Sequence     *struct{ ID string } `json:"Sequence"`
}

func parseComponent(raw json.RawMessage) (*component, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, err
	}
	return &c, nil
}

// Embedded is the tokenizer of an embedded family (assets.Tokenizers).
func Embedded(family string) (*Tokenizer, error) {
	data, err := assets.TokenizerJSON(family)
	if err != nil {
		return nil, err
	}
	return FromJSON(data)
}

// FromJSON builds a tokenizer from the contents of a tokenizer.json file.
func FromJSON(data []byte) (*Tokenizer, error) {
	var f fileJSON
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("parse tokenizer.json: %w", err)
	}
	if f.Model.Type != "BPE" {
		return nil, fmt.Errorf("unsupported tokenizer model %q (only byte-level BPE)", f.Model.Type)
	}
	if f.Model.ByteFallback {
		return nil, fmt.Errorf("unsupported tokenizer: byte_fallback BPE (sentencepiece style)")
	}
	if (f.Model.Prefix != nil && *f.Model.Prefix != "") || (f.Model.Suffix != nil && *f.Model.Suffix != "") {
		return nil, fmt.Errorf("unsupported tokenizer: continuing_subword_prefix/end_of_word_suffix")
	}
	t := &Tokenizer{bl: newByteLevel(), added: map[int32]*AddedToken{}}
	if err := t.buildModel(&f); err != nil {
		return nil, err
	}
	if err := t.configure(&f); err != nil {
		return nil, err
	}
	var raw, normalized []*AddedToken
	for _, a := range f.AddedTokens {
		t.added[a.ID] = a
		if a.Normalized && t.normalize != nil {
			normalized = append(normalized, a)
		} else {
			raw = append(raw, a)
		}
		for int(a.ID) >= len(t.idToToken) {
			t.idToToken = append(t.idToToken, "")
		}
		t.idToToken[a.ID] = a.Content
	}
	t.rawAdded = newAddedMatcher(raw)
	t.normalizedAdded = newAddedMatcher(normalized)
	t.maxTokenBytes = t.longestToken(f.AddedTokens)
	return t, nil
}

// longestToken is the most bytes of text one token stands for, or 0 where
// an added token strips the whitespace around it (and so stands for more).
func (t *Tokenizer) longestToken(added []*AddedToken) int {
	for _, a := range added {
		if a.LStrip || a.RStrip {
			return 0
		}
	}
	longest := 0
	for id := range t.idToToken {
		longest = max(longest, len(t.AppendTokenBytes(nil, int32(id), false)))
	}
	return longest
}

// MinTokens is a lower bound on the tokens text encodes to, from its length
// alone: no token stands for more bytes than the longest one, and NFC
// shrinks text at most threefold (three jamo to one Hangul syllable). It
// lets a prompt far past a context be refused without reading it.
func (t *Tokenizer) MinTokens(text string) int {
	per := t.maxTokenBytes
	if t.normalize != nil {
		per *= 3
	}
	if per == 0 {
		return 0
	}
	return len(text) / per
}

func (t *Tokenizer) buildModel(f *fileJSON) error {
	m := &bpeModel{
		vocab:        f.Model.Vocab,
		merges:       make(map[uint64]merge),
		ignoreMerges: f.Model.IgnoreMerges,
		runeID:       make(map[rune]int32, 256),
		cache:        make(map[string][]int32),
	}
	maxID := int32(-1)
	for s, id := range m.vocab {
		maxID = max(maxID, id)
		if r := []rune(s); len(r) == 1 {
			m.runeID[r[0]] = id
		}
	}
	t.idToToken = make([]string, maxID+1)
	for s, id := range m.vocab {
		t.idToToken[id] = s
	}
	pairs, err := parseMerges(f.Model.Merges)
	if err != nil {
		return err
	}
	for rank, p := range pairs {
		a, okA := m.vocab[p[0]]
		b, okB := m.vocab[p[1]]
		id, okM := m.vocab[p[0]+p[1]]
		if !okA || !okB || !okM {
			return fmt.Errorf("merge %d (%q %q) refers to tokens missing from the vocabulary", rank, p[0], p[1])
		}
		key := pairKey(a, b)
		if _, dup := m.merges[key]; !dup {
			m.merges[key] = merge{rank: int32(rank), id: id}
		}
	}
	t.bpe = m
	return nil
}

// parseMerges accepts both merge encodings: "a b" strings and [a, b] pairs.
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	var pairs [][2]string
	if err := json.Unmarshal(raw, &pairs); err == nil {
		return pairs, nil
	}
	var lines []string
	if err := json.Unmarshal(raw, &lines); err != nil {
		return nil, fmt.Errorf("parse merges: %w", err)
	}
	pairs = make([][2]string, len(lines))
	for i, l := range lines {
		a, b, ok := strings.Cut(l, " ")
		if !ok {
			return nil, fmt.Errorf("merge %d: %q is not two tokens", i, l)
		}
		pairs[i] = [2]string{a, b}
	}
	return pairs, nil
}

func (t *Tokenizer) configure(f *fileJSON) error {
	nz, err := parseComponent(f.Normalizer)
	if err != nil {
		return fmt.Errorf("normalizer: %w", err)
	}
	if t.normalize, err = normalizerFor(nz); err != nil {
		return err
	}
	pt, err := parseComponent(f.PreTokenizer)
	if err != nil {
		return fmt.Errorf("pre_tokenizer: %w", err)
	}
	if err := t.configurePreTokenizer(pt); err != nil {
		return err
	}
	if t.split == nil {
		return fmt.Errorf("unsupported pre_tokenizer: a byte-level pre-tokenizer is required")
	}
	dec, err := parseComponent(f.Decoder)
	if err != nil {
		return fmt.Errorf("decoder: %w", err)
	}
	if dec != nil && dec.Type != "ByteLevel" {
		return fmt.Errorf("unsupported decoder %q", dec.Type)
	}
	post, err := parseComponent(f.PostProcessor)
	if err != nil {
		return fmt.Errorf("post_processor: %w", err)
	}
	return t.configurePostProcessor(post)
}

func normalizerFor(c *component) (func(string) string, error) {
	if c == nil {
		return nil, nil
	}
	switch c.Type {
	case "NFC":
		return norm.NFC.String, nil
	case "NFKC":
		return norm.NFKC.String, nil
	case "NFD":
		return norm.NFD.String, nil
	case "NFKD":
		return norm.NFKD.String, nil
	case "Sequence":
		var fs []func(string) string
		for i := range c.Normalizers {
			f, err := normalizerFor(&c.Normalizers[i])
			if err != nil {
				return nil, err
			}
			if f != nil {
				fs = append(fs, f)
			}
		}
		if len(fs) == 0 {
			return nil, nil
		}
		return func(s string) string {
			for _, f := range fs {
				s = f(s)
			}
			return s
		}, nil
	}
	return nil, fmt.Errorf("unsupported normalizer %q", c.Type)
}

func (t *Tokenizer) configurePreTokenizer(c *component) error {
	if c == nil {
		return nil
	}
	switch c.Type {
	case "Sequence":
		for i := range c.Pretokenizers {
			if err := t.configurePreTokenizer(&c.Pretokenizers[i]); err != nil {
				return err
			}
		}
	case "Split":
		if c.Pattern.Regex == nil || c.Behavior != "Isolated" || c.Invert {
			return fmt.Errorf("unsupported Split pre-tokenizer (need a Regex pattern, behavior Isolated, invert false)")
		}
		if t.split != nil {
			return fmt.Errorf("unsupported pre_tokenizer: more than one splitting pattern")
		}
		s, err := splitterFor(*c.Pattern.Regex)
		if err != nil {
			return err
		}
		t.split = s
	case "ByteLevel":
		t.addPrefixSpace = c.AddPrefixSpace
		if c.UseRegex {
			if t.split != nil {
				return fmt.Errorf("unsupported pre_tokenizer: Split followed by ByteLevel with use_regex")
			}
			t.split = gpt2Splitter{}
		} else if t.split == nil {
			t.split = wholeSplitter{}
		}
	default:
		return fmt.Errorf("unsupported pre-tokenizer %q", c.Type)
	}
	return nil
}

// wholeSplitter keeps the text as one piece (ByteLevel without regex alone).
type wholeSplitter struct{}

func (wholeSplitter) split(s string, emit func(string) bool) { emit(s) }

func (t *Tokenizer) configurePostProcessor(c *component) error {
	if c == nil {
		return nil
	}
	switch c.Type {
	case "ByteLevel":
		return nil // offsets only
	case "Sequence":
		for i := range c.Processors {
			if err := t.configurePostProcessor(&c.Processors[i]); err != nil {
				return err
			}
		}
		return nil
	case "TemplateProcessing":
		seen := false
		for _, p := range c.Single {
			switch {
			case p.Sequence != nil:
				seen = true
			case p.SpecialToken != nil:
				st, ok := c.SpecialTokens[p.SpecialToken.ID]
				if !ok {
					return fmt.Errorf("post_processor: special token %q not defined", p.SpecialToken.ID)
				}
				if seen {
					t.suffix = append(t.suffix, st.IDs...)
				} else {
					t.prefix = append(t.prefix, st.IDs...)
				}
			}
		}
		return nil
	}
	return fmt.Errorf("unsupported post_processor %q", c.Type)
}

// Encode tokenizes text. addSpecial adds the post-processor's special tokens
// (for example Llama-3's <|begin_of_text|>); special tokens written in the
// text are always recognised.
func (t *Tokenizer) Encode(text string, addSpecial bool) []int32 {
	ids, _ := t.EncodeLimit(text, addSpecial, -1)
	return ids
}

// EncodeLimit is Encode that stops once it holds more than limit tokens (a
// negative limit: none), so that a prompt far past a model's context costs
// what the context does to refuse. Pre-tokens are encoded whole and
// independently, so a stopped encoding (complete false) is a prefix of the
// full one, longer than limit and without the closing special tokens.
func (t *Tokenizer) EncodeLimit(text string, addSpecial bool, limit int) (ids []int32, complete bool) {
	text = strings.ToValidUTF8(text, "\uFFFD")
	if addSpecial {
		ids = append(ids, t.prefix...)
	}
	full := func() bool { return limit >= 0 && len(ids) > limit }
	for _, seg := range t.rawAdded.split(text) {
		if full() {
			return ids, false
		}
		if seg.token != nil {
			ids = append(ids, seg.token.ID)
			continue
		}
		s := seg.text
		if t.normalize != nil {
			s = t.normalize(s)
		}
		for _, sub := range t.normalizedAdded.split(s) {
			if full() {
				return ids, false
			}
			if sub.token != nil {
				ids = append(ids, sub.token.ID)
				continue
			}
			ids = t.encodeText(sub.text, ids, limit)
		}
	}
	if full() {
		return ids, false
	}
	if addSpecial {
		ids = append(ids, t.suffix...)
	}
	return ids, true
}

// encodeText appends the tokens of s, pre-token by pre-token, until ids
// holds more than limit (when not negative).
func (t *Tokenizer) encodeText(s string, ids []int32, limit int) []int32 {
	if s == "" {
		return ids
	}
	if t.addPrefixSpace && !strings.HasPrefix(s, " ") {
		s = " " + s
	}
	t.split.split(s, func(piece string) bool {
		ids = t.bpe.encodePiece(t.bl.encode(piece), ids)
		return limit < 0 || len(ids) <= limit
	})
	return ids
}

// Decode turns ids back into text. Unknown ids are skipped, as Hugging Face
// does; skipSpecial drops special added tokens.
func (t *Tokenizer) Decode(ids []int32, skipSpecial bool) string {
	var buf []byte
	for _, id := range ids {
		buf = t.AppendTokenBytes(buf, id, skipSpecial)
	}
	return lossyString(buf)
}

// AppendTokenBytes appends the raw bytes of one token.
func (t *Tokenizer) AppendTokenBytes(buf []byte, id int32, skipSpecial bool) []byte {
	if id < 0 || int(id) >= len(t.idToToken) {
		return buf
	}
	if a, ok := t.added[id]; ok && a.Special && skipSpecial {
		return buf
	}
	tok := t.idToToken[id]
	start := len(buf)
	for _, r := range tok {
		b, ok := t.bl.toByte[r]
		if !ok {
			// Hugging Face keeps a token that is not all byte-level runes as is.
			return append(buf[:start], tok...)
		}
		buf = append(buf, b)
	}
	return buf
}

// VocabSize is one more than the largest token id.
func (t *Tokenizer) VocabSize() int { return len(t.idToToken) }

// TokenID returns the id of a vocabulary entry or added token.
func (t *Tokenizer) TokenID(tok string) (int32, bool) {
	for id, a := range t.added {
		if a.Content == tok {
			return id, true
		}
	}
	id, ok := t.bpe.vocab[tok]
	return id, ok
}

// Token returns the vocabulary string of id ("" when unknown).
func (t *Tokenizer) Token(id int32) string {
	if id < 0 || int(id) >= len(t.idToToken) {
		return ""
	}
	return t.idToToken[id]
}

// IsSpecial reports whether id is a special added token.
func (t *Tokenizer) IsSpecial(id int32) bool {
	a, ok := t.added[id]
	return ok && a.Special
}
