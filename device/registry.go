package device

import (
	"fmt"
	"sort"
	"sync"
)

// Opener creates a device from backend-specific options.
type Opener func(opts OpenOptions) (Device, error)

// OpenOptions are common to every backend.
type OpenOptions struct {
	// Ordinal selects the GPU.
	Ordinal int
}

// Available reports whether a backend can run on this machine, and why not.
type Available func() error

var (
	mu       sync.Mutex
	backends = map[string]backend{}
)

type backend struct {
	open      Opener
	available Available
}

// Register adds a backend; cpu and cuda register themselves when imported.
func Register(name string, open Opener, available Available) {
	mu.Lock()
	defer mu.Unlock()
	backends[name] = backend{open, available}
}

// Open creates a device by name; "auto" picks cuda when it is available,
// else cpu.
func Open(name string, opts OpenOptions) (Device, error) {
	mu.Lock()
	b, ok := backends[name]
	cuda, hasCUDA := backends["cuda"]
	cpu := backends["cpu"]
	mu.Unlock()
	if name == "auto" {
		if hasCUDA && cuda.available() == nil {
			return cuda.open(opts)
		}
		if cpu.open == nil {
			return nil, fmt.Errorf("no device backend is built in")
		}
		return cpu.open(opts)
	}
	if !ok {
		return nil, fmt.Errorf("unknown device %q (known: %v, auto)", name, Names())
	}
	if err := b.available(); err != nil {
		return nil, fmt.Errorf("device %s is not available: %w", name, err)
	}
	return b.open(opts)
}

// Names lists registered backends.
func Names() []string {
	mu.Lock()
	defer mu.Unlock()
	var names []string
	for n := range backends {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
