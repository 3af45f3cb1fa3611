package cuda

import (
	"errors"
	"os"
	"path/filepath"
	"regexp"
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

// TestKernelDefineInt: the host reads the tunables it shares with a kernel
// (MWG_REGS: matmul_wg's block) from EBB_KERNEL_DEFINES, or their default.
func TestKernelDefineInt(t *testing.T) {
	for _, tc := range []struct {
		env  string
		want int
	}{
		{"", 1},
		{"MWG_REGS=0", 0},
		{"A=3, MWG_REGS=0 ,B", 0},
		{"MWG_REGS_X=0", 1},
		{"MWG_REGS=x", 1},
		{"MWG_REGS= 0", 0}, // the kernels get "#define MWG_REGS  0"
	} {
		t.Setenv("EBB_KERNEL_DEFINES", tc.env)
		if got := kernelDefineInt("MWG_REGS", 1); got != tc.want {
			t.Errorf("%q: %d, want %d", tc.env, got, tc.want)
		}
	}
}

func TestKernelDefines(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		bad      bool
	}{
		{in: "", want: ""},
		{in: "GEMV_PRELOAD=8", want: "#define GEMV_PRELOAD 8\n"},
		{in: " A=1, B_2=x ,", want: "#define A 1\n#define B_2 x\n"},
		{in: "FLAG", want: "#define FLAG \n"},
		{in: "2X=1", bad: true},
		{in: "A B=1", bad: true},
		{in: "=1", bad: true},
	} {
		got, err := kernelDefines(tc.in)
		if tc.bad {
			if err == nil {
				t.Errorf("%q: no error", tc.in)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%q: %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

// TestLaunchedKernelsAreLoaded: every kernel the host launches by a literal
// name is one OpenDevice resolves (kernelNames), so that a new kernel left
// out of the list fails here, not at its first launch on a GPU.
func TestLaunchedKernelsAreLoaded(t *testing.T) {
	loaded := map[string]bool{}
	for _, n := range kernelNames {
		loaded[n] = true
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		// tools/gpu_check.sh runs the test binary from the repository root.
		t.Skip("the package's source is not in the working directory")
	}
	call := regexp.MustCompile(`\b(?:launch|launchCluster|kernel)\("([a-z0-9_]+)"\s*[,)]`)
	seen := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range call.FindAllStringSubmatch(string(src), -1) {
			seen++
			if !loaded[m[1]] {
				t.Errorf("%s launches %q, which kernelNames does not list", f, m[1])
			}
		}
	}
	if seen < 30 {
		t.Fatalf("found %d launches by name; the pattern no longer matches the host code", seen)
	}
}

// TestKernelDefinesTakeEffect: a tunable the kernels guard with #ifndef is
// taken; one they #define unguarded, or never read, is an error, not a
// setting NVRTC would silently replace.
func TestKernelDefinesTakeEffect(t *testing.T) {
	for _, tc := range []struct {
		env string
		ok  bool
	}{
		{"", true},
		{"GEMV_PRELOAD=8", true},
		{"MOE_COMBINE_EARLY=0, MOE_ROUTE_WARPS=8", true},
		{"MOE_NR_RANKS=2", false},    // #define'd without #ifndef
		{"NO_SUCH_TUNABLE=1", false}, // read by no kernel
		{"GEMV_PRELOAD_X=1", false},  // a longer name is another macro
	} {
		t.Setenv("EBB_KERNEL_DEFINES", tc.env)
		src, err := KernelSource()
		if (err == nil) != tc.ok {
			t.Errorf("%q: error %v, want ok %v", tc.env, err, tc.ok)
		}
		if defs, _ := kernelDefines(tc.env); err == nil && !strings.HasPrefix(src, defs) {
			t.Errorf("%q: the source does not start with the defines", tc.env)
		}
	}
	// Every macro a kernel guards with #ifndef can be set.
	t.Setenv("EBB_KERNEL_DEFINES", "")
	src, err := KernelSource()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`(?m)^[ \t]*#[ \t]*ifndef[ \t]+(\w+)`).FindAllStringSubmatch(src, -1) {
		if err := definesTakeEffect(m[1]+"=1", src); err != nil {
			t.Errorf("%s: %v", m[1], err)
		}
	}
}

// TestKernelDirReplacesSources: $EBB_KERNEL_DIR's files are the source,
// in place of the embedded ones, and a directory without a prelude or
// kernels is an error that names what is missing.
func TestKernelDirReplacesSources(t *testing.T) {
	// The stand-in files read no macro, so defines set for an A/B run
	// (the GPU check may run under them) would fail them.
	t.Setenv("EBB_KERNEL_DEFINES", "")
	embedded, err := KernelSource()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	t.Setenv("EBB_KERNEL_DIR", dir)
	if _, err := KernelSource(); err == nil || !strings.Contains(err.Error(), "prelude.cuh") {
		t.Errorf("empty directory: error %v, want one naming prelude.cuh", err)
	}
	write := func(name, text string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("prelude.cuh", "// prelude\n")
	if _, err := KernelSource(); err == nil || !strings.Contains(err.Error(), ".cu") {
		t.Errorf("no kernels: error %v, want one naming .cu files", err)
	}
	write("b.cu", "// b\n")
	write("a.cu", "// a\n")
	src, err := KernelSource()
	if err != nil {
		t.Fatal(err)
	}
	if want := "// prelude\n\n// ---- a.cu ----\n// a\n\n// ---- b.cu ----\n// b\n"; src != want {
		t.Errorf("source %q, want %q", src, want)
	}
	t.Setenv("EBB_KERNEL_DIR", "")
	if again, err := KernelSource(); err != nil || again != embedded {
		t.Errorf("unset: %v, the embedded source back: %v", err, again == embedded)
	}
}

// TestEngineArch: sm_90 takes its "a" target only where NVRTC has one, so
// that `ebb kernels --cache` fills the cache entry an engine will look for.
func TestEngineArch(t *testing.T) {
	for _, tc := range []struct {
		arch  string
		major int
		ok    bool
		want  string
	}{
		{"sm_90", 13, true, "sm_90a"},
		{"sm_90", 12, true, "sm_90a"},
		{"sm_90", 11, true, "sm_90"},
		{"sm_90", 13, false, "sm_90"},
		{"sm_80", 13, true, "sm_80"},
		{"sm_100", 13, true, "sm_100"},
	} {
		if got := engineArch(tc.arch, tc.major, tc.ok); got != tc.want {
			t.Errorf("engineArch(%q, %d, %v) = %q, want %q", tc.arch, tc.major, tc.ok, got, tc.want)
		}
	}
}
