package tokenizermanager

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
)

// paramRule says whether a value of an OpenAI request parameter is one ebb
// carries out; nil accepts any value. A parameter set to null counts as
// unset and always passes.
type paramRule func(v json.RawMessage) error

// accepted parameters of the OpenAI endpoints (with SGLang's extensions),
// and the values of each that ebb honours. Anything else is a 400 that
// names the parameter: a request is never served with part of it ignored.
var (
	samplingParams = map[string]paramRule{
		"model": nil, "max_tokens": nil, "temperature": nil, "top_p": nil, "top_k": nil, "min_p": nil, "n": nil,
		"stream": nil, "stream_options": nil, "stop": nil, "stop_token_ids": nil, "stop_regex": nil, "seed": nil,
		"presence_penalty": nil, "frequency_penalty": nil, "repetition_penalty": nil, "ignore_eos": nil,
		"skip_special_tokens": nil, "no_stop_trim": nil, "min_tokens": nil, "rid": nil,
		"routed_dp_rank": nil, "data_parallel_rank": nil, // checked against the engines where the request starts
		"user":                  nil, // an end-user id, for the caller's own accounting
		"return_routed_experts": nil, // SGLang's routing replay
		"return_token_ids":      nil, // SGLang's: the prompt's and the output's token ids
		"logit_bias":            nil, // token ids (as strings) to biases, checked where the request starts
	}
	completionParams = with(samplingParams, map[string]paramRule{
		"prompt": nil, "logprobs": nil, "echo": nil,
		"best_of": onlyValue("1", "best_of other than 1 is not supported"),
		"suffix":  onlyValue(`""`, "suffix is not supported"),
	})
	chatParams = with(samplingParams, map[string]paramRule{
		"messages": nil, "max_completion_tokens": nil, "logprobs": nil, "top_logprobs": nil, "tools": nil,
		"chat_template_kwargs": nil, "parallel_tool_calls": nil, "continue_final_message": nil,
		"separate_reasoning": nil, "stream_reasoning": nil,
		"tool_choice":     oneOf(`"none"`, `"auto"`),
		"response_format": responseFormat,
		"store":           onlyValue("false", "stored completions are not supported"),
		"metadata":        nil, // labels for stored completions: nothing to store
		"service_tier":    oneOf(`"auto"`, `"default"`),
		"modalities":      onlyValue(`["text"]`, "ebb outputs text only"),
	})
)

func with(base, extra map[string]paramRule) map[string]paramRule {
	out := make(map[string]paramRule, len(base)+len(extra))
	for k, v := range base {
		out[k] = v
	}
	for k, v := range extra {
		out[k] = v
	}
	return out
}

func canonical(v json.RawMessage) string {
	var x any
	if json.Unmarshal(v, &x) != nil {
		return string(v)
	}
	b, _ := json.Marshal(x)
	return string(b)
}

// onlyValue accepts the one value that asks for nothing ebb lacks.
func onlyValue(ok, why string) paramRule {
	return func(v json.RawMessage) error {
		if canonical(v) == canonical(json.RawMessage(ok)) {
			return nil
		}
		return fmt.Errorf("%s", why)
	}
}

func oneOf(values ...string) paramRule {
	return func(v json.RawMessage) error {
		for _, ok := range values {
			if canonical(v) == canonical(json.RawMessage(ok)) {
				return nil
			}
		}
		return fmt.Errorf("%s is not supported (supported: %s)", canonical(v), strings.Join(values, ", "))
	}
}

func responseFormat(v json.RawMessage) error {
	var f struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(v, &f); err != nil {
		return fmt.Errorf("must be an object with a type")
	}
	if f.Type != "text" {
		return fmt.Errorf("type %q is not supported: ebb has no constrained decoding (only \"text\")", f.Type)
	}
	return nil
}

// checkParams rejects a body with a parameter ebb does not implement, or a
// value of one that it cannot honour.
func checkParams(body []byte, accepted map[string]paramRule) error {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil {
		return badf("invalid JSON body: %v", err)
	}
	names := make([]string, 0, len(fields))
	for k := range fields {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		v := fields[k]
		if bytes.Equal(bytes.TrimSpace(v), []byte("null")) {
			continue
		}
		rule, ok := accepted[k]
		if !ok {
			return badf("parameter %q is not supported by ebb", k)
		}
		if rule != nil {
			if err := rule(v); err != nil {
				return badf("parameter %q: %v", k, err)
			}
		}
	}
	return nil
}
