package trainer

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/internal/comm"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/gptcuda"
	"github.com/deepstates/dos/internal/nccl"
	"github.com/deepstates/dos/offload"
)

// ZeRO-3 on GPUs (TrainConfig.GPUs > 1 with Device "cuda"): rank r drives
// one GPU from its own goroutine, with its own stream, its gptcuda model
// of Batch/GPUs rows, and its offload.Optimizer over its pieces of every
// tensor (shardParams) on that GPU ("cuda:N"), the optimizer state in
// pinned host memory and its update phase planned for its own share. Each
// iteration, every rank, on its model's stream and its collectives' one:
//
//  1. all-gathers the bf16 working copy of the tensors outside the blocks'
//     matrices (the embeddings, the LayerNorms, ln_f) and the fp32 master
//     weights of those the model reads in fp32 (gptcuda.FP32Tensors) from
//     the ranks' pieces in their optimizers' device memory into its
//     replica of them (gatherSource.refresh);
//  2. runs forward and backward on its rows; before each block's forward
//     and backward (gptcuda.Model.BeforeBlock) it all-gathers that
//     block's matrices and biases into one of two block slots, which
//     the blocks take in turn (the last two blocks' are still there when
//     the backward starts), and the block writes its bf16 gradients into
//     one of two gradient slots;
//  3. as the backward ends each block (OnBlockBackward), reduce-scatters
//     its gradients (Avg: the gradient of the mean loss over the global
//     batch) into its optimizer's device gradients, and the embeddings'
//     after the backward; with the overlap (not TrainConfig.NoOverlap)
//     offload.Optimizer.GradsFinal then starts the update phase's work
//     that needs no global value;
//  4. steps its optimizer (world.step: the sum of squares all-reduced
//     on the host, so that every rank clips and skips alike).
//
// So a GPU holds, besides its activations and its 1/GPUs of the working
// copy and gradients, the tensors outside the blocks' matrices whole and
// two blocks' matrices: ZeRO-3's parameter partitioning (DeepSpeed's
// stage 3 gathers and releases each module's parameters the same way).
// Each replica is padded to GPUs pieces of ceil(numel/GPUs) elements, so
// that the all-gather writes into it and the reduce-scatter reads from it
// in place; a piece shorter than that (the last ranks', when GPUs does not
// divide numel) goes through a staging piece, the others are the
// optimizer's own device memory (cuda.Device.Borrow).
//
// The collectives are NCCL's (internal/nccl, ncclCommInitAll over GPUs
// 0..GPUs-1 of this host), or with TrainConfig.Collectives "staged" they
// go through pinned host memory (nccl.Staged), several ranks per GPU
// allowed: how the sharded GPU iteration is tested on one GPU. They run on
// a stream of their own, ordered against the model's by events: block
// l+1's gather (l-1's in the backward) runs while block l computes, as
// soon as the block that last read its slot is done, and block l's
// reduce-scatter while block l-1's backward runs, which waits for it only
// to reuse its gradient slot. (Staged's collectives wait on the host, so
// there they do not overlap.) The loss and the gradient norm's
// sum of squares are scalars, all-reduced on the host (rank.c) since
// the ranks share a process. Sampling runs on every rank (each its own
// B = 1 model, whose blocks are gathered as the training model's); rank
// 0's logits are drawn from.

// streamedOffsets are the gpt.PerLayer offsets of the tensors gathered
// block by block: every block tensor but its LayerNorms' (block l's
// forward reads block l+1's ln_1, so those stay whole with the other
// small tensors).
var streamedOffsets = []int{gpt.AttnW, gpt.AttnB, gpt.AttnProjW, gpt.AttnProjB, gpt.FcW, gpt.FcB, gpt.FcProjW, gpt.FcProjB}

// gatherSource is a ZeRO-3 GPU rank's weightSource (see above).
type gatherSource struct {
	g *gpuReplica      // its model, stream and device
	c nccl.Collectives // its end of the device communicator
	// The replicas, each tensor padded to n pieces: the bf16 working copy
	// the model reads (work), the bf16 gradients it writes (grad), and
	// the fp32 master weights of the tensors it reads in fp32 (master,
	// nil with --bf16-params), and the staging pieces (stage) of the
	// short pieces, laid out by replicaLayout (replicas: work and grad
	// hold the whole tensors first, then two block slots of the streamed
	// tensors; off[i] is tensor i's element offset in them, block l's
	// streamed tensors in slot l mod 2, moff[i] in master, -1: none; a
	// short piece's 2·piece bytes of working copy and gradient at soff[i]
	// in stage, its 4·piece of masters at msoff[i]). whole lists the
	// tensors gathered at the start of a pass, blocks[l] block l's
	// streamed ones (gathered by BeforeBlock); final[l] the tensors whose
	// gradients block l's backward ends (finalAfter), rest those the
	// backward's end does.
	work, grad, master, stage *cuda.Buffer
	replicas
	// The optimizer's device memory of this rank's pieces (cuda.Borrow),
	// nil for an empty piece: the working copy, the gradients and the
	// master weights.
	wv, gv, mv []*cuda.Buffer
	opt        *offload.Optimizer
	overlap    bool
	// cs is the collectives' stream (stream: it for GradsFinal). ready
	// orders cs after the model's stream (recorded on it, waited at once
	// by cs: ordered); wholeDone the model's stream after the whole
	// tensors' gather and the end's reduce-scatter; gathered[s] is slot
	// s's last gather, reduced[s] its gradients' last reduce-scatter;
	// holds[s] the block whose matrices slot s holds (-1: none, or stale
	// since the weights changed).
	cs                *cuda.Stream
	stream            offload.Stream
	ready, wholeDone  *cuda.Event
	gathered, reduced [2]*cuda.Event
	holds             [2]int
	// done is wait's event; failed is world.failed.
	done   *cuda.Event
	failed *atomic.Bool
	rank   int
}

// minNCCL is the oldest NCCL the GPU ranks run on (ncclGetVersion's code
// for 2.10.0).
const minNCCL = 21000

// replicaAlign is the byte alignment of each tensor in the replicas, as
// cuBLASLt and the vectorized kernels like their operands.
const replicaAlign = 256

// alignUp rounds n up to a multiple of a.
func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }

// openGPUs opens every rank's GPU, model and replicas (each a
// gpuReplica whose weights are gathered: gatherSource), then the device
// communicator: NCCL over GPUs 0..n-1, or with cfg.Collectives "staged"
// the collectives through host memory, rank r on GPU r mod the GPUs this
// host has. It sets w's abort and collectives.
//
// Errors: fewer GPUs than ranks for NCCL (naming --collectives staged), no
// NCCL, out of device memory, the models' and NCCL's own.
func (w *world) openGPUs(cfg *TrainConfig) ([]*gpuReplica, error) {
	count, err := cuda.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("trainer: --device cuda: %w", err)
	}
	staged := cfg.Collectives == "staged" || zeroOneRank == "staged"
	if !staged {
		if count < w.n {
			return nil, fmt.Errorf("trainer: --gpus %d: this host has %d GPU(s), and NCCL runs one rank per GPU (--collectives staged runs several ranks on one GPU through host memory, slowly: for tests)", w.n, count)
		}
		if err := nccl.Available(); err != nil {
			return nil, fmt.Errorf("trainer: --gpus %d: %w (--collectives staged moves the collectives through host memory instead)", w.n, err)
		}
		// bf16 and ncclAvg came with NCCL 2.10.
		if v, path, err := nccl.Version(); err != nil || v < minNCCL {
			return nil, fmt.Errorf("trainer: --gpus %d: NCCL %s is version %d (%v): want 2.10 or later (bf16 and ncclAvg); point DOS_NCCL at a newer libnccl.so.2", w.n, path, v, err)
		}
	}
	devs := make([]*cuda.Device, w.n)
	gs := make([]*gpuReplica, w.n)
	srcs := make([]*gatherSource, w.n)
	seen := map[int]bool{}
	for _, rk := range w.ranks {
		g, err := openGPU(cfg, rk.r%count, cfg.Batch/w.n)
		if err != nil {
			return nil, fmt.Errorf("rank %d: %w", rk.r, err)
		}
		src := &gatherSource{g: g, failed: &w.failed, rank: rk.r}
		g.src, gs[rk.r], srcs[rk.r] = src, g, src
		rk.rep, rk.gradOnDevice = g, true
		devs[rk.r] = g.dev
		seen[g.dev.Ordinal] = true
		if err := src.alloc(cfg, w, rk.r); err != nil {
			return nil, fmt.Errorf("trainer: rank %d: %w", rk.r, err)
		}
	}
	var cs []nccl.Collectives
	if staged {
		st, err := nccl.NewStaged(devs)
		if err != nil {
			return nil, fmt.Errorf("trainer: %w", err)
		}
		for _, s := range st {
			cs = append(cs, s)
		}
		w.collectives = fmt.Sprintf("staged through host memory, %d GPU(s)", len(seen))
	} else {
		cm, err := nccl.InitAll(devs)
		if err != nil {
			return nil, fmt.Errorf("trainer: --gpus %d: %w", w.n, err)
		}
		for _, c := range cm {
			cs = append(cs, c)
		}
		v, _, _ := nccl.Version()
		w.collectives = fmt.Sprintf("NCCL %d.%d.%d over %d GPUs", v/10000, v/100%100, v%100, len(seen))
	}
	for r, src := range srcs {
		src.c = cs[r]
	}
	// A failed rank aborts its own end at once but for NCCL's, whose
	// ends are aborted all together once every rank has returned.
	w.abort = func(rk *rank, err error, all bool) {
		for _, src := range srcs {
			if src.c == nil {
				continue
			}
			if _, isNCCL := src.c.(*nccl.Comm); all || src.rank == rk.r && !isNCCL {
				src.c.Abort(err)
			}
		}
	}
	return gs, nil
}

// alloc allocates rank r's replicas and staging piece (zeroed).
func (gr *gatherSource) alloc(cfg *TrainConfig, z *world, r int) error {
	gr.replicas = replicaLayout(cfg, z.lens, z.piece, z.n, r)
	words, mwords, stage := gr.workBytes, gr.masterBytes, gr.stageBytes
	d, s := gr.g.dev, gr.g.s
	var err error
	if gr.cs, err = d.NewStream(); err != nil {
		return err
	}
	for _, e := range gr.events() {
		if *e, err = d.NewEvent(false); err != nil {
			return err
		}
	}
	gr.holds = [2]int{-1, -1}
	for _, b := range []struct {
		buf   **cuda.Buffer
		bytes int64
	}{{&gr.work, words}, {&gr.grad, words}, {&gr.master, mwords}, {&gr.stage, stage}} {
		if b.bytes == 0 {
			continue
		}
		if *b.buf, err = d.Alloc(b.bytes); err != nil {
			return err
		}
		if err := s.Memset(*b.buf, 0, b.bytes, 0); err != nil {
			return err
		}
	}
	return s.Sync()
}

// replicas is a GPU rank's replica layout (replicaLayout): gatherSource's
// offsets and tensor lists, and the bytes of its buffers.
type replicas struct {
	off, moff, soff, msoff []int64
	short                  []bool
	piece                  []int64
	whole                  []int
	blocks, final          [][]int
	rest                   []int
	// workBytes is the bf16 working copy's replica (the whole tensors and
	// two block slots), the gradients' the same; masterBytes the fp32
	// masters'; stageBytes the staging pieces'.
	workBytes, masterBytes, stageBytes int64
}

// bytes returns the device memory of the replicas and staging pieces.
func (r replicas) bytes() int64 { return 2*r.workBytes + r.masterBytes + r.stageBytes }

// replicaLayout lays out rank r of n's replicas for cfg's tensors (lens
// elements each, piece per rank's piece): each tensor padded to n pieces
// at replicaAlign, the tensors outside the blocks' matrices whole, then
// the blocks' matrices and biases in two slots, block l in slot l mod 2,
// the fp32 masters of gptcuda.FP32Tensors (none with BF16Params), and a
// staging piece for each of this rank's short pieces.
func replicaLayout(cfg *TrainConfig, lens, piece []int, n, r int) replicas {
	k, L := len(lens), cfg.Model.NLayer
	var gr replicas
	gr.off, gr.moff, gr.soff, gr.msoff = make([]int64, k), make([]int64, k), make([]int64, k), make([]int64, k)
	gr.short, gr.piece = make([]bool, k), make([]int64, k)
	fp32 := make([]bool, k)
	if !cfg.BF16Params {
		for _, i := range gptcuda.FP32Tensors(cfg.Model) {
			fp32[i] = true
		}
	}
	streamed := make([]int, k) // 1 + the tensor's index in streamedOffsets, 0 for a whole one
	gr.blocks = make([][]int, L)
	for l := range L {
		for j, o := range streamedOffsets {
			i := gpt.LayerBase(l) + o
			streamed[i] = j + 1
			gr.blocks[l] = append(gr.blocks[l], i)
		}
	}
	gr.final, gr.rest = finalAfter(L)
	nn := int64(n)
	var words, mwords, stage int64 // bytes of the whole tensors, the masters, stage
	slot := make([]int64, len(streamedOffsets))
	var slotBytes int64
	for i, l := range lens {
		p := int64(piece[i])
		gr.piece[i] = p
		gr.moff[i], gr.soff[i], gr.msoff[i] = -1, -1, -1
		if j := streamed[i]; j > 0 {
			if i < gpt.LayerBase(1) { // block 0's lay out the slot
				slot[j-1] = slotBytes
				slotBytes = alignUp(slotBytes+2*p*nn, replicaAlign)
			}
		} else {
			gr.whole = append(gr.whole, i)
			gr.off[i] = words / 2
			words = alignUp(words+2*p*nn, replicaAlign)
		}
		if fp32[i] {
			gr.moff[i] = mwords / 4
			mwords = alignUp(mwords+4*p*nn, replicaAlign)
		}
		if lo, hi := pieceOf(l, n, r); int64(hi-lo) < p {
			gr.short[i] = true
			gr.soff[i] = stage
			stage = alignUp(stage+2*p, replicaAlign)
			if fp32[i] {
				gr.msoff[i] = stage
				stage = alignUp(stage+4*p, replicaAlign)
			}
		}
	}
	for l, idx := range gr.blocks {
		for j, i := range idx {
			gr.off[i] = (words + int64(l%2)*slotBytes + slot[j]) / 2
		}
	}
	gr.workBytes, gr.masterBytes, gr.stageBytes = words+2*slotBytes, mwords, stage
	return gr
}

// bind takes opt's device views of this rank's pieces and points the
// model at the replicas (its fp32 masters too) and sets its hooks.
func (gr *gatherSource) bind(opt *offload.Optimizer) error {
	g, n := gr.g, len(opt.Params())
	gr.opt, gr.stream = opt, offload.CUDAStream(gr.cs)
	gr.wv, gr.gv, gr.mv = make([]*cuda.Buffer, n), make([]*cuda.Buffer, n), make([]*cuda.Buffer, n)
	borrow := func(t offload.DeviceTensor, err error) (*cuda.Buffer, error) {
		if err != nil || t.Len == 0 {
			return nil, err
		}
		return g.dev.Borrow(t.Ptr, t.Bytes())
	}
	var err error
	for i := range n {
		if gr.wv[i], err = borrow(opt.DeviceWorking(i)); err != nil {
			return err
		}
		if gr.gv[i], err = borrow(opt.DeviceGrad(i)); err != nil {
			return err
		}
		g.w[i] = gr.work.Ptr() + 2*uint64(gr.off[i])
		g.g[i] = gr.grad.Ptr() + 2*uint64(gr.off[i])
		if gr.moff[i] >= 0 {
			if gr.mv[i], err = borrow(opt.DeviceMaster(i)); err != nil {
				return err
			}
			g.masters[i] = gr.master.Ptr() + 4*uint64(gr.moff[i])
		}
	}
	gr.overlap = opt.Options().OverlapBackward
	g.beforeBlock = gr.beforeBlock
	g.m.OnBlockBackward(gr.afterBlock)
	return nil
}

// events lists the rank's events, for alloc and close.
func (gr *gatherSource) events() []**cuda.Event {
	return []**cuda.Event{&gr.ready, &gr.wholeDone, &gr.gathered[0], &gr.gathered[1], &gr.reduced[0], &gr.reduced[1], &gr.done}
}

// wait blocks until the model's stream has done what is enqueued on it
// (the collectives' stream's work before the last joinComm too), polling
// (from 20 µs apart, backing off to 1 ms) so that another rank's failure
// ends it with errRankFailed, and an error NCCL found on the device
// (AsyncError) with that: a collective whose peer stopped would keep a
// stream's Sync waiting for ever. Every wait of a rank's goroutine on its
// streams goes through it (gptcuda's Forward, Loss and LogitsAt then find
// the work done). It does not allocate.
func (gr *gatherSource) wait() error {
	if err := gr.done.Record(gr.g.s); err != nil {
		return err
	}
	for d := 20 * time.Microsecond; ; d = min(2*d, time.Millisecond) {
		if ok, err := gr.done.Done(); ok || err != nil {
			return err
		}
		if gr.failed.Load() {
			return errRankFailed
		}
		if err := gr.c.AsyncError(); err != nil {
			return err
		}
		time.Sleep(d)
	}
}

// toComm orders the collectives' stream after the work enqueued on the
// model's stream so far.
func (gr *gatherSource) toComm() error {
	if err := gr.ready.Record(gr.g.s); err != nil {
		return err
	}
	return gr.cs.Wait(gr.ready)
}

// issue enqueues block l's gather into its slot on the collectives'
// stream, after the model's work so far (which holds the slot's last
// reader).
func (gr *gatherSource) issue(l int) error {
	s := l % 2
	gr.holds[s] = -1
	if err := gr.toComm(); err != nil {
		return err
	}
	if err := gr.gather(gr.cs, gr.blocks[l]); err != nil {
		return err
	}
	if err := gr.gathered[s].Record(gr.cs); err != nil {
		return err
	}
	gr.holds[s] = l
	return nil
}

// zeroBlockFault, when set (tests), runs before rank's block l: an error
// fails that rank there, as a device fault would.
var zeroBlockFault func(rank, l int, backward bool) error

// overlapsUpdate: no: a rank's gathers read its piece of every block, and
// its forward runs only after WaitStep.
func (gr *gatherSource) overlapsUpdate() bool { return false }

// beforeBlock is the models' BeforeBlock: block l's matrices in their
// slot (gathered now if they are not there yet), its gradient slot free
// (block l+2's reduce-scatter done), and the next block's gather
// enqueued into the other slot (l+1 forward, l-1 backward), which block
// l computes meanwhile.
func (gr *gatherSource) beforeBlock(l int, backward bool) error {
	if f := zeroBlockFault; f != nil {
		if err := f(gr.rank, l, backward); err != nil {
			return err
		}
	}
	s := l % 2
	if gr.holds[s] != l {
		if err := gr.issue(l); err != nil {
			return err
		}
	}
	if err := gr.g.s.Wait(gr.gathered[s]); err != nil {
		return err
	}
	next := l + 1
	if backward {
		if err := gr.g.s.Wait(gr.reduced[s]); err != nil {
			return err
		}
		next = l - 1
	}
	if next >= 0 && next < len(gr.blocks) && gr.holds[next%2] != next {
		return gr.issue(next)
	}
	return nil
}

// afterBlock is the model's OnBlockBackward: block l's gradients
// reduce-scattered on the collectives' stream once its backward is done.
func (gr *gatherSource) afterBlock(l int) error {
	if err := gr.toComm(); err != nil {
		return err
	}
	if err := gr.reduceScatter(gr.cs, gr.final[l]); err != nil {
		return err
	}
	return gr.reduced[l%2].Record(gr.cs)
}

// refresh gathers the tensors outside the blocks' matrices (and
// forgets what the slots hold: the weights changed since), the model's
// stream ordered after it.
func (gr *gatherSource) refresh() error {
	gr.holds = [2]int{-1, -1}
	if err := gr.toComm(); err != nil {
		return err
	}
	if err := gr.gather(gr.cs, gr.whole); err != nil {
		return err
	}
	return gr.joinComm()
}

// joinComm orders the model's stream after the collectives' work so far.
func (gr *gatherSource) joinComm() error {
	if err := gr.wholeDone.Record(gr.cs); err != nil {
		return err
	}
	return gr.g.s.Wait(gr.wholeDone)
}

// grouped runs f, the collectives of one rank, as one NCCL group (one
// launch) when c is NCCL's (Staged's calls each wait anyway), unless
// another rank failed (errRankFailed).
func (gr *gatherSource) grouped(f func() error) error {
	if gr.failed.Load() {
		return errRankFailed
	}
	c := gr.c
	if _, ok := c.(*nccl.Comm); !ok {
		return f()
	}
	if err := nccl.GroupStart(); err != nil {
		return err
	}
	err := f()
	return errors.Join(err, nccl.GroupEnd())
}

// pieceSpan returns the span a collective sends or receives tensor i's
// piece of es-byte elements (p of them) through: the optimizer's device
// memory v, or the staging piece at off when the piece is short.
func (gr *gatherSource) pieceSpan(i int, v *cuda.Buffer, off int64, es, p int64) nccl.Span {
	if gr.short[i] {
		return nccl.Span{Buf: gr.stage, Off: off, Len: es * p}
	}
	return nccl.Span{Buf: v, Len: es * p}
}

// gather all-gathers the working copy (and master weights) of tensors
// idx into the replicas, on stream s.
func (gr *gatherSource) gather(s *cuda.Stream, idx []int) error {
	for _, i := range idx {
		if gr.short[i] && gr.wv[i] != nil {
			if err := s.CopyDtoD(gr.stage, gr.soff[i], gr.wv[i], 0, gr.wv[i].Len()); err != nil {
				return err
			}
			if gr.mv[i] != nil {
				if err := s.CopyDtoD(gr.stage, gr.msoff[i], gr.mv[i], 0, gr.mv[i].Len()); err != nil {
					return err
				}
			}
		}
	}
	n := int64(gr.c.Size())
	return gr.grouped(func() error {
		for _, i := range idx {
			p := gr.piece[i]
			if err := gr.c.AllGather(s, gr.pieceSpan(i, gr.wv[i], gr.soff[i], 2, p), nccl.Span{Buf: gr.work, Off: 2 * gr.off[i], Len: 2 * n * p}, comm.BF16); err != nil {
				return fmt.Errorf("all-gather of %s's working copy: %w", gr.opt.Params()[i].Name, err)
			}
			if gr.moff[i] >= 0 {
				if err := gr.c.AllGather(s, gr.pieceSpan(i, gr.mv[i], gr.msoff[i], 4, p), nccl.Span{Buf: gr.master, Off: 4 * gr.moff[i], Len: 4 * n * p}, comm.F32); err != nil {
					return fmt.Errorf("all-gather of %s's master weights: %w", gr.opt.Params()[i].Name, err)
				}
			}
		}
		return nil
	})
}

// reduceScatter reduce-scatters the gradients of tensors idx from the
// replica into the optimizer's device gradients (their mean over the
// ranks) on stream s (the collectives'), and with the overlap tells the
// optimizer they are final (GradsFinal).
func (gr *gatherSource) reduceScatter(s *cuda.Stream, idx []int) error {
	n := int64(gr.c.Size())
	err := gr.grouped(func() error {
		for _, i := range idx {
			p := gr.piece[i]
			if err := gr.c.ReduceScatter(s, nccl.Span{Buf: gr.grad, Off: 2 * gr.off[i], Len: 2 * n * p}, gr.pieceSpan(i, gr.gv[i], gr.soff[i], 2, p), comm.BF16, comm.Avg); err != nil {
				return fmt.Errorf("reduce-scatter of %s's gradient: %w", gr.opt.Params()[i].Name, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, i := range idx {
		if gr.short[i] && gr.gv[i] != nil {
			if err := s.CopyDtoD(gr.gv[i], 0, gr.stage, gr.soff[i], gr.gv[i].Len()); err != nil {
				return err
			}
		}
	}
	if gr.overlap {
		return gr.opt.GradsFinal(gr.stream, idx...)
	}
	return nil
}

// end reduce-scatters the gradients of the tensors outside the blocks
// (the embeddings', the LayerNorms') once the backward is done, the
// model's stream ordered after it.
func (gr *gatherSource) end() error {
	if err := gr.toComm(); err != nil {
		return err
	}
	if err := gr.reduceScatter(gr.cs, gr.rest); err != nil {
		return err
	}
	return gr.joinComm()
}

func (gr *gatherSource) streamed() int { return 0 }

func (gr *gatherSource) describe(*TrainConfig) (line, memNote string) {
	return "", fmt.Sprintf(", rank 0's GPU; its replicas of the parameters and gradients %.1f GiB", float64(gr.replicaBytes())/(1<<30))
}

// close frees the borrowed views, the replicas and the staging piece
// (after the streams' work) and the communicator's end.
func (gr *gatherSource) close() error {
	if gr == nil {
		return nil
	}
	var errs []error
	for _, st := range []*cuda.Stream{gr.cs, gr.g.s} {
		if st != nil {
			errs = append(errs, st.Sync())
		}
	}
	for _, e := range gr.events() {
		if *e != nil {
			errs = append(errs, (*e).Free())
			*e = nil
		}
	}
	for _, bs := range [][]*cuda.Buffer{gr.wv, gr.gv, gr.mv, {gr.work, gr.grad, gr.master, gr.stage}} {
		for _, b := range bs {
			if b != nil {
				errs = append(errs, b.Free())
			}
		}
	}
	gr.wv, gr.gv, gr.mv, gr.work, gr.grad, gr.master, gr.stage = nil, nil, nil, nil, nil, nil, nil
	if gr.c != nil {
		errs = append(errs, gr.c.Close())
		gr.c = nil
	}
	if gr.cs != nil {
		errs = append(errs, gr.cs.Free())
		gr.cs = nil
	}
	return errors.Join(errs...)
}

// replicaBytes returns the device memory of the rank's replicas and
// staging piece.
func (gr *gatherSource) replicaBytes() int64 {
	var n int64
	for _, b := range []*cuda.Buffer{gr.work, gr.grad, gr.master, gr.stage} {
		if b != nil {
			n += b.Len()
		}
	}
	return n
}
