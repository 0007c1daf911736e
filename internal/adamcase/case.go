// Package adamcase loads the PyTorch reference cases of the adam-case/v1
// schema (one safetensors file per case; see shared/ADAM_CASES.md and
// scripts/gen_adam_cases.py) and replays them on an optimizer backend,
// measuring the error the schema defines.
//
// A case is the oracle for numerics: PyTorch's torch.optim.AdamW or
// torch.optim.Adam on the CPU in fp32 with foreach=False.
package adamcase

import (
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/safetensors"
)

// Format is the value of the "format" metadata key this package reads.
const Format = "adam-case/v1"

// ErrCase is wrapped by every error about a case file's contents.
var ErrCase = errors.New("adamcase: invalid case")

// Expect is what PyTorch produced after one call. Nil slices are absent from
// the file and not compared.
type Expect struct {
	Skipped     bool // the call's gradient is non-finite: no change, no step
	Param       []float32
	ExpAvg      []float32
	ExpAvgSq    []float32
	MaxExpAvgSq []float32
	ParamBF16   []uint16
	ParamFP16   []uint16
}

// Case is one reference case: hyperparameters, initial state of N
// elements, T gradients and the expected results after each call.
type Case struct {
	Path      string
	Name      string // file name without ".safetensors"
	Hyper     adam.Hyper
	Step0     int64      // step counter before the first call
	FinalStep int64      // step counter after all calls
	GradDType adam.DType // dtype of the stored gradients
	GradScale float64    // loss scale S (gradients are stored times S); 0 for none
	Init      adam.State // initial state; moments are zero when Step0 == 0
	Grads     []adam.Grad
	Expected  []Expect // Expected[t-1] for call t
}

// N returns the number of parameters.
func (c *Case) N() int { return len(c.Init.Param) }

// Load reads and validates the case at path.
//
// Errors: I/O errors, safetensors.ErrInvalid, or ErrCase naming the file and
// the key or tensor at fault. Load never panics on a file's contents.
func Load(path string) (*Case, error) {
	dir, name := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	return loadOne(os.DirFS(dir), name, path)
}

// Parse validates the bytes b of a case file; path names it in errors and
// in Case.Path. The Case does not refer to b afterwards.
//
// Errors: as Load.
func Parse(path string, b []byte) (*Case, error) {
	f, err := safetensors.Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	c, err := fromFile(f, path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

func bad(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrCase, fmt.Sprintf(format, args...))
}

func fromFile(f *safetensors.File, path string) (*Case, error) {
	md := f.Metadata
	get := func(key string) (string, error) {
		v, ok := md[key]
		if !ok {
			return "", bad("metadata key %q is missing", key)
		}
		return v, nil
	}
	num := func(key string) (float64, error) {
		s, err := get(key)
		if err != nil {
			return 0, err
		}
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return 0, bad("metadata %q = %q is not a number", key, s)
		}
		return v, nil
	}
	integer := func(key string) (int64, error) {
		s, err := get(key)
		if err != nil {
			return 0, err
		}
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil || v < 0 {
			return 0, bad("metadata %q = %q is not a non-negative integer", key, s)
		}
		return v, nil
	}
	boolean := func(key string) (bool, error) {
		s, err := get(key)
		if err != nil {
			return false, err
		}
		switch s {
		case "true":
			return true, nil
		case "false":
			return false, nil
		}
		return false, bad("metadata %q = %q: want true or false", key, s)
	}
	if v := md["format"]; v != Format {
		return nil, bad("format %q: want %q", v, Format)
	}
	c := &Case{Path: path, Name: trimExt(filepath.Base(path))}
	var err error
	h := &c.Hyper
	mode, err := get("mode")
	if err != nil {
		return nil, err
	}
	h.Mode = adam.Mode(mode)
	for _, x := range []struct {
		key string
		dst *float64
	}{{"lr", &h.LR}, {"beta1", &h.Betas[0]}, {"beta2", &h.Betas[1]}, {"eps", &h.Eps}, {"weight_decay", &h.WeightDecay}} {
		if *x.dst, err = num(x.key); err != nil {
			return nil, err
		}
	}
	if h.AMSGrad, err = boolean("amsgrad"); err != nil {
		return nil, err
	}
	if h.Maximize, err = boolean("maximize"); err != nil {
		return nil, err
	}
	if err := h.Validate(); err != nil {
		return nil, bad("hyperparameters: %v", err)
	}
	steps, err := integer("steps")
	if err != nil {
		return nil, err
	}
	if c.Step0, err = integer("step0"); err != nil {
		return nil, err
	}
	if c.FinalStep, err = integer("final_step"); err != nil {
		return nil, err
	}
	gd, err := get("grad_dtype")
	if err != nil {
		return nil, err
	}
	if c.GradDType, err = adam.ParseDType(gd); err != nil || c.GradDType == 0 {
		return nil, bad("grad_dtype %q: want float32, bfloat16 or float16", gd)
	}
	if s, err := get("grad_scale"); err != nil {
		return nil, err
	} else if s != "" {
		c.GradScale, err = strconv.ParseFloat(s, 64)
		if inv := float32(1 / c.GradScale); err != nil || !(c.GradScale > 0) || math.IsInf(c.GradScale, 0) || math.IsInf(float64(inv), 0) || inv == 0 {
			return nil, bad("grad_scale %q: want empty or a finite number > 0 whose reciprocal is a finite, non-zero float32", s)
		}
	}
	if steps < 1 || steps > 1<<20 {
		return nil, bad("steps %d: want 1 to %d", steps, 1<<20)
	}
	if c.Step0 > 1<<40 {
		return nil, bad("step0 %d is implausibly large", c.Step0)
	}

	if c.Init.Param, err = f32(f, "param", -1); err != nil {
		return nil, err
	}
	n := len(c.Init.Param)
	opt := func(name string) ([]float32, error) {
		if _, ok := f.Find(name); !ok {
			return make([]float32, n), nil
		}
		if c.Step0 == 0 {
			return nil, bad("tensor %q is present but step0 is 0", name)
		}
		return f32(f, name, n)
	}
	if c.Init.ExpAvg, err = opt("exp_avg"); err != nil {
		return nil, err
	}
	if c.Init.ExpAvgSq, err = opt("exp_avg_sq"); err != nil {
		return nil, err
	}
	if h.AMSGrad {
		if c.Init.MaxExpAvgSq, err = opt("max_exp_avg_sq"); err != nil {
			return nil, err
		}
	}
	for t := 1; t <= int(steps); t++ {
		name := fmt.Sprintf("grad.%d", t)
		var g adam.Grad
		if c.GradDType == adam.F32 {
			v, err := f32(f, name, n)
			if err != nil {
				return nil, err
			}
			g = adam.GradF32(v)
		} else {
			v, err := u16(f, name, n, c.GradDType)
			if err != nil {
				return nil, err
			}
			g = adam.Grad16(c.GradDType, v)
		}
		c.Grads = append(c.Grads, g)

		var e Expect
		if _, ok := f.Find(fmt.Sprintf("expected.skipped.%d", t)); ok {
			e.Skipped = true
		}
		for _, x := range []struct {
			key string
			dst *[]float32
		}{{"param", &e.Param}, {"exp_avg", &e.ExpAvg}, {"exp_avg_sq", &e.ExpAvgSq}, {"max_exp_avg_sq", &e.MaxExpAvgSq}} {
			name := fmt.Sprintf("expected.%s.%d", x.key, t)
			if _, ok := f.Find(name); ok {
				if *x.dst, err = f32(f, name, n); err != nil {
					return nil, err
				}
			}
		}
		if name := fmt.Sprintf("expected.param_bf16.%d", t); has(f, name) {
			if e.ParamBF16, err = u16(f, name, n, adam.BF16); err != nil {
				return nil, err
			}
		}
		if name := fmt.Sprintf("expected.param_fp16.%d", t); has(f, name) {
			if e.ParamFP16, err = u16(f, name, n, adam.F16); err != nil {
				return nil, err
			}
		}
		c.Expected = append(c.Expected, e)
	}
	if want := c.Step0 + int64(steps); c.FinalStep > want || c.FinalStep < c.Step0 {
		return nil, bad("final_step %d outside step0 = %d to step0 + steps = %d", c.FinalStep, c.Step0, want)
	}
	// The schema stores the state after call T unless T is skipped: a case
	// that would compare nothing is refused.
	last := c.Expected[steps-1]
	if !last.Skipped && (last.Param == nil || last.ExpAvg == nil || last.ExpAvgSq == nil || (h.AMSGrad && last.MaxExpAvgSq == nil)) {
		return nil, bad("call %d (the last) is not skipped but its expected.param/exp_avg/exp_avg_sq%s are missing", steps, map[bool]string{true: "/max_exp_avg_sq", false: ""}[h.AMSGrad])
	}
	compared := false
	for _, e := range c.Expected {
		compared = compared || e.Param != nil
	}
	if !compared {
		return nil, bad("no call has expected tensors: the case would compare nothing")
	}
	return c, nil
}

func has(f *safetensors.File, name string) bool {
	_, ok := f.Find(name)
	return ok
}

// f32 reads the F32 tensor name; n >= 0 requires that many elements.
func f32(f *safetensors.File, name string, n int) ([]float32, error) {
	t, ok := f.Find(name)
	if !ok {
		return nil, bad("tensor %q is missing", name)
	}
	if t.DType != safetensors.F32 {
		return nil, bad("tensor %q has dtype %s, want F32", name, t.DType)
	}
	if n >= 0 && t.NumElements() != int64(n) {
		return nil, bad("tensor %q has %d elements, want %d like param", name, t.NumElements(), n)
	}
	return f.Float32(name)
}

func u16(f *safetensors.File, name string, n int, d adam.DType) ([]uint16, error) {
	t, ok := f.Find(name)
	if !ok {
		return nil, bad("tensor %q is missing", name)
	}
	want := safetensors.BF16
	if d == adam.F16 {
		want = safetensors.F16
	}
	if t.DType != want {
		return nil, bad("tensor %q has dtype %s, want %s", name, t.DType, want)
	}
	if t.NumElements() != int64(n) {
		return nil, bad("tensor %q has %d elements, want %d like param", name, t.NumElements(), n)
	}
	v, _, err := f.Uint16(name)
	return v, err
}

func trimExt(s string) string {
	if ext := filepath.Ext(s); ext != "" {
		return s[:len(s)-len(ext)]
	}
	return s
}

// MaxCaseSize is the largest case file LoadDir and LoadFS read, in bytes.
const MaxCaseSize = 1 << 30

// LoadDir loads every *.safetensors file in dir, sorted by name.
//
// Errors: dir cannot be read or is not a directory, holds no case, or a
// case is not a regular file, is over MaxCaseSize, or fails to load (the
// error names the file).
func LoadDir(dir string) ([]*Case, error) {
	if info, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("adamcase: case directory: %w", err)
	} else if !info.IsDir() {
		return nil, fmt.Errorf("adamcase: case directory %s is not a directory", dir)
	}
	return loadFS(os.DirFS(dir), "*.safetensors", dir)
}

// LoadFS is LoadDir on directory dir of fsys (an embedded set of cases, say).
func LoadFS(fsys fs.FS, dir string) ([]*Case, error) {
	return loadFS(fsys, path.Join(dir, "*.safetensors"), dir)
}

// loadFS loads the files of fsys that match pattern; shown names their
// directory in errors.
func loadFS(fsys fs.FS, pattern, shown string) ([]*Case, error) {
	names, err := fs.Glob(fsys, pattern)
	if err != nil {
		return nil, fmt.Errorf("adamcase: reading %s: %w", shown, err)
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("adamcase: no *.safetensors case files in %s", shown)
	}
	sort.Strings(names)
	var cases []*Case
	for _, name := range names {
		c, err := loadOne(fsys, name, filepath.Join(shown, path.Base(name)))
		if err != nil {
			return nil, err
		}
		cases = append(cases, c)
	}
	return cases, nil
}

// loadOne loads the case file name of fsys, shown as shown in errors. It
// reads only a regular file of at most MaxCaseSize bytes, so a FIFO or a
// device never hangs it.
func loadOne(fsys fs.FS, name, shown string) (*Case, error) {
	info, err := fs.Stat(fsys, name)
	if err != nil {
		return nil, fmt.Errorf("adamcase: %s: %w", shown, err)
	}
	if !info.Mode().IsRegular() {
		return nil, fmt.Errorf("adamcase: %s is not a regular file (%v)", shown, info.Mode().Type())
	}
	if info.Size() > MaxCaseSize {
		return nil, fmt.Errorf("adamcase: %s is %d bytes, over the limit of %d", shown, info.Size(), int64(MaxCaseSize))
	}
	b, err := fs.ReadFile(fsys, name)
	if err != nil {
		return nil, fmt.Errorf("adamcase: %s: %w", shown, err)
	}
	return Parse(shown, b)
}
