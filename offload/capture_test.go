package offload

// Lazy checkpoints with Options.Device on the simulated device, while the
// capture runs: copy-on-write through the engine's gate (scheduler.Engine.Hold),
// faults, a full disk, two saves in a row, reads of the state.

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// heldOS blocks every positioned write until release is closed: with a
// ring of two chunks the capture stops at the third chunk, deterministically.
type heldOS struct {
	checkpoint.FS
	release chan struct{}
}

type heldFile struct {
	checkpoint.File
	release chan struct{}
}

func (s heldOS) OpenFile(name string, flag int, perm os.FileMode) (checkpoint.File, error) {
	f, err := s.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return heldFile{f, s.release}, nil
}

func (f heldFile) WriteAt(p []byte, off int64) (int, error) {
	<-f.release
	return f.File.WriteAt(p, off)
}

// fullOS is slow (3 ms a write) and fails every write from the n-th on
// with ENOSPC.
type fullOS struct {
	checkpoint.FS
	n     int64
	count *atomic.Int64
}

type fullFile struct {
	checkpoint.File
	o fullOS
}

func (s fullOS) OpenFile(name string, flag int, perm os.FileMode) (checkpoint.File, error) {
	f, err := s.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return fullFile{f, s}, nil
}

func (f fullFile) WriteAt(p []byte, off int64) (int, error) {
	time.Sleep(3 * time.Millisecond)
	if f.o.count.Add(1) >= f.o.n {
		return 0, &os.PathError{Op: "write", Path: "x", Err: syscall.ENOSPC}
	}
	return f.File.WriteAt(p, off)
}

// replayed is a host optimizer after steps 1..n.
func replayed(t *testing.T, opts Options, n int64) *Optimizer {
	t.Helper()
	b := newTest(t, opts)
	for s := int64(1); s <= n; s++ {
		fill(b, s)
		mustStep(t, b)
	}
	return b
}

// loaded is a host optimizer loaded from the checkpoint root.
func loaded(t *testing.T, opts Options, root string) *Optimizer {
	t.Helper()
	a := newTest(t, opts)
	if _, _, err := a.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	return a
}

// smallEngine is a lazy checkpoint engine over fs with 4 KiB chunks, a
// ring of two and one writer, so that a capture outlasts the steps after
// it; closed when the test ends.
func smallEngine(t *testing.T, fs checkpoint.FS, root string) *checkpoint.Engine {
	t.Helper()
	e, err := checkpoint.NewEngine(fs, root, checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 2 * 4096, Writers: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// stepWithin runs o.Step, failing the test if it does not return in d
// (a gate that never opens).
func stepWithin(t *testing.T, o *Optimizer, d time.Duration) (StepResult, error) {
	t.Helper()
	type r struct {
		res StepResult
		err error
	}
	c := make(chan r, 1)
	go func() {
		res, err := o.Step(StepArgs{})
		c <- r{res, err}
	}()
	select {
	case x := <-c:
		return x.res, x.err
	case <-time.After(d):
		t.Fatalf("Step blocked for %v: deadlock", d)
		return StepResult{}, nil
	}
}

// TestCaptureReadDuringCapture: SaveAsync with the host state current (no
// DownloadAsync), a Step, then Master, whose syncHost brings step t+1's
// resident state back into the host memory that step t's capture may not
// have read yet: it must wait for the capture, and the checkpoint holds
// step t. (Found by review: Master used to overwrite it.)
func TestCaptureReadDuringCapture(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 2}
	for _, s := range []perfmodel.Schedule{{Resident: 5}, {CPU: 1, GPU: 1, Resident: 3}} {
		t.Run(fmt.Sprintf("%+v", s), func(t *testing.T) {
			opts, _ := deviceOpts(base, s)
			o := newTest(t, opts)
			root := t.TempDir()
			release := make(chan struct{})
			var fs checkpoint.FS = heldOS{checkpoint.OS, release}
			if s.CPU+s.GPU > 0 {
				// The Step's gates need the capture to move: slow, not held.
				fs = slowOS{checkpoint.OS}
				close(release)
			}
			e := smallEngine(t, fs, root)
			for step := int64(1); step <= 2; step++ {
				fill(o, step)
				mustStep(t, o)
			}
			master(t, o, 0) // the trainer looks at a weight: the host state is current
			h, err := o.SaveAsync(e, 2, nil)
			if err != nil {
				t.Fatal(err)
			}
			fill(o, 3)
			if _, err := stepWithin(t, o, 10*time.Second); err != nil {
				t.Fatal(err)
			}
			if s.CPU+s.GPU == 0 {
				// The writes go on only after a while: a Master that
				// waits for the capture must not wait forever.
				time.AfterFunc(50*time.Millisecond, func() { close(release) })
			}
			master(t, o, 0) // syncHost: Download of step 3's resident state
			if _, err := h.Wait(); err != nil {
				t.Fatal(err)
			}
			sameState(t, replayed(t, base, 2), loaded(t, base, root))
		})
	}
}

// TestCaptureENOSPC: the flush fails (ENOSPC) while steps run with every
// role, amsgrad and the upcast: no Step deadlocks in a gate, exactly one
// Step reports the failure without taking the step, and training equals
// the host's bitwise.
func TestCaptureENOSPC(t *testing.T) {
	h := adam.DefaultHyper()
	h.AMSGrad = true
	base := Options{Hyper: h, GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2}
	for _, n := range []int64{1, 2, 4} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			opts, _ := deviceOpts(base, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2, UpcastOnGPU: true})
			o := newTest(t, opts)
			host := newTest(t, base)
			e, err := checkpoint.NewEngine(fullOS{checkpoint.OS, n, new(atomic.Int64)}, t.TempDir(), checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 3 * 4096, Writers: 2})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			errs := 0
			var h *checkpoint.Handle
			for step := int64(1); step <= 8; {
				if step == 6 {
					if _, err := h.Wait(); !errors.Is(err, syscall.ENOSPC) {
						t.Fatalf("the save: %v", err)
					}
				}
				fill(o, step)
				fill(host, step)
				res, err := stepWithin(t, o, 10*time.Second)
				if err != nil {
					if !errors.Is(err, syscall.ENOSPC) || o.StepCount() != step-1 {
						t.Fatalf("step %d: %+v %v", step, res, err)
					}
					errs++
					continue
				}
				mustStep(t, host)
				if step == 2 {
					if h, err = o.SaveAsync(e, 2, nil); err != nil {
						t.Fatal(err)
					}
				}
				step++
			}
			if errs != 1 {
				t.Fatalf("the failed save was reported %d times", errs)
			}
			sameState(t, host, synced(t, o))
		})
	}
}

// TestCaptureFaultDuringCapture: the k-th copy or launch of step 3 fails
// while step 2's lazy checkpoint is captured (FaultError recovery runs
// the rest through run()): the checkpoint is step 2's, for every k.
func TestCaptureFaultDuringCapture(t *testing.T) {
	h := adam.DefaultHyper()
	h.AMSGrad = true
	base := Options{Hyper: h, GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2}
	want := replayed(t, base, 2)
	for k := 1; ; k++ {
		opts, d := deviceOpts(base, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2, UpcastOnGPU: true})
		o := newTest(t, opts)
		root := t.TempDir()
		e := smallEngine(t, slowOS{checkpoint.OS}, root)
		for step := int64(1); step <= 2; step++ {
			fill(o, step)
			mustStep(t, o)
		}
		hd, err := o.SaveAsync(e, 2, nil)
		if err != nil {
			t.Fatal(err)
		}
		fill(o, 3)
		d.FailAfter(k)
		_, serr := stepWithin(t, o, 10*time.Second)
		d.FailAfter(0)
		var fe *scheduler.FaultError
		if serr != nil && !errors.As(serr, &fe) && !errors.Is(serr, scheduler.ErrInjected) {
			t.Fatalf("k=%d: %v", k, serr)
		}
		if _, err := hd.Wait(); err != nil {
			t.Fatalf("k=%d: %v", k, err)
		}
		e.Close()
		got := loaded(t, base, root)
		sameState(t, want, got)
		if serr == nil {
			t.Logf("%d faulted operations checked", k-1)
			return
		}
	}
}

// TestCaptureTwoSaves: two lazy saves in a row with steps between and
// during, every role: each checkpoint holds its step.
func TestCaptureTwoSaves(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2}
	opts, _ := deviceOpts(base, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2})
	o := newTest(t, opts)
	roots := []string{t.TempDir(), t.TempDir()} // step 2's, step 3's
	var engines []*checkpoint.Engine
	for _, r := range roots {
		e := smallEngine(t, slowOS{checkpoint.OS}, r)
		engines = append(engines, e)
	}
	var hs []*checkpoint.Handle
	for step := int64(1); step <= 5; step++ {
		fill(o, step)
		if _, err := stepWithin(t, o, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		if step == 2 || step == 3 {
			h, err := o.SaveAsync(engines[step-2], step, nil)
			if err != nil {
				t.Fatal(err)
			}
			hs = append(hs, h)
		}
	}
	for _, h := range hs {
		if _, err := h.Wait(); err != nil {
			t.Fatal(err)
		}
	}
	sameState(t, replayed(t, base, 2), loaded(t, base, roots[0]))
	sameState(t, replayed(t, base, 3), loaded(t, base, roots[1]))
}

// TestCaptureDownloadFault: the k-th D2H of SaveAsync's DownloadAsync
// fails (SaveAsync errs, nothing pending); the next SaveAsync after a
// step, with steps during its capture, holds its step.
func TestCaptureDownloadFault(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2}
	want := replayed(t, base, 3)
	for k := 1; k <= 6; k++ {
		opts, d := deviceOpts(base, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2})
		o := newTest(t, opts)
		root := t.TempDir()
		e := smallEngine(t, slowOS{checkpoint.OS}, root)
		for step := int64(1); step <= 2; step++ {
			fill(o, step)
			mustStep(t, o)
		}
		d.FailAfter(k)
		if _, err := o.SaveAsync(e, 2, nil); !errors.Is(err, scheduler.ErrInjected) {
			t.Fatalf("k=%d: SaveAsync: %v", k, err)
		}
		d.FailAfter(0)
		fill(o, 3)
		mustStep(t, o)
		h, err := o.SaveAsync(e, 3, nil)
		if err != nil {
			t.Fatal(err)
		}
		for step := int64(4); step <= 5; step++ {
			fill(o, step)
			if _, err := stepWithin(t, o, 10*time.Second); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := h.Wait(); err != nil {
			t.Fatal(err)
		}
		e.Close()
		sameState(t, want, loaded(t, base, root))
	}
}

// TestCaptureFailSyncDuringCapture: a device fault seen at the k-th wait
// after SaveAsync (the capture's Prepare or the next Step's): nothing
// deadlocks; a broken optimizer recovers from a good checkpoint.
func TestCaptureFailSyncDuringCapture(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2}
	for k := 1; k <= 12; k++ {
		opts, d := deviceOpts(base, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2})
		o := newTest(t, opts)
		good := t.TempDir()
		for step := int64(1); step <= 2; step++ {
			fill(o, step)
			mustStep(t, o)
		}
		if _, err := o.SaveCheckpoint(checkpoint.OS, good, nil); err != nil {
			t.Fatal(err)
		}
		e := smallEngine(t, slowOS{checkpoint.OS}, t.TempDir())
		fill(o, 3)
		mustStep(t, o)
		d.FailSync(k)
		h, err := o.SaveAsync(e, 3, nil)
		if err != nil {
			t.Fatal(err)
		}
		var errs []error
		for step := int64(4); step <= 6; step++ {
			fill(o, step)
			if _, err := stepWithin(t, o, 10*time.Second); err != nil {
				errs = append(errs, err)
			}
		}
		_, herr := h.Wait()
		d.FailSync(0)
		if o.dev == devBroken {
			if _, _, err := o.LoadCheckpoint(checkpoint.OS, good); err != nil {
				t.Fatalf("k=%d: %v", k, err)
			}
			sameState(t, replayed(t, base, 2), synced(t, o))
		}
		t.Logf("k=%d: save %v; steps %v; broken %v", k, herr, errs, o.dev == devBroken)
		e.Close()
	}
}
