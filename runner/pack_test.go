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
	// 5 logit rows, 3 sampled with 2 top logprobs, 2 prompt rows with 4.
	l := makeLayout(10, 3, 40, 5, 3, 2, 4, 7)
	ints := []struct{ off, n int }{{l.tokens, 10}, {l.positions, 10}, {l.slots, 10}, {l.qptr, 4}, {l.kvptr, 4},
		{l.kvidx, 40}, {l.lastQptr, 4}, {l.rows, 5}, {l.topK, 3}, {l.keys, 6}, {l.targets, 2}, {l.penPtr, 4}, {l.penTok, 7}, {l.penCnt, 7}, {l.outIDs, 3}, {l.outTop, 6},
		{l.inTopK, 2}, {l.inKeys, 4}, {l.inIDs, 2}, {l.inTop, 8}}
	floats := []struct{ off, n int }{{l.temp, 3}, {l.topP, 3}, {l.minP, 3}, {l.rep, 3}, {l.freq, 3}, {l.pres, 3},
		{l.outLp, 3}, {l.outTopLp, 6}, {l.outTL, 2}, {l.penBias, 7}, {l.inTemp, 2}, {l.inTopP, 2}, {l.inMinP, 2},
		{l.inLp, 2}, {l.inTopLp, 8}}
	for _, c := range []struct {
		name   string
		fields []struct{ off, n int }
		length int
	}{{"int", ints, l.intsLen}, {"float", floats, l.floatsLen}} {
		end := 0
		for i, f := range c.fields {
			if f.off != end {
				t.Fatalf("%s field %d at %d, want %d", c.name, i, f.off, end)
			}
			end += f.n
		}
		if end != c.length {
			t.Fatalf("%s length %d, fields end at %d", c.name, c.length, end)
		}
	}
	// Without top logprobs at the prompt rows their fields take no room.
	if l0 := makeLayout(10, 3, 40, 5, 3, 2, 0, 7); l0.intsLen != l.intsLen-16 || l0.floatsLen != l.floatsLen-16 {
		t.Fatalf("no prompt top logprobs: %d ints, %d floats", l0.intsLen, l0.floatsLen)
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
