package weightsync

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// pickle helpers for hand-written payloads.
func op(b *bytes.Buffer, code byte, arg ...byte) { b.WriteByte(code); b.Write(arg) }
func sbu(b *bytes.Buffer, s string)              { op(b, 0x8c, byte(len(s))); b.WriteString(s) }
func stackGlobal(b *bytes.Buffer, module, name string) {
	sbu(b, module)
	sbu(b, name)
	op(b, 0x93)
}

func TestHostilePayloadsAreRefused(t *testing.T) {
	var osSystem bytes.Buffer
	op(&osSystem, 0x80, 2)
	osSystem.WriteString("cos\nsystem\n")
	sbu(&osSystem, "touch /tmp/ebb-pwned")
	op(&osSystem, 0x85)
	op(&osSystem, 'R')
	op(&osSystem, '.')

	var eval bytes.Buffer
	op(&eval, 0x80, 4)
	stackGlobal(&eval, "builtins", "eval")
	sbu(&eval, "1+1")
	op(&eval, 0x85)
	op(&eval, 'R')
	op(&eval, '.')

	var wrongArgs bytes.Buffer
	op(&wrongArgs, 0x80, 4)
	stackGlobal(&wrongArgs, "torch.multiprocessing.reductions", "rebuild_cuda_tensor")
	op(&wrongArgs, ')')
	op(&wrongArgs, 'R')
	op(&wrongArgs, '.')

	var hugeBytes bytes.Buffer
	op(&hugeBytes, 0x80, 4)
	op(&hugeBytes, 0x8e)
	binary.Write(&hugeBytes, binary.LittleEndian, uint64(1<<40))
	op(&hugeBytes, '.')

	var notAList bytes.Buffer
	op(&notAList, 0x80, 4)
	op(&notAList, 'K', 7)
	op(&notAList, '.')

	deep := []byte{0x80, 4}
	for i := 0; i < 200; i++ {
		deep = append(deep, '(')
	}

	var badOpcode bytes.Buffer
	op(&badOpcode, 0x80, 4)
	op(&badOpcode, 'S') // protocol 0's STRING: never in these payloads
	badOpcode.WriteString("'x'\n.")

	for _, c := range []struct {
		name    string
		payload []byte
		want    string
	}{
		{"os.system", osSystem.Bytes(), "os.system"},
		{"builtins.eval", eval.Bytes(), "builtins.eval"},
		{"wrong arguments", wrongArgs.Bytes(), "15 arguments"},
		{"huge length", hugeBytes.Bytes(), "exceeds the payload"},
		{"not a list", notAList.Bytes(), "list of (name, tensor) pairs"},
		{"deep nesting", deep, "nested deeper"},
		{"foreign opcode", badOpcode.Bytes(), "opcode 0x53"},
		{"empty", nil, "truncated"},
		{"truncated", osSystem.Bytes()[:7], "truncated"},
	} {
		p, err := Decode(c.payload, FormatDefault, 0)
		if err == nil || !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v (want a refusal naming %q)", c.name, err, c.want)
		}
		if p == nil {
			t.Errorf("%s: nil payload", c.name)
		}
	}
	if _, err := os.Stat("/tmp/ebb-pwned"); err == nil {
		t.Fatal("a payload ran a command")
	}
}

func FuzzDecode(f *testing.F) {
	f.Add([]byte{0x80, 4, ']', '.'})
	f.Add([]byte("\x80\x02cos\nsystem\nq\x00."))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, format := range []string{FormatDefault, FormatFlattened} {
			p, err := Decode(b, format, 0)
			if p == nil {
				t.Fatal("nil payload")
			}
			if err == nil {
				for _, nt := range p.Tensors {
					if nt.Tensor == nil || nt.Tensor.Storage == nil {
						t.Fatal("tensor without storage")
					}
				}
			}
		}
	})
}

// torchPython is Debian's Python with PyTorch for the CPU (installed by
// scripts/install-deps.sh), or "" when it is missing.
func torchPython(t *testing.T) string {
	t.Helper()
	if err := exec.Command("/usr/bin/python3", "-c", "import torch").Run(); err != nil {
		t.Skip("no PyTorch for /usr/bin/python3 (scripts/install-deps.sh installs python3-torch)")
	}
	return "/usr/bin/python3"
}

// TestCUDATensorPickles decodes pickles of CUDA tensors with the exact
// structure torch 2.x's reduce_tensor gives (read off torch 2.11 with
// tools/probe_torch_wire.py), made here with the real rebuild function so
// that the bytes are ForkingPickler's own: plain, with SGLang's patched
// device field (a GPU UUID), in a flattened bucket and per TP rank.
func TestCUDATensorPickles(t *testing.T) {
	py := torchPython(t)
	script := `
import base64, io, sys, dataclasses, types, torch
from multiprocessing.reduction import ForkingPickler
from torch.multiprocessing import reductions
sys.path.insert(0, "../tools")
import weight_update_trainer as w
class CUDALike:
    def __init__(self, shape, dtype, device, handle, storage_off, rc_off):
        self.a = (torch.Tensor, torch.Size(shape), tuple(torch.empty(shape).stride()), 4, torch.storage.TypedStorage,
                  dtype, device, handle, 4096, storage_off, False, b"/torch_7_9_0", rc_off, bytes(range(64)), True)
    def __reduce__(self):
        return (reductions.rebuild_cuda_tensor, self.a)
h = b"\x02c" + bytes(range(100, 164))
def dump(o):
    b = io.BytesIO(); ForkingPickler(b).dump(o); return base64.b64encode(b.getvalue()).decode()
print(dump([("model.norm.weight", CUDALike([64], torch.bfloat16, 0, h, 512, 1)),
            ("lm_head.weight", CUDALike([8, 64], torch.float32, "444b9b87-128f-97a9-3f15-bdd64b2cf934", bytes(64), 0, 2))]))
flat = CUDALike([100], torch.bfloat16, 0, h, 0, 3)
print(dump({"flattened_tensor": flat, "metadata": [w.FlattenedTensorMetadata("a", torch.Size([2, 3]), torch.bfloat16, 0, 6, 6),
                                                    w.FlattenedTensorMetadata("b", torch.Size([4]), torch.bfloat16, 6, 10, 4)]}))
inner = base64.b64decode(dump(CUDALike([3], torch.float16, 0, h, 0, 4)))
print(dump([("x", w.LocalSerializedTensor([b"rank0 is not this", inner]))]))
`
	out, err := exec.Command(py, "-c", script).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	lines := strings.Fields(string(out))
	if len(lines) != 3 {
		t.Fatalf("python printed %q", out)
	}
	raw := make([][]byte, 3)
	for i, l := range lines {
		raw[i], _ = base64.StdEncoding.DecodeString(l)
	}
	p, err := Decode(raw[0], FormatDefault, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Tensors) != 2 || len(p.Storages) != 2 {
		t.Fatalf("%d tensors, %d storages", len(p.Tensors), len(p.Storages))
	}
	norm, head := p.Tensors[0].Tensor, p.Tensors[1].Tensor
	if p.Tensors[0].Name != "model.norm.weight" || norm.DType != "bfloat16" || norm.Shape[0] != 64 || norm.Offset != 4 ||
		norm.Storage.IPCOffset != 512 || norm.Storage.IPCHandle[0] != 100 || norm.Storage.RefCounter != "/torch_7_9_0" ||
		norm.Storage.RefOffset != 1 || !norm.Storage.EventSync || norm.Storage.Event[63] != 63 || norm.Storage.Device != "0" {
		t.Fatalf("norm: %+v %+v", norm, norm.Storage)
	}
	if head.DType != "float32" || head.Shape[1] != 64 || head.Stride[0] != 64 || head.Storage.Device != "444b9b87-128f-97a9-3f15-bdd64b2cf934" {
		t.Fatalf("lm_head: %+v %+v", head, head.Storage)
	}
	if off, n := head.ByteRange(); off != 16 || n != 8*64*4 {
		t.Fatalf("lm_head bytes [%d, +%d)", off, n)
	}
	p, err = Decode(raw[1], FormatFlattened, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Tensors) != 2 || p.Tensors[1].Name != "b" || p.Tensors[1].Tensor.Offset != 4+6 || p.Tensors[0].Tensor.Shape[1] != 3 {
		t.Fatalf("flattened: %+v", p.Tensors)
	}
	p, err = Decode(raw[2], FormatDefault, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Tensors) != 1 || p.Tensors[0].Tensor.DType != "float16" || p.Tensors[0].Tensor.Storage.RefOffset != 4 {
		t.Fatalf("local: %+v", p.Tensors)
	}
	if _, err := Decode(raw[2], FormatDefault, 0); err == nil {
		t.Fatal("rank 0's value (not a pickle) decoded")
	}
}
