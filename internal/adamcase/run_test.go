package adamcase

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/safetensors"
)

func ownCase(t *testing.T, name string) *Case {
	t.Helper()
	c, err := Load(filepath.Join("..", "..", "testdata", "adam-cases", name+".safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// The runner must be able to fail: a perturbed expectation, a wrong final
// step and a backend that misses a non-finite gradient are all caught.
func TestRunDetectsMismatch(t *testing.T) {
	c := ownCase(t, "plain")
	c.Expected[2].ExpAvgSq[17] *= 1 + 3e-5
	if r := Run(c, Scalar{}); r.Passed() || !strings.Contains(r.Err.Error(), "exp_avg_sq.3") {
		t.Fatalf("perturbed exp_avg_sq passed: %+v", r)
	}

	c = ownCase(t, "plain")
	c.Expected[4].ParamBF16[5] ^= 1
	if r := Run(c, Scalar{}); r.Passed() || !strings.Contains(r.Err.Error(), "param_bf16.5[5]") {
		t.Fatalf("flipped bf16 copy passed: %+v", r)
	}

	c = ownCase(t, "plain")
	c.FinalStep++
	if r := Run(c, Scalar{}); r.Passed() {
		t.Fatal("wrong final step passed")
	}

	c = ownCase(t, "fp16_scaled")
	if r := Run(c, alwaysFinite{}); r.Passed() || !strings.Contains(r.Err.Error(), "skipped") {
		t.Fatalf("a backend that never skips passed: %+v", r)
	}
}

type alwaysFinite struct{ Scalar }

func (alwaysFinite) AllFinite(adam.Grad) (bool, error) { return true, nil }

func TestRelErr(t *testing.T) {
	nan := float32(math.NaN())
	for _, tc := range []struct {
		got, want []float32
		err       float64
	}{
		{[]float32{1, 2}, []float32{1, 2}, 0},
		{[]float32{1.5, 2}, []float32{1, 2}, 0.5 / math.Sqrt(2.5)},
		{[]float32{nan}, []float32{nan}, 0},
		{[]float32{nan}, []float32{1}, math.Inf(1)},
		{[]float32{0}, []float32{0}, 0},
		{[]float32{1e-30}, []float32{0}, math.Inf(1)},
		{[]float32{3e38, 3e38}, []float32{3e38, 3e38}, 0},
	} {
		if got := RelErr(tc.got, tc.want); math.Abs(got-tc.err) > 1e-12 && !(math.IsInf(got, 1) && math.IsInf(tc.err, 1)) {
			t.Errorf("RelErr(%v, %v) = %g, want %g", tc.got, tc.want, got, tc.err)
		}
	}
}

// A damaged case file gives an error naming the file, never a panic.
func TestLoadDamaged(t *testing.T) {
	path := filepath.Join("..", "..", "testdata", "adam-cases", "odd_7.safetensors")
	orig, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{0, 7, 8, 100, len(orig) / 2, len(orig) - 1} {
		if _, err := Parse("cut.safetensors", orig[:n]); err == nil || !strings.Contains(err.Error(), "cut.safetensors") {
			t.Errorf("truncated to %d bytes: %v", n, err)
		}
	}
	for i := 0; i < len(orig); i += 13 {
		b := append([]byte(nil), orig...)
		b[i] ^= 0x5a
		Parse("flip.safetensors", b) // must not panic; data flips may parse
	}
	// A metadata value that is not a number.
	f, err := safetensors.Parse(orig)
	if err != nil {
		t.Fatal(err)
	}
	md := map[string]string{}
	for k, v := range f.Metadata {
		md[k] = v
	}
	md["lr"] = "fast"
	var ts []safetensors.Tensor
	for _, ti := range f.Tensors {
		_, b, _ := f.Bytes(ti.Name)
		ts = append(ts, safetensors.Tensor{Spec: safetensors.Spec{Name: ti.Name, DType: ti.DType, Shape: ti.Shape}, Data: b})
	}
	enc, err := safetensors.Encode(md, ts)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Parse("badlr.safetensors", enc); !errors.Is(err, ErrCase) || !strings.Contains(err.Error(), `"lr"`) {
		t.Errorf("bad lr: %v", err)
	}
}

func TestLoadDirErrors(t *testing.T) {
	if _, err := LoadDir(t.TempDir()); err == nil || !strings.Contains(err.Error(), "no *.safetensors") {
		t.Errorf("empty dir: %v", err)
	}
	if _, err := LoadDir(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("missing dir: no error")
	}
}

// rewrite re-encodes the case file src with its metadata changed by md and
// the tensors for which keep returns true.
func rewrite(t *testing.T, src string, md func(map[string]string), keep func(string) bool) []byte {
	t.Helper()
	orig, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	f, err := safetensors.Parse(orig)
	if err != nil {
		t.Fatal(err)
	}
	meta := map[string]string{}
	for k, v := range f.Metadata {
		meta[k] = v
	}
	md(meta)
	var ts []safetensors.Tensor
	for _, ti := range f.Tensors {
		if keep(ti.Name) {
			_, b, _ := f.Bytes(ti.Name)
			ts = append(ts, safetensors.Tensor{Spec: safetensors.Spec{Name: ti.Name, DType: ti.DType, Shape: ti.Shape}, Data: b})
		}
	}
	enc, err := safetensors.Encode(meta, ts)
	if err != nil {
		t.Fatal(err)
	}
	return enc
}

func TestLoadRefusesEmptyComparisons(t *testing.T) {
	src := filepath.Join("..", "..", "testdata", "adam-cases", "odd_7.safetensors")
	all := func(string) bool { return true }
	for name, tc := range map[string]struct {
		b    []byte
		want string
	}{
		"no expectations": {rewrite(t, src, func(map[string]string) {}, func(n string) bool { return !strings.HasPrefix(n, "expected.") }), "call 5 (the last)"},
		"last call bare":  {rewrite(t, src, func(map[string]string) {}, func(n string) bool { return n != "expected.param.5" }), "call 5 (the last)"},
		"zero steps":      {rewrite(t, src, func(m map[string]string) { m["steps"], m["final_step"] = "0", "0" }, all), "steps 0"},
		"tiny grad_scale": {rewrite(t, src, func(m map[string]string) { m["grad_scale"] = "1e-300" }, all), "grad_scale"},
		"huge step0":      {rewrite(t, src, func(m map[string]string) { m["step0"] = "9223372036854775807" }, all), "step0"},
	} {
		if _, err := Parse(name, tc.b); !errors.Is(err, ErrCase) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want ErrCase containing %q", name, err, tc.want)
		}
	}
}

func TestLoadDirSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	if err := os.Symlink("/dev/zero", filepath.Join(dir, "zero.safetensors")); err != nil {
		t.Skip(err)
	}
	if _, err := LoadDir(dir); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("symlink to /dev/zero: %v", err)
	}
	if _, err := Load(filepath.Join(dir, "zero.safetensors")); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("Load of /dev/zero: %v", err)
	}
}
