package runner

import "testing"

func TestUniformIsSeededAndInRange(t *testing.T) {
	seen := map[float32]bool{}
	for n := 0; n < 1000; n++ {
		u := Uniform(42, n)
		if u < 0 || u >= 1 {
			t.Fatalf("draw %d = %v", n, u)
		}
		if Uniform(42, n) != u {
			t.Fatal("the same seed and index gave different draws")
		}
		seen[u] = true
	}
	if len(seen) < 990 || Uniform(1, 0) == Uniform(2, 0) {
		t.Fatal("draws repeat")
	}
}

func TestLayoutFieldsDoNotOverlap(t *testing.T) {
	l := makeLayout(10, 3, 40, 5, 3, 2, 7)
	ints := []struct{ off, n int }{{l.tokens, 10}, {l.positions, 10}, {l.slots, 10}, {l.qptr, 4}, {l.kvptr, 4},
		{l.kvidx, 40}, {l.rows, 5}, {l.topK, 3}, {l.targets, 2}, {l.penPtr, 4}, {l.penTok, 7}, {l.penCnt, 7}, {l.outIDs, 3}, {l.outTop, 6}}
	end := 0
	for i, f := range ints {
		if f.off != end {
			t.Fatalf("int field %d at %d, want %d", i, f.off, end)
		}
		end += f.n
	}
	if end != l.intsLen {
		t.Fatalf("ints length %d, fields end at %d", l.intsLen, end)
	}
}
