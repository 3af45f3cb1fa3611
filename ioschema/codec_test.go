package ioschema

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"ebb/memory"
)

func ptr[T any](v T) *T { return &v }

// samples has one populated value of every registered message.
func samples() []Message {
	fr := FinishLength(7)
	return []Message{
		&GenerateReqInput{Text: Texts{Items: []string{"a", "b"}, Batch: true}, SamplingParams: SamplingBatch{Items: []SamplingParams{{Temperature: ptr(0.5)}}},
			Rid: Rids{Items: []string{"r"}}, ReturnLogprob: true, LogprobStartLen: ptr(3), TopLogprobsNum: 2, Stream: true,
			RoutedDPRank: ptr(1), DataParallelRank: ptr(0), ReturnRoutedExperts: true},
		&GenerateReqOutput{Rid: "r", Text: ptr("hi"), OutputIDs: []int32{1, 2}, MetaInfo: map[string]any{"id": "r"}, Finished: true},
		&TokenizedGenerateReqInput{Rid: "x", InputText: "t", InputIDs: Int32s{1, 2, 3}, SamplingParams: SamplingParams{MaxNewTokens: ptr(4), Stop: StringList{"\n"}},
			ReturnLogprob: true, LogprobStartLen: -1, TopLogprobsNum: 1, ReturnRoutedExperts: true},
		&BatchTokenIDOutput{tokenOutputs: tokenOutputs{Rids: []string{"a"}, FinishedReasons: []*FinishReason{fr}, OutputIDs: []Int32s{{5}},
			PromptTokens: []int{3}, CompletionTokens: []int{1}, CachedTokens: []int{0}, OutputTokenLogprobsVal: [][]float32{{-0.5}},
			InputTokenLogprobsVal: [][]float32{{-1, -2}}, InputTokenLogprobsIdx: []Int32s{{7, 8}},
			InputTopLogprobsVal: [][][]float32{{nil, {-0.1, -2}}}, InputTopLogprobsIdx: [][]Int32s{{nil, {4, 8}}},
			RoutedExperts: []Int32s{{3, 1, -1, -1}}, WeightVersion: "v1"}, SkipSpecialTokens: []bool{true}, SpacesBetweenSpecialTokens: []bool{true}, NoStopTrim: []bool{false}, Stop: [][]string{{"x"}}},
		&BatchStrOutput{tokenOutputs: tokenOutputs{Rids: []string{"a"}, FinishedReasons: []*FinishReason{nil}, OutputIDs: []Int32s{{5}}}, OutputStrs: []string{"hé"}},
		&AbortReq{Rid: "a", AbortAll: true},
		&ErrorOutput{Rid: "a", Message: "bad", Request: "GenerateReqInput"},
		&FlushCacheReqInput{Control{Rid: "1"}},
		&FlushCacheReqOutput{Result{Rid: "1", Success: true}},
		&PauseGenerationReqInput{Control: Control{Rid: "1"}, Mode: PauseRetract},
		&PauseGenerationReqOutput{Result: Result{Success: true}, Retracted: 2},
		&ContinueGenerationReqInput{Control: Control{Rid: "1"}, TorchEmptyCache: true},
		&ContinueGenerationReqOutput{Result: Result{Success: true}, ReservedBefore: 10, ReservedAfter: 5},
		&ReleaseMemoryOccupationReqInput{Control: Control{Rid: "1"}, Tags: []string{"kv_cache"}},
		&ReleaseMemoryOccupationReqOutput{MemoryResult{Result: Result{Success: true}, Tags: []memory.Outcome{{Tag: memory.KVCache, Bytes: 4, State: "released"}}}},
		&ResumeMemoryOccupationReqInput{Control: Control{Rid: "1"}, Tags: []string{"weights"}},
		&ResumeMemoryOccupationReqOutput{MemoryResult{Result: Result{Success: true}}},
		&UpdateWeightFromDiskReqInput{Control: Control{Rid: "1"}, ModelPath: "/m", FlushCache: ptr(false), AbortAllRequests: true, WeightVersion: ptr("v2")},
		&UpdateWeightFromDiskReqOutput{Result: Result{Success: true}, NumPausedRequest: 1},
		&UpdateWeightsFromTensorReqInput{Control: Control{Rid: "1"}, SerializedNamedTensors: SerializedPayloads{{0x80, 4, '.'}}, FlushCache: ptr(true),
			LoadFormat: ptr("flattened_bucket"), WeightVersion: ptr("v3")},
		&UpdateWeightsFromTensorReqOutput{Result: Result{Message: "no"}, Tensors: 3, Bytes: 99},
		&InitWeightsUpdateGroupReqInput{Control: Control{Rid: "1"}, MasterAddr: "h", MasterPort: 1, WorldSize: 2, GroupName: "g", Backend: "nccl"},
		&InitWeightsUpdateGroupReqOutput{Result{Message: "no"}},
		&UpdateWeightsFromDistributedReqInput{Control: Control{Rid: "1"}, Names: []string{"w"}, DTypes: []string{"bfloat16"}, Shapes: [][]int{{2, 3}},
			FlushCache: ptr(true), GroupName: "g", LoadFormat: ptr("flattened_bucket")},
		&UpdateWeightsFromDistributedReqOutput{Result: Result{Message: "no"}, Tensors: 1},
		&DestroyWeightsUpdateGroupReqInput{Control: Control{Rid: "1"}, GroupName: "g"},
		&DestroyWeightsUpdateGroupReqOutput{Result{Success: true}},
		&UpdateWeightVersionReqInput{Control: Control{Rid: "1"}, NewVersion: "v9", AbortAllRequests: true},
		&UpdateWeightVersionReqOutput{Result{Success: true}},
		&GetWeightsByNameReqInput{Control: Control{Rid: "1"}, Name: "model.norm.weight", TruncateSize: 5},
		&GetWeightsByNameReqOutput{Result: Result{Success: true}, Parameter: []float32{1, 2}, Shape: []int{2}},
		&GetMemoryStatsReqInput{Control{Rid: "1"}},
		&GetMemoryStatsReqOutput{Result: Result{Success: true}, Tags: []memory.TagStats{{Tag: memory.Weights, State: "resident", Reserved: 8}}, NVMLProcessBytes: -1},
		&GetServerInfoReqInput{Control{Rid: "1"}},
		&GetServerInfoReqOutput{Result: Result{Success: true}, Info: map[string]any{"k": "v"}},
	}
}

func TestEveryMessageRoundTrips(t *testing.T) {
	seen := map[string]bool{}
	for _, m := range samples() {
		seen[m.TypeName()] = true
		b, err := Encode(m)
		if err != nil {
			t.Fatalf("%s: %v", m.TypeName(), err)
		}
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("%s: %v", m.TypeName(), err)
		}
		want, _ := New(m.TypeName())
		// Compare through a second encoding: maps decoded as any differ in
		// integer width from what was encoded.
		b2, err := Encode(got)
		if err != nil {
			t.Fatal(err)
		}
		if err := msgpack.Unmarshal(b2, want); err != nil {
			t.Fatal(err)
		}
		if reflect.TypeOf(got) != reflect.TypeOf(m) || string(b) != string(b2) {
			t.Fatalf("%s did not round-trip:\n%#v\n%#v", m.TypeName(), m, got)
		}
	}
	for _, name := range TypeNames() {
		if !seen[name] {
			t.Errorf("%s has no round-trip sample", name)
		}
	}
}

// TestPythonShapedInput decodes what a Python client sends: plain maps with
// lists of ints, a missing optional field, and an extra unknown field.
func TestPythonShapedInput(t *testing.T) {
	b, err := msgpack.Marshal(map[string]any{
		"type": "GenerateReqInput", "input_ids": []int{1, 2, 3}, "rid": "py-1",
		"sampling_params":   map[string]any{"max_new_tokens": 8, "temperature": 0.0, "stop": "\n"},
		"some_future_field": []string{"ignored"},
	})
	if err != nil {
		t.Fatal(err)
	}
	m, err := Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	g := m.(*GenerateReqInput)
	sp, _ := g.SamplingParams.For(0)
	if g.InputIDs.Batch || len(g.InputIDs.Items[0]) != 3 || g.Rid.Items[0] != "py-1" || *sp.MaxNewTokens != 8 || sp.Stop[0] != "\n" {
		t.Fatalf("decoded %+v", g)
	}
	if g.LogprobStartLen != nil {
		t.Fatal("missing logprob_start_len should stay unset")
	}
	if g.DPRank() != nil {
		t.Fatal("no rank given, yet one is asked for")
	}
}

// TestDPRank: routed_dp_rank, or its deprecated spelling data_parallel_rank
// (what sgl-model-gateway's dp-aware mode sends); the new name wins.
func TestDPRank(t *testing.T) {
	for _, tc := range []struct {
		fields map[string]any
		want   int
	}{
		{map[string]any{"routed_dp_rank": 1}, 1},
		{map[string]any{"data_parallel_rank": 2}, 2},
		{map[string]any{"routed_dp_rank": 3, "data_parallel_rank": 0}, 3},
		{map[string]any{"routed_dp_rank": nil, "data_parallel_rank": 0}, 0},
	} {
		in := map[string]any{"type": "GenerateReqInput", "input_ids": []int{1}}
		for k, v := range tc.fields {
			in[k] = v
		}
		b, _ := msgpack.Marshal(in)
		m, err := Decode(b)
		if err != nil {
			t.Fatal(err)
		}
		if r := m.(*GenerateReqInput).DPRank(); r == nil || *r != tc.want {
			t.Errorf("%v: rank %v, want %d", tc.fields, r, tc.want)
		}
	}
	b, _ := msgpack.Marshal(map[string]any{"type": "GenerateReqInput", "input_ids": []int{1}, "routed_dp_rank": "one"})
	if _, err := Decode(b); err == nil {
		t.Error("a rank that is not an int decoded")
	}
}

func TestDefaults(t *testing.T) {
	for name, check := range map[string]func(Message) bool{
		"UpdateWeightFromDiskReqInput": func(m Message) bool { return *m.(*UpdateWeightFromDiskReqInput).FlushCache },
		"PauseGenerationReqInput":      func(m Message) bool { return m.(*PauseGenerationReqInput).Mode == PauseAbort },
		"GetWeightsByNameReqInput":     func(m Message) bool { return m.(*GetWeightsByNameReqInput).TruncateSize == 100 },
	} {
		b, _ := msgpack.Marshal(map[string]any{"type": name})
		m, err := Decode(b)
		if err != nil || !check(m) {
			t.Errorf("%s: defaults not applied (%v)", name, err)
		}
	}
}

func TestBadInputIsAnError(t *testing.T) {
	enc := func(v any) []byte { b, _ := msgpack.Marshal(v); return b }
	cases := []struct {
		name string
		data []byte
		want error
	}{
		{"empty", nil, ErrMalformed},
		{"garbage", []byte{0xc1, 0xff, 0x00}, ErrMalformed},
		{"not a map", enc([]int{1, 2}), ErrMalformed},
		{"no type", enc(map[string]any{"rid": "x"}), ErrMalformed},
		{"unknown type", enc(map[string]any{"type": "LaunchMissilesReqInput"}), ErrUnknownType},
		{"wrong field type", enc(map[string]any{"type": "AbortReq", "abort_all": "yes"}), ErrMalformed},
		{"wrong ids", enc(map[string]any{"type": "GenerateReqInput", "input_ids": []any{1, "two"}}), ErrMalformed},
		{"negative id", enc(map[string]any{"type": "GenerateReqInput", "input_ids": []int{-1}}), ErrMalformed},
		{"type not a string", enc(map[string]any{"type": 5}), ErrMalformed},
		{"truncated", enc(map[string]any{"type": "AbortReq", "rid": "abcdef"})[:10], ErrMalformed},
	}
	for _, c := range cases {
		_, err := Decode(c.data)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: got %v, want %v", c.name, err, c.want)
		}
	}
	if rid := RidOf(enc(map[string]any{"type": "AbortReq", "rid": "keep-me", "abort_all": "yes"})); rid != "keep-me" {
		t.Errorf("RidOf = %q", rid)
	}
}

func TestSamplingResolve(t *testing.T) {
	d := &GenerationDefaults{Temperature: ptr(0.6), TopK: ptr(20)}
	r, err := (&SamplingParams{TopP: ptr(0.9)}).Resolve(d)
	if err != nil || r.Temperature != float32(0.6) || r.TopK != 20 || r.TopP != float32(0.9) || r.MaxNewTokens != DefaultMaxNewTokens {
		t.Fatalf("resolve: %+v %v", r, err)
	}
	r, _ = (&SamplingParams{Temperature: ptr(0.0)}).Resolve(d)
	if r.Temperature != 0 || r.TopK != 1 {
		t.Fatalf("temperature 0 is greedy: %+v", r)
	}
	bad := []SamplingParams{{TopP: ptr(0.0)}, {TopK: ptr(0)}, {Temperature: ptr(-1.0)},
		{MinP: ptr(2.0)}, {MaxNewTokens: ptr(-1)}, {RepetitionPenalty: ptr(0.0)}, {Regex: ptr("a+")},
		{FrequencyPenalty: 3}, {MinNewTokens: 500}}
	for _, p := range bad {
		if _, err := p.Resolve(nil); err == nil {
			t.Errorf("accepted %+v", p)
		}
	}
	// A negative max_new_tokens is one error, not also min_new_tokens'.
	if _, err := (&SamplingParams{MaxNewTokens: ptr(-4)}).Resolve(nil); err == nil || err.Error() != "max_new_tokens must be at least 0, got -4" {
		t.Errorf("max_new_tokens -4: %v", err)
	}
}

func TestJSONBodies(t *testing.T) {
	var g GenerateReqInput
	body := `{"input_ids": [[1,2],[3]], "sampling_params": [{"max_new_tokens": 1}, {"stop": ["a","b"]}], "rid": ["x","y"]}`
	if err := jsonUnmarshal(body, &g); err != nil {
		t.Fatal(err)
	}
	if !g.InputIDs.Batch || len(g.InputIDs.Items) != 2 || !g.SamplingParams.Batch || g.Rid.Items[1] != "y" {
		t.Fatalf("%+v", g)
	}
	if err := jsonUnmarshal(`{"text": 5}`, &g); err == nil || !strings.Contains(err.Error(), "text") {
		t.Fatalf("bad text accepted: %v", err)
	}
}

func TestWeightWrite(t *testing.T) {
	for _, tc := range []struct {
		m               Message
		abortAll, write bool
	}{
		{&UpdateWeightFromDiskReqInput{AbortAllRequests: true}, true, true},
		{&UpdateWeightsFromTensorReqInput{}, false, true},
		{&UpdateWeightsFromDistributedReqInput{AbortAllRequests: true}, true, true},
		{&UpdateWeightVersionReqInput{AbortAllRequests: true}, false, false},
		{&FlushCacheReqInput{}, false, false},
	} {
		if abortAll, ok := WeightWrite(tc.m); abortAll != tc.abortAll || ok != tc.write {
			t.Errorf("%s: %v, %v", tc.m.TypeName(), abortAll, ok)
		}
	}
}

// TestUnsupportedIsRefusedByName: SGLang parameters ebb does not carry out
// are refused by name, over JSON and msgpack alike, where set; unset (null,
// false, empty) they pass, and a sampling key SGLang does not know is an
// error as in SGLang.
func TestUnsupportedIsRefusedByName(t *testing.T) {
	for _, c := range []struct {
		name, body, want string // want "": accepted
	}{
		{"plain", `{"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "stream_interval": 4}}`, ""},
		{"unset", `{"input_ids": [1], "return_hidden_states": false, "lora_path": null, "image_data": [null, null], "token_ids_logprob": []}`, ""},
		{"hidden states", `{"input_ids": [1], "return_hidden_states": true}`, "return_hidden_states: not supported"},
		{"two", `{"input_ids": [1], "lora_path": "a", "image_data": ["x"]}`, "image_data, lora_path: not supported"},
		{"token ids logprob", `{"input_ids": [1], "token_ids_logprob": [3, 4]}`, "token_ids_logprob: not supported"},
		{"misspelt sampling key", `{"input_ids": [1], "sampling_params": {"max_tokens": 2}}`, `unknown field "max_tokens"`},
		{"one of a batch", `{"input_ids": [[1], [2]], "sampling_params": [{}, {"temprature": 1}]}`, `unknown field "temprature"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			var fields map[string]any
			if err := jsonUnmarshal(c.body, &fields); err != nil {
				t.Fatal(err)
			}
			fields["type"] = "GenerateReqInput"
			packed, _ := msgpack.Marshal(integral(fields)) // as Python's msgpack packs ints
			viaMsgpack, merr := Decode(packed)
			var viaJSON GenerateReqInput
			jerr := jsonUnmarshal(c.body, &viaJSON)
			for transport, err := range map[string]error{"json": jerr, "msgpack": merr} {
				if err == nil {
					if transport == "json" {
						err = viaJSON.Unsupported()
					} else {
						err = viaMsgpack.(*GenerateReqInput).Unsupported()
					}
				}
				if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
					t.Errorf("%s: %v, want %q", transport, err, c.want)
				}
			}
		})
	}
	refused := []SamplingParams{{StopRegex: StringList{"(?<=a)b"}}, {StructuralTag: ptr("{}")},
		{CustomParams: map[string]any{"k": 1}}, {LogitBias: map[string]float64{"5x": 1}}, {StreamInterval: ptr(0)}}
	for _, p := range refused {
		if _, err := p.Resolve(nil); err == nil {
			t.Errorf("accepted %+v", p)
		}
	}
}

// integral is v (decoded JSON) with its whole numbers as int64.
func integral(v any) any {
	switch x := v.(type) {
	case float64:
		if x == float64(int64(x)) {
			return int64(x)
		}
	case []any:
		for i := range x {
			x[i] = integral(x[i])
		}
	case map[string]any:
		for k := range x {
			x[k] = integral(x[k])
		}
	}
	return v
}
