package cuda

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"fmt"
	"sort"
)

// KernelResource is what ptxas gave one kernel of a CUBIN: its registers a
// thread, which with its block size and shared memory decide how many
// blocks share an SM, and its stack frame, which is where registers spill.
type KernelResource struct {
	Name      string
	Registers int
	Frame     int // bytes of local memory a thread (spills and local arrays)
	Shared    int // bytes of static shared memory a block
}

// .nv.info attributes (EIATTR_*) that carry a kernel's resources.
const (
	eiattrFrameSize = 0x11
	eiattrRegCount  = 0x2f
	eifmtSVal       = 0x04 // an attribute with a 16-bit size and a payload
)

// KernelResources reads each kernel's registers and frame from a CUBIN's
// .nv.info section (what `cuobjdump -res-usage` prints), so that a
// kernel's occupancy can be checked where there is no CUDA toolkit, only
// NVRTC; its static shared memory is the size of its .nv.shared section.
// Kernels come sorted by name.
func KernelResources(cubin []byte) ([]KernelResource, error) {
	if len(cubin) < 0x18 {
		return nil, fmt.Errorf("cubin: %d bytes", len(cubin))
	}
	// A CUBIN keeps its ABI version where ELF keeps its own (1), which
	// debug/elf insists on: a copy says 1.
	b := bytes.Clone(cubin)
	b[elf.EI_VERSION] = byte(elf.EV_CURRENT)
	binary.LittleEndian.PutUint32(b[0x14:], uint32(elf.EV_CURRENT))
	f, err := elf.NewFile(bytes.NewReader(b))
	if err != nil {
		return nil, fmt.Errorf("cubin: %w", err)
	}
	syms, err := f.Symbols()
	if err != nil {
		return nil, fmt.Errorf("cubin symbols: %w", err)
	}
	info := f.Section(".nv.info")
	if info == nil {
		return nil, fmt.Errorf("cubin: no .nv.info section")
	}
	data, err := info.Data()
	if err != nil {
		return nil, fmt.Errorf("cubin .nv.info: %w", err)
	}
	byName := map[string]*KernelResource{}
	kernel := func(sym uint32) *KernelResource {
		// debug/elf leaves out the null symbol 0.
		if sym == 0 || int(sym) > len(syms) {
			return nil
		}
		name := syms[sym-1].Name
		if byName[name] == nil {
			byName[name] = &KernelResource{Name: name}
		}
		return byName[name]
	}
	for off := 0; off+4 <= len(data); {
		format, attr := data[off], data[off+1]
		if format != eifmtSVal {
			off += 4 // the other formats are 4 bytes in all, value inline
			continue
		}
		size := int(binary.LittleEndian.Uint16(data[off+2:]))
		payload := data[off+4 : min(len(data), off+4+size)]
		if (attr == eiattrRegCount || attr == eiattrFrameSize) && len(payload) >= 8 {
			if k := kernel(binary.LittleEndian.Uint32(payload)); k != nil {
				v := int(binary.LittleEndian.Uint32(payload[4:]))
				if attr == eiattrRegCount {
					k.Registers = v
				} else {
					k.Frame = v
				}
			}
		}
		off += 4 + size
	}
	var out []KernelResource
	for _, s := range syms {
		if elf.ST_TYPE(s.Info) != elf.STT_FUNC || byName[s.Name] == nil || byName[s.Name].Registers == 0 {
			continue
		}
		if sec := f.Section(".nv.shared." + s.Name); sec != nil {
			byName[s.Name].Shared = int(sec.Size)
		}
		out = append(out, *byName[s.Name])
		delete(byName, s.Name)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}
