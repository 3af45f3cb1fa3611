package runner

import "testing"

func TestKeysAreSeeded(t *testing.T) {
	seen := map[[2]uint32]bool{}
	for n := 0; n < 1000; n++ {
		k0, k1 := Key(42, n)
		if a, b := Key(42, n); a != k0 || b != k1 {
			t.Fatal("the same seed and index gave different keys")
		}
		seen[[2]uint32{k0, k1}] = true
	}
	a0, _ := Key(1, 0)
	b0, _ := Key(2, 0)
	if len(seen) < 1000 || a0 == b0 {
		t.Fatal("keys repeat")
	}
}

func TestLayoutFieldsDoNotOverlap(t *testing.T) {
	l := makeLayout(10, 3, 40, 5, 3, 2, 7)
	ints := []struct{ off, n int }{{l.tokens, 10}, {l.positions, 10}, {l.slots, 10}, {l.qptr, 4}, {l.kvptr, 4},
		{l.kvidx, 40}, {l.lastQptr, 4}, {l.rows, 5}, {l.topK, 3}, {l.keys, 6}, {l.targets, 2}, {l.penPtr, 4}, {l.penTok, 7}, {l.penCnt, 7}, {l.outIDs, 3}, {l.outTop, 6}}
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

func TestLeadingDecodes(t *testing.T) {
	for _, tc := range []struct {
		qptr []int32
		want int
	}{
		{[]int32{0}, 0},
		{[]int32{0, 1, 2, 3}, 3},        // all decodes
		{[]int32{0, 1, 2, 130, 131}, 2}, // decodes, a prompt chunk, a one-token chunk
		{[]int32{0, 128, 129}, 0},       // a prompt first
		{[]int32{0, 1, 1, 2}, 1},        // an empty sequence ends the run
	} {
		if got := leadingDecodes(tc.qptr); got != tc.want {
			t.Errorf("leadingDecodes(%v) = %d, want %d", tc.qptr, got, tc.want)
		}
	}
}
