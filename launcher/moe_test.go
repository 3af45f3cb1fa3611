package launcher

import (
	"encoding/base64"
	"encoding/binary"
	"maps"
	"slices"
	"strings"
	"testing"

	"ebb/engine"
	"ebb/ioschema"
	"ebb/scheduler"
	"ebb/tinymodel"
)

// decodeRouted reverses SGLang's encoding: base64 of little-endian int32s.
func decodeRouted(t *testing.T, s string) []int32 {
	t.Helper()
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil || len(b)%4 != 0 {
		t.Fatalf("routed_experts %q: %v", s, err)
	}
	out := make([]int32, len(b)/4)
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

// TestRoutedExpertsOverHTTP: a mixture-of-experts model served with
// --enable-return-routed-experts returns meta_info.routed_experts from
// /generate (whole and streamed) and sglext.routed_experts from
// /v1/completions, SGLang's base64 of [tokens - 1, layers, k] int32, equal
// to what the in-process engine computes; a server without the flag
// answers a request that asks with an error naming it.
func TestRoutedExpertsOverHTTP(t *testing.T) {
	dir := t.TempDir()
	spec, _ := tinymodel.Default("qwen3_moe")
	spec.Layers = 3
	if err := tinymodel.Write(dir, spec); err != nil {
		t.Fatal(err)
	}
	s := startServer(t, "--model", dir, "--enable-return-routed-experts")
	ids := []int32{9707, 11, 1879, 0, 358, 1079, 264, 1273}
	body := map[string]any{"input_ids": ids, "sampling_params": map[string]any{"max_new_tokens": 12, "temperature": 0, "ignore_eos": true},
		"return_routed_experts": true}
	var got struct {
		OutputIDs []int32 `json:"output_ids"`
		MetaInfo  struct {
			RoutedExperts string `json:"routed_experts"`
		} `json:"meta_info"`
	}
	if code := s.post(t, "/generate", body, &got); code != 200 {
		t.Fatalf("status %d", code)
	}
	routed := decodeRouted(t, got.MetaInfo.RoutedExperts)

	e, err := engine.Open(engine.Config{ModelDir: dir, Device: "cpu", MaxTotalTokens: 4096, MaxRunningRequests: 4, EnableReturnRoutedExperts: true})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	zero, n := 0.0, 12
	params, _ := (&ioschema.SamplingParams{Temperature: &zero, MaxNewTokens: &n, IgnoreEOS: true}).Resolve(e.Defaults())
	outs, err := scheduler.Generate(e, []scheduler.Request{{Rid: "x", InputIDs: ids, Params: params, LogprobStartLen: -1, ReturnRoutedExperts: true}})
	if err != nil {
		t.Fatal(err)
	}
	want := outs[0].RoutedExperts
	if len(want) != (len(ids)+n-1)*spec.Layers*spec.ExpertsPerToken {
		t.Fatalf("offline: %d routed ids", len(want))
	}
	if !slices.Equal(got.OutputIDs, outs[0].OutputIDs) || !slices.Equal(routed, want) {
		t.Fatalf("server tokens %v routing %v\noffline tokens %v routing %v", got.OutputIDs, routed, outs[0].OutputIDs, want)
	}

	stream := maps.Clone(body)
	last, _, err := streamGenerate(t.Context(), s.url, stream, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(decodeRouted(t, last.MetaInfo.RoutedExperts), want) {
		t.Fatal("the last chunk of a stream has other routed experts")
	}
	var completion struct {
		Sglext struct {
			RoutedExperts string `json:"routed_experts"`
		} `json:"sglext"`
	}
	if code := s.post(t, "/v1/completions", map[string]any{"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
		"return_routed_experts": true}, &completion); code != 200 {
		t.Fatalf("completions: status %d", code)
	}
	if !slices.Equal(decodeRouted(t, completion.Sglext.RoutedExperts), want) {
		t.Fatal("/v1/completions sglext.routed_experts differs from the engine's")
	}

	plain := startServer(t, "--model", dir)
	var failed struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if code := plain.post(t, "/generate", body, &failed); code == 200 || !strings.Contains(failed.Error.Message, "--enable-return-routed-experts") {
		t.Fatalf("asking a server without the flag: status %d, %+v", code, failed)
	}
}
