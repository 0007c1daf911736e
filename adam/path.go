package adam

import (
	"fmt"
	"os"
	"unsafe"
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

// alignHead returns how many elements of x come before its first one at
// an address that is a multiple of bytes (a power of two, at least 4), at
// most len(x).
func alignHead(x []float32, bytes uintptr) int {
	if len(x) == 0 {
		return 0
	}
	return min(len(x), int((-uintptr(unsafe.Pointer(unsafe.SliceData(x)))&(bytes-1))/4))
}

// updateTo is update out of place: the new p, m, v (and vmax) of the
// inputs p, m, v, vmax and g go to dp, dm, dv, dvmax, and the new p to pc
// too; the inputs are only read. On a SIMD path the elements from dp's
// first vector-aligned one on, a multiple of the lanes, take the kernel's
// non-temporal stores (dm, dv and dvmax must then be aligned alike, as
// arrays allocated alike are); the rest, and every element where they
// are not, are copied to the outputs and updated there in place.
func (path Path) updateTo(c *Coeffs, p, m, v, vmax, g, dp, dm, dv, dvmax, pc []float32) {
	n := len(g)
	a, body := n, 0 // the reference's head; the kernel's body
	if vec := uintptr(4 * path.lanes); path.lanes > 1 && n > 0 {
		if h := alignHead(dp, vec); alignHead(dm, vec) == h && alignHead(dv, vec) == h && (vmax == nil || alignHead(dvmax, vec) == h) {
			a, body = h, (n-h)-(n-h)%path.lanes
		}
	}
	ref := func(lo, hi int) {
		if lo == hi {
			return
		}
		copy(dp[lo:hi], p[lo:hi])
		copy(dm[lo:hi], m[lo:hi])
		copy(dv[lo:hi], v[lo:hi])
		var vt []float32
		if vmax != nil {
			copy(dvmax[lo:hi], vmax[lo:hi])
			vt = dvmax[lo:hi]
		}
		update(c, dp[lo:hi], dm[lo:hi], dv[lo:hi], vt, g[lo:hi])
		copy(pc[lo:hi], dp[lo:hi])
	}
	ref(0, a)
	if body > 0 {
		hi := a + body
		_, _, _, _, _, _, _ = p[hi-1], m[hi-1], v[hi-1], dp[hi-1], dm[hi-1], dv[hi-1], pc[hi-1]
		var vm, dvm *float32
		if vmax != nil {
			vm, dvm = &vmax[a:hi][0], &dvmax[a:hi][0]
			raceRead32(vmax[a:hi])
			raceWrite32(dvmax[a:hi])
		}
		raceRead32(g[a:hi])
		raceRead32(p[a:hi])
		raceRead32(m[a:hi])
		raceRead32(v[a:hi])
		raceWrite32(dp[a:hi])
		raceWrite32(dm[a:hi])
		raceWrite32(dv[a:hi])
		raceWrite32(pc[a:hi])
		k, flags := kernelArgs(c)
		simdKernelTo(path.lanes, &p[a], &m[a], &v[a], vm, &g[a], &dp[a], &dm[a], &dv[a], dvm, &pc[a], body, &k, flags)
	}
	ref(a+body, n)
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
