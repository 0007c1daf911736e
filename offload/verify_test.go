package offload

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/safetensors"
)

// badCheckpoint saves o's state under root as a checkpoint with valid
// checksums in which tensor name's elements at idx are set to val: it
// copies that tensor out of a Snapshot (whose views are o's state, left
// alone) and writes the result with checkpoint.Save. It returns the
// directory.
func badCheckpoint(t *testing.T, o *Optimizer, root, name string, val float32, idx ...int) string {
	t.Helper()
	snap, err := o.Snapshot(nil)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for i, ts := range snap.Tensors {
		if ts.Name != name {
			continue
		}
		var b []byte
		for _, d := range ts.Data {
			b = append(b, d...)
		}
		for _, j := range idx {
			copy(b[4*j:], safetensors.Float32Bytes([]float32{val}))
		}
		snap.Tensors[i].Data, snap.Tensors[i].Groups = [][]byte{b}, nil
		found = true
	}
	if !found {
		t.Fatalf("no tensor %q", name)
	}
	snap.Check = nil // the optimizer refuses to save such a state itself
	dir, err := checkpoint.Save(checkpoint.OS, root, snap)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func verifyDir(t *testing.T, dir string) error {
	t.Helper()
	c, err := checkpoint.Open(checkpoint.OS, dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Verify(); err != nil {
		t.Fatalf("the checksums of %s: %v", dir, err)
	}
	return VerifyCheckpoint(c)
}

// TestLoadRefusesBadValues is issue 14's defect 9: checkpoints whose
// checksums are valid but whose state is NaN, Inf or negative where it must
// not be are refused by LoadCheckpoint, the optimizer untouched, and
// reported by VerifyCheckpoint with the tensor, the first bad element and
// the count; a clean one passes both.
func TestLoadRefusesBadValues(t *testing.T) {
	o := newTest(t, resumeOpts()) // amsgrad: max_exp_avg_sq too
	runSteps(t, o, 1, 3)
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	for _, tc := range []struct {
		tensor string
		val    float32
		idx    []int
		want   string
	}{
		{"h.0.attn.c_attn.weight.master", nan, []int{7, 9, 700}, "element 7 is NaN; 3 of its 768 elements fail the check (finite)"},
		{"wte.weight.exp_avg", -inf, []int{0}, "element 0 is -Inf; 1 of its 800 elements fail the check (finite)"},
		{"wte.weight.exp_avg_sq", inf, []int{3}, "element 3 is +Inf; 1 of its 800 elements fail the check (finite, >= 0)"},
		{"ln_f.bias.exp_avg_sq", -1, []int{15, 2}, "element 2 is -1; 2 of its 16 elements fail the check (finite, >= 0)"},
		{"h.0.ln_1.weight.max_exp_avg_sq", -1e-30, []int{5}, "element 5 is -1e-30; 1 of its 16 elements"},
	} {
		t.Run(tc.tensor, func(t *testing.T) {
			dir := badCheckpoint(t, o, t.TempDir(), tc.tensor, tc.val, tc.idx...)
			victim, before := newTest(t, resumeOpts()), newTest(t, resumeOpts())
			_, _, err := victim.LoadCheckpoint(checkpoint.OS, dir)
			for _, want := range []string{dir, fmt.Sprintf("%q", tc.tensor), tc.want} {
				if !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), want) {
					t.Errorf("LoadCheckpoint: %v\nwant ErrCorrupt with %s", err, want)
				}
			}
			sameState(t, before, victim)
			if victim.Options().Hyper != before.Options().Hyper {
				t.Errorf("hyperparameters changed: %v", victim.Options().Hyper)
			}
			err = verifyDir(t, dir)
			for _, want := range []string{dir, fmt.Sprintf("%q", tc.tensor), tc.want} {
				if !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), want) {
					t.Errorf("VerifyCheckpoint: %v\nwant ErrCorrupt with %s", err, want)
				}
			}
		})
	}
	t.Run("clean", func(t *testing.T) {
		// -0.0 in exp_avg_sq is >= 0; negative exp_avg and master are fine.
		dir := badCheckpoint(t, o, t.TempDir(), "ln_f.bias.exp_avg_sq", float32(math.Copysign(0, -1)), 4)
		if err := verifyDir(t, dir); err != nil {
			t.Errorf("VerifyCheckpoint: %v", err)
		}
		fresh := newTest(t, resumeOpts())
		if _, _, err := fresh.LoadCheckpoint(checkpoint.OS, dir); err != nil {
			t.Errorf("LoadCheckpoint: %v", err)
		}
	})
}

// TestVerifyChunks: a state tensor larger than VerifyFunc's 4 MiB chunk,
// bad in two chunks, is reported once with both counted and the first
// index; LoadCheckpoint says the same.
func TestVerifyChunks(t *testing.T) {
	const n = 3 << 20 // 12 MiB of fp32: three chunks
	o, err := New([]Param{{Name: "w", Shape: []int{n}}}, Options{SubgroupSize: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	dir := badCheckpoint(t, o, t.TempDir(), "w.exp_avg_sq", -2, 1<<20+5, n-1)
	want := fmt.Sprintf(`"w.exp_avg_sq": element %d is -2; 2 of its %d elements fail the check (finite, >= 0)`, 1<<20+5, n)
	if err := verifyDir(t, dir); !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "more corrupt") {
		t.Errorf("VerifyCheckpoint: %v\nwant %s", err, want)
	}
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, dir); !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), want) {
		t.Errorf("LoadCheckpoint: %v\nwant %s", err, want)
	}
}

// TestVerifyObject: VerifyCheckpoint checks the optimizer object (it
// decodes, its format, its hyperparameters, its step) and reports it with
// a bad tensor too.
func TestVerifyObject(t *testing.T) {
	o := newTest(t, resumeOpts())
	runSteps(t, o, 1, 2)
	save := func(t *testing.T, edit func(obj map[string]any), tensor string) string {
		t.Helper()
		snap, err := o.Snapshot(nil)
		if err != nil {
			t.Fatal(err)
		}
		var obj map[string]any
		if err := json.Unmarshal(snap.Objects[ObjectName], &obj); err != nil {
			t.Fatal(err)
		}
		edit(obj)
		if snap.Objects[ObjectName], err = json.Marshal(obj); err != nil {
			t.Fatal(err)
		}
		if tensor != "" {
			// A copy whose first element is NaN, the state untouched.
			for i, ts := range snap.Tensors {
				if ts.Name == tensor {
					b := append([]byte(nil), ts.Data[0]...)
					copy(b, safetensors.Float32Bytes([]float32{float32(math.NaN())}))
					snap.Tensors[i].Data = append([][]byte{b}, ts.Data[1:]...)
				}
			}
		}
		snap.Check = nil // the optimizer refuses to save such a state itself
		dir, err := checkpoint.Save(checkpoint.OS, t.TempDir(), snap)
		if err != nil {
			t.Fatal(err)
		}
		return dir
	}
	for _, tc := range []struct {
		name   string
		edit   func(map[string]any)
		tensor string
		want   []string
	}{
		{"format", func(m map[string]any) { m["format"] = "dos-offload/v9" }, "", []string{`format "dos-offload/v9"`}},
		{"hyper", func(m map[string]any) { m["hyper"].(map[string]any)["lr"] = -1.0 }, "", []string{"lr -1", adam.ErrHyper.Error()}},
		{"mode", func(m map[string]any) { m["hyper"].(map[string]any)["mode"] = "sgd" }, "", []string{`mode "sgd"`}},
		{"step", func(m map[string]any) { m["step"] = 3 }, "", []string{"optimizer step 3 is outside [0, 2]"}},
		{"negative step", func(m map[string]any) { m["step"] = -1 }, "", []string{"optimizer step -1"}},
		{"undecodable", func(m map[string]any) { m["step"] = "two" }, "", []string{"optimizer object"}},
		{"and a tensor", func(m map[string]any) { m["step"] = 3 }, "ln_f.bias.exp_avg", []string{"optimizer step 3", `"ln_f.bias.exp_avg": element 0 is NaN`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := save(t, tc.edit, tc.tensor)
			err := verifyDir(t, dir)
			for _, want := range append(tc.want, dir) {
				if !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), want) {
					t.Errorf("VerifyCheckpoint: %v\nwant ErrCorrupt with %s", err, want)
				}
			}
			victim, before := newTest(t, resumeOpts()), newTest(t, resumeOpts())
			if _, _, err := victim.LoadCheckpoint(checkpoint.OS, dir); !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), tc.want[0]) {
				t.Errorf("LoadCheckpoint: %v\nwant ErrCorrupt with %s", err, tc.want[0])
			}
			sameState(t, before, victim)
		})
	}
}

func TestCheckState(t *testing.T) {
	negZero := float32(math.Copysign(0, -1))
	for _, tc := range []struct {
		name string
		v    []float32
		want string // "" for no error
	}{
		{"a.master", []float32{-1, 0, 3e38, negZero}, ""},
		{"a.exp_avg", []float32{-1e-45, 1}, ""},
		{"a.exp_avg_sq", []float32{0, negZero, 1e-45, math.MaxFloat32}, ""},
		{"a.exp_avg_sq", []float32{0, -1e-45}, "element 1 is -1e-45; 1 of its 2 elements fail the check (finite, >= 0)"},
		{"a.max_exp_avg_sq", []float32{float32(math.Inf(-1))}, "element 0 is -Inf"},
		{"a.master", []float32{1, float32(math.NaN()), float32(math.Inf(1)), -2}, "element 1 is NaN; 2 of its 4 elements fail the check (finite)"},
		{"a.master", []float32{math.Float32frombits(0xffc00001)}, "element 0 is NaN"}, // a negative NaN
		{"other", []float32{-1, float32(math.Inf(1))}, `"other": element 1 is +Inf`},
		{"a.master", nil, ""},
	} {
		err := CheckState(tc.name, tc.v)
		if tc.want == "" {
			if err != nil {
				t.Errorf("CheckState(%q, %v): %v", tc.name, tc.v, err)
			}
			continue
		}
		if !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.name) {
			t.Errorf("CheckState(%q, %v): %v, want ErrCorrupt with %q", tc.name, tc.v, err, tc.want)
		}
	}
	if raceEnabled {
		return
	}
	v := make([]float32, 1000)
	if a := testing.AllocsPerRun(10, func() { _ = CheckState("w.exp_avg_sq", v) }); a != 0 {
		t.Errorf("CheckState allocates %v times", a)
	}
}

// TestCheckStateLengths cross-checks CheckState's two-elements-at-a-time
// scan against the plain loop (math.IsNaN, IsInf, x < 0) at lengths around
// its 256-element blocks, one bad value at each end of a block, and random
// special values.
func TestCheckStateLengths(t *testing.T) {
	specials := []float32{0, float32(math.Copysign(0, -1)), 1, -1, 1e-45, -1e-45, math.MaxFloat32, -math.MaxFloat32,
		float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()), math.Float32frombits(0xff800001), math.Float32frombits(0x7f7fffff)}
	ref := func(name string, v []float32) (first, bad int) {
		first = -1
		nonNeg := strings.HasSuffix(name, "_sq")
		for i, x := range v {
			if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) || nonNeg && x < 0 {
				if bad == 0 {
					first = i
				}
				bad++
			}
		}
		return first, bad
	}
	r := rand.New(rand.NewPCG(3, 4))
	for _, name := range []string{"w.master", "w.exp_avg_sq"} {
		for _, n := range []int{1, 2, 3, 255, 256, 257, 511, 512, 513, 1001} {
			for trial := range 40 {
				v := make([]float32, n)
				switch {
				case trial < 4: // one bad value at an end of a block
					v[[]int{0, n - 1, min(255, n-1), min(256, n-1)}[trial]] = float32(math.NaN())
				default:
					for k := r.IntN(4); k > 0; k-- {
						v[r.IntN(n)] = specials[r.IntN(len(specials))]
					}
				}
				first, bad := ref(name, v)
				err := CheckState(name, v)
				if bad == 0 {
					if err != nil {
						t.Fatalf("%s n=%d %v: %v", name, n, v, err)
					}
					continue
				}
				want := fmt.Sprintf("element %d is %v; %d of its %d elements", first, v[first], bad, n)
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Fatalf("%s n=%d: %v, want %s", name, n, err, want)
				}
			}
		}
	}
}

// BenchmarkCheckState/n=16M: the value check's rate, against a copy of the
// same bytes (LoadCheckpoint runs it once per tensor it loads).
func BenchmarkCheckState(b *testing.B) {
	const n = 16 << 20
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(i)
	}
	b.Run("n=16M", func(b *testing.B) {
		b.SetBytes(4 * n)
		b.ReportAllocs()
		for b.Loop() {
			if err := CheckState("w.exp_avg_sq", v); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("copy/n=16M", func(b *testing.B) {
		dst := make([]float32, n)
		b.SetBytes(4 * n)
		b.ReportAllocs()
		for b.Loop() {
			copy(dst, v)
		}
	})
}

// TestSaveRefusesNonFiniteState: finite but huge gradients overflow
// exp_avg_sq to +Inf (a state LoadCheckpoint refuses). Neither the
// synchronous nor the lazy save commits it, and under Keep = 1 the
// checkpoint that loads stays the latest, untouched.
func TestSaveRefusesNonFiniteState(t *testing.T) {
	o := newTest(t, Options{SubgroupSize: 300})
	fill(o, 1)
	mustStep(t, o)
	root := filepath.Join(t.TempDir(), "root")
	e, err := checkpoint.NewEngine(checkpoint.OS, root, checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 3 * 4096, Keep: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	h, err := o.SaveAsync(e, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	good, err := h.Wait()
	if err != nil {
		t.Fatal(err)
	}
	fill(o, 2)
	g := o.Grad(1).Float32()
	g[len(g)/2+1] = 3e38 // squared: +Inf in fp32
	mustStep(t, o)
	name := o.Params()[1].Name + ExpAvgSqSuffix
	if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err == nil || !strings.Contains(err.Error(), name) {
		t.Fatalf("SaveCheckpoint of an Inf exp_avg_sq: %v, want an error naming %s", err, name)
	}
	h, err = o.SaveAsync(e, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Wait(); err == nil || !strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), fmt.Sprintf("element %d is +Inf", len(g)/2+1)) {
		t.Fatalf("lazy save of an Inf exp_avg_sq: %v, want an error naming %s and its element", err, name)
	}
	o.AcknowledgeSave(h)
	latest, err := checkpoint.Resolve(checkpoint.OS, root)
	if err != nil || latest != good {
		t.Fatalf("latest %q (%v), want the good checkpoint %q", latest, err, good)
	}
	if err := verifyDir(t, good); err != nil {
		t.Fatal(err)
	}
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	if o.StepCount() != 1 {
		t.Fatalf("loaded step %d, want 1", o.StepCount())
	}
}

// TestSaveCheckSplitElements: the save check sees pieces cut anywhere,
// elements split between them, and finds the one bad element by index.
func TestSaveCheckSplitElements(t *testing.T) {
	v := make([]float32, 300)
	for i := range v {
		v[i] = float32(i) - 150
	}
	b := safetensors.Float32Bytes(v)
	ts := []checkpoint.Tensor{{Name: "w" + ExpAvgSuffix, DType: safetensors.F32, Data: [][]byte{b}}, {Name: "w" + ExpAvgSqSuffix, DType: safetensors.F32, Data: [][]byte{b}}}
	for _, cut := range []int{1, 3, 4, 7, 64, 1199} {
		check := newSaveCheck(&checkpoint.Snapshot{Tensors: ts})
		var errs [2]error
		for k := range ts {
			for off := 0; off < len(b); off += cut {
				if err := check(k, int64(off), b[off:min(off+cut, len(b))]); err != nil {
					errs[k] = err
				}
			}
		}
		if errs[0] != nil {
			t.Errorf("cut %d: exp_avg with negative values refused: %v", cut, errs[0])
		}
		if errs[1] == nil || !strings.Contains(errs[1].Error(), "element 0 is -150; 150 of its 300 elements") {
			t.Errorf("cut %d: exp_avg_sq with 150 negative values: %v", cut, errs[1])
		}
	}
}

// TestSaveCheckExtraTensors: the save check finds the state tensors by
// name and dtype when the save runs: tensors a caller adds to a Snapshot
// before or after them (a trainer's, of any dtype and sign) neither fail a
// good save nor shift the check onto the wrong tensor (an adversarial
// review found a good state refused and an index out of range).
func TestSaveCheckExtraTensors(t *testing.T) {
	o := newTest(t, Options{SubgroupSize: 400})
	fill(o, 1)
	mustStep(t, o)
	extra := []checkpoint.Tensor{
		{Name: "model.extra", DType: safetensors.F32, Shape: []int64{2}, Data: [][]byte{safetensors.Float32Bytes([]float32{-1, float32(math.Inf(1))})}},
		{Name: "model.bf16", DType: safetensors.BF16, Shape: []int64{3}, Data: [][]byte{{1, 2, 3, 4, 5, 6}}},
	}
	for _, where := range []string{"before", "after"} {
		snap, err := o.Snapshot(nil)
		if err != nil {
			t.Fatal(err)
		}
		if where == "before" {
			snap.Tensors = append(slices.Clone(extra), snap.Tensors...)
		} else {
			snap.Tensors = append(snap.Tensors, extra...)
		}
		if _, err := checkpoint.Save(checkpoint.OS, t.TempDir(), snap); err != nil {
			t.Errorf("extra tensors %s the state: %v", where, err)
		}
	}
}
