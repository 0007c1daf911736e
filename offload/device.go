package offload

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// OpenDevice opens the device that spec names, for Options.Device:
//   - "cuda": GPU 0 with dos's CUDA kernels (kernels.Open: the driver
//     opened at run time, the primary context, the committed PTX loaded);
//     "cuda:N" GPU N (a ZeRO-3 rank's);
//   - "sim": the simulated device (scheduler.NewSim) with 1 TiB of
//     simulated memory, which executes the same operations on the CPU.
//
// Call release after the Optimizer's Close; it is never nil when err is.
// A trainer opens its device here rather than through scheduler and
// kernels, which stay implementation details.
//
// Errors: an unknown spec; for "cuda", why there is no usable GPU (no
// driver, no device, the kernels' PTX refused), as kernels.Open says.
func OpenDevice(spec string) (dev scheduler.Device, release func(), err error) {
	switch spec {
	case "sim":
		return scheduler.NewSim(scheduler.SimOptions{Capacity: 1 << 40}), func() {}, nil
	}
	if n, ok := strings.CutPrefix(spec, "cuda:"); ok || spec == "cuda" {
		if !ok {
			n = "0"
		}
		ord, err := strconv.Atoi(n)
		if err != nil || ord < 0 || n != strconv.Itoa(ord) {
			return nil, nil, fmt.Errorf("offload: device %q: want cuda:N with N a GPU's ordinal (0, 1, ...)", spec)
		}
		d, k, rel, err := kernels.Open(ord)
		if err != nil {
			return nil, nil, fmt.Errorf("offload: device %s: %w", spec, err)
		}
		return scheduler.NewCUDA(d, k), rel, nil
	}
	return nil, nil, fmt.Errorf("offload: device %q: want cuda, cuda:N or sim", spec)
}

// ParseSchedule parses a forced split of the subgroups for
// Options.Schedule, "CPU,GPU,RESIDENT" subgroup counts (scheduler's
// syntax: "2,2,1").
//
// Errors: anything but three counts >= 0.
func ParseSchedule(text string) (perfmodel.Schedule, error) { return scheduler.ParseSchedule(text) }

// MixedSchedule is the split Options.Schedule takes for n subgroups when
// there is no profile to choose one: about a third each on the CPU,
// streamed through the GPU and resident, at least one streamed
// (scheduler.MixedSchedule).
func MixedSchedule(n int) perfmodel.Schedule { return scheduler.MixedSchedule(n) }

// SubgroupCount returns how many subgroups New cuts total parameters into
// with subgroups of size elements (the last one may be shorter), without
// Options.Groups: the count a schedule's CPU+GPU+RESIDENT must add up to.
// With groups each is cut apart: len(Optimizer.Subgroups()). It panics
// when size < 1.
func SubgroupCount(total, size int) int {
	if size < 1 {
		panic("offload: SubgroupCount with a size below 1")
	}
	return perfmodel.SubgroupCount(int64(total), int64(size))
}

// LoadProfile reads the performance model's profile at path (a dos
// calibrate --json file) for Options.Profile, checking that it was
// measured on this machine: this CPU and core count, and dev's GPU when
// dev is a CUDA device (perfmodel.Load).
//
// Errors: those of perfmodel.Load (a missing or malformed file, another
// machine, another version).
func LoadProfile(path string, dev scheduler.Device) (*perfmodel.Profile, error) {
	here := perfmodel.Here()
	if dev != nil {
		if _, sim := dev.(*scheduler.Sim); !sim {
			here.GPU = dev.Name()
		}
	}
	return perfmodel.Load(path, here)
}

// Profile is the performance model's measured rates of a machine, for
// Options.Profile: what LoadProfile reads and Calibrate measures
// (perfmodel.Profile).
type Profile = perfmodel.Profile

// Prediction is the performance model's plan of one update phase
// (perfmodel.Prediction): its schedule, its predicted time in seconds
// (Makespan), its bottleneck.
type Prediction = perfmodel.Prediction

// Bound is a lower bound on an update phase or a whole iteration
// (perfmodel.Bound: seconds, the binding resource, each resource's time):
// what Optimizer.Bound and Optimizer.IterationBound return.
type Bound = perfmodel.Bound

// Iteration is what a training iteration does besides its update phase,
// for Optimizer.IterationBound (perfmodel.Iteration: the forward and
// backward's seconds, the streamed weights' bytes each way).
type Iteration = perfmodel.Iteration

// IterationWork is a training iteration's work besides its update phase,
// for Optimizer.PredictIteration (perfmodel.IterationWork: the forward's
// and backward's seconds alone, the blocks, whether the forward overlaps
// the phase; the speculation's fields are the optimizer's).
type IterationWork = perfmodel.IterationWork

// IterationPrediction is Optimizer.PredictIteration's answer
// (perfmodel.IterationPrediction: the phase, what speculation hides, the
// iteration, in seconds).
type IterationPrediction = perfmodel.IterationPrediction

// Stream is a device stream an Optimizer orders work after
// (Optimizer.GradsFinal): the stream a trainer computes its gradients on
// (scheduler.Stream).
type Stream = scheduler.Stream

// CUDAStream is the Stream of the CUDA stream s, which must belong to the
// GPU of the Optimizer's Device (scheduler.CUDAStream).
func CUDAStream(s *cuda.Stream) Stream { return scheduler.CUDAStream(s) }

// TraceOp is one operation of an update phase as it ran (Optimizer.Trace:
// its resource, what it did, its start and end from the phase's start;
// scheduler.Op), and the row type of a trainer's own timeline.
type TraceOp = scheduler.Op

// TraceCounter is one sample of a quantity along a timeline (its name,
// time and value; scheduler.Counter), such as the device memory in use.
type TraceCounter = scheduler.Counter

// Resource names a timeline's row (perfmodel.Resource: "cpu", "h2d",
// "d2h", "gpu"; a trainer adds its own, such as its compute).
type Resource = perfmodel.Resource

// Calibrate measures this machine briefly for the performance model, what
// Options.Calibrate does in New: the CPU update rate at threads workers
// and gradient dtype gd (perfmodel.CalibrateCPU, 3 repetitions of
// subgroups of 8M to 64M parameters) and, on a CUDA device dev, its copy,
// conversion and update rates at reduced sizes (perfmodel.CalibrateGPU,
// 3 repetitions, at CalibrationSizes(deviceBytes): at most deviceBytes
// of device memory, 0 for CalibrationBytes, copies of 16 to 256 MiB and
// updates of 16M and 64M parameters): a few seconds in all, and up to
// about 2 GB of host memory while it runs. On another device (the
// simulated one) the profile has no GPU rates, so the model keeps every
// subgroup on the CPU.
//
// With ranks > 1 (ZeRO-3's ranks in one process, each with threads
// workers) the CPU is measured by ranks calibrations at once, as the
// ranks' update phases share the host's memory, and the slowest one's
// rates are kept; beyond two ranks each one's subgroups are 2/ranks of
// one calibration's (at least 1M parameters), so that the memory stays
// two calibrations'. The host memory the calibrations held is returned to
// the system before Calibrate returns (their arrays, outside the Go heap,
// are unmapped as each ends).
//
// Errors: deviceBytes (on a CUDA device) below MinCalibrationBytes, the
// GPU's or the CPU's measurement (named), for instance out of device
// memory. It panics when threads or ranks is below 1.
func Calibrate(dev scheduler.Device, threads int, gd adam.DType, ranks int, deviceBytes int64) (*Profile, error) {
	if threads < 1 || ranks < 1 {
		panic("offload: Calibrate with threads or ranks below 1")
	}
	p := &perfmodel.Profile{Format: perfmodel.ProfileFormat, Version: perfmodel.ProfileVersion, Created: time.Now().UTC()}
	if d, k, ok := scheduler.CUDAOf(dev); ok {
		copies, updates, err := CalibrationSizes(deviceBytes)
		if err != nil {
			return nil, err
		}
		gp, err := perfmodel.CalibrateGPU(d, k, perfmodel.GPUOptions{
			CopySizes: copies, UpdateSizes: updates, Reps: 3, Threads: threads, HostMemSeconds: 0.2}, nil)
		if err != nil {
			return nil, fmt.Errorf("offload: calibrating the GPU: %w", err)
		}
		p.GPU = gp
	}
	co := perfmodel.CPUOptions{Threads: []int{threads}, Reps: 3, GradDTypes: []adam.DType{gd}}
	if ranks > 2 {
		// The ranks' subgroups together as large as two calibrations'
		// (what two ranks measure with: about 3.6 GB at most, whatever
		// the ranks), each at least 1M.
		b := max(2*perfmodel.CPUSizes(2)[0]/ranks, 1<<20)
		co.Sizes = []int{b, 2 * b, 4 * b}
	}
	fits, errs := make([][]perfmodel.CPUFit, ranks), make([]error, ranks)
	var wg sync.WaitGroup
	for r := range fits {
		wg.Go(func() { fits[r], errs[r] = perfmodel.CalibrateCPU(co, nil) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("offload: calibrating the CPU: %w", err)
	}
	p.CPU = fits[0]
	for _, f := range fits[1:] {
		if len(f) > 0 && len(p.CPU) > 0 && f[0].Rate < p.CPU[0].Rate {
			p.CPU = f
		}
	}
	return p, nil
}

// CalibrationBytes is the device memory, in bytes, that Calibrate's GPU
// measurement holds at its full sizes (copies of 16 to 256 MiB, updates
// of 16M and 64M parameters): two 256 MiB copy buffers and five fp32
// buffers of 64M elements, 1.75 GiB; MinCalibrationBytes at its
// smallest (copies of 1 to 16 MiB, updates of 1M and 4M parameters),
// 112 MiB.
const (
	CalibrationBytes    = calibrationPerElem * calibrationMaxElems
	MinCalibrationBytes = calibrationPerElem * calibrationMinElems
)

const (
	// calibrationPerElem is perfmodel.CalibrateGPU's device bytes per
	// parameter of its largest update: 5 fp32 buffers, and 2 copy
	// buffers of 4 bytes per parameter each.
	calibrationPerElem  = 5*4 + 2*4
	calibrationMaxElems = 64 << 20
	calibrationMinElems = 4 << 20
)

// CalibrationSizes returns the copy sizes (bytes) and update sizes
// (parameters) at which Calibrate measures the GPU within deviceBytes
// of device memory (0: CalibrationBytes): the largest update of 64M
// parameters halved until the measurement fits, to 4M at least, the
// updates that and a quarter of it, and the copies 1/16, 1/4 and all of
// 4 bytes per parameter of it. Smaller sizes fit the same latency and
// rate less surely (the updates come closer to the L2 cache's size).
//
// Errors: deviceBytes below MinCalibrationBytes (negative included).
func CalibrationSizes(deviceBytes int64) (copies, updates []int64, err error) {
	if deviceBytes == 0 {
		deviceBytes = CalibrationBytes
	}
	if deviceBytes < MinCalibrationBytes {
		return nil, nil, fmt.Errorf("offload: calibrating the GPU in %d MiB of device memory: it needs %d MiB at least (a profile skips it: dos calibrate --json PATH, then --profile PATH)",
			max(deviceBytes, 0)>>20, MinCalibrationBytes>>20)
	}
	n := int64(calibrationMaxElems)
	for n > calibrationMinElems && calibrationPerElem*n > deviceBytes {
		n /= 2
	}
	return []int64{n / 4, n, 4 * n}, []int64{n / 4, n}, nil
}
