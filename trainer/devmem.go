package trainer

import (
	"fmt"
	"strings"

	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/internal/gptcuda"
	"github.com/deepstates/dos/offload"
)

// DeviceMemory is the device memory, in bytes, that a run on one GPU
// (Device "cuda", GPUs 1), or one rank of a ZeRO-3 job on its own GPU
// (GPUs > 1: NCCL's one rank per GPU), allocates outside its update
// phase, by what holds it. The update phase's resident state and staging come on top,
// within what is left (the GPU budget: the performance model's
// perfmodel.Workload.GPUMemory of its schedule, 0 for all on the CPU).
type DeviceMemory struct {
	// Activations is the training model's (gptcuda.MemoryBytes at Batch
	// rows of NCtx positions, with Recompute): activations, scratch and
	// cuBLASLt's workspace.
	Activations int64
	// Sampler is the B = 1 model that samples at the end (SampleBytes >
	// 0), 0 otherwise.
	Sampler int64
	// WeightsGrads is the optimizer's bf16 working copy and the
	// gradients (GradDType), one element each per parameter that is not
	// streamed (offload.Options.DeviceBytes).
	WeightsGrads int64
	// Streamed is how many blocks' matrices and biases stream from host
	// memory (TrainConfig.Streamed), and Slots their two block slots'
	// working copy and gradients on the device (0 without streaming).
	Streamed int
	Slots    int64
	// Masters is the fp32 master weights the model reads on the device
	// (gptcuda.FP32Tensors: embeddings, LayerNorms), 4 bytes per element;
	// 0 with BF16Params.
	Masters int64
	// Replicas is a ZeRO-3 rank's replicas (replicaLayout): the tensors
	// outside the blocks' matrices whole and two blocks' matrices, in
	// bf16 for the working copy and the gradients, their fp32 masters,
	// and the staging pieces; 0 on one GPU. WeightsGrads and Masters
	// are then the rank's pieces (its 1/GPUs, the largest rank's).
	Replicas int64
	// Calibration is the start-up calibration's device memory at its
	// smallest (offload.MinCalibrationBytes; it measures at larger sizes
	// where more is free), 0 with Profile or Schedule (no calibration).
	// It runs before the optimizer allocates WeightsGrads and Masters
	// and after the activations, slots and replicas, and the sampler
	// comes at the end: Total counts the larger of the two.
	Calibration int64
}

// gibBytes is a GiB in bytes, for the messages.
const gibBytes = 1 << 30

// MaxDeviceBytes bounds what DeviceMemory counts: 1 PiB, beyond any
// device (and far below where an int64 count of bytes overflows).
const MaxDeviceBytes = 1 << 50

// TooLarge reports whether m's activations were beyond MaxDeviceBytes
// (counted as MaxDeviceBytes).
func (m DeviceMemory) TooLarge() bool { return m.Activations >= MaxDeviceBytes }

// deviceBound reports whether batch rows of cfg might need more than
// MaxDeviceBytes of activations: an upper bound in float64 of what
// gptcuda allocates (per layer and token 64 × C bytes and the attention's
// 8 × H × T, and the logits' 8 × V per token), so that gptcuda.MemoryBytes
// is only asked where its int64 products cannot overflow.
func deviceBound(cfg gpt.Config, batch int) bool {
	L, C, H, T, V, B := float64(cfg.NLayer), float64(cfg.NEmbd), float64(cfg.NHead), float64(cfg.NCtx), float64(cfg.VocabSize), float64(batch)
	return B*T*(8*V+L*(64*C+8*H*T)) > MaxDeviceBytes
}

// Total is the device memory m's parts need at their peak, in bytes:
// their sum, but Calibration only where it is more than the sampler, the
// weights, gradients and masters it runs before.
func (m DeviceMemory) Total() int64 {
	return m.Activations + m.Slots + m.Replicas + max(m.Sampler+m.WeightsGrads+m.Masters, m.Calibration)
}

// BudgetLeft is the update phase's device memory under a cap of capBytes
// once m is allocated, in bytes (negative: m is over the cap): what a
// run's default GPU budget is under GPUMemory, less the margin the
// trainer keeps for what the cap counts besides (capMargin, 256 MiB).
// The calibration, freed before the budget is taken, is not counted.
func (m DeviceMemory) BudgetLeft(capBytes int64) int64 {
	return capBytes - CapMargin - (m.Activations + m.Slots + m.Replicas + m.Sampler + m.WeightsGrads + m.Masters)
}

// CapMargin is the device memory, in bytes, that a run under GPUMemory
// keeps aside from its update phase's budget for what the cap counts
// besides DeviceMemory (the kernels' modules, cuBLASLt's handles): 256 MiB.
const CapMargin = capMargin

// DeviceMemory returns what a run of c on one GPU allocates on it outside
// the update phase (DeviceMemory), at batch rows; Activations is 0 where
// gptcuda refuses c's attention for its head size (New says why).
//
// Where the activations' bytes would be beyond MaxDeviceBytes (a batch or
// context no device holds: gptcuda's int64 count would overflow) they are
// MaxDeviceBytes, and TooLarge reports it.
func (c *TrainConfig) DeviceMemory(batch int) DeviceMemory {
	return c.deviceMemory(batch, c.streamedAt(batch))
}

// deviceMemory is DeviceMemory with n blocks streamed.
func (c *TrainConfig) deviceMemory(batch, n int) DeviceMemory {
	m := c.deviceParts(batch, n)
	if c.Profile == "" && c.Schedule == "" {
		m.Calibration = offload.MinCalibrationBytes
	}
	return m
}

// deviceParts is deviceMemory but for the calibration.
func (c *TrainConfig) deviceParts(batch, n int) DeviceMemory {
	if c.GPUs > 1 {
		return c.rankDeviceMemory(batch)
	}
	opts := gptcuda.Options{Recompute: c.Recompute}
	weights := c.optimizerOptions().DeviceBytes(c.Model.NumParams() - n*blockStreamedElems(c.Model))
	var slots int64
	if n > 0 {
		slots = 2 * slotBytes(c.Model)
	}
	if deviceBound(c.Model, batch) {
		return DeviceMemory{Activations: MaxDeviceBytes, WeightsGrads: weights, Streamed: n, Slots: slots}
	}
	m := DeviceMemory{Activations: gptcuda.MemoryBytes(c.Model, batch, c.Model.NCtx, opts), Streamed: n, Slots: slots}
	if c.SampleBytes > 0 && !deviceBound(c.Model, 1) {
		m.Sampler = gptcuda.MemoryBytes(c.Model, 1, c.Model.NCtx, samplerOptions)
	}
	m.WeightsGrads = weights
	if !c.BF16Params {
		ts := c.Model.Tensors()
		for _, i := range gptcuda.FP32Tensors(c.Model) {
			m.Masters += 4 * int64(ts[i].Numel())
		}
	}
	return m
}

// rankDeviceMemory is DeviceMemory for one rank of a ZeRO-3 job of
// GPUs ranks at a global batch of batch rows (batch/GPUs each): the
// largest of the first and the last rank's (the first has the longest
// pieces, the last the most staging).
func (c *TrainConfig) rankDeviceMemory(batch int) DeviceMemory {
	n := c.GPUs
	rows := batch / n
	var m DeviceMemory
	if deviceBound(c.Model, rows) {
		m.Activations = MaxDeviceBytes
	} else {
		m.Activations = gptcuda.MemoryBytes(c.Model, rows, c.Model.NCtx, gptcuda.Options{Recompute: c.Recompute})
		if c.SampleBytes > 0 && !deviceBound(c.Model, 1) {
			m.Sampler = gptcuda.MemoryBytes(c.Model, 1, c.Model.NCtx, samplerOptions)
		}
	}
	ts := c.Model.Tensors()
	lens, piece := make([]int, len(ts)), make([]int, len(ts))
	for i, t := range ts {
		lens[i], piece[i] = t.Numel(), (t.Numel()+n-1)/n
	}
	fp32 := map[int]bool{}
	if !c.BF16Params {
		for _, i := range gptcuda.FP32Tensors(c.Model) {
			fp32[i] = true
		}
	}
	best := m
	for _, r := range []int{0, n - 1} {
		elems, masters := 0, int64(0)
		for i, l := range lens {
			lo, hi := pieceOf(l, n, r)
			elems += hi - lo
			if fp32[i] {
				masters += 4 * int64(hi-lo)
			}
		}
		at := m
		at.WeightsGrads, at.Masters = c.optimizerOptions().DeviceBytes(elems), masters
		at.Replicas = replicaLayout(c, lens, piece, n, r).bytes()
		if r == 0 || at.Total() > best.Total() {
			best = at
		}
	}
	return best
}

// checkDeviceMemory refuses a run on one GPU under GPUMemory whose device
// memory outside the update phase (DeviceMemory) is over the cap, before
// anything is allocated: it could only fail later, out of device memory.
// The error gives the parts and what would fit (a smaller --batch,
// --recompute; the gradients are bf16 on the GPU, Validate says). A
// ZeRO-3 job over NCCL (GPUs > 1, one rank per GPU) is checked per rank
// (rankDeviceMemory); staged collectives, which may put several ranks on
// one GPU, and runs without a cap are not checked here (offload's budget
// is measured once the device is open).
func (c *TrainConfig) checkDeviceMemory() error {
	if c.Device != "cuda" || c.GPUs > 1 && c.Collectives == "staged" || c.GPUMemory <= 0 {
		return nil
	}
	// The run keeps CapMargin aside (the kernels' modules, cuBLASLt's
	// handles), and what it advises fits with it aside too.
	safe := int64(c.GPUMemory*gibBytes) - CapMargin
	m := c.DeviceMemory(c.Batch)
	if m.Activations == 0 || m.Total() <= safe {
		return nil
	}
	var fits []string
	if c.GPUs <= 1 {
		// More blocks' weights from host memory (the fewest that fit are
		// more than now: now does not fit).
		if n, ok := c.fewestStreamed(c.Batch, c.deviceMemory(c.Batch, 0), safe); ok {
			fits = append(fits, fmt.Sprintf("--stream-blocks %d", n))
		}
	}
	if b := c.largestBatch(safe); b > 0 {
		fits = append(fits, fmt.Sprintf("--batch %d", b))
	}
	if c.GPUs > 1 { // more ranks, smaller pieces and rows
		more := *c
		for more.GPUs = c.GPUs + 1; more.GPUs <= 4*c.GPUs; more.GPUs++ {
			if c.Batch%more.GPUs == 0 && more.DeviceMemory(c.Batch).Total() <= safe {
				fits = append(fits, fmt.Sprintf("--gpus %d", more.GPUs))
				break
			}
		}
	}
	if !c.Recompute {
		r := *c
		r.Recompute = true
		if r.DeviceMemory(c.Batch).Total() <= safe {
			fits = append(fits, "--recompute")
		} else if b := r.largestBatch(safe); b > 0 {
			fits = append(fits, fmt.Sprintf("--recompute --batch %d", b))
		}
	}
	if m.Calibration > 0 && m.Calibration > m.Sampler+m.WeightsGrads+m.Masters {
		p := *c
		p.Profile = "profile"
		if p.DeviceMemory(c.Batch).Total() <= safe {
			fits = append(fits, "--profile PATH (from dos calibrate --json PATH: no start-up calibration on the device)")
		}
	}
	advice := "no smaller --batch, --recompute or --stream-blocks fits: what stays on the device, with one row's activations, is too large for this cap (a GPU with more memory, or ZeRO-3 over several, --gpus N)"
	if len(fits) > 0 {
		advice = "what fits: " + strings.Join(fits, ", or ")
	}
	if m.TooLarge() {
		return &DeviceMemoryError{fmt.Sprintf("trainer: --gpu-memory %g GiB: --layers %d --embd %d --ctx %d --batch %d need over %d PiB of device memory for the activations alone; %s",
			c.GPUMemory, c.Model.NLayer, c.Model.NEmbd, c.Model.NCtx, c.Batch, MaxDeviceBytes>>50, advice)}
	}
	sampler := ""
	if m.Replicas > 0 {
		sampler = fmt.Sprintf(", the rank's replicas %.2f (--gpus %d: each GPU's; weights and gradients and masters are its pieces)", float64(m.Replicas)/gibBytes, c.GPUs)
	}
	if m.Streamed > 0 {
		sampler = fmt.Sprintf(", %d blocks streamed: their 2 slots %.2f", m.Streamed, float64(m.Slots)/gibBytes)
	}
	if m.Sampler > 0 {
		sampler += fmt.Sprintf(", the sampler %.2f (--sample 0: none)", float64(m.Sampler)/gibBytes)
	}
	if m.Calibration > m.Sampler+m.WeightsGrads+m.Masters {
		sampler += fmt.Sprintf(", the start-up calibration %.2f (more than the weights, gradients and masters it runs before; --profile: none)", float64(m.Calibration)/gibBytes)
	}
	return &DeviceMemoryError{fmt.Sprintf("trainer: --gpu-memory %g GiB: --layers %d --embd %d --ctx %d --batch %d need %.2f GiB of device memory before the update phase's, over the %.2f the cap leaves once %d MiB are kept aside (weights and gradients %.2f, fp32 masters %.2f, activations %.2f%s); %s",
		c.GPUMemory, c.Model.NLayer, c.Model.NEmbd, c.Model.NCtx, c.Batch, float64(m.Total())/gibBytes, float64(safe)/gibBytes, CapMargin>>20,
		float64(m.WeightsGrads)/gibBytes, float64(m.Masters)/gibBytes, float64(m.Activations)/gibBytes, sampler, advice)}
}

// DeviceMemoryError is Validate's refusal of a run on one GPU whose device
// memory outside the update phase is over GPUMemory (checkDeviceMemory):
// the flags are each valid, the run does not fit. Its message gives the
// parts and what would fit.
type DeviceMemoryError struct{ msg string }

func (e *DeviceMemoryError) Error() string { return e.msg }

// largestBatch is the largest batch below c.Batch whose DeviceMemory fits
// in capBytes, 0 for none (LargestBatch).
func (c *TrainConfig) largestBatch(capBytes int64) int { return c.LargestBatch(capBytes, c.Batch-1) }

// LargestBatch returns the largest batch of at most upTo rows whose
// DeviceMemory (c's model, Recompute, SampleBytes, BF16Params) fits in
// capBytes, 0 for none: the memory grows with the batch, so it is found
// by bisection.
func (c *TrainConfig) LargestBatch(capBytes int64, upTo int) int {
	if c.GPUs > 1 { // in rows per rank: the batch is a multiple of the ranks
		return c.rankRows(capBytes, upTo/c.GPUs) * c.GPUs
	}
	lo, hi := 0, upTo // lo fits (0: none), hi is the largest to try
	for lo < hi {
		mid := lo + (hi-lo)/2 + 1 // in (lo, hi], without overflow
		if m := c.DeviceMemory(mid); m.Activations > 0 && m.Total() <= capBytes {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return lo
}

// rankRows is LargestBatch for a ZeRO-3 rank: the most rows per rank, at
// most upTo, whose rankDeviceMemory fits in capBytes.
func (c *TrainConfig) rankRows(capBytes int64, upTo int) int {
	lo, hi := 0, upTo
	for lo < hi {
		mid := lo + (hi-lo)/2 + 1
		if m := c.deviceMemory(mid*c.GPUs, 0); m.Activations > 0 && m.Total() <= capBytes {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return lo
}
