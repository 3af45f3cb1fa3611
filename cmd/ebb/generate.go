package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"ebb/engine"
	"ebb/ioschema"
	"ebb/scheduler"
)

func generateCmd() *cobra.Command {
	var (
		cfg                         engine.Config
		prompts                     []string
		inputIDs                    []string
		maxNew                      int
		temperature                 float64
		topP                        float64
		topK                        int
		minP                        float64
		seed                        uint64
		ignoreEOS                   bool
		returnLogprob, returnRouted bool
		logprobStart                int
		asJSON                      bool
	)
	cmd := &cobra.Command{
		Use:   "generate --model DIR (--prompt TEXT | --input-ids 1,2,3)...",
		Short: "Generate from a model in this process, without a server",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(prompts) == 0 && len(inputIDs) == 0 {
				return fmt.Errorf("give --prompt or --input-ids")
			}
			if cfg.MaxRunningRequests == 0 {
				cfg.MaxRunningRequests = max(len(prompts)+len(inputIDs), 1)
			}
			if cfg.ChunkedPrefillSize == 0 {
				cfg.ChunkedPrefillSize = 2048
			}
			cfg.EnableReturnRoutedExperts = cfg.EnableReturnRoutedExperts || returnRouted
			e, err := engine.Open(cfg)
			if err != nil {
				return err
			}
			defer e.Close()
			var sp ioschema.SamplingParams
			flags := cmd.Flags()
			sp.MaxNewTokens, sp.Temperature = ifSet(flags, "max-new-tokens", &maxNew), ifSet(flags, "temperature", &temperature)
			sp.TopP, sp.TopK, sp.MinP = ifSet(flags, "top-p", &topP), ifSet(flags, "top-k", &topK), ifSet(flags, "min-p", &minP)
			sp.SamplingSeed = ifSet(flags, "seed", &seed)
			sp.IgnoreEOS = ignoreEOS
			params, err := sp.Resolve(e.Defaults())
			if err != nil {
				return err
			}
			var inputs [][]int32
			for _, p := range prompts {
				if e.Tokenizer == nil {
					return fmt.Errorf("%s has no tokenizer.json: use --input-ids", cfg.ModelDir)
				}
				inputs = append(inputs, e.Tokenizer.Encode(p, true))
			}
			for _, s := range inputIDs {
				ids, err := parseIDs(s)
				if err != nil {
					return err
				}
				inputs = append(inputs, ids)
			}
			outs, err := runOffline(e, inputs, params, returnLogprob, logprobStart, returnRouted)
			if err != nil {
				return err
			}
			enc := json.NewEncoder(os.Stdout)
			for _, o := range outs {
				if asJSON {
					if err := enc.Encode(o); err != nil {
						return err
					}
				} else if o.Text != nil {
					fmt.Println(*o.Text)
				} else {
					fmt.Println(o.OutputIDs)
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	addEngineFlags(f, &cfg)
	f.StringArrayVar(&prompts, "prompt", nil, "prompt text (repeatable)")
	f.StringArrayVar(&inputIDs, "input-ids", nil, "comma-separated prompt token ids (repeatable)")
	f.IntVar(&maxNew, "max-new-tokens", ioschema.DefaultMaxNewTokens, "tokens to generate")
	f.Float64Var(&temperature, "temperature", 1, "sampling temperature (0: greedy); default from generation_config.json")
	f.Float64Var(&topP, "top-p", 1, "nucleus sampling mass")
	f.IntVar(&topK, "top-k", -1, "sample among the k most likely tokens (-1: all)")
	f.Float64Var(&minP, "min-p", 0, "drop tokens below min_p times the top probability")
	f.Uint64Var(&seed, "seed", 0, "sampling seed (reproducible draws)")
	f.BoolVar(&ignoreEOS, "ignore-eos", false, "keep generating past end-of-sequence tokens")
	f.BoolVar(&returnLogprob, "return-logprob", false, "report the logprob of each generated token")
	f.IntVar(&logprobStart, "logprob-start-len", -1, "with --return-logprob, also report prompt token logprobs from this position")
	f.BoolVar(&returnRouted, "return-routed-experts", false, "report the experts each token was routed to (mixture-of-experts models; turns on --enable-return-routed-experts)")
	f.BoolVar(&asJSON, "json", false, "print one SGLang /generate-shaped JSON object per prompt")
	return cmd
}

func parseIDs(s string) ([]int32, error) {
	var ids []int32
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		v, err := strconv.ParseInt(part, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("--input-ids: %q is not a token id", part)
		}
		ids = append(ids, int32(v))
	}
	if len(ids) == 0 {
		return nil, fmt.Errorf("--input-ids: no ids")
	}
	return ids, nil
}

// GenerateOutput is the shape of SGLang's /generate response.
type GenerateOutput struct {
	Text      *string        `json:"text"`
	OutputIDs []int32        `json:"output_ids"`
	MetaInfo  map[string]any `json:"meta_info"`
}

// runOffline generates every input at once and shapes the results.
func runOffline(e *engine.Engine, inputs [][]int32, params ioschema.Resolved, returnLogprob bool, logprobStart int, returnRouted bool) ([]GenerateOutput, error) {
	reqs := make([]scheduler.Request, len(inputs))
	for i, ids := range inputs {
		reqs[i] = scheduler.Request{Rid: fmt.Sprintf("generate-%d", i), InputIDs: ids, Params: params,
			ReturnLogprob: returnLogprob, LogprobStartLen: logprobStart, ReturnRoutedExperts: returnRouted}
	}
	results, err := scheduler.Generate(e, reqs)
	if err != nil {
		return nil, err
	}
	outs := make([]GenerateOutput, len(results))
	for i, r := range results {
		o := GenerateOutput{OutputIDs: r.OutputIDs, MetaInfo: map[string]any{
			"id": r.Rid, "prompt_tokens": r.PromptTokens, "completion_tokens": r.CompletionTokens,
			"cached_tokens": r.CachedTokens, "finish_reason": r.FinishReason,
		}}
		if o.OutputIDs == nil {
			o.OutputIDs = []int32{}
		}
		if e.Tokenizer != nil {
			text := e.Tokenizer.Decode(r.OutputIDs, params.SkipSpecialTokens)
			o.Text = &text
		}
		if r.RoutedExperts != nil {
			o.MetaInfo["routed_experts"] = ioschema.EncodeRoutedExperts(r.RoutedExperts)
		}
		if returnLogprob {
			o.MetaInfo["output_token_logprobs"] = logprobTriples(e, r.OutputLogprobs, r.OutputIDs)
			if r.InputLogprobs != nil {
				o.MetaInfo["input_token_logprobs"] = logprobTriples(e, r.InputLogprobs, r.InputTokenIDs)
			}
		}
		outs[i] = o
	}
	return outs, nil
}

// logprobTriples renders SGLang's [logprob, token_id, text] lists; the
// first prompt token has no logprob (null).
func logprobTriples(e *engine.Engine, lps []float32, ids []int32) [][]any {
	out := make([][]any, len(ids))
	for j, t := range ids {
		var text, lp any
		if e.Tokenizer != nil {
			text = e.Tokenizer.Decode([]int32{t}, false)
		}
		if !math.IsNaN(float64(lps[j])) {
			lp = float64(lps[j])
		}
		out[j] = []any{lp, t, text}
	}
	return out
}
