package offload

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
)

// closeOpts returns the options of the Close tests: the host path, or the
// simulated device with CPU, streamed and resident subgroups (testParams
// makes 6 subgroups of at most 300 elements).
func closeOpts(device bool) Options {
	opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, MaxGradNorm: 1, Threads: 2}
	if device {
		opts, _ = deviceOpts(opts, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2})
	}
	return opts
}

// TestCloseDuringStep is issue 14's defect 10: Close from one goroutine
// while another is in Step panicked (a nil pool or engine, or "Pool used
// after Close"). Close must wait for the Step in flight; the Steps after it
// return ErrClosed.
func TestCloseDuringStep(t *testing.T) {
	trials := 60
	if testing.Short() {
		trials = 10
	}
	for _, device := range []bool{false, true} {
		t.Run(fmt.Sprintf("device=%t", device), func(t *testing.T) {
			for trial := range trials {
				o := newTest(t, closeOpts(device))
				fill(o, 1)
				started := make(chan struct{})
				stepErr := make(chan error, 1)
				go func() {
					close(started)
					for {
						if _, err := o.Step(StepArgs{LossScale: 2}); err != nil {
							stepErr <- err
							return
						}
					}
				}()
				<-started
				// Close at different points of a Step (one takes tens to
				// hundreds of microseconds here).
				time.Sleep(time.Duration(trial%7) * 40 * time.Microsecond)
				o.Close()
				if err := <-stepErr; !errors.Is(err, ErrClosed) {
					t.Fatalf("trial %d: Step after Close: %v, want ErrClosed", trial, err)
				}
			}
		})
	}
}

// TestCloseConcurrentCalls: Close while two goroutines call Step and the
// other methods that use the state, the pool or the engine. Every call
// returns nil or ErrClosed, none panics, and -race finds no race: the
// calls are serialized.
func TestCloseConcurrentCalls(t *testing.T) {
	trials := 20
	if testing.Short() {
		trials = 4
	}
	for _, device := range []bool{false, true} {
		t.Run(fmt.Sprintf("device=%t", device), func(t *testing.T) {
			for trial := range trials {
				o := newTest(t, closeOpts(device))
				fill(o, 1)
				root := t.TempDir()
				saved, err := o.SaveCheckpoint(checkpoint.OS, filepath.Join(root, "first"), nil)
				if err != nil {
					t.Fatal(err)
				}
				bias := make([]float32, 16)
				var wg sync.WaitGroup
				errs := make(chan error, 2)
				wg.Go(func() {
					for {
						if _, err := o.Step(StepArgs{LossScale: 2}); err != nil {
							errs <- err
							return
						}
					}
				})
				wg.Go(func() {
					for i := 0; ; i++ {
						var err error
						switch i % 7 {
						case 0:
							err = o.SetParam("ln_f.bias", bias)
						case 1:
							err = o.SetLR(1e-3)
						case 2:
							_, err = o.Snapshot(nil)
						case 3:
							o.ZeroGrad()
							_ = o.StepCount()
							_ = o.Options()
							_, _ = o.Schedule()
						case 4:
							_ = o.Working(0)
							_ = o.Grad(1)
						case 5:
							if i%35 == 5 {
								_, err = o.SaveCheckpoint(checkpoint.OS, filepath.Join(root, fmt.Sprint(i)), nil)
							}
						case 6:
							if i%35 == 6 {
								_, _, err = o.LoadCheckpoint(checkpoint.OS, saved)
							}
						}
						if err != nil {
							errs <- err
							return
						}
					}
				})
				time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
				o.Close()
				wg.Wait()
				for range 2 {
					if err := <-errs; !errors.Is(err, ErrClosed) {
						t.Fatalf("trial %d: %v, want ErrClosed", trial, err)
					}
				}
			}
		})
	}
}

// TestClosedAll: after Close, every call that uses the pool or the
// engine returns ErrClosed, on the host path and the device path.
func TestClosedAll(t *testing.T) {
	for _, device := range []bool{false, true} {
		t.Run(fmt.Sprintf("device=%t", device), func(t *testing.T) {
			o := newTest(t, closeOpts(device))
			root := t.TempDir()
			if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
				t.Fatal(err)
			}
			e, err := checkpoint.NewEngine(checkpoint.OS, t.TempDir(), checkpoint.EngineOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			o.Close()
			o.Close()
			if _, err := o.Step(StepArgs{}); !errors.Is(err, ErrClosed) {
				t.Errorf("Step: %v", err)
			}
			if err := o.SetParam("ln_f.bias", make([]float32, 16)); !errors.Is(err, ErrClosed) {
				t.Errorf("SetParam: %v", err)
			}
			if err := o.SetLR(1); !errors.Is(err, ErrClosed) {
				t.Errorf("SetLR: %v", err)
			}
			if _, err := o.Snapshot(nil); !errors.Is(err, ErrClosed) {
				t.Errorf("Snapshot: %v", err)
			}
			if _, err := o.SaveAsync(e, 9, nil); !errors.Is(err, ErrClosed) {
				t.Errorf("SaveAsync: %v", err)
			}
			if _, err := o.SaveCheckpoint(checkpoint.OS, t.TempDir(), nil); !errors.Is(err, ErrClosed) {
				t.Errorf("SaveCheckpoint: %v", err)
			}
			if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); !errors.Is(err, ErrClosed) {
				t.Errorf("LoadCheckpoint: %v", err)
			}
		})
	}
}
