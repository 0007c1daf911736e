package offload

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"testing"
	"unsafe"

	"github.com/deepstates/dos/perfmodel"
)

// TestStepAsync: a trainer's next forward over the update's tail. After
// StepAsync, each parameter read on the trainer's stream once WaitParams
// returned for it (its device working copy and fp32 copy by a copy D2H on
// that stream, an OffloadParam's HostWorking on the host) has the value the
// host optimizer's Step gives, while the phase still runs; WaitStep then
// returns Step's result and the state is Step's, bit for bit, over
// TestSpeculate's mix of kept, clipped, skipped and restored steps, with
// speculation and without, on several schedules, the resident subgroups
// last and first (Options.ResidentFirst); on the simulated device
// every read is ordered after the write it reads.
func TestStepAsync(t *testing.T) {
	steps := []specStep{
		{scale: 0.01}, {scale: 0.01}, {scale: 1}, {scale: 0.01},
		{scale: 0.01, nan: true}, {scale: 0.01}, {scale: 0.01, lossScale: 4}, {scale: 0.01, lossScale: 4},
	}
	masters := []string{"h.0.ln_1.weight", "ln_f.bias"}
	for _, held := range [][]string{nil, {"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}} {
		for _, s := range []perfmodel.Schedule{{CPU: 2, GPU: 1, Resident: 1}, {CPU: 4}, {GPU: 4}, {Resident: 4}, {CPU: 1, GPU: 1, Resident: 2}} {
			if held == nil {
				s.CPU++ // the held parameters' subgroup is one of the others then
			}
			for _, c := range []struct {
				budget int64
				first  bool
			}{{0, false}, {1 << 20, false}, {1 << 20, true}} {
				budget := c.budget
				t.Run(fmt.Sprintf("held=%v/%+v/speculate=%d/residentFirst=%v", held, s, budget, c.first), func(t *testing.T) {
					base := specBase()
					base.DeviceMasters, base.ResidentFirst = masters, c.first
					r := newRig(t, testParams, base, held, s, budget)
					b := r.b
					// The views, before the phase holds the lock.
					n := len(b.Params())
					dw, dm := make([]DeviceTensor, n), make([]DeviceTensor, n)
					hw := make([]HostTensor, n)
					for i, p := range b.Params() {
						var err error
						if hw[i], err = b.HostWorking(i); err != nil {
							if dw[i], err = b.DeviceWorking(i); err != nil {
								t.Fatal(err)
							}
						}
						for _, m := range masters {
							if p.Name == m {
								if dm[i], err = b.DeviceMaster(i); err != nil {
									t.Fatal(err)
								}
							}
						}
					}
					for k, st := range steps {
						fill(r.ref, int64(k+1))
						scaleGrads(r.ref, st.scale)
						if st.nan {
							r.ref.Grad(2).Uint16()[3] = 0x7fc0
						}
						r.send(t, false, true)
						args := StepArgs{LossScale: st.lossScale}
						rr, err := r.ref.Step(args)
						if err != nil {
							t.Fatal(err)
						}
						args.GradOnDevice = true
						ra, err := b.StepAsync(args)
						if err != nil {
							t.Fatal(err)
						}
						if ra.Skipped != rr.Skipped || ra.ClipCoef != rr.ClipCoef || ra.Step != rr.Step || b.StepCount() != rr.Step {
							t.Fatalf("step %d: StepAsync %+v (StepCount %d), Step %+v", k, ra, b.StepCount(), rr)
						}
						rerr := forwardReads(r, k, dw, dm, hw)
						rb, err := b.WaitStep()
						if err != nil {
							t.Fatal(err)
						}
						if rerr != nil {
							t.Fatal(rerr)
						}
						if rb.Skipped != rr.Skipped || rb.ClipCoef != rr.ClipCoef || rb.Step != rr.Step || rb.Speculated != ra.Speculated {
							t.Fatalf("step %d: WaitStep %+v, StepAsync %+v, Step %+v", k, rb, ra, rr)
						}
						if rb, err := b.WaitStep(); err != nil || rb != (StepResult{}) {
							t.Fatalf("a second WaitStep: %+v, %v; want a zero result and nil", rb, err)
						}
						sameState(t, synced(t, r.ref), synced(t, b.workingNow(t)))
					}
					if err := r.sim.OrderErr(); err != nil {
						t.Fatal(err)
					}
				})
			}
		}
	}
}

// forwardReads reads every parameter of r.b in order as a forward would,
// each after WaitParams, and compares it with r.ref's (stepped): the
// working copy, and the fp32 copy where dm has one.
func forwardReads(r *specRig, k int, dw, dm []DeviceTensor, hw []HostTensor) error {
	b, ref := r.b, r.ref
	for i := range b.Params() {
		if err := b.WaitParams(r.io.s, i, i+1); err != nil {
			return err
		}
		if !b.ParamsReady(i, i+1) {
			return fmt.Errorf("step %d: ParamsReady(%d, %d) false after WaitParams", k, i, i+1)
		}
		want := tensorBytes(ref.Working(i))
		var got []byte
		if hw[i].Bytes != nil {
			got = hw[i].Bytes
		} else {
			var err error
			if got, err = readDevice(r.io, dw[i]); err != nil {
				return fmt.Errorf("step %d: reading %s after WaitParams: %w", k, dw[i].Name, err)
			}
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("step %d: %s's working copy after WaitParams is not the step's", k, b.Params()[i].Name)
		}
		if dm[i].Vec.Mem == nil {
			continue
		}
		m, err := readDevice(r.io, dm[i])
		if err != nil {
			return fmt.Errorf("step %d: reading %s's fp32 copy after WaitParams: %w", k, dm[i].Name, err)
		}
		master, err := ref.Master(i)
		if err != nil {
			return err
		}
		f := unsafe.Slice((*float32)(unsafe.Pointer(&m[0])), len(master))
		for j := range master {
			if math.Float32bits(f[j]) != math.Float32bits(master[j]) {
				return fmt.Errorf("step %d: %s's fp32 copy element %d after WaitParams: %g, want %g", k, dm[i].Name, j, f[j], master[j])
			}
		}
	}
	return nil
}

// readDevice copies v D2H on x's stream and returns its bytes (a copy).
func readDevice(x *streamIO, v DeviceTensor) ([]byte, error) {
	size := int64(v.DType.Size())
	if err := errors.Join(x.d.D2H(x.s, x.h, 0, v.Vec.Mem, v.Vec.Off*size, v.Bytes()), x.d.Record(x.ev, x.s), x.d.Sync(x.ev)); err != nil {
		return nil, err
	}
	return bytes.Clone(x.h.Bytes()[:v.Bytes()]), nil
}

// TestStepAsyncHost: without a device StepAsync is Step (the same state
// and result, WaitStep's too); a refused StepAsync leaves nothing for
// WaitStep; a StepAsync before WaitStep took the last result is refused.
func TestStepAsyncHost(t *testing.T) {
	base := Options{MaxGradNorm: 0.5, SubgroupSize: 400, Threads: 2}
	ref, o := newTest(t, base), newTest(t, base)
	for step := int64(1); step <= 3; step++ {
		fill(ref, step)
		fill(o, step)
		rr, err := ref.Step(StepArgs{})
		if err != nil {
			t.Fatal(err)
		}
		ra, err := o.StepAsync(StepArgs{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := o.StepAsync(StepArgs{}); err == nil {
			t.Fatal("a second StepAsync before WaitStep: no error")
		}
		rb, err := o.WaitStep()
		if err != nil {
			t.Fatal(err)
		}
		if ra.Step != rr.Step || rb.Step != rr.Step || rb.GradNorm != rr.GradNorm || ra.GradNorm != rr.GradNorm {
			t.Fatalf("step %d: StepAsync %+v, WaitStep %+v, Step %+v", step, ra, rb, rr)
		}
		sameState(t, ref, o)
	}
	if _, err := o.StepAsync(StepArgs{LossScale: -1}); err == nil {
		t.Fatal("LossScale -1: no error")
	}
	if r, err := o.WaitStep(); err != nil || r != (StepResult{}) {
		t.Fatalf("WaitStep after a refused StepAsync: %+v, %v; want a zero result and nil", r, err)
	}
	if !o.ParamsReady(0, len(o.Params())) || o.ParamsReady(1, 0) || o.ParamsReady(0, len(o.Params())+1) {
		t.Error("ParamsReady: want true with no phase, false out of order or range")
	}
}
