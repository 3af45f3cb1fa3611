package cuda

import (
	"slices"
	"testing"
)

// TestBenchAttentionLayouts checks the attention benchmark's contexts and
// KV slot layouts (no GPU needed): every slot once, in range.
func TestBenchAttentionLayouts(t *testing.T) {
	ctx := benchContexts(5, 100, 500, false)
	if !slices.Equal(ctx, []int{500, 400, 300, 200, 100}) {
		t.Fatalf("contexts %v, want longest first from 500 to 100", ctx)
	}
	shuffled := benchContexts(5, 100, 500, true)
	if slices.Sort(shuffled); !slices.Equal(shuffled, []int{100, 200, 300, 400, 500}) {
		t.Fatalf("shuffled contexts %v", shuffled)
	}
	for _, layout := range []string{"contiguous", "interleaved", "random"} {
		idx, err := benchSlots(ctx, layout)
		if err != nil {
			t.Fatal(err)
		}
		if len(idx) != 1500 {
			t.Fatalf("%s: %d slots, want 1500", layout, len(idx))
		}
		seen := map[int32]bool{}
		for _, i := range idx {
			if seen[i] || i < 0 || int(i) >= 5*500 {
				t.Fatalf("%s: slot %d repeated or out of range", layout, i)
			}
			seen[i] = true
		}
		switch layout {
		case "contiguous":
			if idx[0] != 0 || idx[1499] != 1499 {
				t.Fatalf("contiguous: %d..%d", idx[0], idx[1499])
			}
		case "interleaved":
			// Sequence 1 starts after sequence 0's 500 positions; its
			// position p sits at slot 5p+1.
			if idx[500] != 1 || idx[501] != 6 {
				t.Fatalf("interleaved: sequence 1 at %d, %d", idx[500], idx[501])
			}
		}
	}
	if _, err := benchSlots(ctx, "diagonal"); err == nil {
		t.Fatal("unknown layout accepted")
	}
}
