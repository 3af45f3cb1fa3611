package cuda

import (
	"errors"
	"strings"
	"testing"
)

// TestKernelsCompile compiles every embedded kernel to PTX for sm_80 and
// sm_90 with whatever NVRTC is installed (CI installs Debian's libnvrtc11.2),
// so kernel compile errors show up without a GPU.
func TestKernelsCompile(t *testing.T) {
	major, minor, err := NVRTCVersion()
	if errors.Is(err, ErrNoLibrary) {
		t.Skip("no NVRTC on this machine:", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	src, err := KernelSource()
	if err != nil {
		t.Fatal(err)
	}
	for _, arch := range []string{"compute_80", "compute_90"} {
		ptx, err := Compile(src, "ebb_kernels.cu", arch)
		if err != nil {
			t.Fatalf("NVRTC %d.%d: %v", major, minor, err)
		}
		if !strings.Contains(string(ptx), ".entry") {
			t.Fatalf("%s: PTX has no kernels", arch)
		}
		// Every kernel OpenDevice resolves by name is in the module.
		for _, name := range kernelNames {
			if !strings.Contains(string(ptx), ".entry "+name+"(") {
				t.Errorf("%s: no kernel %q in the module", arch, name)
			}
		}
		t.Logf("NVRTC %d.%d %s: %d bytes of PTX", major, minor, arch, len(ptx))
	}
}

func TestNoGPUFailsCleanly(t *testing.T) {
	if Available() == nil {
		t.Skip("a GPU is present")
	}
	if _, err := Open(0); err == nil {
		t.Fatal("Open succeeded without a GPU")
	}
}
