package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"ebb/tokenizer"
)

func tokenizeCmd() *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:   "tokenize --model DIR",
		Short: "Encode JSON strings and decode JSON id arrays, one per line on stdin",
		Long: `Reads JSON lines on stdin. A JSON string is encoded to a JSON array of ids
(no special tokens added); a JSON array of ids is decoded to a JSON string
(special tokens kept). One output line per input line. Needs only the
tokenizer files in DIR.`,
		RunE: func(*cobra.Command, []string) error {
			tok, err := tokenizer.Load(dir)
			if err != nil {
				return err
			}
			return tokenizeLines(tok, os.Stdin, os.Stdout)
		},
	}
	cmd.Flags().StringVar(&dir, "model", "", "directory holding tokenizer.json")
	_ = cmd.MarkFlagRequired("model")
	return cmd
}

func tokenizeLines(tok *tokenizer.Tokenizer, in *os.File, out *os.File) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(nil, 64<<20)
	w := bufio.NewWriter(out)
	defer w.Flush()
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	for line := 1; sc.Scan(); line++ {
		b := bytes.TrimSpace(sc.Bytes())
		var err error
		switch {
		case len(b) > 0 && b[0] == '"':
			var s string
			if err = json.Unmarshal(b, &s); err == nil {
				ids := tok.Encode(s, false)
				if ids == nil {
					ids = []int32{}
				}
				err = enc.Encode(ids)
			}
		case len(b) > 0 && b[0] == '[':
			var ids []int32
			if err = json.Unmarshal(b, &ids); err == nil {
				err = enc.Encode(tok.Decode(ids, false))
			}
		default:
			err = fmt.Errorf("expected a JSON string or array")
		}
		if err != nil {
			return fmt.Errorf("line %d: %w", line, err)
		}
	}
	return sc.Err()
}
