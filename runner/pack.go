package runner

import (
	"math"

	"ebb/device"
	"ebb/model"
)

// hostStep packs a step's inputs into one int32 and one float32 buffer, so a
// step costs two host-to-device copies.
type hostStep struct {
	ints   []int32
	floats []float32

	numSeqs, numTokens, numKV int
	numSample, numRows, topK  int
	inTopK                    int // top logprobs at the prompt-logprob rows (0: none)
	nnz                       int
	penalties                 bool

	sampleSeq []int // seq index of each sample row
	targetSeq []int // seq index of each prompt-logprob row
	targetRow []int // row within that seq's tokens

	targetsTensor device.Tensor
	inTop         device.SampleArgs // greedy sampling of the prompt-logprob rows, for their top logprobs
}

// layout gives the offsets of each field in the packed buffers.
type layout struct {
	tokens, positions, slots, qptr, kvptr, kvidx, rows, topK, keys, targets, penPtr, penTok, penCnt int
	penBias, lastQptr                                                                               int
	outIDs, outTop, intsLen                                                                         int
	temp, topP, minP, rep, freq, pres, outLp, outTopLp, outTL, floatsLen                            int
	// The prompt-logprob rows' greedy sampling, for their top logprobs.
	inTopK, inKeys, inIDs, inTop, inTemp, inTopP, inMinP, inLp, inTopLp int
}

// makeLayout: t tokens, s sequences, kv KV entries, r logit rows of which
// samples are sampled, k top logprobs at those, k2 at the others, nnz
// penalty entries.
func makeLayout(t, s, kv, r, samples, k, k2, nnz int) layout {
	var l layout
	n := 0
	next := func(size int) int { off := n; n += size; return off }
	l.tokens, l.positions, l.slots = next(t), next(t), next(t)
	l.qptr, l.kvptr, l.kvidx, l.lastQptr = next(s+1), next(s+1), next(kv), next(s+1)
	l.rows, l.topK, l.keys, l.targets = next(r), next(samples), next(2*samples), next(r-samples)
	l.penPtr, l.penTok, l.penCnt = next(samples+1), next(nnz), next(nnz)
	l.outIDs, l.outTop = next(samples), next(samples*k)
	nt := 0 // prompt-logprob rows that take top logprobs
	if k2 > 0 {
		nt = r - samples
	}
	l.inTopK, l.inKeys, l.inIDs, l.inTop = next(nt), next(2*nt), next(nt), next(nt*k2)
	l.intsLen = n
	n = 0
	l.temp, l.topP, l.minP = next(samples), next(samples), next(samples)
	l.rep, l.freq, l.pres = next(samples), next(samples), next(samples)
	l.outLp, l.outTopLp, l.outTL = next(samples), next(samples*k), next(r-samples)
	l.penBias = next(nnz)
	l.inTemp, l.inTopP, l.inMinP, l.inLp, l.inTopLp = next(nt), next(nt), next(nt), next(nt), next(nt*k2)
	l.floatsLen = n
	return l
}

func inputBytes(t, s, kv, r, k, k2, nnz int) int64 {
	l := makeLayout(t, s, kv, r, min(s, r), k, k2, nnz)
	return int64(4*(l.intsLen+l.floatsLen)) + 1024
}

func (h *hostStep) bytes() int64 {
	return int64(4*(len(h.ints)+len(h.floats))) + 1024
}

func (h *hostStep) layout() layout {
	return makeLayout(h.numTokens, h.numSeqs, h.numKV, h.numRows, h.numSample, h.topK, h.inTopK, h.nnz)
}

func (h *hostStep) pack(seqs []SeqStep, maxTopK int) {
	*h = hostStep{ints: h.ints[:0], floats: h.floats[:0], sampleSeq: h.sampleSeq[:0],
		targetSeq: h.targetSeq[:0], targetRow: h.targetRow[:0]}
	h.numSeqs = len(seqs)
	for i, s := range seqs {
		h.numTokens += len(s.Tokens)
		h.numKV += len(s.Slots)
		if s.Sample {
			h.sampleSeq = append(h.sampleSeq, i)
			h.topK = max(h.topK, s.Params.TopLogprobs)
			if len(s.Adjust) > 0 {
				h.penalties = true
				h.nnz += len(s.Adjust)
			}
		}
		for j, t := range s.NextTokens {
			if t >= 0 {
				h.targetSeq = append(h.targetSeq, i)
				h.targetRow = append(h.targetRow, j)
				h.inTopK = max(h.inTopK, s.InputTopK)
			}
		}
	}
	h.topK, h.inTopK = min(h.topK, maxTopK), min(h.inTopK, maxTopK)
	h.numSample = len(h.sampleSeq)
	h.numRows = h.numSample + len(h.targetSeq)
	l := h.layout()
	h.ints = grow(h.ints, l.intsLen)
	h.floats = growF(h.floats, l.floatsLen)
	ints, fl := h.ints, h.floats

	row, kv := 0, 0
	rowStart := make([]int, len(seqs))
	ints[l.qptr], ints[l.kvptr] = 0, 0
	for i, s := range seqs {
		rowStart[i] = row
		for j, t := range s.Tokens {
			ints[l.tokens+row+j] = t
			ints[l.positions+row+j] = int32(s.Start + j)
			ints[l.slots+row+j] = s.Slots[s.Start+j]
		}
		copy(ints[l.kvidx+kv:], s.Slots)
		row += len(s.Tokens)
		kv += len(s.Slots)
		ints[l.qptr+i+1], ints[l.kvptr+i+1] = int32(row), int32(kv)
	}
	// The last layer's queries: each sampled sequence's last token.
	ints[l.lastQptr] = 0
	for i, r := 0, 0; i < len(seqs); i++ {
		if r < len(h.sampleSeq) && h.sampleSeq[r] == i {
			r++
		}
		ints[l.lastQptr+i+1] = int32(r)
	}
	nnz := 0
	ints[l.penPtr] = 0
	for r, i := range h.sampleSeq {
		s := &seqs[i]
		ints[l.rows+r] = int32(rowStart[i] + len(s.Tokens) - 1)
		p := s.Params
		ints[l.topK+r] = int32(p.TopK)
		fl[l.temp+r], fl[l.topP+r], fl[l.minP+r] = p.Temperature, p.TopP, p.MinP
		k0, k1 := Key(p.Seed, s.Draw)
		ints[l.keys+2*r], ints[l.keys+2*r+1] = int32(k0), int32(k1)
		fl[l.rep+r], fl[l.freq+r], fl[l.pres+r] = p.RepetitionPenalty, p.FrequencyPenalty, p.PresencePenalty
		if fl[l.rep+r] == 0 {
			fl[l.rep+r] = 1
		}
		for _, a := range s.Adjust {
			ints[l.penTok+nnz], ints[l.penCnt+nnz], fl[l.penBias+nnz] = a.Token, a.Count, a.Bias
			nnz++
		}
		ints[l.penPtr+r+1] = int32(nnz)
	}
	for k := range h.targetSeq {
		i, j := h.targetSeq[k], h.targetRow[k]
		ints[l.rows+h.numSample+k] = int32(rowStart[i] + j)
		ints[l.targets+k] = seqs[i].NextTokens[j]
		if h.inTopK > 0 { // greedy: no filter, no temperature
			ints[l.inTopK+k], ints[l.inKeys+2*k], ints[l.inKeys+2*k+1] = 0, 0, 0
			fl[l.inTemp+k], fl[l.inTopP+k], fl[l.inMinP+k] = 0, 1, 0
		}
	}
}

func grow(b []int32, n int) []int32 {
	if cap(b) < n {
		return make([]int32, n)
	}
	return b[:n]
}

func growF(b []float32, n int) []float32 {
	if cap(b) < n {
		return make([]float32, n)
	}
	return b[:n]
}

// upload copies the packed buffers into scratch tensors and returns views.
func (h *hostStep) upload(dev device.Device, s *device.Scratch) (model.Inputs, device.SampleArgs, device.PenaltyArgs, device.Tensor, error) {
	l := h.layout()
	ints := s.Take(device.I32, l.intsLen)
	floats := s.Take(device.F32, max(l.floatsLen, 1))
	if err := dev.Upload(ints, model.I32Bytes(h.ints), device.I32); err != nil {
		return model.Inputs{}, device.SampleArgs{}, device.PenaltyArgs{}, device.Tensor{}, err
	}
	if l.floatsLen > 0 {
		if err := dev.Upload(floats.Rows(0, l.floatsLen), model.F32Bytes(h.floats), device.F32); err != nil {
			return model.Inputs{}, device.SampleArgs{}, device.PenaltyArgs{}, device.Tensor{}, err
		}
	}
	iv := func(off, n int) device.Tensor { return ints.Rows(off, off+n) }
	fv := func(off, n int) device.Tensor { return floats.Rows(off, off+n) }
	in := model.Inputs{
		Tokens: iv(l.tokens, h.numTokens), Positions: iv(l.positions, h.numTokens), OutSlots: iv(l.slots, h.numTokens),
		Attn: device.AttnMeta{
			NumSeqs: h.numSeqs, QIndptr: iv(l.qptr, h.numSeqs+1), KVIndptr: iv(l.kvptr, h.numSeqs+1),
			KVIndices: iv(l.kvidx, h.numKV),
		},
		LogitRows: iv(l.rows, h.numRows),
	}
	in.Attn.Decodes = leadingDecodes(h.ints[l.qptr : l.qptr+h.numSeqs+1])
	for i := 0; i < h.numSeqs; i++ {
		in.Attn.MaxQLen = max(in.Attn.MaxQLen, int(h.ints[l.qptr+i+1]-h.ints[l.qptr+i]))
		in.Attn.MaxKVLen = max(in.Attn.MaxKVLen, int(h.ints[l.kvptr+i+1]-h.ints[l.kvptr+i]))
	}
	if h.numSample > 0 && h.numRows == h.numSample {
		// Every logit row is a sampled last token: the model may run its
		// last layer on those rows alone (model.Inputs.LastAttn).
		in.LastAttn = in.Attn
		in.LastAttn.QIndptr, in.LastAttn.MaxQLen = iv(l.lastQptr, h.numSeqs+1), 1
		in.LastAttn.Decodes, in.LastAttn.Sparse = 0, true
	}
	ns := h.numSample
	samp := device.SampleArgs{
		Temperature: fv(l.temp, ns), TopP: fv(l.topP, ns), TopK: iv(l.topK, ns), MinP: fv(l.minP, ns),
		Keys: iv(l.keys, 2*ns), IDs: iv(l.outIDs, ns), Logprobs: fv(l.outLp, ns),
	}
	if h.topK > 0 {
		samp.TopIDs = iv(l.outTop, ns*h.topK).View(ns, h.topK)
		samp.TopLogprobs = fv(l.outTopLp, ns*h.topK).View(ns, h.topK)
	}
	var pen device.PenaltyArgs
	if h.penalties {
		pen = device.PenaltyArgs{
			RowPtr: iv(l.penPtr, ns+1), Tokens: iv(l.penTok, h.nnz), Counts: iv(l.penCnt, h.nnz),
			Bias:       fv(l.penBias, h.nnz),
			Repetition: fv(l.rep, ns), Frequency: fv(l.freq, ns), Presence: fv(l.pres, ns),
		}
	}
	var tl device.Tensor
	if nt := h.numRows - ns; nt > 0 {
		tl = fv(l.outTL, nt)
		h.targetsTensor = iv(l.targets, nt)
		if h.inTopK > 0 {
			h.inTop = device.SampleArgs{
				Temperature: fv(l.inTemp, nt), TopP: fv(l.inTopP, nt), TopK: iv(l.inTopK, nt), MinP: fv(l.inMinP, nt),
				Keys: iv(l.inKeys, 2*nt), IDs: iv(l.inIDs, nt), Logprobs: fv(l.inLp, nt),
				TopIDs: iv(l.inTop, nt*h.inTopK).View(nt, h.inTopK), TopLogprobs: fv(l.inTopLp, nt*h.inTopK).View(nt, h.inTopK),
			}
		}
	}
	return in, samp, pen, tl, nil
}

// results downloads the sampled ids and logprobs.
func (h *hostStep) results(dev device.Device, samp device.SampleArgs, tl device.Tensor) ([]SeqResult, error) {
	out := make([]SeqResult, h.numSeqs)
	ns := h.numSample
	if ns > 0 {
		ids := make([]int32, ns)
		lps := make([]float32, ns)
		if err := dev.DownloadI32(samp.IDs, ids); err != nil {
			return nil, err
		}
		if err := dev.DownloadF32(samp.Logprobs, lps); err != nil {
			return nil, err
		}
		var topIDs []int32
		var topLps []float32
		if h.topK > 0 {
			topIDs, topLps = make([]int32, ns*h.topK), make([]float32, ns*h.topK)
			if err := dev.DownloadI32(samp.TopIDs, topIDs); err != nil {
				return nil, err
			}
			if err := dev.DownloadF32(samp.TopLogprobs, topLps); err != nil {
				return nil, err
			}
		}
		for r, i := range h.sampleSeq {
			out[i].Token, out[i].Logprob = ids[r], lps[r]
			if h.topK > 0 {
				out[i].TopIDs = topIDs[r*h.topK : (r+1)*h.topK]
				out[i].TopLogprobs = topLps[r*h.topK : (r+1)*h.topK]
			}
		}
	}
	if tl.Valid() {
		vals := make([]float32, tl.Numel())
		if err := dev.DownloadF32(tl, vals); err != nil {
			return nil, err
		}
		for k, v := range vals {
			i, j := h.targetSeq[k], h.targetRow[k]
			if out[i].InputLogprobs == nil {
				out[i].InputLogprobs = nanSlice(h.tokensOf(i))
			}
			out[i].InputLogprobs[j] = v
		}
	}
	if h.inTopK > 0 {
		k2 := h.inTopK
		ids, lps := make([]int32, h.inTop.TopIDs.Numel()), make([]float32, h.inTop.TopLogprobs.Numel())
		if err := dev.DownloadI32(h.inTop.TopIDs, ids); err != nil {
			return nil, err
		}
		if err := dev.DownloadF32(h.inTop.TopLogprobs, lps); err != nil {
			return nil, err
		}
		for k := range h.targetSeq {
			i, j := h.targetSeq[k], h.targetRow[k]
			if out[i].InputTopIDs == nil {
				n := h.tokensOf(i)
				out[i].InputTopIDs, out[i].InputTopLogprobs = make([][]int32, n), make([][]float32, n)
			}
			out[i].InputTopIDs[j], out[i].InputTopLogprobs[j] = ids[k*k2:(k+1)*k2], lps[k*k2:(k+1)*k2]
		}
	}
	return out, dev.Sync()
}

func (h *hostStep) tokensOf(seq int) int {
	l := h.layout()
	return int(h.ints[l.qptr+seq+1] - h.ints[l.qptr+seq])
}

func nanSlice(n int) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(math.NaN())
	}
	return s
}

// Key is the noise key of token index n of a sequence: the same seed gives
// the same draws whatever else is in the batch.
func Key(seed uint64, n int) (uint32, uint32) {
	x := splitmix(seed ^ splitmix(uint64(n)+0x632be59bd9b4e019))
	return uint32(x), uint32(x >> 32)
}

func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// leadingDecodes counts the sequences at the front of a step with one query
// each (qptr holds the query offsets): the scheduler puts a mixed step's
// decodes first.
func leadingDecodes(qptr []int32) int {
	n := 0
	for n+1 < len(qptr) && qptr[n+1]-qptr[n] == 1 {
		n++
	}
	return n
}
