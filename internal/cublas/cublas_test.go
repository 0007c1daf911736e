package cublas

import (
	"errors"
	"github.com/deepstates/dos/internal/cuda"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestAvailable runs everywhere: without cuBLASLt or a GPU it returns an
// error that says why, without panicking; without the library the error
// names the places searched.
func TestAvailable(t *testing.T) {
	err := Available()
	t.Logf("Available: %v", err)
	if err == nil {
		v, path, err := Version()
		if err != nil || v < 120000 {
			t.Fatalf("Version = %d, %q, %v", v, path, err)
		}
		t.Logf("cuBLASLt %d from %s", v, path)
		return
	}
	if load() == nil {
		return // the library is here; the GPU is not (cuda's error)
	}
	for _, want := range []string{"cublas: no cuBLASLt", "libcublasLt.so.13", "the loader's search path", "/usr/local/cuda/lib64", "/usr/local/cuda/targets/"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	if _, err := New(nil, nil); err == nil {
		t.Error("New(nil, nil) succeeded")
	}
}

// TestAvailableEnvNowhere runs the test binary again with DOS_CUBLASLT
// pointing at no file (the library is loaded once per process): Available's
// error names it and dlopen's complaint, unless cuBLASLt was found in
// another place.
func TestAvailableEnvNowhere(t *testing.T) {
	if os.Getenv("DOS_CUBLAS_TEST_CHILD") == "1" {
		if err := load(); err != nil {
			os.Stdout.WriteString("LOAD ERROR: " + err.Error() + "\n")
		} else {
			os.Stdout.WriteString("LOADED: " + lib.path + "\n")
		}
		return
	}
	nowhere := filepath.Join(t.TempDir(), "nowhere", "libcublasLt.so.13")
	cmd := exec.Command(os.Args[0], "-test.run=^TestAvailableEnvNowhere$", "-test.count=1")
	cmd.Env = append(os.Environ(), "DOS_CUBLAS_TEST_CHILD=1", EnvLibrary+"="+nowhere)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	s := string(out)
	t.Logf("child: %s", strings.TrimSpace(s))
	switch {
	case strings.Contains(s, "LOADED: "):
		if strings.Contains(s, "LOADED: "+nowhere) {
			t.Fatal("loaded a file that does not exist")
		}
	case strings.Contains(s, "LOAD ERROR: "):
		for _, want := range []string{EnvLibrary + "=" + nowhere, nowhere + ": cannot open shared object file", "/usr/local/cuda/lib64"} {
			if !strings.Contains(s, want) {
				t.Errorf("error lacks %q", want)
			}
		}
	default:
		t.Fatalf("child printed neither: %s", s)
	}
}

// TestOpenLibErrors: Library.OpenFrom's error lists every place and the dlopen
// failures that matter, whatever is installed.
func TestOpenLibErrors(t *testing.T) {
	dir := t.TempDir()
	junk := filepath.Join(dir, "libcublasLt.so.13")
	if err := os.WriteFile(junk, []byte("not a library"), 0o644); err != nil {
		t.Fatal(err)
	}
	cs := []cuda.LibraryPlace{
		{Path: "/nonexistent/libcublasLt.so", Where: EnvLibrary + "=/nonexistent/libcublasLt.so", Must: true},
		{Path: "/nonexistent-dir/libcublasLt.so.13", Where: "/nonexistent-dir"},
		{Path: junk, Where: dir},
	}
	_, _, err := library.OpenFrom(cs)
	if err == nil {
		t.Fatal("OpenFrom of nothing succeeded")
	}
	t.Logf("%v", err)
	for _, want := range []string{
		EnvLibrary + "=/nonexistent/libcublasLt.so", "/nonexistent/libcublasLt.so: cannot open shared object file",
		"/nonexistent-dir", dir, junk + ":", // the junk file was dlopen'ed and refused
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q", want)
		}
	}
	if strings.Contains(err.Error(), "/nonexistent-dir/libcublasLt.so.13:") {
		t.Error("a missing file in a directory was dlopen'ed")
	}
}

// TestCandidates: the search order, DOS_CUBLASLT first, as a file or a
// directory.
func TestCandidates(t *testing.T) {
	glob := func(pat string) ([]string, error) {
		if strings.HasPrefix(pat, "/usr/local/lib/python3*/dist-packages/nvidia/cu13/") {
			return []string{"/usr/local/lib/python3.12/dist-packages/nvidia/cu13/lib"}, nil
		}
		return nil, nil
	}
	paths := func(cs []cuda.LibraryPlace) []string {
		var p []string
		for _, c := range cs {
			p = append(p, c.Path)
		}
		return p
	}
	got := paths(library.Places("", glob))
	want := []string{
		"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so",
		"/usr/local/cuda/lib64/libcublasLt.so.13", "/usr/local/cuda/lib64/libcublasLt.so.12", "/usr/local/cuda/lib64/libcublasLt.so",
	}
	if !slices.Equal(got[:len(want)], want) {
		t.Errorf("order %q, want it to start %q", got, want)
	}
	if !slices.Contains(got, "/usr/local/lib/python3.12/dist-packages/nvidia/cu13/lib/libcublasLt.so.13") {
		t.Errorf("the wheel's directory is missing from %q", got)
	}
	if got := paths(library.Places("/opt/x/libcublasLt.so.12", glob)); got[0] != "/opt/x/libcublasLt.so.12" || got[1] != "libcublasLt.so.13" {
		t.Errorf("a DOS_CUBLASLT file: %q", got[:2])
	}
	dir := t.TempDir()
	if got := paths(library.Places(dir, glob)); !slices.Equal(got[:3], []string{dir + "/libcublasLt.so.13", dir + "/libcublasLt.so.12", dir + "/libcublasLt.so"}) {
		t.Errorf("a DOS_CUBLASLT directory: %q", got[:3])
	}
}

// TestValidate: every rule of GEMM.Validate and check, with its message.
func TestValidate(t *testing.T) {
	ok := GEMM{M: 37, N: 64, K: 48}
	if err := check(&ok, 1, 2, 3, 0, 0); err != nil {
		t.Fatalf("valid GEMM: %v", err)
	}
	cases := []struct {
		name               string
		edit               func(*GEMM)
		c, a, b, bias, aux uint64
		want               string
	}{
		{"zero M", func(g *GEMM) { g.M = 0 }, 1, 2, 3, 0, 0, "sizes must be >= 1"},
		{"negative K", func(g *GEMM) { g.K = -1 }, 1, 2, 3, 0, 0, "sizes must be >= 1"},
		{"huge N", func(g *GEMM) { g.N = 1 << 31 }, 1, 2, 3, 0, 0, "int32"},
		{"bad type", func(g *GEMM) { g.AType = 7 }, 1, 2, 3, 0, 0, "unknown element type"},
		{"negative batch", func(g *GEMM) { g.Batch = -2 }, 1, 2, 3, 0, 0, "negative batch"},
		{"negative stride", func(g *GEMM) { g.Batch, g.StrideA, g.StrideC = 2, -1, 37*64 }, 1, 2, 3, 0, 0, "negative stride"},
		{"overlapping C", func(g *GEMM) { g.Batch, g.StrideC = 2, 37*64-1 }, 1, 2, 3, 0, 0, "would overlap"},
		{"nil C", func(g *GEMM) {}, 0, 2, 3, 0, 0, "nil matrix pointer"},
		{"nil B", func(g *GEMM) {}, 1, 2, 0, 0, 0, "nil matrix pointer"},
		{"bias missing", func(g *GEMM) { g.Epilogue = Bias }, 1, 2, 3, 0, 0, "needs a bias pointer"},
		{"bias unused", func(g *GEMM) {}, 1, 2, 3, 4, 0, "bias pointer without an epilogue"},
		{"aux missing", func(g *GEMM) { g.Epilogue = DGELU }, 1, 2, 3, 0, 0, "needs an aux pointer"},
		{"aux unused", func(g *GEMM) { g.Epilogue = Bias }, 1, 2, 3, 4, 5, "aux pointer without an epilogue"},
		{"gelu bias missing", func(g *GEMM) { g.Epilogue = GELUAuxBias }, 1, 2, 3, 0, 5, "needs a bias pointer"},
		{"gelu f32", func(g *GEMM) { g.Epilogue, g.CType = GELUAuxBias, F32 }, 1, 2, 3, 4, 5, "needs a bf16 C"},
		{"gelu N", func(g *GEMM) { g.Epilogue, g.N = DGELU, 60 }, 1, 2, 3, 0, 5, "multiple of 8"},
		{"epilogue batch", func(g *GEMM) { g.Epilogue, g.Batch, g.StrideC = Bias, 2, 37*64 }, 1, 2, 3, 4, 0, "Batch <= 1"},
		{"bad epilogue", func(g *GEMM) { g.Epilogue = 9 }, 1, 2, 3, 0, 0, "unknown epilogue"},
	}
	for _, c := range cases {
		g := ok
		c.edit(&g)
		err := check(&g, c.c, c.a, c.b, c.bias, c.aux)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), "cublas: M=") {
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.want)
		}
	}
	if err := check(nil, 1, 2, 3, 0, 0); err == nil {
		t.Error("nil GEMM accepted")
	}
	// A single GEMM's strides are ignored; a batch's may broadcast A or B.
	g := ok
	g.StrideA, g.StrideC = -5, 1
	if err := g.Validate(); err != nil {
		t.Errorf("strides of a single GEMM: %v", err)
	}
	g = GEMM{M: 64, N: 64, K: 64, Batch: 12, StrideB: 0, StrideC: 64 * 64}
	if err := g.Validate(); err != nil {
		t.Errorf("broadcast B: %v", err)
	}
}

// TestColMajor: the row-major GEMM as cuBLAS's column-major one, for every
// transpose and a batch.
func TestColMajor(t *testing.T) {
	const M, N, K = 37, 64, 48
	cases := []struct {
		g    GEMM
		want colMajor
	}{
		{GEMM{M: M, N: N, K: K}, colMajor{m: N, n: M, k: K, opA: opN, opB: opN, batch: 1,
			a: layout{rows: N, cols: K, ld: N}, b: layout{rows: K, cols: M, ld: K}, c: layout{rows: N, cols: M, ld: N}}},
		{GEMM{M: M, N: N, K: K, TransA: true}, colMajor{m: N, n: M, k: K, opA: opN, opB: opT, batch: 1,
			a: layout{rows: N, cols: K, ld: N}, b: layout{rows: M, cols: K, ld: M}, c: layout{rows: N, cols: M, ld: N}}},
		{GEMM{M: M, N: N, K: K, TransB: true}, colMajor{m: N, n: M, k: K, opA: opT, opB: opN, batch: 1,
			a: layout{rows: K, cols: N, ld: K}, b: layout{rows: K, cols: M, ld: K}, c: layout{rows: N, cols: M, ld: N}}},
		{GEMM{M: M, N: N, K: K, TransA: true, TransB: true}, colMajor{m: N, n: M, k: K, opA: opT, opB: opT, batch: 1,
			a: layout{rows: K, cols: N, ld: K}, b: layout{rows: M, cols: K, ld: M}, c: layout{rows: N, cols: M, ld: N}}},
		// Attention's QKᵀ: Q [T, hs] times K [T, hs] transposed, 12 heads.
		{GEMM{M: 64, N: 64, K: 32, TransB: true, Batch: 12, StrideA: 64 * 32, StrideB: 64 * 32, StrideC: 64 * 64},
			colMajor{m: 64, n: 64, k: 32, opA: opT, opB: opN, batch: 12,
				a: layout{rows: 32, cols: 64, ld: 32, stride: 64 * 32}, b: layout{rows: 32, cols: 64, ld: 32, stride: 64 * 32},
				c: layout{rows: 64, cols: 64, ld: 64, stride: 64 * 64}}},
		// Batch 1: one matrix, strides ignored.
		{GEMM{M: 2, N: 3, K: 4, Batch: 1, StrideA: 99}, colMajor{m: 3, n: 2, k: 4, opA: opN, opB: opN, batch: 1,
			a: layout{rows: 3, cols: 4, ld: 3}, b: layout{rows: 4, cols: 2, ld: 4}, c: layout{rows: 3, cols: 2, ld: 3}}},
	}
	for _, c := range cases {
		if got := colMajorOf(&c.g); got != c.want {
			t.Errorf("%v:\n got %+v\nwant %+v", &c.g, got, c.want)
		}
	}
	// Every layout's stored shape covers op's: cuBLAS's op(A) is m×k, op(B)
	// k×n, and each ld is at least its rows.
	for _, ta := range []bool{false, true} {
		for _, tb := range []bool{false, true} {
			cm := colMajorOf(&GEMM{M: M, N: N, K: K, TransA: ta, TransB: tb})
			r, c := cm.a.rows, cm.a.cols
			if cm.opA == opT {
				r, c = c, r
			}
			if r != cm.m || c != cm.k {
				t.Errorf("TransA=%v TransB=%v: op(A) is %d×%d, want %d×%d", ta, tb, r, c, cm.m, cm.k)
			}
			r, c = cm.b.rows, cm.b.cols
			if cm.opB == opT {
				r, c = c, r
			}
			if r != cm.k || c != cm.n {
				t.Errorf("TransA=%v TransB=%v: op(B) is %d×%d, want %d×%d", ta, tb, r, c, cm.k, cm.n)
			}
			for _, l := range []layout{cm.a, cm.b, cm.c} {
				if l.ld < l.rows {
					t.Errorf("TransA=%v TransB=%v: ld %d < rows %d", ta, tb, l.ld, l.rows)
				}
			}
		}
	}
}

// TestPlanKey: what a plan depends on and what it does not.
func TestPlanKey(t *testing.T) {
	g := GEMM{M: 37, N: 64, K: 48}
	base := keyOf(&g, 1<<20, 2<<20, 3<<20, 0, 0)
	same := []GEMM{
		{M: 37, N: 64, K: 48, Alpha: 0.5},
		{M: 37, N: 64, K: 48, Accumulate: true},
		{M: 37, N: 64, K: 48, Batch: 1, StrideA: 7, StrideC: 9},
	}
	for _, s := range same {
		if k := keyOf(&s, 1<<20, 2<<20, 3<<20, 0, 0); k != base {
			t.Errorf("%v has another plan than %v", &s, &g)
		}
	}
	if keyOf(&g, 1<<20+16, 2<<20, 3<<20, 0, 0) == base {
		t.Error("a C aligned to 16 bytes shares the plan of one aligned to 256")
	}
	if keyOf(&g, 1<<20+512, 2<<20+1024, 3<<20+256, 0, 0) != base {
		t.Error("pointers aligned to 256 or more have another plan")
	}
	h := GEMM{M: 37, N: 64, K: 48, TransA: true}
	if keyOf(&h, 1<<20, 2<<20, 3<<20, 0, 0) == base {
		t.Error("TransA shares the plan")
	}
	for _, c := range []struct {
		p      uint64
		stride int64
		want   uint16
	}{{0, 0, 256}, {1 << 30, 0, 256}, {4096 + 16, 0, 16}, {4096 + 2, 0, 2}, {4096, 37 * 2, 2}, {4096, 64 * 2, 128}, {4096 + 8, 64 * 4, 8}} {
		if got := alignment(c.p, c.stride); got != c.want {
			t.Errorf("alignment(%#x, %d) = %d, want %d", c.p, c.stride, got, c.want)
		}
	}
}

// TestError: a status becomes an *Error with its name, with or without the
// library.
func TestError(t *testing.T) {
	var err error = newError("cublasLtMatmul(M=1 N=2 K=3)", statusNotSupported)
	var e *Error
	if !errors.As(err, &e) || e.Name != "CUBLAS_STATUS_NOT_SUPPORTED" || e.Status != 15 {
		t.Fatalf("%#v", err)
	}
	if s := err.Error(); !strings.HasPrefix(s, "cublas: cublasLtMatmul(M=1 N=2 K=3): CUBLAS_STATUS_NOT_SUPPORTED") {
		t.Errorf("Error() = %q", s)
	}
	if n := newError("x", 12345).Name; !strings.Contains(n, "12345") && !strings.Contains(n, "UNKNOWN") {
		t.Errorf("unknown status named %q", n)
	}
}

func TestStrings(t *testing.T) {
	g := GEMM{M: 8192, N: 3072, K: 768, TransB: true, CType: F32, Alpha: 0.125, Accumulate: true, Epilogue: Bias}
	if s, want := g.String(), "M=8192 N=3072 K=768 TransB bf16->f32 alpha=0.125 accumulate epilogue=bias"; s != want {
		t.Errorf("String() = %q, want %q", s, want)
	}
	if BF16.Size() != 2 || F32.Size() != 4 || DGELU.String() != "dgelu" || DType(5).String() != "DType(5)" {
		t.Error("DType or Epilogue strings")
	}
}
