package tokenizermanager

import "testing"

// TestPromptKey: equal prompts give one key and any difference (a token,
// a length, a token's sign) another, as submit's grouping of copies needs.
func TestPromptKey(t *testing.T) {
	for _, c := range []struct {
		a, b []int32
		same bool
	}{
		{[]int32{1, 2, 3}, []int32{1, 2, 3}, true},
		{nil, []int32{}, true},
		{[]int32{1, 2, 3}, []int32{1, 2, 4}, false},
		{[]int32{1, 2}, []int32{1, 2, 0}, false},
		{[]int32{256}, []int32{1, 0}, false},
		{[]int32{-1}, []int32{1<<31 - 1}, false},
	} {
		if got := promptKey(c.a) == promptKey(c.b); got != c.same {
			t.Errorf("%v and %v: same key %v, want %v", c.a, c.b, got, c.same)
		}
	}
}
