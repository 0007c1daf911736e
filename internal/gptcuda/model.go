// Package gptcuda is the GPT-2 model on a CUDA device: forward and backward
// of Hugging Face's GPT2LMHeadModel (the architecture gpt.Config describes)
// in bf16 with fp32 accumulation, the way llm.c's train_gpt2.cu computes it
// in C. The matrix products run in cuBLASLt (internal/cublas), everything
// else in dos's kernels (internal/kernels, gpt2.cu).
//
// The model owns its activations; the weights it reads and the gradients it
// writes are the caller's device memory, given per tensor as raw device
// addresses of bf16 arrays in gpt.Config.Tensors order: a trainer hands it
// offload.Optimizer's device views, so forward reads the optimizer's 16-bit
// working copy and backward writes the gradients where the update phase
// reads them, with no host round trip.
//
// Precision: weights, activations and gradients are bf16; the residual
// stream and its gradient are fp32, as PyTorch's autocast keeps them; every
// sum and element-wise formula is fp32; wte's gradient (the classifier's
// and the embedding's contributions) is summed in fp32 and rounded once.
// Every kernel is deterministic, so equal inputs give equal bits.
//
// Attention is cuBLAS's strided-batched products around a causal softmax
// kernel, keeping every layer's attention matrix for backward (B·NH·T²
// bf16 per layer; MemoryBytes counts it), or, for head size 64, dos's
// flash-attention kernels, which store no T×T matrix (Options.Attention).
//
// A Model is not safe for concurrent use; all its work runs in order on one
// stream.
package gptcuda

import (
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/internal/cublas"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
)

// Attention picks how a Model computes causal self-attention.
type Attention int

const (
	// AttentionAuto is AttentionFlash where the head size is 64 (every
	// GPT-2 preset), else AttentionCuBLAS.
	AttentionAuto Attention = iota
	// AttentionFlash runs kernels.GPT's flash-attention kernels (head size
	// 64 only): no T×T matrix is stored.
	AttentionFlash
	// AttentionCuBLAS runs cuBLASLt's strided-batched products around a
	// causal softmax kernel and keeps each layer's B·NH·T² attention
	// matrix for backward.
	AttentionCuBLAS
)

// String names the attention as Options and dos's output spell it: auto,
// flash, cublas.
func (a Attention) String() string {
	switch a {
	case AttentionAuto:
		return "auto"
	case AttentionFlash:
		return "flash"
	case AttentionCuBLAS:
		return "cublas"
	}
	return fmt.Sprintf("Attention(%d)", int(a))
}

// Options configure New; the zero value is the default.
type Options struct {
	Attention Attention
	// SeparateGELU runs the GELU and its backward as kernels of their own
	// instead of in cuBLASLt's epilogues (GELU_AUX_BIAS, DGELU) of the
	// products around them. They are separate anyway when 4·NEmbd is not
	// a multiple of 8 (the epilogues' auxiliary output needs it).
	SeparateGELU bool
	// Recompute keeps only each block's input residual through forward
	// and runs the block's forward again in backward (Megatron's full
	// activation recomputation, per block): one block's activations
	// instead of NLayer's, for about a third more compute. The
	// gradients are the same bits (every kernel is deterministic).
	Recompute bool
}

// fusedGELU reports whether the GELU runs in cuBLASLt's epilogues at
// width C: unless SeparateGELU, and only when 4C is a multiple of 8.
func (o Options) fusedGELU(C int) bool { return !o.SeparateGELU && 4*C%8 == 0 }

// resolve returns the attention New uses for head size hs.
func (o Options) resolve(hs int) (Attention, error) {
	switch o.Attention {
	case AttentionAuto:
		if hs == kernels.FlashHeadSize {
			return AttentionFlash, nil
		}
		return AttentionCuBLAS, nil
	case AttentionFlash:
		if hs != kernels.FlashHeadSize {
			return 0, fmt.Errorf("gptcuda: flash attention needs head size %d, not %d", kernels.FlashHeadSize, hs)
		}
		return AttentionFlash, nil
	case AttentionCuBLAS:
		return AttentionCuBLAS, nil
	}
	return 0, fmt.Errorf("gptcuda: unknown %v", o.Attention)
}

// maxGridY is CUDA's limit on a grid's y extent: the flash kernels launch
// B*NH blocks along y.
const maxGridY = 65535

// Model is GPT-2 forward and backward on one device for a fixed batch B and
// sequence length T.
type Model struct {
	cfg                gpt.Config
	b, t               int
	bt, c, nh, hs, v   int
	l                  int
	attn               Attention // resolved: flash or cublas
	fusedGELU          bool
	recompute          bool // Options.Recompute      // !Options.SeparateGELU
	s                  *cuda.Stream
	k                  *kernels.GPT
	blas               *cublas.Handle
	bufs               []*cuda.Buffer
	host               *cuda.HostBuffer // tokens, targets, the wte segments; losses coming back
	in                 *cuda.Buffer     // their device copy
	trained            bool             // the last Forward computed the classifier's gradient
	hasLoss            bool             // the last Forward computed the losses
	hasLogits          bool             // the last Forward left its logits (gradScale 0)
	count              []int32          // the segments' counting sort, VocabSize+1
	lossBuf, logitBuf  *cuda.Buffer     // the buffers of act.lossesDev and act.logits
	nseg               int              // wte segments of the last Forward
	logitsHost         *cuda.HostBuffer
	masters            []uint64                         // SetMasters's, in gpt.Config.Tensors order; 0: read the bf16 tensor
	onBlock            func(l int) error                // OnBlockBackward's
	beforeBlock        func(l int, backward bool) error // BeforeBlock's
	ok                 bool
	act                activations
	gemm               gemms
	tokOff, tgtOff     int64 // byte offsets in host/in
	posOff, segOff     int64
	segTokOff, lossOff int64
}

// activations are the device addresses of what forward keeps for backward
// and the scratch of both passes.
type activations struct {
	resid, resid2    uint64 // fp32 [L+1, BT, C], [L, BT, C]
	ln1, ln2         uint64 // bf16 [L, BT, C]
	ln1Stat, ln2Stat uint64 // fp32 [L, 2, BT]: mean, rstd
	qkv              uint64 // bf16 [L, BT, 3C]
	att              uint64 // bf16 [L, B*NH, T, T]
	atty             uint64 // bf16 [L, BT, C]
	fch, fchg        uint64 // bf16 [L, BT, 4C]: pre-GELU, post-GELU
	lnf, lnfStat     uint64 // bf16 [BT, C], fp32 [2, BT]
	logits           uint64 // bf16 [BT, V]
	q, k, v, y       uint64 // bf16 [B, NH, T, HS]
	dq, dk, dv       uint64
	pre              uint64 // fp32 [B*NH, T, T]: scores, then their gradient
	dpre             uint64 // bf16 [B*NH, T, T]
	yproj            uint64 // bf16 [BT, C]: a projection's output before the residual add
	dres             uint64 // fp32 [BT, C]
	dres16, dln      uint64 // bf16 [BT, C]
	dbig, dbig2      uint64 // bf16 [BT, 4C]
	dwte             uint64 // fp32 [V, C]
	part             uint64 // fp32 [ColSumChunks, 2, 4C]
	tokens, targets  uint64 // int32 [BT], inside m.in
	pos, seg, segTok uint64 // int32 [BT], [BT+1], [BT], inside m.in
	lossesDev        uint64 // fp32 [BT]: each position's loss
	lse, dsum        uint64 // flash: fp32 [L, B*NH, T] log-sum-exps; [B*NH, T] rowsum(dO ∘ O)
}

// gemms are the model's matrix products, built once (cuBLASLt caches its
// descriptors per shape).
type gemms struct {
	fcGELU, dXGELU                cublas.GEMM // c_fc with the GELU epilogue; c_proj's dX with DGELU
	qkv, proj, fc, fcproj, logits cublas.GEMM // forward
	scores, attV                  cublas.GEMM
	dW, dX                        [4]cublas.GEMM // qkv, proj, fc, fcproj
	dwte, dlnf                    cublas.GEMM
	datt, dv, dq, dk              cublas.GEMM
}

// MemoryBytes returns the device memory New allocates for cfg at batch B
// and sequence length T with opts (activations, scratch and cuBLASLt's
// workspace), in bytes; 0 when New would refuse the options. The caller's
// weights and gradients are not included.
func MemoryBytes(cfg gpt.Config, B, T int, opts Options) int64 {
	list := arrays(cfg, B, T, opts)
	if list == nil {
		return 0
	}
	var n int64
	for _, a := range list {
		n += a.bytes
	}
	return n + cublas.WorkspaceBytes
}

// array is one device array of a Model: where its address goes, and its
// size in bytes.
type array struct {
	p     func(*activations) *uint64
	bytes int64
}

// arrays lists the Model's device arrays for cfg, B, T and opts (nil when
// opts do not resolve).
func arrays(cfg gpt.Config, B, T int, opts Options) []array {
	attn, err := opts.resolve(cfg.NEmbd / cfg.NHead)
	if err != nil {
		return nil
	}
	L, BT, C, V := int64(cfg.NLayer), int64(B)*int64(T), int64(cfg.NEmbd), int64(cfg.VocabSize)
	rows := int64(B) * int64(cfg.NHead) * int64(T) // attention rows, B*NH*T
	Lk := L                                        // blocks whose activations are kept
	if opts.Recompute {
		Lk = 1
	}
	att := rows * int64(T)
	a := func(p func(*activations) *uint64, bytes int64) array { return array{p, bytes} }
	list := []array{
		a(func(x *activations) *uint64 { return &x.resid }, 4*(L+1)*BT*C),
		a(func(x *activations) *uint64 { return &x.resid2 }, 4*Lk*BT*C),
		a(func(x *activations) *uint64 { return &x.ln1 }, 2*Lk*BT*C),
		a(func(x *activations) *uint64 { return &x.ln2 }, 2*Lk*BT*C),
		a(func(x *activations) *uint64 { return &x.ln1Stat }, 4*Lk*2*BT),
		a(func(x *activations) *uint64 { return &x.ln2Stat }, 4*Lk*2*BT),
		a(func(x *activations) *uint64 { return &x.qkv }, 2*Lk*BT*3*C),
		a(func(x *activations) *uint64 { return &x.atty }, 2*Lk*BT*C),
		a(func(x *activations) *uint64 { return &x.fch }, 2*Lk*BT*4*C),
		a(func(x *activations) *uint64 { return &x.fchg }, 2*Lk*BT*4*C),
		a(func(x *activations) *uint64 { return &x.lnf }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.lnfStat }, 4*2*BT),
		a(func(x *activations) *uint64 { return &x.logits }, 2*BT*V),
		a(func(x *activations) *uint64 { return &x.yproj }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.dres }, 4*BT*C),
		a(func(x *activations) *uint64 { return &x.dres16 }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.dln }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.dbig }, 2*BT*4*C),
		a(func(x *activations) *uint64 { return &x.dbig2 }, 2*BT*4*C),
		a(func(x *activations) *uint64 { return &x.dwte }, 4*V*C),
		a(func(x *activations) *uint64 { return &x.part }, 4*kernels.ColSumChunks*2*4*C),
		a(func(x *activations) *uint64 { return &x.lossesDev }, 4*BT),
	}
	if attn == AttentionFlash {
		return append(list,
			a(func(x *activations) *uint64 { return &x.lse }, 4*Lk*rows),
			a(func(x *activations) *uint64 { return &x.dsum }, 4*rows))
	}
	return append(list,
		a(func(x *activations) *uint64 { return &x.att }, 2*Lk*att),
		a(func(x *activations) *uint64 { return &x.q }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.k }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.v }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.y }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.dq }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.dk }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.dv }, 2*BT*C),
		a(func(x *activations) *uint64 { return &x.pre }, 4*att),
		a(func(x *activations) *uint64 { return &x.dpre }, 2*att))
}

// Kernels are the GPT-2 model's CUDA kernels loaded on one device (dos's
// committed PTX: LayerNorm, GELU, attention, the classifier, embeddings,
// column sums; kernels.GPT), shared by every Model of that device.
type Kernels = kernels.GPT

// LoadKernels loads the model's kernels on d (kernels.LoadGPT), for New;
// Close them after the last Model on d.
//
// Errors: the driver's refusal of the PTX (an older driver, another
// architecture), as kernels.LoadGPT says.
func LoadKernels(d *cuda.Device) (*Kernels, error) { return kernels.LoadGPT(d) }

// New allocates a Model for cfg at batch B and sequence length T (1 <= T
// <= cfg.NCtx) on s's device, with kernels k (LoadKernels) and a
// cuBLASLt handle on s.
//
// Errors: an invalid cfg, B or T; cuBLASLt missing (cublas.Available's
// reason); out of device memory (the error says how much MemoryBytes
// wanted). Nothing is left allocated on error.
func New(s *cuda.Stream, k *kernels.GPT, cfg gpt.Config, B, T int, opts Options) (*Model, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("gptcuda: %w", err)
	}
	if B < 1 || T < 1 || T > cfg.NCtx {
		return nil, fmt.Errorf("gptcuda: batch %d, sequence length %d: want B >= 1 and 1 <= T <= n_positions = %d", B, T, cfg.NCtx)
	}
	if int64(B)*int64(T) > 1<<30 {
		return nil, fmt.Errorf("gptcuda: batch %d × sequence length %d tokens is too many", B, T)
	}
	attn, err := opts.resolve(cfg.NEmbd / cfg.NHead)
	if err != nil {
		return nil, err
	}
	if attn == AttentionFlash && B*cfg.NHead > maxGridY {
		if opts.Attention == AttentionFlash {
			return nil, fmt.Errorf("gptcuda: flash attention takes at most %d batch rows × heads, not %d × %d", maxGridY, B, cfg.NHead)
		}
		attn = AttentionCuBLAS
	}
	opts.Attention = attn // resolved: what alloc and MemoryBytes size
	m := &Model{cfg: cfg, b: B, t: T, bt: B * T, c: cfg.NEmbd, nh: cfg.NHead, hs: cfg.NEmbd / cfg.NHead,
		v: cfg.VocabSize, l: cfg.NLayer, attn: attn, fusedGELU: opts.fusedGELU(cfg.NEmbd), recompute: opts.Recompute, s: s, k: k,
		masters: make([]uint64, cfg.NumTensors())}
	if m.blas, err = cublas.New(s.Device(), s); err != nil {
		return nil, fmt.Errorf("gptcuda: %w", err)
	}
	if err = m.alloc(opts); err != nil {
		m.Close()
		if cuda.IsOutOfMemory(err) {
			return nil, fmt.Errorf("gptcuda: a GPT of %d layers, width %d, at batch %d × %d tokens needs %.2f GiB of device memory for activations: %w",
				cfg.NLayer, cfg.NEmbd, B, T, float64(MemoryBytes(cfg, B, T, opts))/(1<<30), err)
		}
		return nil, fmt.Errorf("gptcuda: %w", err)
	}
	m.buildGEMMs()
	m.ok = true
	return m, nil
}

// alloc allocates every activation and scratch array for opts (resolved:
// the arrays MemoryBytes counts).
func (m *Model) alloc(opts Options) error {
	d := m.s.Device()
	BT := int64(m.bt)
	get := func(p *uint64, bytes int64) error {
		b, err := d.Alloc(bytes)
		if err != nil {
			return err
		}
		m.bufs = append(m.bufs, b)
		*p = b.Ptr()
		return nil
	}
	for _, x := range arrays(m.cfg, m.b, m.t, opts) {
		p := x.p(&m.act)
		if err := get(p, x.bytes); err != nil {
			return err
		}
		switch p {
		case &m.act.lossesDev:
			m.lossBuf = m.bufs[len(m.bufs)-1]
		case &m.act.logits:
			m.logitBuf = m.bufs[len(m.bufs)-1]
		}
	}
	a := &m.act
	// The per-batch inputs: tokens, targets, positions by token, segment
	// starts, segment tokens (int32), laid out alike on the host and the
	// device; the losses come back through the same pinned buffer.
	m.tokOff, m.tgtOff = 0, 4*BT
	m.posOff, m.segOff = 8*BT, 12*BT
	m.segTokOff = 12*BT + 4*(BT+1)
	inBytes := m.segTokOff + 4*BT
	m.lossOff = (inBytes + 255) &^ 255
	var err error
	if m.host, err = d.HostAlloc(m.lossOff + 4*BT); err != nil {
		return err
	}
	if m.in, err = d.Alloc(inBytes); err != nil {
		return err
	}
	base := m.in.Ptr()
	a.tokens, a.targets = base+uint64(m.tokOff), base+uint64(m.tgtOff)
	a.pos, a.seg, a.segTok = base+uint64(m.posOff), base+uint64(m.segOff), base+uint64(m.segTokOff)
	return nil
}

// buildGEMMs describes every matrix product once. Row-major: a linear
// layer is y [BT, out] = x [BT, in] · W [in, out] (HF Conv1D); its
// backward dx = dy · Wᵀ and dW = xᵀ · dy.
func (m *Model) buildGEMMs() {
	BT, C, V, T, HS := m.bt, m.c, m.v, m.t, m.hs
	g := &m.gemm
	lin := func(in, out int, ep cublas.Epilogue) cublas.GEMM {
		return cublas.GEMM{M: BT, N: out, K: in, AType: cublas.BF16, CType: cublas.BF16, Epilogue: ep}
	}
	g.qkv, g.proj = lin(C, 3*C, cublas.Bias), lin(C, C, cublas.Bias)
	g.fc, g.fcproj = lin(C, 4*C, cublas.Bias), lin(4*C, C, cublas.Bias)
	g.fcGELU = lin(C, 4*C, cublas.GELUAuxBias)
	g.logits = cublas.GEMM{M: BT, N: V, K: C, TransB: true, AType: cublas.BF16, CType: cublas.BF16}
	for i, io := range [4][2]int{{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}} {
		in, out := io[0], io[1]
		g.dW[i] = cublas.GEMM{M: in, N: out, K: BT, TransA: true, AType: cublas.BF16, CType: cublas.BF16}
		g.dX[i] = cublas.GEMM{M: BT, N: in, K: out, TransB: true, AType: cublas.BF16, CType: cublas.BF16}
	}
	g.dXGELU = g.dX[3]
	g.dXGELU.Epilogue = cublas.DGELU
	g.dwte = cublas.GEMM{M: V, N: C, K: BT, TransA: true, AType: cublas.BF16, CType: cublas.F32}
	g.dlnf = cublas.GEMM{M: BT, N: C, K: V, AType: cublas.BF16, CType: cublas.BF16}
	batch := m.b * m.nh
	tt, ths := int64(T)*int64(T), int64(T)*int64(HS)
	bat := func(M, N, K int, ta, tb bool, sa, sb, sc int64, ct cublas.DType, alpha float32) cublas.GEMM {
		return cublas.GEMM{M: M, N: N, K: K, TransA: ta, TransB: tb, Batch: batch, StrideA: sa, StrideB: sb, StrideC: sc,
			AType: cublas.BF16, CType: ct, Alpha: alpha}
	}
	scale := float32(1 / math.Sqrt(float64(HS)))
	g.scores = bat(T, T, HS, false, true, ths, ths, tt, cublas.F32, scale) // q kᵀ / sqrt(HS)
	g.attV = bat(T, HS, T, false, false, tt, ths, ths, cublas.BF16, 0)     // att v
	g.datt = bat(T, T, HS, false, true, ths, ths, tt, cublas.F32, 0)       // dy vᵀ
	g.dv = bat(T, HS, T, true, false, tt, ths, ths, cublas.BF16, 0)        // attᵀ dy
	g.dq = bat(T, HS, T, false, false, tt, ths, ths, cublas.BF16, 0)       // dpre k
	g.dk = bat(T, HS, T, true, false, tt, ths, ths, cublas.BF16, 0)        // dpreᵀ q
}

// Attention returns the attention the model computes with (flash or
// cublas).
func (m *Model) Attention() Attention { return m.attn }

// Config returns the model's configuration.
func (m *Model) Config() gpt.Config { return m.cfg }

// Shape returns the batch size B and sequence length T.
func (m *Model) Shape() (B, T int) { return m.b, m.t }

// Close frees the model's device and pinned memory and its cuBLASLt
// handle, after the stream's work is done. A second Close does nothing.
func (m *Model) Close() error {
	var errs []error
	if m.s != nil && m.ok {
		errs = append(errs, m.s.Sync())
	}
	m.ok = false
	for i := len(m.bufs) - 1; i >= 0; i-- {
		errs = append(errs, m.bufs[i].Free())
	}
	m.bufs = nil
	if m.in != nil {
		errs = append(errs, m.in.Free())
		m.in = nil
	}
	for _, h := range []**cuda.HostBuffer{&m.host, &m.logitsHost} {
		if *h != nil {
			errs = append(errs, (*h).Free())
			*h = nil
		}
	}
	if m.blas != nil {
		errs = append(errs, m.blas.Close())
		m.blas = nil
	}
	return errors.Join(errs...)
}

// ErrClosed is returned by a Model's methods after Close.
var ErrClosed = errors.New("gptcuda: model closed")

// FP32Tensors returns the indices, in cfg.Tensors order, of the tensors
// that SetMasters may make the model read in fp32, in pairs: wte and wpe,
// then each LayerNorm's weight and bias (block by block, ln_1 then ln_2,
// then ln_f). PyTorch's bf16 autocast reads these in fp32 (the embedding
// lookup and layer_norm are not autocast to bf16).
func FP32Tensors(cfg gpt.Config) []int {
	n := cfg.NumTensors()
	out := []int{tWte, tWpe}
	for l := range cfg.NLayer {
		out = append(out, lnBlock(l, gpt.Ln1W), lnBlock(l, gpt.Ln1B), lnBlock(l, gpt.Ln2W), lnBlock(l, gpt.Ln2B))
	}
	return append(out, n-2, n-1)
}

// SetMasters makes forward and backward read some parameters in fp32 from
// the given device addresses (the optimizer's fp32 master weights on the
// device, offload.Optimizer.DeviceMaster) instead of their bf16 tensor,
// as PyTorch's bf16 autocast reads them: the embeddings in the lookup
// (wte and wpe, both or neither; the logits' matrix product still reads
// wte in bf16) and the LayerNorms' weights and biases (each LayerNorm's
// both or neither). masters is in gpt.Config.Tensors order, 0 for a
// tensor read in bf16; nil reads every tensor in bf16 (the default). The
// addresses must stay valid while the model runs.
//
// Errors: a closed model; a wrong length; an address for another
// tensor, or for one of a pair without the other (naming the tensor).
func (m *Model) SetMasters(masters []uint64) error {
	if !m.ok {
		return ErrClosed
	}
	ts := m.cfg.Tensors()
	if masters == nil {
		clear(m.masters)
		return nil
	}
	if len(masters) != len(ts) {
		return fmt.Errorf("gptcuda: SetMasters: %d addresses, want %d (gpt.Config.Tensors order)", len(masters), len(ts))
	}
	allowed := make([]bool, len(ts))
	fp32 := FP32Tensors(m.cfg)
	for j := 0; j < len(fp32); j += 2 { // pairs: wte and wpe, each LayerNorm's weight and bias
		a, b := fp32[j], fp32[j+1]
		if (masters[a] == 0) != (masters[b] == 0) {
			return fmt.Errorf("gptcuda: SetMasters: %s and %s are read in fp32 both or neither", ts[a].Name, ts[b].Name)
		}
		allowed[a], allowed[b] = true, true
	}
	for i, a := range masters {
		if a != 0 && !allowed[i] {
			return fmt.Errorf("gptcuda: SetMasters: %s is read in bf16 only (the embeddings and LayerNorms may be fp32)", ts[i].Name)
		}
	}
	copy(m.masters, masters)
	return nil
}

// tensors checks a tensor address list.
func (m *Model) tensors(ts []uint64, what string) error {
	if !m.ok {
		return ErrClosed
	}
	if want := m.cfg.NumTensors(); len(ts) != want { // not Tensors(): Forward and Backward call this every step
		return fmt.Errorf("gptcuda: %d %s tensors, want %d (gpt.Config.Tensors order)", len(ts), what, want)
	}
	for i, p := range ts {
		if p == 0 {
			return fmt.Errorf("gptcuda: %s tensor %d (%s) has a nil device address", what, i, m.cfg.Tensors()[i].Name)
		}
	}
	return nil
}

// int32s views the pinned input buffer at byte offset off as n int32s.
func (m *Model) int32s(off int64, n int) []int32 {
	return unsafe.Slice((*int32)(unsafe.Pointer(&m.host.Bytes()[off])), n)
}
