// Package kernels holds dos's CUDA kernels (adamw.cu), their PTX (built by
// scripts/build-kernels.sh with nvcc on the GPU machine, committed, embedded
// here) and typed launchers over package cuda.
//
// The fused AdamW kernel follows adam.Step exactly: the gradient is upcast
// in the kernel, multiplied by the loss-scale factor and the clip
// coefficient, negated under maximize, and the same fp32 operations run in
// the same order, each rounded, so the GPU result equals the CPU result bit
// for bit (a NaN result may carry another NaN). Both weight-decay modes,
// amsgrad and the optional bf16/fp16 copy of the new master weights are
// kernel variants chosen per launch. Loads and stores are 16 bytes wide when
// every pointer is 16-byte aligned (8 for 16-bit arrays), grid-stride.
//
// A Kernels is safe for concurrent use; launches from several goroutines
// serialize on a mutex around the argument block (microseconds).
package kernels

import (
	"bytes"
	_ "embed"
	"fmt"
	"math"
	"sync"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
)

//go:embed adamw.ptx
var adamwPTX []byte

// PTX returns a copy of the embedded PTX of adamw.cu.
func PTX() []byte { return bytes.Clone(adamwPTX) }

// Stamp returns the SHA-256 of adamw.cu recorded on the PTX's first line
// ("// dos-source-sha256: HEX adamw.cu"), or "" when it is missing.
func Stamp() string { return stampOf(adamwPTX) }

// stampOf reads the "// dos-source-sha256: HEX NAME.cu" first line of a PTX.
func stampOf(ptx []byte) string {
	line, _, _ := bytes.Cut(ptx, []byte("\n"))
	f := bytes.Fields(line)
	if len(f) < 3 || string(f[1]) != "dos-source-sha256:" {
		return ""
	}
	return string(f[2])
}

// Block is the thread-block size of every launch.
const Block = 256

// maxGrid is the most blocks a launch's x dimension may have (2^31-1);
// bigger ranges are covered by the kernels' grid-stride loops.
const maxGrid = 1<<31 - 1

// Kernels is the loaded module and its functions on one device.
type Kernels struct {
	d     *cuda.Device
	mod   *cuda.Module
	adamw [3][3]*cuda.Function // [gradient dtype][copy dtype], dtypes indexed by dtypeIndex
	multi [3][3]*cuda.Function
	widen [3]*cuda.Function // BF16, F16 at their dtypeIndex
	round [3]*cuda.Function
	stats [3]*cuda.Function
	grid  uint32 // blocks of a grid-stride launch: enough to fill the device

	mu      sync.Mutex
	args    *cuda.Args
	partial *cuda.Buffer     // GradStats: per-block sums, then the non-finite flag
	host    *cuda.HostBuffer // their pinned host copy
	tables  *cuda.Buffer     // AdamWMulti: tensor and chunk tables
	hostTab *cuda.HostBuffer
	tabDone *cuda.Event // the last table upload finished
}

// dtypeIndex maps F32, BF16, F16 (gradients) and 0, BF16, F16 (copies) to
// 0, 1, 2, the order of the kernels' GRAD_* and OUT_* constants.
func dtypeIndex(d adam.DType) (int, bool) {
	switch d {
	case adam.F32, 0:
		return 0, true
	case adam.BF16:
		return 1, true
	case adam.F16:
		return 2, true
	}
	return 0, false
}

var dtypeSuffix = [3]string{"f32", "bf16", "f16"}

// Open opens GPU ordinal (cuda.Available, cuda.Open) and loads the
// kernels on it; release closes both, kernels first. It is how a command
// or a test starts on a GPU.
//
// Errors: no driver or no such device (cuda.Available's reason), those of
// cuda.Open and Load (what was opened is closed).
func Open(ordinal int) (d *cuda.Device, k *Kernels, release func(), err error) {
	if err := cuda.Available(); err != nil {
		return nil, nil, nil, err
	}
	if d, err = cuda.Open(ordinal); err != nil {
		return nil, nil, nil, err
	}
	if k, err = Load(d); err != nil {
		d.Close()
		return nil, nil, nil, err
	}
	return d, k, func() { k.Close(); d.Close() }, nil
}

// Load compiles the embedded PTX for d and looks up every kernel.
//
// Errors: the driver rejecting the PTX (its log is in the error), a missing
// kernel, a closed device.
func Load(d *cuda.Device) (*Kernels, error) {
	ptx, err := ptxSource("adamw.ptx", adamwPTX)
	if err != nil {
		return nil, err
	}
	mod, err := d.LoadModule(ptx)
	if err != nil {
		return nil, fmt.Errorf("kernels: %w", err)
	}
	k := &Kernels{d: d, mod: mod, grid: uint32(d.SMs * 8)}
	fail := func(err error) (*Kernels, error) {
		k.Close()
		return nil, fmt.Errorf("kernels: %w", err)
	}
	for gi := range 3 {
		for oi := range 3 {
			name := "dos_adamw_" + dtypeSuffix[gi]
			if oi > 0 {
				name += "_" + dtypeSuffix[oi]
			}
			if k.adamw[gi][oi], err = mod.Function(name); err != nil {
				return fail(err)
			}
			if k.multi[gi][oi], err = mod.Function("dos_adamw_multi_" + name[len("dos_adamw_"):]); err != nil {
				return fail(err)
			}
		}
		if k.stats[gi], err = mod.Function("dos_grad_stats_" + dtypeSuffix[gi]); err != nil {
			return fail(err)
		}
		if gi > 0 {
			if k.widen[gi], err = mod.Function("dos_widen_" + dtypeSuffix[gi]); err != nil {
				return fail(err)
			}
			if k.round[gi], err = mod.Function("dos_round_" + dtypeSuffix[gi]); err != nil {
				return fail(err)
			}
		}
	}
	if k.args, err = cuda.NewArgs(); err != nil {
		return fail(err)
	}
	if k.tabDone, err = d.NewEvent(false); err != nil {
		return fail(err)
	}
	return k, nil
}

// Close frees the module and the launchers' buffers.
func (k *Kernels) Close() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	var first error
	keep := func(err error) {
		if first == nil {
			first = err
		}
	}
	for _, f := range []func() error{
		func() error { return freeBuf(k.partial) }, func() error { return freeHost(k.host) },
		func() error { return freeBuf(k.tables) }, func() error { return freeHost(k.hostTab) },
	} {
		if err := f(); err != nil {
			keep(err)
		}
	}
	if k.tabDone != nil {
		keep(k.tabDone.Free())
	}
	if k.args != nil {
		keep(k.args.Free())
	}
	keep(k.mod.Free())
	return first
}

func freeBuf(b *cuda.Buffer) error {
	if b == nil {
		return nil
	}
	return b.Free()
}

func freeHost(h *cuda.HostBuffer) error {
	if h == nil {
		return nil
	}
	return h.Free()
}

// Vec is N elements in device memory, starting Off elements into Buf; the
// element size (4 for fp32, 2 for bf16/fp16) comes from where it is used.
type Vec struct {
	Buf    *cuda.Buffer
	Off, N int64
}

func (v Vec) check(what string, elem int64, n int64) error {
	if v.Buf == nil {
		return fmt.Errorf("kernels: %s: no buffer", what)
	}
	if v.Buf.Freed() {
		return fmt.Errorf("kernels: %s: %w", what, cuda.ErrFreed)
	}
	if v.N != n {
		return fmt.Errorf("kernels: %s has %d elements, want %d", what, v.N, n)
	}
	if max := v.Buf.Len() / elem; v.Off < 0 || v.N < 0 || v.Off > max || v.N > max-v.Off { // no overflow
		return fmt.Errorf("kernels: %s: elements [%d, %d) of %d bytes each outside its %d-byte buffer", what, v.Off, v.Off+v.N, elem, v.Buf.Len())
	}
	return nil
}

// State is a subgroup's fp32 optimizer state on the device: master weights,
// exp_avg, exp_avg_sq and, with amsgrad only, max_exp_avg_sq.
type State struct {
	Param, ExpAvg, ExpAvgSq, MaxExpAvgSq Vec
}

// Grad is a gradient on the device: fp32, bf16 or fp16 elements.
type Grad struct {
	DType adam.DType
	Vec
}

// Copy16 is the optional 16-bit copy of the new master weights the kernel
// writes (DType BF16 or F16; 0 for none).
type Copy16 struct {
	DType adam.DType
	Vec
}

// Kernel flag bits (adamw.cu).
const (
	fL2       = 1
	fSmallW   = 2
	fAMSGrad  = 4
	fMaximize = 8
	fUnscale  = 16
	fClip     = 32
)

func flags(c *adam.Coeffs) int32 {
	var f int32
	if c.L2 != 0 {
		f |= fL2
	}
	if c.Beta1Weight < 0.5 {
		f |= fSmallW
	}
	if c.AMSGrad {
		f |= fAMSGrad
	}
	if c.Maximize {
		f |= fMaximize
	}
	if c.Unscale != 1 {
		f |= fUnscale
	}
	if c.Clip != 1 {
		f |= fClip
	}
	return f
}

// coefArgs appends the scalars of c in the kernels' COEF_PARAMS order.
func coefArgs(a *cuda.Args, c *adam.Coeffs) {
	w := c.Beta1Weight
	a.F32(c.Decay).F32(c.L2).F32(w).F32(float32(1 - w)).F32(c.Beta2).F32(c.OneMinusB2).
		F32(c.BC2Sqrt).F32(c.Eps).F32(c.NegStepSize).F32(c.Unscale).F32(c.Clip).I32(flags(c))
}

// AdamW enqueues one fused AdamW step on s over the subgroup st with the
// scalars c (adam.Hyper.Coeffs), reading g and writing out when out.DType
// is set. Semantics are adam.Step's. It does not allocate.
//
// Errors: lengths that differ, a range outside its buffer, amsgrad without
// MaxExpAvgSq, a bad dtype, a freed buffer or stream, a launch failure. A
// fault inside the kernel surfaces from the stream's next Sync.
func (k *Kernels) AdamW(s *cuda.Stream, c *adam.Coeffs, st State, g Grad, out Copy16) error {
	n := st.Param.N
	gi, ok := dtypeIndex(g.DType)
	if !ok || g.DType == 0 {
		return fmt.Errorf("kernels: AdamW: gradient dtype %v", g.DType)
	}
	oi, ok := dtypeIndex(out.DType)
	if !ok || out.DType == adam.F32 {
		return fmt.Errorf("kernels: AdamW: copy dtype %v", out.DType)
	}
	if err := checkState(st, c.AMSGrad, n); err != nil {
		return err
	}
	if err := g.check("gradient", elemSize(g.DType), n); err != nil {
		return err
	}
	if out.DType != 0 {
		if err := out.check("16-bit copy", 2, n); err != nil {
			return err
		}
	}
	if n == 0 {
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	a := k.args
	a.Reset()
	a.Ptr(st.Param.Buf, 4*st.Param.Off).Ptr(st.ExpAvg.Buf, 4*st.ExpAvg.Off).Ptr(st.ExpAvgSq.Buf, 4*st.ExpAvgSq.Off)
	if c.AMSGrad {
		a.Ptr(st.MaxExpAvgSq.Buf, 4*st.MaxExpAvgSq.Off)
	} else {
		a.U64(0)
	}
	a.Ptr(g.Buf, elemSize(g.DType)*g.Off)
	if out.DType != 0 {
		a.Ptr(out.Buf, 2*out.Off)
	} else {
		a.U64(0)
	}
	a.U64(uint64(n))
	coefArgs(a, c)
	// One thread per 4 elements, the whole range in one wave of blocks: on
	// the H200 this ran at 151.7 Gparam/s against 138-143 for a
	// grid-stride launch of 4 to 32 blocks per SM (2^28 fp32 elements).
	grid := uint32(min((n+4*Block-1)/(4*Block), maxGrid))
	return k.adamw[gi][oi].Launch(s, cuda.Dim3{X: grid, Y: 1, Z: 1}, cuda.Dim3{X: Block, Y: 1, Z: 1}, 0, a)
}

func checkState(st State, amsgrad bool, n int64) error {
	for _, x := range []struct {
		name string
		v    Vec
	}{{"param", st.Param}, {"exp_avg", st.ExpAvg}, {"exp_avg_sq", st.ExpAvgSq}} {
		if err := x.v.check(x.name, 4, n); err != nil {
			return err
		}
	}
	if amsgrad {
		if err := st.MaxExpAvgSq.check("max_exp_avg_sq (amsgrad)", 4, n); err != nil {
			return err
		}
	}
	return nil
}

func elemSize(d adam.DType) int64 {
	if d == adam.F32 {
		return 4
	}
	return 2
}

// Widen16 enqueues the exact upcast of the 16-bit src (dtype d, BF16 or
// F16) into the fp32 dst (adam.BF16ToF32, F16ToF32).
func (k *Kernels) Widen16(s *cuda.Stream, d adam.DType, dst, src Vec) error {
	return k.cast(s, d, k.widen, dst, 4, src, 2)
}

// Round16 enqueues the round-to-nearest-even of the fp32 src into the
// 16-bit dst (adam.F32ToBF16, F32ToF16).
func (k *Kernels) Round16(s *cuda.Stream, d adam.DType, dst, src Vec) error {
	return k.cast(s, d, k.round, dst, 2, src, 4)
}

func (k *Kernels) cast(s *cuda.Stream, d adam.DType, fs [3]*cuda.Function, dst Vec, dstElem int64, src Vec, srcElem int64) error {
	i, ok := dtypeIndex(d)
	if !ok || i == 0 {
		return fmt.Errorf("kernels: cast: dtype %v is not 16-bit", d)
	}
	if err := src.check("source", srcElem, src.N); err != nil {
		return err
	}
	if err := dst.check("destination", dstElem, src.N); err != nil {
		return err
	}
	if src.N == 0 {
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	a := k.args
	a.Reset()
	a.Ptr(dst.Buf, dstElem*dst.Off).Ptr(src.Buf, srcElem*src.Off).U64(uint64(src.N))
	grid := min(k.grid, uint32((src.N+Block-1)/Block))
	return fs[i].Launch(s, cuda.Dim3{X: grid, Y: 1, Z: 1}, cuda.Dim3{X: Block, Y: 1, Z: 1}, 0, a)
}

// StatsChunk is how many elements each partial sum of GradStats covers:
// adam.MinChunk, so that the device adds in the CPU's order.
const StatsChunk = adam.MinChunk

// GradStats returns whether every element of g is finite and the sum of
// squares of float32(g_i*unscale) in float64: adam.Path.GradStats on the
// device, bit for bit (the same per-element operations, the same 16 lanes
// per StatsChunk block, the blocks added in order). It enqueues on s and
// waits for s (a synchronization point).
//
// Errors: a dtype other than F32, BF16 or F16; g outside its buffer; the
// driver's.
func (k *Kernels) GradStats(s *cuda.Stream, g Grad, unscale float32) (finite bool, sumSquares float64, err error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	blocks, finite, err := k.partials(s, g, unscale)
	if err != nil || blocks == 0 {
		return finite, 0, err
	}
	h := k.host.Bytes()
	for b := range blocks {
		sumSquares += math.Float64frombits(*(*uint64)(unsafe.Pointer(&h[8*b])))
	}
	return finite, sumSquares, nil
}

// GradPartials is GradStats without the last sum, adam.Pool.GradPartials
// on the device: it writes the sum of squares of g's StatsChunk block b to
// dst[b] (the same bits as the CPU's) and reports whether every element is
// finite. It waits for s.
//
// Errors: those of GradStats; dst shorter than g's blocks.
func (k *Kernels) GradPartials(s *cuda.Stream, g Grad, unscale float32, dst []float64) (finite bool, err error) {
	if blocks := (g.N + StatsChunk - 1) / StatsChunk; int64(len(dst)) < blocks {
		return false, fmt.Errorf("kernels: GradPartials: %d partials for %d blocks", len(dst), blocks)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	blocks, finite, err := k.partials(s, g, unscale)
	if err != nil || blocks == 0 {
		return finite, err
	}
	copy(dst, unsafe.Slice((*float64)(unsafe.Pointer(&k.host.Bytes()[0])), blocks))
	return finite, nil
}

// GradPartialsTo is GradPartials without the wait: it enqueues on s the
// kernel that writes the sum of squares of g's StatsChunk block b
// (float64, the CPU's bits, as GradPartials) to dst's elements Off+b, and
// sets flag's int32 element Off to 1 if any element of g is not finite
// (it never clears it: zero it first, Memset, to start a count over). dst
// holds at least g's blocks; flag one element. Nothing is read back: the
// caller orders its read of dst and flag after s (an event). It waits for
// nothing and allocates nothing.
//
// Errors: a dtype other than F32, BF16 or F16; g, dst or flag outside its
// buffer; the driver's.
func (k *Kernels) GradPartialsTo(s *cuda.Stream, g Grad, unscale float32, dst, flag Vec) error {
	gi, err := statsGrad("GradPartialsTo", g)
	if err != nil || g.N == 0 {
		return err
	}
	blocks := (g.N + StatsChunk - 1) / StatsChunk
	if dst.N < blocks {
		return fmt.Errorf("kernels: GradPartialsTo: %d partials for %d blocks", dst.N, blocks)
	}
	if err := dst.check("partials", 8, dst.N); err != nil {
		return err
	}
	if err := flag.check("non-finite flag", 4, 1); err != nil {
		return err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.launchStats(s, gi, g, unscale, blocks, dst.Buf, 8*dst.Off, flag.Buf, 4*flag.Off)
}

// statsGrad checks g for the stats kernel and returns its dtype's index;
// fn names the caller in the error.
func statsGrad(fn string, g Grad) (int, error) {
	gi, ok := dtypeIndex(g.DType)
	if !ok || g.DType == 0 {
		return 0, fmt.Errorf("kernels: %s: gradient dtype %v", fn, g.DType)
	}
	return gi, g.check("gradient", elemSize(g.DType), g.N)
}

// launchStats enqueues the stats kernel over g (of dtype index gi, blocks
// StatsChunk blocks): block b's partial sum to dst's byte dstOff+8b, a
// non-finite element setting the int32 at flag's byte flagOff. k.mu is
// held.
func (k *Kernels) launchStats(s *cuda.Stream, gi int, g Grad, unscale float32, blocks int64, dst *cuda.Buffer, dstOff int64, flag *cuda.Buffer, flagOff int64) error {
	a := k.args
	a.Reset()
	a.Ptr(g.Buf, elemSize(g.DType)*g.Off).U64(uint64(g.N)).F32(unscale).U64(StatsChunk).Ptr(dst, dstOff).Ptr(flag, flagOff)
	// 16 blocks of StatsChunk per thread block of 256 (16 lanes each).
	return k.stats[gi].Launch(s, cuda.Dim3{X: uint32((blocks + 15) / 16), Y: 1, Z: 1}, cuda.Dim3{X: 256, Y: 1, Z: 1}, 0, a)
}

// partials runs the stats kernel over g and brings its partial sums to
// k.host (blocks of them, float64 each); k.mu is held.
func (k *Kernels) partials(s *cuda.Stream, g Grad, unscale float32) (blocks int64, finite bool, err error) {
	gi, err := statsGrad("GradStats", g)
	if err != nil {
		return 0, false, err
	}
	if g.N == 0 {
		return 0, true, nil
	}
	blocks = (g.N + StatsChunk - 1) / StatsChunk
	need := 8*blocks + 8 // partial sums, then the flag
	if k.partial == nil || k.partial.Len() < need {
		if err := k.grow(&k.partial, &k.host, need); err != nil {
			return 0, false, err
		}
	}
	flagOff := 8 * blocks
	if err := s.Memset(k.partial, flagOff, 4, 0); err != nil {
		return 0, false, err
	}
	if err := k.launchStats(s, gi, g, unscale, blocks, k.partial, 0, k.partial, flagOff); err != nil {
		return 0, false, err
	}
	if err := s.CopyDtoH(k.host, 0, k.partial, 0, need); err != nil {
		return 0, false, err
	}
	if err := s.Sync(); err != nil {
		return 0, false, err
	}
	return blocks, *(*int32)(unsafe.Pointer(&k.host.Bytes()[flagOff])) == 0, nil
}

// grow replaces a device buffer and its pinned host twin with ones of at
// least need bytes (64 KiB at least).
func (k *Kernels) grow(dev **cuda.Buffer, host **cuda.HostBuffer, need int64) error {
	if err := freeBuf(*dev); err != nil {
		return err
	}
	if err := freeHost(*host); err != nil {
		return err
	}
	*dev, *host = nil, nil
	need = max(need, 1<<16)
	var err error
	if *dev, err = k.d.Alloc(need); err != nil {
		return err
	}
	*host, err = k.d.HostAlloc(need)
	return err
}
