package nccl

import (
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/deepstates/dos/internal/comm"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/ebitengine/purego"
)

// TestAvailable: with NCCL and a GPU (DOS_REQUIRE_GPU=1 demands them),
// Available is nil and Version names a 2.x library; without, the error
// says what is missing: NCCL, naming every place searched, or the GPU.
func TestAvailable(t *testing.T) {
	err := Available()
	if err == nil {
		v, path, err := Version()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("NCCL %d from %s", v, path)
		if v < 20000 || v >= 30000 {
			t.Errorf("version %d: want 2.x (20000 to 29999)", v)
		}
		return
	}
	if os.Getenv("DOS_REQUIRE_GPU") == "1" {
		t.Fatalf("DOS_REQUIRE_GPU=1 but NCCL or the GPU is missing: %v", err)
	}
	t.Logf("%v", err)
	if lib.err != nil {
		for _, want := range []string{"nccl: no NCCL (libnccl.so.2, libnccl.so)", "the loader's search path", "/usr/local/cuda/lib64"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error lacks %q", want)
			}
		}
	} else if cuda.Available() == nil {
		t.Errorf("Available failed with NCCL loaded and a GPU: %v", err)
	}
	if _, err := InitAll(nil); err == nil {
		t.Error("InitAll without NCCL or devices succeeded")
	}
}

// TestPlaces: DOS_NCCL first (a file or a directory), then the loader's
// search path, the toolkit, and PyTorch's wheel directory.
func TestPlaces(t *testing.T) {
	glob := func(pat string) ([]string, error) {
		if strings.HasPrefix(pat, "/usr/local/lib/python3*/dist-packages/nvidia/nccl/") {
			return []string{"/usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib"}, nil
		}
		return nil, nil
	}
	var got []string
	for _, p := range library.Places("/opt/nccl/libnccl.so.2", glob) {
		got = append(got, p.Path)
	}
	want := []string{"/opt/nccl/libnccl.so.2", "libnccl.so.2", "libnccl.so", "/usr/local/cuda/lib64/libnccl.so.2"}
	if !slices.Equal(got[:len(want)], want) {
		t.Errorf("order %q, want it to start %q", got, want)
	}
	if !slices.Contains(got, "/usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib/libnccl.so.2") {
		t.Errorf("the wheel's directory is missing from %q", got)
	}
}

// TestChecks: what a collective refuses before NCCL sees it, each with
// its message.
func TestChecks(t *testing.T) {
	if err := sizes("AllGather", 8, 24, 3, 4, "send", "recv"); err != nil {
		t.Errorf("3 ranks of 8 bytes into 24: %v", err)
	}
	for _, c := range []struct {
		small, big int64
		mult       int
		es         int64
		want       string
	}{
		{8, 20, 3, 4, "want 3 × send's 8"},
		{6, 18, 3, 4, "not whole elements of 4 bytes"},
		{8, 8, 1, 8, ""},
	} {
		err := sizes("AllGather", c.small, c.big, c.mult, c.es, "send", "recv")
		if (err == nil) != (c.want == "") || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("sizes(%d, %d, %d, %d) = %v, want %q", c.small, c.big, c.mult, c.es, err, c.want)
		}
	}
	if _, err := dataType(comm.DType(7)); err == nil || !strings.Contains(err.Error(), "DType(7)") {
		t.Errorf("an unknown dtype: %v", err)
	}
	for dt, want := range map[comm.DType]uintptr{comm.F32: 7, comm.BF16: 9, comm.F64: 8} {
		if got, err := dataType(dt); err != nil || got != want {
			t.Errorf("dataType(%v) = %d, %v; want ncclDataType_t %d", dt, got, err, want)
		}
	}
	if o, err := redOp(comm.Avg); err != nil || o != 4 {
		t.Errorf("Avg: ncclRedOp_t %d, %v; want ncclAvg (4)", o, err)
	}
	if _, err := redOp(comm.Op(9)); err == nil {
		t.Error("an unknown reduction was accepted")
	}
	if _, err := (Span{}).ptr("AllReduce send", 4); err == nil || !strings.Contains(err.Error(), "AllReduce send: nil buffer") {
		t.Errorf("a nil buffer: %v", err)
	}
	e := newError("ncclCommInitAll(2 devices [0 0])", 5, 0)
	if e.Name != "ncclInvalidUsage" || !strings.Contains(e.Error(), "nccl: ncclCommInitAll(2 devices [0 0]): ncclInvalidUsage") {
		t.Errorf("newError: %v", e)
	}
	if newError("x", 42, 0).Name != "ncclResult_t(42)" {
		t.Error("an unknown ncclResult_t is not named by its number")
	}
	var ne *Error
	if !errors.As(error(e), &ne) {
		t.Error("newError is not an *Error")
	}
}

// TestNVLSOff: loading NCCL (or failing to) leaves NCCL_NVLS_ENABLE=0 in
// the C environment NCCL reads, even where the process started with 1. It
// runs itself again with NCCL_NVLS_ENABLE=1 in its environment, since NCCL
// loads once per process.
func TestNVLSOff(t *testing.T) {
	if os.Getenv("DOS_NCCL_TEST_CHILD") == "1" {
		before, _ := cGetenv(EnvNVLS)
		_ = load()
		after, err := cGetenv(EnvNVLS)
		os.Stdout.WriteString("BEFORE " + before + " AFTER " + after + " GO " + os.Getenv(EnvNVLS) + "\n")
		if err != nil {
			os.Stdout.WriteString("ERROR " + err.Error() + "\n")
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestNVLSOff$", "-test.count=1")
	cmd.Env = append(os.Environ(), "DOS_NCCL_TEST_CHILD=1", EnvNVLS+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "BEFORE 1 AFTER 0 GO 0") {
		t.Errorf("child printed %q, want BEFORE 1 AFTER 0 GO 0", out)
	}
}

// TestID: an id goes through String and ParseID unchanged; anything but
// 256 hex digits is refused.
func TestID(t *testing.T) {
	var id ID
	for i := range id {
		id[i] = byte(i * 7)
	}
	got, err := ParseID(id.String())
	if err != nil || got != id {
		t.Fatalf("round trip: %v, %v", got == id, err)
	}
	for _, bad := range []string{"", id.String()[:254], id.String() + "00", "zz" + id.String()[2:]} {
		if _, err := ParseID(bad); err == nil {
			t.Errorf("ParseID of %d characters accepted", len(bad))
		}
	}
}

// cGetenv returns the C environment's value of name ("" when unset): what
// NCCL sees. For tests.
func cGetenv(name string) (string, error) {
	libc, err := purego.Dlopen("libc.so.6", purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return "", err
	}
	getenv, err := purego.Dlsym(libc, "getenv")
	if err != nil {
		return "", err
	}
	out, free, err := outBlock()
	if err != nil {
		return "", err
	}
	defer free()
	copy(unsafe.Slice((*byte)(out), 256), name+"\x00")
	r, _, _ := purego.SyscallN(getenv, uintptr(out))
	if r == 0 {
		return "", nil
	}
	return cuda.CString(*(*unsafe.Pointer)(unsafe.Pointer(&r))), nil
}
