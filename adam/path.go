package adam

import (
	"fmt"
	"os"
)

// The kernels of the avx2 and avx512 paths, kernels_gen_amd64.s and its
// declarations, are generated with avo from one description in _gen, a
// module of its own (so dos does not depend on avo). make gen-check, part
// of make test, fails when they are not what _gen writes.
//go:generate go run -C _gen . -dir ..

// Path is one implementation of the element-wise core of Step: "generic"
// (the Go reference loop), "avx2" (8 lanes) or "avx512" (16 lanes). Every
// path performs the same IEEE operations in the same order, none fused, so
// all paths give bitwise the same results, except that a NaN result may
// carry another sign or payload: which NaN an operation on NaNs returns
// depends on operand order, which IEEE 754 leaves open.
type Path struct {
	name  string
	lanes int // the kernel updates a multiple of lanes elements; 1: no kernel
}

// Name returns the path's name.
func (p Path) Name() string { return p.name }

// String returns the path's name.
func (p Path) String() string { return p.name }

// Generic is the pure-Go path, available everywhere.
var Generic = Path{name: "generic", lanes: 1}

// Paths returns the paths this machine can run, the generic one first and
// the fastest last (detected with klauspost/cpuid at start-up; none but
// generic under the noasm build tag or off amd64).
func Paths() []Path { return append([]Path{Generic}, simdPaths()...) }

// DefaultPath is the path of Step, Pool and everything built on them: the
// fastest available, or the one the environment variable DOS_ADAM_PATH
// names (generic, avx2, avx512) when it is set and available.
var DefaultPath = pickDefault()

func pickDefault() Path {
	paths := Paths()
	if want := os.Getenv("DOS_ADAM_PATH"); want != "" {
		p, err := PathByName(want)
		if err != nil {
			fmt.Fprintf(os.Stderr, "adam: DOS_ADAM_PATH=%q is not available here; using %s\n", want, paths[len(paths)-1].name)
		} else {
			return p
		}
	}
	return paths[len(paths)-1]
}

// PathByName returns the available path named name.
//
// Errors: no such path, or not available on this machine.
func PathByName(name string) (Path, error) {
	var names []string
	for _, p := range Paths() {
		if p.name == name {
			return p, nil
		}
		names = append(names, p.name)
	}
	return Path{}, fmt.Errorf("adam: path %q is not available here (available: %v)", name, names)
}

// kernelArgs packs c's scalars and flags for a kernel: decay, l2, w, 1-w,
// beta2, 1-beta2, sqrt(bias correction 2), eps, -step size; flag bit 0: L2
// weight decay, bit 1: lerp with a small weight, bit 2: amsgrad.
func kernelArgs(c *Coeffs) (k [9]float32, flags int) {
	w := c.Beta1Weight
	k = [9]float32{c.Decay, c.L2, w, float32(1 - w), c.Beta2, c.OneMinusB2, c.BC2Sqrt, c.Eps, c.NegStepSize}
	if c.L2 != 0 {
		flags |= 1
	}
	if w < 0.5 {
		flags |= 2
	}
	if c.AMSGrad {
		flags |= 4
	}
	return k, flags
}

// update runs the core on the path: the lane-multiple head in the
// kernel, the tail in the Go reference.
func (path Path) update(c *Coeffs, p, m, v, vmax, g []float32) {
	n := len(g)
	head := 0
	if path.lanes > 1 {
		head = n - n%path.lanes
	}
	if head > 0 {
		_, _, _ = p[head-1], m[head-1], v[head-1]
		var vm *float32
		if vmax != nil {
			vm = &vmax[:head][0]
		}
		raceRead32(g[:head])
		raceWrite32(p[:head])
		raceWrite32(m[:head])
		raceWrite32(v[:head])
		if vmax != nil {
			raceWrite32(vmax[:head])
		}
		k, flags := kernelArgs(c)
		// A direct call (simdKernel switches on lanes): a call through a
		// func value would make &k escape and allocate.
		simdKernel(path.lanes, &p[0], &m[0], &v[0], vm, &g[0], head, &k, flags)
	}
	if head < n {
		var vt []float32
		if vmax != nil {
			vt = vmax[head:n]
		}
		update(c, p[head:n], m[head:n], v[head:n], vt, g[head:n])
	}
}
