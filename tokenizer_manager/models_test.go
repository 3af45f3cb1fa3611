package tokenizermanager

import (
	"encoding/json"
	"net/http"
	"testing"
)

// TestModelEndpoints: /v1/models lists the served model and
// /v1/models/{model} retrieves it by name, slashes and all, as SGLang's
// retrieve_model does; another name is a 404 in OpenAI's error form.
func TestModelEndpoints(t *testing.T) {
	srv := scriptedServer(t, func(c *Config) { c.ModelName = "Qwen/Qwen3-0.6B" })
	get := func(path string) (int, map[string]any) {
		t.Helper()
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		return resp.StatusCode, body
	}
	code, list := get("/v1/models")
	data, _ := list["data"].([]any)
	if code != http.StatusOK || len(data) != 1 {
		t.Fatalf("/v1/models: %d %v", code, list)
	}
	card := data[0].(map[string]any)
	if card["id"] != "Qwen/Qwen3-0.6B" || card["max_model_len"] == nil {
		t.Fatalf("/v1/models: %v", card)
	}
	for _, c := range []struct {
		path   string
		status int
		want   string // the card's id, or the error's code
	}{
		{"/v1/models/Qwen/Qwen3-0.6B", http.StatusOK, "Qwen/Qwen3-0.6B"},
		{"/v1/models/Qwen3-0.6B", http.StatusNotFound, "model_not_found"},
		{"/v1/models/gpt-4", http.StatusNotFound, "model_not_found"},
	} {
		code, body := get(c.path)
		if code != c.status {
			t.Errorf("GET %s: status %d, want %d (%v)", c.path, code, c.status, body)
			continue
		}
		if c.status == http.StatusOK {
			if body["id"] != c.want || body["object"] != "model" || body["max_model_len"] != card["max_model_len"] {
				t.Errorf("GET %s: %v, want the listed card %v", c.path, body, card)
			}
			continue
		}
		e, _ := body["error"].(map[string]any)
		if e["code"] != c.want || e["param"] != "model" || e["type"] != "invalid_request_error" {
			t.Errorf("GET %s: error %v", c.path, body)
		}
	}
}
